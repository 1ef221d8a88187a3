//! The seeds' study: a tensor-parallel MLP (d → 4d, GELU, 4d → d) against one process.
//!
//! ```text
//! RAYON_NUM_THREADS=1 target/release/examples/bench_mlp                # one process, 1 thread
//! RAYON_NUM_THREADS=2 target/release/examples/bench_mlp                # one process, all cores
//! target/release/tprun --standalone --nproc-per-node 2 target/release/examples/bench_mlp
//! scripts/bench-mlp.sh                                                 # all modes, ratio table
//! ```
//!
//! For each d_model, sequence length and pass (`fwd`, `fwd_bwd`) it times the MLP (batch 1)
//! over iterations; an iteration's time is the slowest rank's. The time spent in collectives
//! comes from the process group's counters. It also measures, on this machine and in this run,
//! the rate of one rank's matmuls (λ_compute, multiply-adds per second, from a dense
//! [S·d × 4d] GEMM with this rank's threads) and of the all-reduce (λ_comms, f32 words a rank
//! moves per second at the bus bandwidth of a d-wide all-reduce), and prints the seed's model
//! of the communication share, t_comms / t_compute ≈ (R − 1) / d_model · λ_compute / (4 λ_comms),
//! next to the measured one. Rank 0 prints one JSON line per configuration: `d_model`,
//! `seq_len`, `pass`, `ranks`, `threads_per_rank`, `backend`, `median_ms`, `comm_ms`,
//! `measured_comm_ratio`, `model_comm_ratio`, `lambda_compute`, `lambda_comms`.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::Activation;
use candle_tp::comm::{CollectiveKind, ReduceOp};
use candle_tp::{ColumnParallelLinear, Mlp, Partition, ProcessGroup, RowParallelLinear};
use clap::Parser;

#[path = "common/progress.rs"]
mod progress;

#[derive(Parser, Debug)]
#[command(about = "Tensor-parallel MLP timing against one process (the seeds' study)")]
struct Args {
    /// Model widths.
    #[arg(long, value_delimiter = ',', default_value = "512,1024,2048,4096")]
    d_model: Vec<usize>,
    /// Sequence lengths (batch 1).
    #[arg(long, value_delimiter = ',', default_value = "1,128")]
    seq_len: Vec<usize>,
    /// Passes: fwd, fwd_bwd.
    #[arg(long, value_delimiter = ',', default_value = "fwd,fwd_bwd")]
    pass: Vec<String>,
    /// Approximate seconds spent timing each configuration.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
}

fn backend() -> &'static str {
    if cfg!(feature = "mkl") {
        "mkl"
    } else {
        "gemm"
    }
}

fn threads() -> usize {
    candle_core::utils::get_num_threads()
}

