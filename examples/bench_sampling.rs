//! The cost of one sampling step on vocabulary-parallel logits (threads backend).
//!
//! ```text
//! cargo run --release --example bench_sampling -- --vocab 49152 --worlds 1,2 --iters 300
//! ```
//!
//! Logits are normal with standard deviation `--sigma` (the same on every run); for each world
//! size and mode (greedy, temperature 0.8 alone, top-k 50, top-p 0.9) rank 0 times `--iters`
//! draws of one sampler and prints one JSON line: `mode`, `world_size`, `vocab`, `iters`,
//! `median_us`, `min_us`, `p10_us` and `p90_us` per draw (a draw waits for every rank, so rank 0's time is the
//! step's).

use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_tp::generate::{DistributedSampler, SamplingParams};
use candle_tp::rng::SplitMix64;
use candle_tp::{run_threads, Partition};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Time one sampling step on vocabulary-parallel logits")]
struct Args {
    /// Vocabulary size.
    #[arg(long, default_value_t = 49152)]
    vocab: usize,
    /// World sizes (threads).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    worlds: Vec<usize>,
    /// Draws timed per mode and world size.
    #[arg(long, default_value_t = 300)]
    iters: usize,
    /// Standard deviation of the logits.
    #[arg(long, default_value_t = 3.0)]
    sigma: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut rng = SplitMix64::new(1);
    let logits: Vec<f32> = (0..args.vocab)
        .map(|_| (rng.next_normal() * args.sigma) as f32)
        .collect();
    let modes = [
        ("greedy", SamplingParams::greedy()),
        (
            "temperature",
            SamplingParams {
                temperature: 0.8,
                top_k: None,
                top_p: None,
                seed: 1,
            },
        ),
        (
            "top_k",
            SamplingParams {
                temperature: 0.8,
                top_k: Some(50),
                top_p: None,
                seed: 1,
            },
        ),
        (
            "top_p",
            SamplingParams {
                temperature: 0.8,
                top_k: None,
                top_p: Some(0.9),
                seed: 1,
            },
        ),
    ];
    for &world in &args.worlds {
        let part = Partition::new(args.vocab, world)?;
        for (name, params) in modes {
            let times = run_threads(world, |pg| {
                let local = Tensor::new(&logits[part.range(pg.rank())], &Device::Cpu)?;
                let mut s = DistributedSampler::new(params);
                let mut us = Vec::with_capacity(args.iters);
                for _ in 0..args.iters {
                    let t = Instant::now();
                    s.sample_shard(&local, &part, &pg)?;
                    us.push(t.elapsed().as_secs_f64() * 1e6);
                }
                Ok(us)
            })?;
            let mut us = times[0].clone();
            us.sort_by(f64::total_cmp);
            println!(
                "{}",
                serde_json::json!({
                    "mode": name, "world_size": world, "vocab": args.vocab, "iters": args.iters,
                    "median_us": (us[us.len() / 2] * 10.0).round() / 10.0,
                    "min_us": (us[0] * 10.0).round() / 10.0,
                    "p10_us": (us[us.len() / 10] * 10.0).round() / 10.0,
                    "p90_us": (us[us.len() * 9 / 10] * 10.0).round() / 10.0,
                })
            );
        }
    }
    Ok(())
}
