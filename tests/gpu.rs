//! GPU tests (feature `nccl`), run by `scripts/gpu-smoke.sh` on a machine with NVIDIA GPUs.
//! Every test prints `skipped: ...` and passes where no GPU is usable (CI, the stub driver).
//!
//! - `nccl_one_rank`: a 1-rank NCCL communicator: every tensor collective (f32, f16, bf16;
//!   leading and non-leading dims), the host-slice collectives, a sub-group, stats.
//! - `nccl_zero_elements`: zero-element tensors and empty host slices through the NCCL group.
//! - `layers_match_cpu`: the TP layers and mappings on CUDA (forward and backward) against the
//!   same layers on the CPU, on a plain 1-rank group and on a 1-rank NCCL group.
//! - `quantized_layers_match_cpu`: row- and column-parallel layers with GGUF weights on CUDA
//!   (candle's CUDA `QMatMul`) against the exact product of the quantized operands.
//! - `parallel_2d_matches_cpu`: 2D (SUMMA) layers on CUDA tensors (a 2 x 2 grid of threads on
//!   one GPU) against the same grid on the CPU, forward and backward.
//! - `nccl_multi_rank`: this binary re-executed under `tprun` with 2..=min(GPUs, 4) ranks, one
//!   GPU each (NCCL refuses two ranks on one GPU, so fewer than 2 GPUs skips it): collectives
//!   with unequal sizes and non-leading dims against sums computed here on the CPU, sub-groups,
//!   and the TP layers against the dense CPU layer.
#![cfg(feature = "nccl")]

mod common;

use std::process::Command;

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_tp::comm::{init_nccl, GroupOptions, ReduceOp, Rendezvous};
use candle_tp::{ColumnParallelLinear, Partition, ProcessGroup, RowParallelLinear};
use common::{max_abs_diff, seeded};

fn gpus() -> usize {
    cudarc::driver::CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .unwrap_or(0)
}

fn one_rank_nccl(dev: &Device) -> ProcessGroup {
    let rv = Rendezvous {
        rank: 0,
        world_size: 1,
        master_addr: "127.0.0.1".into(),
        master_port: 0,
        token: String::new(),
    };
    init_nccl(&rv, dev, GroupOptions::default()).expect("1-rank NCCL communicator")
}

fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-2,
        _ => 1e-1,
    }
}

fn close(what: &str, got: &Tensor, want: &Tensor, tol: f32) {
    let got = got.to_device(&Device::Cpu).expect("to cpu");
    let want = want.to_device(&Device::Cpu).expect("to cpu");
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let d = max_abs_diff(&got, &want).expect("diff");
    assert!(d <= tol, "{what}: max |diff| {d} > {tol}");
    println!("  {what}: max |diff| {d:.2e}");
}

