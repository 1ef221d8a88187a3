//! Speed of the fused decode attention ([`candle_tp_kernels::attention::causal_attention`])
//! with each kernel this CPU runs (scalar excluded: it is the reference, not a contender), one
//! thread, for one query row per head (a decode step) of several sequences against their KV
//! caches, kept in f32 and in f16. Rounds interleave the kernels and precisions; the table
//! gives each one's median time per call, nanoseconds per KV head and cached position (one
//! task reads one key and one value row there for its group's query heads), and the f32 AVX2
//! time in the same run divided by its own.
//!
//! ```text
//! cargo run --release -p candle-tp-kernels --example bench_attention [ROUNDS]
//! ```
//!
//! The shapes are SmolLM2-135M's rank 0 at world 2 (6 query heads on 2 KV heads of 64) for 16
//! sequences at 64, 256 and 1024 cached positions. Each call reads the next of 30 layers'
//! caches, as a decode step does, so that they come from memory rather than from the core's
//! cache (one layer's caches of 16 sequences at 64 positions fit in a Zen 5 core's L2; its 30
//! layers do not).

use candle_tp_kernels::attention::{causal_attention, AttentionShape, CacheView, KvElement};
use half::f16;
use std::time::Instant;

/// Median seconds per call of `f` over `rounds` timings of `reps` calls.
fn time(rounds: &mut Vec<f64>, reps: usize, mut f: impl FnMut()) {
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    rounds.push(t.elapsed().as_secs_f64() / reps as f64);
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

mod common;

/// Layers whose caches the calls go through in turn.
const LAYERS: usize = 30;

fn main() -> candle_core::Result<()> {
    let (rounds, kernels, pool) = common::setup();
    println!(
        "{:<6} {:>9} {:>11} {:>5} {:>10} {:>13} {:>10}",
        "cache", "positions", "kernel", "", "µs / call", "ns / head·pos", "x avx2 f32"
    );
    let (batch, q_heads, kv_heads, d) = (16, 6, 2, 64);
    for positions in [64usize, 256, 1024] {
        let cap = positions + 16;
        let n = LAYERS * batch * kv_heads * cap * d;
        let value = |i: usize, m: usize| ((i * m) % 1000) as f32 / 1000.0 - 0.5;
        let (k32, v32): (Vec<f32>, Vec<f32>) = (
            (0..n).map(|i| value(i, 7919)).collect(),
            (0..n).map(|i| value(i, 104_729)).collect(),
        );
        let k16: Vec<f16> = k32.iter().map(|&x| f16::from_f32(x)).collect();
        let v16: Vec<f16> = v32.iter().map(|&x| f16::from_f32(x)).collect();
        let q: Vec<f32> = (0..batch * q_heads * d).map(|i| value(i, 31)).collect();
        let shape = AttentionShape {
            batch,
            q_heads,
            kv_heads,
            queries: 1,
            positions,
            head_dim: d,
        };
        fn view<T: KvElement>(data: &[T], heads: usize, cap: usize, d: usize) -> CacheView<'_, T> {
            CacheView {
                data,
                offset: 0,
                batch: heads * cap * d,
                head: cap * d,
                pos: d,
            }
        }
        // About 20 ms per timing at 15 ns per KV head and position.
        let reps = (20_000_000 / (15 * batch * kv_heads * positions)).max(3);
        let mut out = vec![0f32; q.len()];
        let mut times = vec![vec![Vec::new(); 2]; kernels.len()];
        // The caches of the next layer at each call.
        let per_layer = n / LAYERS;
        let mut layer = 0;
        let mut next = |len: usize| {
            layer = (layer + 1) % LAYERS;
            layer * per_layer..layer * per_layer + len
        };
        pool.install(|| -> candle_core::Result<()> {
            for _ in 0..rounds {
                for (ki, &kernel) in kernels.iter().enumerate() {
                    let mut err = Ok(());
                    time(&mut times[ki][0], reps, || {
                        let at = next(per_layer);
                        let (k, v) = (&k32[at.clone()], &v32[at]);
                        let (k, v) = (view(k, kv_heads, cap, d), view(v, kv_heads, cap, d));
                        err = causal_attention(kernel, &q, k, v, shape, None, 0.125, &mut out);
                    });
                    std::mem::replace(&mut err, Ok(()))?;
                    time(&mut times[ki][1], reps, || {
                        let at = next(per_layer);
                        let (k, v) = (&k16[at.clone()], &v16[at]);
                        let (k, v) = (view(k, kv_heads, cap, d), view(v, kv_heads, cap, d));
                        err = causal_attention(kernel, &q, k, v, shape, None, 0.125, &mut out);
                    });
                    err?;
                }
            }
            Ok(())
        })?;
        let medians: Vec<[f64; 2]> = times
            .into_iter()
            .map(|t| {
                let mut t = t.into_iter().map(median);
                [t.next().unwrap_or(0.0), t.next().unwrap_or(0.0)]
            })
            .collect();
        let avx2 = medians[0][0];
        for (c, cache) in ["f32", "f16"].into_iter().enumerate() {
            for (ki, kernel) in kernels.iter().enumerate() {
                let s = medians[ki][c];
                println!(
                    "{cache:<6} {positions:>9} {:>11} {:>5} {:>10.1} {:>13.2} {:>10.2}",
                    kernel.name(),
                    "",
                    s * 1e6,
                    s * 1e9 / (batch * kv_heads * positions) as f64,
                    avx2 / s
                );
            }
        }
    }
    Ok(())
}
