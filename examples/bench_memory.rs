//! The host's streaming read bandwidth: the ceiling of a memory-bound decode.
//!
//! ```text
//! target/release/examples/bench_memory --threads 2
//! ```
//!
//! Each of `--threads` threads sums its own slice of a `--mib` buffer (much larger than the
//! last-level cache), all starting together; a pass's bandwidth is the buffer's bytes over the
//! slowest thread's time. A probe that reads slower than a program on the same host is no
//! ceiling (on a 16-core Intel Xeon, llama.cpp's decode streamed 107 GB/s where one 32-byte
//! stream per thread read 98, issue 47), so every pass is made by each read method this CPU
//! runs, interleaved, and the fastest method's median is the figure:
//!
//! | method | reads |
//! |---|---|
//! | `scalar` | 8-byte loads, eight accumulators |
//! | `avx2` | 32-byte loads, one stream per thread |
//! | `avx512` | 64-byte loads, one stream per thread |
//! | `avx512x4` | 64-byte loads from four streams per thread (the slice's quarters in step: more lines in flight, as a kernel reading four weight rows has) |
//! | `avx512pf` | `avx512` with a software prefetch 2 KiB ahead |
//! | `avx512pf12k` | `avx512` with every line prefetched 12 KiB ahead (what the quantized kernels do since 2026-11-28: two ranks of a 1 B decode on a Zen 5 then streamed 58-60 GB/s where two threads of the methods above read 53) |
//! | `avx512x4pf8k` | `avx512x4` with every line of each stream prefetched 8 KiB ahead (the 512-bit quantized engine's four weight streams) |
//! | `avx512nt` | `avx512x4` with non-temporal loads (`vmovntdqa`) and `prefetchnta` |
//!
//! One JSON line: `impl` ("host"), `threads`, `mib`, `read_gb_s` (the fastest method's
//! median pass), `best_gb_s` (the fastest pass of any method), `method` (the fastest
//! method), `methods` (each method's median) and `passes_gb_s` (the fastest method's passes).
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
    /// Ask for transparent huge pages for the buffer (`madvise(MADV_HUGEPAGE)`; Linux), where
    /// the kernel gives them only on request (`/sys/kernel/mm/transparent_hugepage/enabled`
    /// set to `madvise`).
    #[arg(long)]
    huge_pages: bool,
}