#[test]
fn nccl_one_rank() -> Result<()> {
    if gpus() == 0 {
        eprintln!("skipped: no GPU");
        return Ok(());
    }
    let dev = Device::new_cuda(0)?;
    let pg = one_rank_nccl(&dev);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let x = seeded(&[3, 5, 4], 7).to_dtype(dtype)?;
        let g = x.to_device(&dev)?;
        let t = tol(dtype);
        close("all_reduce", &pg.all_reduce(&g, ReduceOp::Sum)?, &x, t);
        close("all_reduce max", &pg.all_reduce(&g, ReduceOp::Max)?, &x, t);
        close("all_gather dim 0", &pg.all_gather(&g, 0)?, &x, t);
        close("all_gather dim 1", &pg.all_gather(&g, 1)?, &x, t);
        close(
            "reduce_scatter dim 2",
            &pg.reduce_scatter(&g, 2, ReduceOp::Sum)?,
            &x,
            t,
        );
        close("broadcast", &pg.broadcast(&g, 0)?, &x, t);
        // A strided input (the op makes it contiguous first).
        let tr = g.transpose(0, 2)?;
        close(
            "all_reduce transposed",
            &pg.all_reduce(&tr, ReduceOp::Sum)?,
            &x.transpose(0, 2)?,
            t,
        );
    }
    let mut v = vec![1.5f32, -2.0, 3.0];
    pg.all_reduce_slice(&mut v, ReduceOp::Sum)?;
    assert_eq!(v, vec![1.5, -2.0, 3.0]);
    let mut ids = vec![0i64; 1];
    pg.all_gather_slice(&[42i64], &mut ids)?;
    assert_eq!(ids, vec![42]);
    let mut b = vec![7u32, 8];
    pg.broadcast_slice(&mut b, 0)?;
    assert_eq!(b, vec![7, 8]);
    pg.barrier()?;
    let sub = pg.split(Some(0))?.expect("member of color 0");
    let s = sub.all_reduce(&Tensor::new(&[2f32, 3.0], &dev)?, ReduceOp::Sum)?;
    assert_eq!(s.to_vec1::<f32>()?, vec![2.0, 3.0]);
    assert!(pg.stats().total().calls >= 20, "{:?}", pg.stats());
    // A tensor of another GPU (or another stream) is refused with a clear error.
    if gpus() > 1 {
        let other = Tensor::zeros(3, DType::F32, &Device::new_cuda(1)?)?;
        let err = pg.all_reduce(&other, ReduceOp::Sum).expect_err("wrong GPU");
        assert!(err.to_string().contains("cuda:1"), "{err}");
    }
    Ok(())
}

/// Zero-element buffers through a 1-rank NCCL communicator: tensors with a zero dim and empty
/// host slices go through every collective and come back empty, without a NCCL error or a hang
/// (the NCCL backend skips or issues zero-count calls; the shapes must survive).
#[test]
fn nccl_zero_elements() -> Result<()> {
    if gpus() == 0 {
        eprintln!("skipped: no GPU");
        return Ok(());
    }
    let dev = Device::new_cuda(0)?;
    let pg = one_rank_nccl(&dev);
    for dims in [vec![0usize], vec![3, 0], vec![0, 4]] {
        let g = Tensor::zeros(dims.as_slice(), DType::F32, &dev)?;
        let mut out = vec![
            ("all_reduce", pg.all_reduce(&g, ReduceOp::Sum)?),
            ("broadcast", pg.broadcast(&g, 0)?),
            ("all_gather", pg.all_gather(&g, dims.len() - 1)?),
        ];
        // A reduce-scatter splits a dim over the ranks: along a dim of size 0 there is nothing
        // to give each rank, which is a clear error (not a hang); along another dim it works.
        for (d, &n) in dims.iter().enumerate() {
            let r = pg.reduce_scatter(&g, d, ReduceOp::Sum);
            if n == 0 {
                let e = r
                    .expect_err("reduce_scatter along an empty dim")
                    .to_string();
                assert!(e.contains("reduce_scatter") && e.contains("dim"), "{e}");
            } else {
                out.push(("reduce_scatter", r?));
            }
        }
        for (what, t) in out {
            assert_eq!(t.dims(), dims.as_slice(), "{what} of shape {dims:?}");
            assert!(t.device().is_cuda(), "{what} left the GPU");
        }
        println!("  shape {dims:?}: all_reduce, broadcast, all_gather, reduce_scatter ok");
    }
    let mut v: Vec<f32> = Vec::new();
    pg.all_reduce_slice(&mut v, ReduceOp::Sum)?;
    pg.broadcast_slice(&mut v, 0)?;
    let mut none: Vec<i64> = Vec::new();
    pg.all_gather_slice(&[], &mut none)?;
    assert!(v.is_empty() && none.is_empty());
    // The communicator still works after them.
    let x = Tensor::new(&[1f32, 2.0], &dev)?;
    assert_eq!(
        pg.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?,
        vec![1.0, 2.0]
    );
    Ok(())
}