/// Times `f` on every rank; returns per-iteration times (ms), each the slowest rank's, and
/// the milliseconds per iteration this rank spent inside all-reduces during the timed loop.
fn time_iters(
    pg: &ProcessGroup,
    seconds: f64,
    mut f: impl FnMut() -> Result<()>,
) -> Result<(Vec<f64>, f64)> {
    let t0 = Instant::now();
    f()?;
    let once = t0.elapsed().as_secs_f64();
    let mut n = [(seconds / once.max(1e-6)).clamp(3.0, 2000.0)];
    // Every rank must run the same number of iterations.
    pg.all_reduce_slice(&mut n, ReduceOp::Max)?;
    let n = n[0] as usize;
    f()?;
    pg.barrier()?;
    let mut times = vec![0f64; n];
    let before = pg.stats();
    for t in times.iter_mut() {
        let t0 = Instant::now();
        f()?;
        *t = t0.elapsed().as_secs_f64() * 1e3;
    }
    let comm = pg
        .stats()
        .since(&before)
        .get(CollectiveKind::AllReduce)
        .time
        .as_secs_f64()
        * 1e3
        / n as f64;
    pg.all_reduce_slice(&mut times, ReduceOp::Max)?;
    Ok((times, comm))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn seeded(shape: &[usize], seed: u64, scale: f32) -> Result<Tensor> {
    Ok(candle_tp::rng::seeded_uniform(
        shape,
        seed,
        scale,
        &Device::Cpu,
    )?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let pg = candle_tp::init_from_env(&Device::Cpu)?;
    let (rank, world) = (pg.rank(), pg.size());
    let bar = progress::Bar::new(
        args.d_model.len() * args.seq_len.len() * args.pass.len(),
        "config",
        rank == 0,
    );
    for &d in &args.d_model {
        let h = 4 * d;
        let part = Partition::new(h, world)?;
        let r = part.range(rank);
        let w1 = seeded(&[h, d], 1, 1.0 / (d as f32).sqrt())?
            .narrow(0, r.start, r.len())?
            .contiguous()?;
        let b1 = seeded(&[h], 2, 0.1)?
            .narrow(0, r.start, r.len())?
            .contiguous()?;
        let w2 = seeded(&[d, h], 3, 1.0 / (h as f32).sqrt())?
            .narrow(1, r.start, r.len())?
            .contiguous()?;
        let b2 = seeded(&[d], 4, 0.1)?;
        let vars: Vec<Var> = [&w1, &b1, &w2, &b2]
            .iter()
            .map(|t| Var::from_tensor(t))
            .collect::<candle_core::Result<_>>()?;
        let mlp = Mlp::new(
            ColumnParallelLinear::new(
                vars[0].as_tensor().clone(),
                Some(vars[1].as_tensor().clone()),
                d,
                part,
                pg.clone(),
            )?,
            RowParallelLinear::new(
                vars[2].as_tensor().clone(),
                Some(vars[3].as_tensor().clone()),
                part,
                d,
                pg.clone(),
            )?,
            Activation::Gelu,
        );
        for &s in &args.seq_len {
            let x = seeded(&[1, s, d], 5, 1.0)?;
            // λ_compute: multiply-adds per second of this rank's share of the MLP's GEMMs.
            let xs = x.reshape((s, d))?;
            let w1t = w1.t()?;
            let (mut t, _) = time_iters(&pg, args.seconds / 4.0, || {
                let _ = xs.matmul(&w1t)?;
                Ok(())
            })?;
            let lambda_compute = (s * d * r.len()) as f64 / (median(&mut t) * 1e-3);
            // λ_comms: f32 words a rank moves per second in the MLP's all-reduce (S·d values).
            let mut buf = vec![0f32; s * d];
            let (mut t, _) = time_iters(&pg, args.seconds / 4.0, || {
                pg.all_reduce_slice(&mut buf, ReduceOp::Sum)?;
                Ok(())
            })?;
            let words = if world > 1 {
                2.0 * (world as f64 - 1.0) / world as f64 * (s * d) as f64
            } else {
                0.0
            };
            let lambda_comms = words / (median(&mut t) * 1e-3);
            for pass in &args.pass {
                bar.set_message(format!("d_model {d}, seq_len {s}, {pass}"));
                let (mut times, comm) = match pass.as_str() {
                    "fwd" => time_iters(&pg, args.seconds, || {
                        let _ = mlp.forward(&x)?;
                        Ok(())
                    })?,
                    "fwd_bwd" => {
                        let xv = Var::from_tensor(&x)?;
                        time_iters(&pg, args.seconds, || {
                            let y = mlp.forward(xv.as_tensor())?;
                            let _ = y.sum_all()?.backward()?;
                            Ok(())
                        })?
                    }
                    other => anyhow::bail!("unknown pass {other} (fwd, fwd_bwd)"),
                };
                // Time inside the MLP's all-reduces (waiting for the slowest rank included).
                let mut comm = [comm];
                pg.all_reduce_slice(&mut comm, ReduceOp::Max)?;
                let med = median(&mut times);
                let measured = if med > comm[0] {
                    comm[0] / (med - comm[0])
                } else {
                    f64::INFINITY
                };
                let model = if world > 1 {
                    (world as f64 - 1.0) / d as f64 * lambda_compute / (4.0 * lambda_comms)
                } else {
                    0.0
                };
                bar.inc();
                if rank == 0 {
                    bar.println(serde_json::json!({
                        "d_model": d,
                        "seq_len": s,
                        "pass": pass,
                        "ranks": world,
                        "threads_per_rank": threads(),
                        "backend": backend(),
                        "median_ms": med,
                        "comm_ms": comm[0],
                        "measured_comm_ratio": measured,
                        "model_comm_ratio": model,
                        "lambda_compute": lambda_compute,
                        "lambda_comms": if world > 1 { lambda_comms } else { 0.0 },
                        "dtype": format!("{:?}", DType::F32).to_lowercase(),
                    }));
                }
            }
        }
    }
    bar.finish();
    Ok(())
}
