//! The host's streaming read bandwidth: the ceiling of a memory-bound decode.
//!
//! ```text
//! target/release/examples/bench_memory --threads 2
//! ```
//!
//! Each of `--threads` threads sums its own slice of a `--mib` buffer (much larger than the
//! last-level cache) with 32-byte loads, all starting together; a pass's bandwidth is the
//! buffer's bytes over the slowest thread's time. One JSON line: `impl` ("host"), `threads`,
//! `mib`, `read_gb_s` (the median pass), `best_gb_s` and `passes_gb_s`.
//!
//! A decode step reads every weight once, so `tokens/s × weight bytes per token` (the
//! `weight_bytes_per_token` that `bench_generate` reports for a GGUF file) cannot pass this
//! figure at the same thread count: `scripts/bench-llama-cpp.sh` runs it in every round and
//! prints each decode's share of it, for candle-tp and for llama.cpp.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Streaming read bandwidth of this host, in GB/s, with N threads at once")]
struct Args {
    /// Threads reading at once, each its own slice.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Buffer size in MiB (all threads together).
    #[arg(long, default_value_t = 1024)]
    mib: usize,
    /// Timed passes over the buffer (after one untimed pass).
    #[arg(long, default_value_t = 5)]
    passes: usize,
}

/// The wrapping sum of `xs`, read in 128-byte steps with four 32-byte loads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(xs: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    let chunks = xs.chunks_exact(16);
    let tail: u64 = chunks.remainder().iter().fold(0, |a, &b| a.wrapping_add(b));
    for c in chunks {
        let p = c.as_ptr() as *const __m256i;
        for (k, a) in acc.iter_mut().enumerate() {
            // SAFETY: `c` holds 16 u64, so `p.add(k)` for k < 4 is in bounds.
            *a = _mm256_add_epi64(*a, unsafe { _mm256_loadu_si256(p.add(k)) });
        }
    }
    let mut lanes = [0u64; 4];
    let total = _mm256_add_epi64(
        _mm256_add_epi64(acc[0], acc[1]),
        _mm256_add_epi64(acc[2], acc[3]),
    );
    // SAFETY: `lanes` has room for 32 bytes.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, total) };
    lanes.iter().fold(tail, |a, &b| a.wrapping_add(b))
}

/// The wrapping sum of `xs`, with eight independent accumulators.
fn sum_scalar(xs: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = xs.chunks_exact(8);
    let tail: u64 = chunks.remainder().iter().fold(0, |a, &b| a.wrapping_add(b));
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(x);
        }
    }
    acc.iter().fold(tail, |a, &b| a.wrapping_add(b))
}

fn sum(xs: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { sum_avx2(xs) };
    }
    sum_scalar(xs)
}

/// One pass: every thread sums its slice after a common start; the slowest thread's time.
fn pass(slices: &[&[u64]]) -> (Duration, u64) {
    let start = Barrier::new(slices.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = slices
            .iter()
            .map(|slice| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    let t = Instant::now();
                    let v = sum(slice);
                    (t.elapsed(), v)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a reading thread panicked"))
            .fold((Duration::ZERO, 0u64), |(t, v), (ti, vi)| {
                (t.max(ti), v.wrapping_add(vi))
            })
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.threads == 0 || args.passes == 0 || args.mib == 0 {
        bail!(
            "--threads, --passes and --mib must be positive (got {}, {}, {})",
            args.threads,
            args.passes,
            args.mib
        );
    }
    // The buffer in u64 words (2^17 per MiB), of distinct values, so that no page is shared
    // with another (the zero page).
    let words = args.mib << 17;
    let buf: Vec<u64> = (0..words as u64).collect();
    let per = words / args.threads;
    let slices: Vec<&[u64]> = buf.chunks(per).take(args.threads).collect();
    let bytes = (per * args.threads * 8) as f64;
    let (_, check) = pass(&slices);
    let mut gbs: Vec<f64> = (0..args.passes)
        .map(|_| bytes / pass(&slices).0.as_secs_f64() / 1e9)
        .collect();
    let passes = gbs.clone();
    gbs.sort_by(f64::total_cmp);
    let report = serde_json::json!({
        "impl": "host",
        "threads": args.threads,
        "mib": args.mib,
        "read_gb_s": gbs[gbs.len() / 2],
        "best_gb_s": gbs[gbs.len() - 1],
        "passes_gb_s": passes,
        "checksum": check,
    });
    println!("{report}");
    Ok(())
}