fn check_layers(pg: ProcessGroup, dev: &Device, label: &str) -> Result<()> {
    let (d, h) = (8, 12);
    let w1 = seeded(&[h, d], 1);
    let b1 = seeded(&[h], 2);
    let w2 = seeded(&[d, h], 3);
    let b2 = seeded(&[d], 4);
    let x = seeded(&[2, 3, d], 5);
    let dense = candle_nn::Linear::new(w2.clone(), Some(b2.clone())).forward(
        &candle_nn::Linear::new(w1.clone(), Some(b1.clone()))
            .forward(&x)?
            .gelu()?,
    )?;
    let on = |t: &Tensor| t.to_device(dev);
    let fc1 = ColumnParallelLinear::from_dense(&on(&w1)?, Some(&on(&b1)?), pg.clone())?;
    let fc2 = RowParallelLinear::from_dense(&on(&w2)?, Some(&on(&b2)?), pg.clone())?;
    let xv = candle_core::Var::from_tensor(&on(&x)?)?;
    let y = fc2.forward(&fc1.forward(xv.as_tensor())?.gelu()?)?;
    close(&format!("{label}: column+row MLP"), &y, &dense, 1e-4);
    let grads = y.sum_all()?.backward()?;
    let gx = grads.get(xv.as_tensor()).expect("grad of x");
    // The gradient of sum(y) w.r.t. x, computed densely on the CPU.
    let xc = candle_core::Var::from_tensor(&x)?;
    let yc = candle_nn::Linear::new(w2.clone(), Some(b2.clone())).forward(
        &candle_nn::Linear::new(w1.clone(), Some(b1.clone()))
            .forward(xc.as_tensor())?
            .gelu()?,
    )?;
    let gc = yc.sum_all()?.backward()?;
    close(
        &format!("{label}: grad x"),
        gx,
        gc.get(xc.as_tensor()).expect("grad"),
        1e-4,
    );
    // Mappings with unequal parts along the last dim and their backward.
    let part = Partition::new(5, pg.size()).map_err(candle_core::Error::wrap)?;
    let z = seeded(&[2, 5], 6);
    let zv = candle_core::Var::from_tensor(&on(&z)?)?;
    let sc = candle_tp::ops::scatter_to_tp(zv.as_tensor(), &pg, &part)?;
    let ga = candle_tp::ops::gather_from_tp(&sc, &pg, &part)?;
    close(&format!("{label}: scatter+gather"), &ga, &z, 0.0);
    let gz = ga.sqr()?.sum_all()?.backward()?;
    close(
        &format!("{label}: grad of scatter+gather"),
        gz.get(zv.as_tensor()).expect("grad"),
        &(z * 2.0)?,
        1e-6,
    );
    // Vocab-parallel embedding on u32 ids.
    let table = seeded(&[10, 4], 8);
    let emb = candle_tp::VocabParallelEmbedding::from_dense(&on(&table)?, pg.clone())?;
    let ids = Tensor::new(&[[0u32, 9, 4]], dev)?;
    let want = candle_nn::Embedding::new(table, 4).forward(&ids.to_device(&Device::Cpu)?)?;
    close(
        &format!("{label}: embedding"),
        &emb.forward(&ids)?,
        &want,
        1e-6,
    );
    Ok(())
}

#[test]
fn layers_match_cpu() -> Result<()> {
    if gpus() == 0 {
        eprintln!("skipped: no GPU");
        return Ok(());
    }
    let dev = Device::new_cuda(0)?;
    check_layers(ProcessGroup::single(), &dev, "single group")?;
    check_layers(one_rank_nccl(&dev), &dev, "1-rank NCCL group")
}

