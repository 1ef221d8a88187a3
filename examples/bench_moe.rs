//! Throughput of the tensor-parallel sparse MoE layer ([`candle_tp::SparseMoe`]) at 2 ranks
//! against 1 rank with the same threads, interleaved in one run.
//!
//! ```text
//! cargo run --release --example bench_moe -- --tokens 1,16,128
//! ```
//!
//! Two ranks run as threads of this process (the `threads` backend). Rank 0 holds the whole
//! layer as a 1-rank model and the two ranks hold a 2-way split of the same weights; each
//! round times the 1-rank layer on rank 0 with a pool of `--threads` threads (rank 1 waits),
//! then the 2-rank layer with `--threads / 2` threads per rank, so both use the same cores.
//! Rounds alternate so that noise from other work on the machine hits both alike. Per token
//! count rank 0 prints one JSON line: `hidden`, `intermediate`, `experts`, `top_k`,
//! `tokens`, `threads`, `ms_1rank` and `ms_2ranks` (medians), `speedup` (their ratio),
//! `tokens_per_s_1rank`, `tokens_per_s_2ranks`, `allreduce_ms_2ranks` (median time in the
//! one all-reduce per forward), `backend`.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_tp::comm::CollectiveKind;
use candle_tp::{run_threads, MoeConfig, ProcessGroup, ShardedVarBuilder, SparseMoe};
use clap::Parser;

#[path = "common/progress.rs"]
mod progress;

#[derive(Parser, Debug)]
#[command(about = "Sparse MoE layer: 2 ranks against 1 rank, same threads")]
struct Args {
    /// Model width.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// Width of one expert's MLP.
    #[arg(long, default_value_t = 2048)]
    intermediate: usize,
    /// Experts.
    #[arg(long, default_value_t = 8)]
    experts: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 2)]
    top_k: usize,
    /// Token counts (one forward each).
    #[arg(long, value_delimiter = ',', default_value = "1,16,128")]
    tokens: Vec<usize>,
    /// Threads in all (the 1-rank pool; each of the 2 ranks gets half).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Interleaved rounds per token count.
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// Forwards timed per round and mode.
    #[arg(long, default_value_t = 5)]
    iters: usize,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn weights(a: &Args) -> Result<HashMap<String, Tensor>> {
    let dev = Device::Cpu;
    let mut m = HashMap::new();
    let (h, i) = (a.hidden, a.intermediate);
    let mut seed = 1u64;
    let mut rand = |shape: &[usize], scale: f64| {
        seed += 1;
        candle_tp::rng::seeded_uniform(shape, seed, scale as f32, &dev)
    };
    m.insert("gate.weight".into(), rand(&[a.experts, h], 1.0)?);
    for e in 0..a.experts {
        m.insert(
            format!("experts.{e}.w1.weight"),
            rand(&[i, h], 1.0 / (h as f64).sqrt())?,
        );
        m.insert(
            format!("experts.{e}.w3.weight"),
            rand(&[i, h], 1.0 / (h as f64).sqrt())?,
        );
        m.insert(
            format!("experts.{e}.w2.weight"),
            rand(&[h, i], 1.0 / (i as f64).sqrt())?,
        );
    }
    Ok(m)
}

/// Per forward: milliseconds, and milliseconds inside the all-reduce (from `pg`'s counters).
fn time_forward(
    moe: &SparseMoe,
    x: &Tensor,
    iters: usize,
    pg: &ProcessGroup,
) -> Result<Vec<(f64, f64)>> {
    (0..iters)
        .map(|_| {
            let before = pg.stats();
            let t = Instant::now();
            let y = moe.forward(x)?;
            let _ = y.flatten_all()?.get(0)?.to_scalar::<f32>()?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let ar = pg.stats().since(&before).get(CollectiveKind::AllReduce);
            Ok((ms, ar.time.as_secs_f64() * 1e3))
        })
        .collect()
}

fn pool(threads: usize) -> Result<rayon::ThreadPool> {
    Ok(rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.threads < 2 {
        bail!("--threads must be at least 2 (one per rank at 2 ranks)");
    }
    let cfg = MoeConfig {
        hidden_size: args.hidden,
        intermediate_size: args.intermediate,
        num_experts: args.experts,
        num_experts_per_tok: args.top_k,
        norm_topk_prob: true,
        act: candle_nn::Activation::Silu,
        router: "gate".into(),
        expert_names: ["w1".into(), "w3".into(), "w2".into()],
    };
    let tensors = weights(&args)?;
    let backend = if cfg!(feature = "mkl") { "mkl" } else { "gemm" };
    let bar = progress::Bar::new(args.tokens.len() * (args.rounds + 1), "round", true);
    let lines = run_threads(2, |pg| -> candle_core::Result<Vec<String>> {
        let err = |e: anyhow::Error| candle_core::Error::msg(e.to_string());
        let dev = Device::Cpu;
        let vb =
            |g: ProcessGroup| ShardedVarBuilder::from_tensors(tensors.clone(), DType::F32, &dev, g);
        let split = SparseMoe::load(&cfg, vb(pg.clone()))?;
        let whole = if pg.rank() == 0 {
            Some(SparseMoe::load(&cfg, vb(ProcessGroup::single()))?)
        } else {
            None
        };
        let all = pool(args.threads).map_err(err)?;
        let half = pool(args.threads / 2).map_err(err)?;
        let mut out = Vec::new();
        for &n in &args.tokens {
            let x = candle_tp::rng::seeded_uniform(&[1, n, args.hidden], 7, 1.0, &dev)?;
            let (mut t1, mut t2, mut ar) = (Vec::new(), Vec::new(), Vec::new());
            for round in 0..=args.rounds {
                if pg.rank() == 0 {
                    bar.set_message(format!("{n} tokens"));
                }
                // Round 0 warms up both modes and is not counted.
                pg.barrier().map_err(candle_core::Error::wrap)?;
                if let Some(w) = &whole {
                    let single = ProcessGroup::single();
                    let t = all
                        .install(|| time_forward(w, &x, args.iters, &single))
                        .map_err(err)?;
                    if round > 0 {
                        t1.extend(t.iter().map(|p| p.0));
                    }
                }
                pg.barrier().map_err(candle_core::Error::wrap)?;
                let t = half
                    .install(|| time_forward(&split, &x, args.iters, &pg))
                    .map_err(err)?;
                if round > 0 {
                    t2.extend(t.iter().map(|p| p.0));
                    ar.extend(t.iter().map(|p| p.1));
                }
                if pg.rank() == 0 {
                    bar.inc();
                }
            }
            if pg.rank() == 0 {
                let (m1, m2, a) = (median(&mut t1), median(&mut t2), median(&mut ar));
                out.push(
                    serde_json::json!({
                        "bench": "moe", "hidden": args.hidden, "intermediate": args.intermediate,
                        "experts": args.experts, "top_k": args.top_k, "tokens": n,
                        "threads": args.threads, "ms_1rank": m1, "ms_2ranks": m2,
                        "speedup": m1 / m2, "tokens_per_s_1rank": n as f64 * 1e3 / m1,
                        "tokens_per_s_2ranks": n as f64 * 1e3 / m2,
                        "allreduce_ms_2ranks": a, "backend": backend,
                    })
                    .to_string(),
                );
            }
        }
        Ok(out)
    })?;
    bar.finish();
    for l in &lines[0] {
        bar.println(l);
    }
    Ok(())
}