/// `words` distinct u64 values, so that no page is shared with another (the zero page), in
/// memory asked for as transparent huge pages where `huge` (before any page is touched).
fn buffer(words: usize, huge: bool) -> Vec<u64> {
    let mut buf: Vec<u64> = Vec::with_capacity(words);
    #[cfg(target_os = "linux")]
    if huge {
        const HUGE: usize = 2 << 20;
        let start = buf.as_ptr() as usize;
        let (lo, hi) = (
            start.next_multiple_of(HUGE),
            (start + words * 8) / HUGE * HUGE,
        );
        if hi > lo {
            // SAFETY: advice on whole pages of this allocation, which nothing reads yet.
            let rc =
                unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
            if rc != 0 {
                eprintln!(
                    "madvise(MADV_HUGEPAGE): {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = huge;
    buf.extend(0..words as u64);
    buf
}

/// How a thread reads its slice.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Method {
    Scalar,
    Avx2,
    Avx512,
    Avx512x4,
    Avx512Prefetch,
    Avx512Prefetch12k,
    Avx512x4Prefetch8k,
    Avx512Nt,
}

impl Method {
    const ALL: [Method; 8] = [
        Method::Scalar,
        Method::Avx2,
        Method::Avx512,
        Method::Avx512x4,
        Method::Avx512Prefetch,
        Method::Avx512Prefetch12k,
        Method::Avx512x4Prefetch8k,
        Method::Avx512Nt,
    ];

    fn name(self) -> &'static str {
        match self {
            Method::Scalar => "scalar",
            Method::Avx2 => "avx2",
            Method::Avx512 => "avx512",
            Method::Avx512x4 => "avx512x4",
            Method::Avx512Prefetch => "avx512pf",
            Method::Avx512Prefetch12k => "avx512pf12k",
            Method::Avx512x4Prefetch8k => "avx512x4pf8k",
            Method::Avx512Nt => "avx512nt",
        }
    }

    /// Whether this CPU runs the method.
    fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Method::Scalar => true,
                Method::Avx2 => is_x86_feature_detected!("avx2"),
                _ => is_x86_feature_detected!("avx512f"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Method::Scalar
        }
    }

    /// The wrapping sum of `xs` (so that no read is optimised away).
    fn sum(self, xs: &[u64]) -> u64 {
        assert!(self.available(), "{} is not available here", self.name());
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has the method's features (checked above).
        unsafe {
            match self {
                Method::Scalar => sum_scalar(xs),
                Method::Avx2 => sum_avx2(xs),
                Method::Avx512 => sum_avx512::<1, 0, 1, false>(xs),
                Method::Avx512x4 => sum_avx512::<4, 0, 1, false>(xs),
                Method::Avx512Prefetch => sum_avx512::<1, 2048, 1, false>(xs),
                Method::Avx512Prefetch12k => sum_avx512::<1, 12288, 4, false>(xs),
                Method::Avx512x4Prefetch8k => sum_avx512::<4, 8192, 4, false>(xs),
                Method::Avx512Nt => sum_avx512::<4, 1024, 1, true>(xs),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        sum_scalar(xs)
    }
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

/// A cache line of the buffer: eight words, 64-byte aligned.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct Line([u64; 8]);

/// The wrapping sum of `xs` with 64-byte loads, 256 bytes per step and stream: `STREAMS`
/// equal parts of `xs` read in step, each prefetched `AHEAD` bytes ahead (0: none), the first
/// `LINES` of a step's four lines, with non-temporal loads and `prefetchnta` where `NT`. The 64-byte-aligned middle of the slice
/// is read so (`vmovntdqa` needs alignment); the ends are added word by word.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_avx512<
    const STREAMS: usize,
    const AHEAD: usize,
    const LINES: usize,
    const NT: bool,
>(
    xs: &[u64],
) -> u64 {
    use std::arch::x86_64::*;
    // SAFETY: u64 -> 64-byte-aligned lines of 8 words; `align_to` keeps the ends apart.
    let (head, body, tail) = unsafe { xs.align_to::<Line>() };
    let step = 4; // blocks per stream and step
    let per = body.len() / STREAMS / step * step;
    let mut acc = [_mm512_setzero_si512(); 4];
    for i in (0..per).step_by(step) {
        for s in 0..STREAMS {
            let p = body.as_ptr().add(s * per + i);
            if AHEAD > 0 {
                // A hint: no fault past the end.
                for line in 0..LINES {
                    let ahead = (p as *const i8).wrapping_add(AHEAD + 64 * line);
                    if NT {
                        _mm_prefetch(ahead, _MM_HINT_NTA);
                    } else {
                        _mm_prefetch(ahead, _MM_HINT_T0);
                    }
                }
            }
            for (k, a) in acc.iter_mut().enumerate() {
                // `p.add(k)` is a 64-byte-aligned block of `body`.
                let v = if NT {
                    _mm512_stream_load_si512(p.add(k) as *const __m512i)
                } else {
                    _mm512_load_si512(p.add(k) as *const __m512i)
                };
                *a = _mm512_add_epi64(*a, v);
            }
        }
    }
    let total = _mm512_add_epi64(
        _mm512_add_epi64(acc[0], acc[1]),
        _mm512_add_epi64(acc[2], acc[3]),
    );
    let mut sum = _mm512_reduce_add_epi64(total) as u64;
    let rest = body[per * STREAMS..].iter().flat_map(|l| &l.0);
    for &w in head.iter().chain(rest).chain(tail) {
        sum = sum.wrapping_add(w);
    }
    sum
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

/// One pass: every thread sums its slice by `method` after a common start; the slowest
/// thread's time and the sum.
fn pass(slices: &[&[u64]], method: Method) -> (Duration, u64) {
    let start = Barrier::new(slices.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = slices
            .iter()
            .map(|slice| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    let t = Instant::now();
                    let v = method.sum(slice);
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

/// The process's memory in transparent huge pages, in MiB (`AnonHugePages` of
/// `/proc/self/smaps_rollup`; `None` where there is no such file).
fn anon_huge_mib() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = text.lines().find(|l| l.starts_with("AnonHugePages:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib >> 10)
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
    // The buffer in u64 words (2^17 per MiB).
    let words = args.mib << 17;
    let buf = buffer(words, args.huge_pages);
    let per = words / args.threads;
    let slices: Vec<&[u64]> = buf.chunks(per).take(args.threads).collect();
    let bytes = (per * args.threads * 8) as f64;
    let methods: Vec<Method> = Method::ALL.into_iter().filter(|m| m.available()).collect();
    // Every method must read the same words: a sum that differs is a wrong reader.
    let check = pass(&slices, Method::Scalar).1;
    for &m in &methods {
        let got = pass(&slices, m).1;
        if got != check {
            bail!(
                "{} read a sum of {got}, the scalar reader {check}",
                m.name()
            );
        }
    }
    // Passes interleaved across the methods, so that a noisy moment hits them alike.
    let mut gbs: Vec<Vec<f64>> = vec![Vec::new(); methods.len()];
    for _ in 0..args.passes {
        for (g, &m) in gbs.iter_mut().zip(&methods) {
            g.push(bytes / pass(&slices, m).0.as_secs_f64() / 1e9);
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let medians: Vec<f64> = gbs.iter().map(|g| median(g)).collect();
    let fastest = (0..methods.len())
        .max_by(|&a, &b| medians[a].total_cmp(&medians[b]))
        .expect("the scalar method is always available");
    let best = gbs.iter().flatten().copied().fold(0f64, f64::max);
    let report = serde_json::json!({
        "impl": "host",
        "threads": args.threads,
        "mib": args.mib,
        "huge_pages": args.huge_pages,
        "anon_huge_mib": anon_huge_mib(),
        "read_gb_s": medians[fastest],
        "best_gb_s": best,
        "method": methods[fastest].name(),
        "methods": methods
            .iter()
            .zip(&medians)
            .map(|(m, g)| (m.name().to_string(), serde_json::json!(g)))
            .collect::<serde_json::Map<_, _>>(),
        "passes_gb_s": gbs[fastest],
        "checksum": check,
    });
    println!("{report}");
    Ok(())
}