/// Quantized weights on CUDA (candle's CUDA `QMatMul`, which the crate uses off the CPU)
/// through a row-parallel layer on a 1-rank NCCL group and a column-parallel one, for every
/// block type a Llama-family GGUF file uses, at 1, 3 and 16 activation rows (candle's
/// matrix-vector kernels up to 8 rows, its tiled kernels above). The reference is the exact
/// product of the quantized operands (tests/common/quantized.rs) where it exists, else the
/// crate's CPU kernel. CUDA quantizes the activations its own way (q8_1: one scale per 32
/// values, and for the types with a minimum the block sum of the unquantized activations), so
/// the bound is 2 % of the largest output: it catches a wrong layout, block or device path, not
/// rounding.
#[test]
fn quantized_layers_match_cpu() -> anyhow::Result<()> {
    use candle_core::quantized::{QStorage, QTensor};
    use candle_tp::nn::ParallelWeight;
    if gpus() == 0 {
        eprintln!("skipped: no GPU");
        return Ok(());
    }
    let dev = Device::new_cuda(0)?;
    let pg = one_rank_nccl(&dev);
    let (n, k) = (64, 4 * 256);
    let w = seeded(&[n, k], 11);
    for dtype in common::quantized::LLAMA_GGUF_TYPES {
        let q = QTensor::quantize(&w, dtype)?;
        let on = |d: &Device| -> candle_core::Result<QTensor> {
            QTensor::new(QStorage::from_data(q.data()?, d, dtype)?, (n, k))
        };
        let row = RowParallelLinear::from_weight(
            ParallelWeight::quantized(on(&dev)?, None)?,
            None,
            Partition::new(k, 1)?,
            n,
            pg.clone(),
        )?;
        let col = ColumnParallelLinear::from_weight(
            ParallelWeight::quantized(on(&dev)?, None)?,
            k,
            Partition::new(n, 1)?,
            pg.clone(),
        )?;
        let cpu = ParallelWeight::quantized(on(&Device::Cpu)?, None)?;
        for m in [1, 3, 16] {
            let x = seeded(&[m, k], 12 + m as u64);
            let exact: Vec<f64> = match common::quantized::exact_product(&q, &x) {
                Ok((exact, _)) => exact,
                // Q4_1 and Q5_1: the crate's CPU kernel (tests/quant_matmul.rs ties it to
                // candle's portable scalar product within f32 rounding).
                Err(_) => cpu
                    .forward(&x)?
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .into_iter()
                    .map(f64::from)
                    .collect(),
            };
            let mag = exact.iter().fold(0f64, |a, v| a.max(v.abs()));
            for (what, layer) in [
                ("row", &row as &dyn Module),
                ("column", &col as &dyn Module),
            ] {
                let y = layer.forward(&x.to_device(&dev)?)?;
                anyhow::ensure!(
                    y.device().is_cuda(),
                    "{dtype:?} {what}: output left the GPU"
                );
                let got = y.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
                anyhow::ensure!(got.len() == exact.len(), "{dtype:?} {what} m {m}: sizes");
                anyhow::ensure!(
                    got.iter().all(|v| v.is_finite()),
                    "{dtype:?} {what} m {m}: non-finite output"
                );
                let worst = got
                    .iter()
                    .zip(&exact)
                    .fold(0f64, |a, (&g, &e)| a.max((g as f64 - e).abs()));
                anyhow::ensure!(
                    worst <= 2e-2 * mag,
                    "{dtype:?} {what} m {m}: max |cuda - reference| {worst:.3e} > 2 % of {mag:.3}"
                );
                println!(
                    "  {dtype:?} {what} m {m}: max |cuda - reference| / max |y| {:.2e}",
                    worst / mag
                );
            }
        }
    }
    Ok(())
}

