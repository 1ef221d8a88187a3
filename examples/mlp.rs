//! The seeds' tensor-parallel MLP, run as real processes.
//!
//! ```text
//! cargo build --release --examples
//! scripts/tprun --nproc-per-node 2 target/release/examples/mlp
//! # on GPUs (one per rank, NCCL): cargo build --release --features cuda,nccl --examples
//! scripts/tprun --nproc-per-node 2 target/release/examples/mlp --device cuda
//! ```
//!
//! Every rank builds the same full weights from a fixed seed, keeps its shards in a
//! column-parallel `fc1` (d → 4d) and a row-parallel `fc2` (4d → d), and prints the local
//! shapes, as the Colossal-AI 1D page does: with 2 ranks and d = 256 the first layer's weight
//! is [256, 512] (in × out). It runs forward and backward, compares with the dense MLP built
//! from the same weights, and rank 0 prints the largest errors over all ranks as one JSON line.

use anyhow::Result;
use candle_core::{Device, Module, Tensor, Var};
use candle_nn::{Activation, Linear};
use candle_tp::{ColumnParallelLinear, Mlp, Partition, ReduceOp, RowParallelLinear};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Tensor-parallel MLP forward and backward, checked against the dense MLP")]
struct Args {
    /// Model width d (the hidden layer has 4d units).
    #[arg(long, default_value_t = 256)]
    d_model: usize,
    /// Batch size.
    #[arg(long, default_value_t = 2)]
    batch: usize,
    /// Sequence length.
    #[arg(long, default_value_t = 16)]
    seq_len: usize,
    /// Seed of the weights and inputs (the same on every rank).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Device of the tensor-parallel MLP: `cpu`, or `cuda` (GPU `LOCAL_RANK`, NCCL between
    /// ranks; needs `--features cuda,nccl`). The dense reference always runs on the CPU.
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn seeded(shape: &[usize], seed: u64, scale: f32) -> Result<Tensor> {
    Ok(candle_tp::rng::seeded_uniform(
        shape,
        seed,
        scale,
        &Device::Cpu,
    )?)
}

fn max_err(a: &Tensor, b: &Tensor) -> Result<f32> {
    let (a, b) = (a.to_device(&Device::Cpu)?, b.to_device(&Device::Cpu)?);
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

fn narrow(t: &Tensor, dim: usize, part: &Partition, rank: usize) -> Result<Tensor> {
    let r = part.range(rank);
    Ok(t.narrow(dim, r.start, r.len())?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = candle_tp::device_from_arg(&args.device)?;
    let pg = candle_tp::init_from_env(&device)?;
    let (rank, world) = (pg.rank(), pg.size());
    let (d, h) = (args.d_model, 4 * args.d_model);
    let s = args.seed;
    let (w1, b1) = (
        seeded(&[h, d], s, 1.0 / (d as f32).sqrt())?,
        seeded(&[h], s + 1, 0.1)?,
    );
    let (w2, b2) = (
        seeded(&[d, h], s + 2, 1.0 / (h as f32).sqrt())?,
        seeded(&[d], s + 3, 0.1)?,
    );
    let x = seeded(&[args.batch, args.seq_len, d], s + 4, 1.0)?;
    let probe = seeded(&[args.batch, args.seq_len, d], s + 5, 1.0)?;

    // Dense reference, on every rank.
    let vars: Vec<Var> = [&x, &w1, &b1, &w2, &b2]
        .iter()
        .map(|t| Var::from_tensor(t))
        .collect::<candle_core::Result<_>>()?;
    let t = |i: usize| vars[i].as_tensor().clone();
    let dense_out = Linear::new(t(3), Some(t(4)))
        .forward(&Linear::new(t(1), Some(t(2))).forward(&t(0))?.gelu_erf()?)?;
    let dense_grads = (&dense_out * &probe)?.sum_all()?.backward()?;

    // Tensor-parallel MLP from this rank's shards.
    let part = Partition::new(h, world)?;
    let shards = [
        x.clone(),
        narrow(&w1, 0, &part, rank)?,
        narrow(&b1, 0, &part, rank)?,
        narrow(&w2, 1, &part, rank)?,
        b2.clone(),
    ];
    let pvars: Vec<Var> = shards
        .iter()
        .map(|t| Var::from_tensor(&t.to_device(&device)?))
        .collect::<candle_core::Result<_>>()?;
    let p = |i: usize| pvars[i].as_tensor().clone();
    let fc1 = ColumnParallelLinear::new(p(1), Some(p(2)), d, part, pg.clone())?;
    let fc2 = RowParallelLinear::new(p(3), Some(p(4)), part, d, pg.clone())?;
    let mlp = Mlp::new(fc1.clone(), fc2.clone(), Activation::Gelu);
    let hidden = fc1.forward(&p(0))?;
    let out = mlp.forward(&p(0))?;
    let grads = (&out * &probe.to_device(&device)?)?.sum_all()?.backward()?;

    let dims = |t: &Tensor| format!("{:?}", t.dims());
    println!(
        "rank {rank}/{world}: fc1 weight (in x out) [{}, {}] (candle layout {}), fc1 bias {}",
        d,
        part.size(rank),
        dims(fc1.weight()?),
        dims(fc1.bias().expect("bias"))
    );
    println!(
        "rank {rank}/{world}: fc2 weight (in x out) [{}, {}] (candle layout {}), fc2 bias {} (replicated)",
        part.size(rank),
        d,
        dims(fc2.weight()?),
        dims(fc2.bias().expect("bias"))
    );
    println!(
        "rank {rank}/{world}: input {}, hidden activation {}, output {}",
        dims(&x),
        dims(&hidden),
        dims(&out)
    );

    let g = |store: &candle_core::backprop::GradStore, v: &Var| {
        store.get(v).cloned().expect("gradient")
    };
    let err_out = max_err(&out, &dense_out)?;
    let err_gx = max_err(&g(&grads, &pvars[0]), &g(&dense_grads, &vars[0]))?;
    let err_gw = max_err(
        &g(&grads, &pvars[1]),
        &narrow(&g(&dense_grads, &vars[1]), 0, &part, rank)?,
    )?
    .max(max_err(
        &g(&grads, &pvars[3]),
        &narrow(&g(&dense_grads, &vars[3]), 1, &part, rank)?,
    )?);
    let err_gb = max_err(
        &g(&grads, &pvars[2]),
        &narrow(&g(&dense_grads, &vars[2]), 0, &part, rank)?,
    )?
    .max(max_err(&g(&grads, &pvars[4]), &g(&dense_grads, &vars[4]))?);
    // The largest error over all ranks.
    let mut errs = [err_out, err_gx, err_gw, err_gb];
    pg.all_reduce_slice(&mut errs, ReduceOp::Max)?;
    if rank == 0 {
        println!(
            "{}",
            serde_json::json!({
                "world_size": world,
                "device": args.device,
                "d_model": d,
                "batch": args.batch,
                "seq_len": args.seq_len,
                "max_abs_err_out": errs[0],
                "max_abs_err_grad_input": errs[1],
                "max_abs_err_grad_weight": errs[2],
                "max_abs_err_grad_bias": errs[3],
            })
        );
    }
    Ok(())
}
