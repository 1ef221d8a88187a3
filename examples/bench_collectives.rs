//! Collective latency and bandwidth on whatever backend `init_from_env` picks (shm on one host,
//! hierarchical across hosts, or the one `CANDLE_TP_BACKEND` names), nccl-tests style.
//!
//! ```text
//! cargo build --release --examples --bins
//! target/release/tprun --standalone --nproc-per-node 2 target/release/examples/bench_collectives
//! target/release/tprun --standalone --nproc-per-node 2 target/release/examples/bench_collectives -- \
//!     --ops all_reduce --dtypes f32 --sizes 4K,1M,64M
//! ```
//!
//! Every iteration is timed on every rank; an iteration's time is the slowest rank's (an
//! all-reduce of the per-iteration times after the loop, outside the timing), and rank 0
//! prints the median, minimum and maximum over iterations as one JSON line per measurement:
//! `op`, `dtype`, `world_size`, `bytes`, `iters`, `median_us`, `min_us`, `max_us`,
//! `algbw_gbps`, `busbw_gbps`, and `backend` (shm, hierarchical, mpi) with `cross_host_bytes`
//! (rank 0's payload handed to the across-host stage per iteration). `bytes` follows nccl-tests: the buffer of all-reduce, the
//! gathered output of all-gather, the input of reduce-scatter, each rank's send buffer of
//! all-to-all (equal blocks, one per rank). busbw = algbw · 2(n−1)/n for all-reduce and
//! algbw · (n−1)/n for the others. `all_to_all_fallback` times the all-to-all through the
//! all-gather that backends without their own run (every send buffer to every rank), printed
//! as op `all_to_all` with `impl` `candle-tp, all-gather fallback`, beside the native one.
//! `scripts/bench-collectives.sh` runs the same procedure with Open MPI and prints the ratios.

use std::time::Instant;

use anyhow::{bail, Result};
use candle_tp::comm::{Element, ProcessGroup, ReduceOp};
use clap::Parser;

#[path = "common/progress.rs"]
mod progress;
use half::bf16;

#[derive(Parser, Debug)]
#[command(about = "Benchmark all_reduce, all_gather, reduce_scatter and all_to_all")]
struct Args {
    /// Sizes in bytes (suffixes K, M): default 4K to 64M in steps of 4x.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "4K,16K,64K,256K,1M,4M,16M,64M"
    )]
    sizes: Vec<String>,
    /// Collectives: all_reduce, all_gather, reduce_scatter, all_to_all, all_to_all_fallback
    /// (the all-to-all through an all-gather of every send buffer: what it replaced).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "all_reduce,all_gather,reduce_scatter"
    )]
    ops: Vec<String>,
    /// Element types: f32, bf16.
    #[arg(long, value_delimiter = ',', default_value = "f32,bf16")]
    dtypes: Vec<String>,
    /// Bytes moved per measurement, which sets the iteration count (between 5 and 1000).
    #[arg(long, default_value_t = 256 << 20)]
    budget_bytes: usize,
}

fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    Ok(num
        .parse::<usize>()
        .map_err(|_| anyhow::anyhow!("bad size '{s}'"))?
        * mult)
}

/// Iterations for a size: the same rule as the MPI program of scripts/bench-collectives.sh.
fn iterations(bytes: usize, budget: usize) -> usize {
    (budget / bytes.max(1)).clamp(5, 1000)
}

/// Per-iteration times (slowest rank, microseconds) and this rank's payload bytes that crossed
/// hosts per iteration.
type Timed = Option<(Vec<f64>, f64)>;

fn time_op<T: Element>(pg: &ProcessGroup, op: &str, bytes: usize, budget: usize) -> Result<Timed> {
    let world = pg.size();
    let esz = std::mem::size_of::<T>();
    // Element counts: all_reduce buffer, all_gather output, reduce_scatter input and each
    // rank's all_to_all input are `bytes`.
    let n = bytes / esz;
    if !n.is_multiple_of(world) && op != "all_reduce" {
        return Ok(None);
    }
    // Zeros: the values do not change the work (no NaN or denormal paths either way).
    let mut a: Vec<T> = vec![T::default(); n];
    let mut b: Vec<T> = vec![T::default(); n];
    let iters = iterations(bytes, budget);
    let warmup = (iters / 10).max(2);
    let mut times = vec![0f64; iters];
    let blocks = vec![n / world; world];
    let run = |a: &mut Vec<T>, b: &mut Vec<T>| -> Result<()> {
        match op {
            "all_to_all" => pg.all_to_all_v_slice(a, &blocks, b, &blocks)?,
            "all_to_all_fallback" => {
                pg.all_to_all_v_slice_via_all_gather(a, &blocks, b, &blocks)?
            }
            "all_reduce" => pg.all_reduce_slice(a, ReduceOp::Sum)?,
            "all_gather" => pg.all_gather_slice(&a[..n / world], b)?,
            "reduce_scatter" => pg.reduce_scatter_slice(a, &mut b[..n / world], ReduceOp::Sum)?,
            other => bail!("unknown op {other}"),
        }
        Ok(())
    };
    for _ in 0..warmup {
        run(&mut a, &mut b)?;
    }
    pg.barrier()?;
    let before = pg.stats();
    for t in times.iter_mut() {
        let t0 = Instant::now();
        run(&mut a, &mut b)?;
        *t = t0.elapsed().as_secs_f64() * 1e6;
    }
    let cross = pg.stats().since(&before).total().cross_host_bytes as f64 / iters as f64;
    pg.all_reduce_slice(&mut times, ReduceOp::Max)?;
    Ok(Some((times, cross)))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let pg = candle_tp::init_from_env(&candle_core::Device::Cpu)?;
    let world = pg.size();
    let sizes: Vec<usize> = args
        .sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<_>>()?;
    let bar = progress::Bar::new(
        args.ops.len() * args.dtypes.len() * sizes.len(),
        "size",
        pg.rank() == 0,
    );
    for op in &args.ops {
        for dtype in &args.dtypes {
            for &bytes in &sizes {
                bar.set_message(format!("{op} {dtype} {bytes} bytes"));
                let times = match dtype.as_str() {
                    "f32" => time_op::<f32>(&pg, op, bytes, args.budget_bytes)?,
                    "bf16" => time_op::<bf16>(&pg, op, bytes, args.budget_bytes)?,
                    other => bail!("unsupported dtype {other} (f32, bf16)"),
                };
                bar.inc();
                let Some((mut times, cross)) = times else {
                    continue;
                };
                if pg.rank() != 0 {
                    continue;
                }
                times.sort_by(f64::total_cmp);
                let median = times[times.len() / 2];
                let algbw = bytes as f64 / (median * 1e-6) / 1e9;
                let factor = if op == "all_reduce" { 2.0 } else { 1.0 } * (world as f64 - 1.0)
                    / world as f64;
                let (implementation, op) = match op.as_str() {
                    "all_to_all_fallback" => ("candle-tp, all-gather fallback", "all_to_all"),
                    op => ("candle-tp", op),
                };
                bar.println(serde_json::json!({
                        "impl": implementation,
                        "backend": pg.backend(),
                        "cross_host_bytes": cross,
                        "op": op,
                        "dtype": dtype,
                        "world_size": world,
                        "bytes": bytes,
                        "iters": times.len(),
                        "median_us": median,
                        "min_us": times[0],
                        "max_us": times[times.len() - 1],
                        "algbw_gbps": algbw,
                        "busbw_gbps": algbw * factor,
                }));
            }
        }
    }
    bar.finish();
    Ok(())
}