/// 2D (SUMMA) layers with CUDA tensors, whose product is built from broadcasts (the CPU's is
/// the `Summa` op): a 2 x 2 grid of threads on GPU 0, the CPU engine staging the collectives
/// through host memory (NCCL refuses two ranks on one GPU), against the same grid on the CPU:
/// the output and the gradients of the input and weight blocks.
#[test]
fn parallel_2d_matches_cpu() -> anyhow::Result<()> {
    use candle_core::Var;
    use candle_tp::{DeviceMesh, Linear2d};
    if gpus() == 0 {
        eprintln!("skipped: no GPU");
        return Ok(());
    }
    let errs = candle_tp::run_threads(4, |pg| {
        let mesh = DeviceMesh::grid_2d(&pg).map_err(candle_core::Error::wrap)?;
        let seed = 100 + 3 * pg.rank() as u64;
        // The bias: block `col` of 10 (5 long), part `row` of it (3 or 2).
        let bias_len = Partition::new(5, 2)
            .map_err(candle_core::Error::wrap)?
            .size(pg.rank() / 2);
        let (x, w, b, dy) = (
            seeded(&[3, 4], seed),
            seeded(&[4, 5], seed + 1),
            seeded(&[bias_len], seed + 2),
            seeded(&[3, 5], seed + 3),
        );
        let run = |dev: &Device| -> Result<Vec<Tensor>> {
            let xv = Var::from_tensor(&x.to_device(dev)?)?;
            let wv = Var::from_tensor(&w.to_device(dev)?)?;
            let bv = Var::from_tensor(&b.to_device(dev)?)?;
            let layer = Linear2d::new(
                wv.as_tensor().clone(),
                Some(bv.as_tensor().clone()),
                8,
                10,
                &mesh,
            )?;
            let y = layer.forward(xv.as_tensor())?;
            assert_eq!(y.device().is_cuda(), dev.is_cuda(), "output device");
            let g = (&y * dy.to_device(dev)?)?.sum_all()?.backward()?;
            let mut out = vec![y];
            for v in [&xv, &wv, &bv] {
                out.push(g.get(v.as_tensor()).expect("a gradient").clone());
            }
            out.iter().map(|t| t.to_device(&Device::Cpu)).collect()
        };
        let gpu = run(&Device::new_cuda(0)?)?;
        let cpu = run(&Device::Cpu)?;
        gpu.iter()
            .zip(&cpu)
            .map(|(a, b)| max_abs_diff(a, b))
            .collect::<Result<Vec<f32>>>()
    })?;
    for (rank, e) in errs.iter().enumerate() {
        println!("  rank {rank}: max |cuda - cpu| of y, dX, dW, db: {e:?}");
        anyhow::ensure!(e.iter().all(|&e| e <= 1e-5), "rank {rank}: {e:?}");
    }
    Ok(())
}

/// Inputs of rank `r`: every rank can compute every other's, so the expected results are
/// computed here on the CPU, independently of NCCL.
fn input(r: usize, cols: usize) -> Tensor {
    seeded(&[2, cols, 3], 100 + r as u64)
}

