//! The README's first example: a two-layer MLP split across the ranks (Megatron's column then
//! row parallel linear), checked against the same MLP computed densely on every rank.
//! `tprun --nproc-per-node 2 target/release/examples/quickstart` (or under torchrun).
use std::collections::HashMap;

use candle_core::{DType, Device, Module, Tensor};

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let pg = candle_tp::init_from_env(&dev)?; // RANK, WORLD_SIZE, MASTER_ADDR... from tprun/torchrun
    let full = |rows: usize, cols: usize, s: f64| -> candle_core::Result<Tensor> {
        Tensor::arange(0f32, (rows * cols) as f32, &dev)?
            .affine(s, 0.0)?
            .sin()?
            .reshape((rows, cols))
    }; // the same full weights on every rank; each rank keeps only its slice
    let (w_up, w_down, x) = (full(32, 8, 0.1)?, full(8, 32, 0.3)?, full(2, 8, 0.7)?);
    let weights = HashMap::from([
        ("up.weight".into(), w_up.clone()),
        ("down.weight".into(), w_down.clone()),
    ]);
    let vb = candle_tp::ShardedVarBuilder::from_tensors(weights, DType::F32, &dev, pg.clone());
    let up = candle_tp::column_linear_no_bias(8, 32, vb.pp("up"))?; // rows 32/world of up.weight
    let down = candle_tp::row_linear_no_bias(32, 8, vb.pp("down"))?; // all-reduce inside
    let y = down.forward(&up.forward(&x)?.gelu()?)?;
    let dense = x.matmul(&w_up.t()?)?.gelu()?.matmul(&w_down.t()?)?;
    let err = (&y - dense)?.abs()?.max_all()?.to_scalar::<f32>()?;
    if err.is_nan() || err > 1e-5 {
        candle_core::bail!("rank {}: parallel and dense MLP differ by {err}", pg.rank());
    }
    println!(
        "rank {} of {}: y[0] = {:.4?}, max |y - dense| = {err:.1e}",
        pg.rank(),
        pg.size(),
        y.get(0)?.to_vec1::<f32>()?
    );
    Ok(())
}