fn worker() -> Result<()> {
    let dev = candle_tp::device_from_arg("cuda")?;
    let pg = candle_tp::init_from_env(&dev)?;
    let (rank, n) = (pg.rank(), pg.size());
    println!("rank {rank}/{n} on {dev:?}");
    let part = Partition::new(7, n).map_err(candle_core::Error::wrap)?;
    let all: Vec<Tensor> = (0..n).map(|r| input(r, 7)).collect();
    let sum = all.iter().skip(1).try_fold(all[0].clone(), |a, b| a + b)?;
    let max = all
        .iter()
        .skip(1)
        .try_fold(all[0].clone(), |a, b| a.maximum(b))?;
    let shares: Vec<Tensor> = (0..n).map(|r| input(r, part.size(r))).collect();
    let gathered = Tensor::cat(&shares, 1)?;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let t = tol(dtype) * n as f32;
        let mine = all[rank].to_dtype(dtype)?.to_device(&dev)?;
        let q = |x: &Tensor| x.to_dtype(dtype);
        close(
            "all_reduce sum",
            &pg.all_reduce(&mine, ReduceOp::Sum)?,
            &q(&sum)?,
            t,
        );
        close(
            "all_reduce max",
            &pg.all_reduce(&mine, ReduceOp::Max)?,
            &q(&max)?,
            t,
        );
        let share = shares[rank].to_dtype(dtype)?.to_device(&dev)?;
        close(
            "all_gather unequal dim 1",
            &pg.all_gather(&share, 1)?,
            &q(&gathered)?,
            t,
        );
        let lead = shares[rank]
            .transpose(0, 1)?
            .contiguous()?
            .to_dtype(dtype)?
            .to_device(&dev)?;
        close(
            "all_gather unequal dim 0",
            &pg.all_gather(&lead, 0)?,
            &q(&gathered.transpose(0, 1)?.contiguous()?)?,
            t,
        );
        let r = part.range(rank);
        close(
            "reduce_scatter unequal dim 1",
            &pg.reduce_scatter(&mine, 1, ReduceOp::Sum)?,
            &q(&sum.narrow(1, r.start, r.len())?)?,
            t,
        );
        let even = Tensor::cat(&vec![all[rank].clone(); n], 1)?
            .to_dtype(dtype)?
            .to_device(&dev)?;
        close(
            "reduce_scatter even dim 1",
            &pg.reduce_scatter(&even, 1, ReduceOp::Sum)?,
            &q(&sum)?,
            t,
        );
        close(
            "broadcast",
            &pg.broadcast(&mine, n - 1)?,
            &q(&all[n - 1])?,
            0.0,
        );
    }
    let mut v = vec![rank as f32 + 1.0; 3];
    pg.all_reduce_slice(&mut v, ReduceOp::Sum)?;
    assert_eq!(v, vec![(n * (n + 1) / 2) as f32; 3]);
    let mut ranks = vec![0i64; n];
    pg.all_gather_slice(&[rank as i64], &mut ranks)?;
    assert_eq!(ranks, (0..n as i64).collect::<Vec<_>>());
    pg.barrier()?;
    // Sub-groups: the even ranks through `split`, the first and last through `new_group`.
    let evens = pg.split(Some((rank % 2) as u32))?.expect("a color");
    let s = evens.all_reduce(&Tensor::new(&[rank as f32], &dev)?, ReduceOp::Sum)?;
    let want: usize = (0..n).filter(|r| r % 2 == rank % 2).sum();
    assert_eq!(s.to_vec1::<f32>()?, vec![want as f32]);
    if let Some(ends) = pg.new_group_named(&[0, n - 1], "ends")? {
        let s = ends.all_reduce(&Tensor::new(&[1f32], &dev)?, ReduceOp::Sum)?;
        assert_eq!(s.to_vec1::<f32>()?, vec![2.0]);
    }
    check_layers(pg.clone(), &dev, &format!("{n} ranks"))?;
    pg.barrier()?;
    println!("WORKER_OK rank {rank}/{n}");
    Ok(())
}

/// The worker side of `nccl_multi_rank`; a no-op unless started by it.
#[test]
#[ignore]
fn worker_entry() {
    if std::env::var("CANDLE_TP_GPU_WORKER").is_err() {
        return;
    }
    if let Err(e) = worker() {
        eprintln!("worker failed: {e}");
        std::process::exit(1);
    }
}

#[test]
fn nccl_multi_rank() {
    let g = gpus();
    if g < 2 {
        eprintln!(
            "skipped: {g} GPU(s); NCCL refuses two ranks on one GPU, multi-rank tests need 2 or more"
        );
        return;
    }
    let exe = std::env::current_exe().expect("test binary");
    // target/<profile>/deps/gpu-<hash> (or a copy next to tprun) -> target/<profile>/tprun
    let tprun = std::env::var_os("CANDLE_TP_TPRUN")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            exe.ancestors()
                .skip(1)
                .take(2)
                .map(|d| d.join("tprun"))
                .find(|p| p.exists())
        })
        .expect("tprun next to the test binary (or CANDLE_TP_TPRUN)");
    for n in 2..=g.min(4) {
        let out = Command::new(&tprun)
            .args(["--standalone", "--nproc-per-node", &n.to_string()])
            .arg(&exe)
            .args(["--ignored", "--exact", "worker_entry", "--nocapture"])
            .env("CANDLE_TP_GPU_WORKER", "1")
            .output()
            .expect("run tprun");
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        println!("{text}");
        assert!(out.status.success(), "{n} ranks failed:\n{text}");
        assert_eq!(text.matches("WORKER_OK").count(), n, "{text}");
    }
}
