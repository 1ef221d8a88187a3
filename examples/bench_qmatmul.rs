//! Decode-time (m = 1) matmul speed of candle-tp's Q4_1 kernel against candle's `QMatMul`
//! (Q4_1, and Q4_0 / Q8_0 on the same shapes) and the f32 matmul, at 1 and 2 threads; and the
//! f32 matmul of candle against candle-tp's small-m kernel (`quant::matmul_small_m`, what a
//! batch of decode streams runs: `--m 1,2,4,8,16`). And the f64-accumulating kernels that
//! row-parallel layers run (`QuantMatMul::forward_f64`: Q4_1, Q8_0, Q4_K, Q6_K) against the
//! f32 product each replaces (candle-tp's Q4_1 kernel, candle's `QMatMul` for the others);
//! the k-quants only on shapes whose k is a multiple of 256.
//!
//! ```text
//! cargo run --release --example bench_qmatmul                         # SmolLM2's shapes, m = 1
//! cargo run --release --example bench_qmatmul -- --m 1,7 --passes 5
//! cargo run --release --example bench_qmatmul -- --m 1,2,4,8,16 --footprint-mib 128
//! cargo run --release --example bench_qmatmul -- --footprint-mib 128   # weights from DRAM
//! ```
//!
//! By default each implementation multiplies with one copy of its weight, which stays in the
//! caches between calls for all but the largest shapes; `--footprint-mib` cycles through enough
//! copies to stream the weights from memory, as a whole model's decode step does.
//!
//! Candle's thread pool is sized once per process from `RAYON_NUM_THREADS` /
//! `CANDLE_NUM_THREADS`, so the program re-runs itself once per thread count and pass,
//! alternating the thread counts (`--passes` times). Inside each child every round times
//! every case once in turn, each for about `--batch-ms` of back-to-back calls, so a slow spell
//! of this shared machine hits all cases alike. Reported: the median over all rounds of all
//! passes of the time per call, and the weight bytes streamed per second. One JSON line per
//! (shape, m, threads, implementation), then a table with the ratios.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use candle_tp::quant::QuantMatMul;
use candle_tp::rng::seeded_uniform;
use clap::Parser;

#[path = "common/progress.rs"]
mod progress;
use serde_json::json;

#[derive(Parser, Debug)]
#[command(about = "Q4_1 matmul: candle-tp's kernel vs candle's QMatMul vs f32")]
struct Args {
    /// Weight shapes `NxK` (out x in features): SmolLM2's q/o, up/gate, down, lm_head.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "576x576,1536x576,576x1536,49152x576"
    )]
    shapes: Vec<String>,
    /// Activation rows (1 = decode).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    m: Vec<usize>,
    /// Thread counts compared.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// Children per thread count, alternating.
    #[arg(long, default_value_t = 3)]
    passes: usize,
    /// Rounds inside each child.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Milliseconds of back-to-back calls per timing.
    #[arg(long, default_value_t = 30.0)]
    batch_ms: f64,
    /// Cycle each implementation through enough copies of its weight to span this many MiB,
    /// so the weights stream from memory as in a whole model (0: one copy, cache-warm).
    #[arg(long, default_value_t = 0)]
    footprint_mib: usize,
    /// Internal: run the measurements with this process's thread pool and print samples.
    #[arg(long, hide = true)]
    child: bool,
}

/// The implementations compared, in table order.
const IMPLS: [&str; 12] = [
    "candle-tp Q4_1",
    "candle QMatMul Q4_1",
    "candle QMatMul Q4_0",
    "candle QMatMul Q8_0",
    "candle f32 matmul",
    "candle-tp f32 small-m",
    "candle-tp f64 Q4_1",
    "candle-tp f64 Q8_0",
    "candle QMatMul Q4_K",
    "candle-tp f64 Q4_K",
    "candle QMatMul Q6_K",
    "candle-tp f64 Q6_K",
];

/// `(f64 kernel, the f32 product it replaces)`: indices into [`IMPLS`].
const F64_PAIRS: [(usize, usize); 4] = [(6, 0), (7, 3), (9, 8), (11, 10)];

fn parse_shape(s: &str) -> Result<(usize, usize)> {
    let (n, k) = s.split_once('x').context("shape must be NxK")?;
    Ok((n.parse()?, k.parse()?))
}

/// One multiplication, `x -> x Wᵀ`.
type RunFn = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor>>;

/// One implementation on one shape: a closure running `y = x Wᵀ` (cycling through the
/// weight's copies), and the bytes of one copy.
struct Case {
    /// Index into [`IMPLS`].
    impl_index: usize,
    bytes: usize,
    run: RunFn,
}

/// Runs the copies in turn, one per call.
fn cycle<M: Module + 'static>(copies: Vec<M>) -> RunFn {
    let next = std::cell::Cell::new(0usize);
    Box::new(move |x| {
        let i = next.get();
        next.set((i + 1) % copies.len());
        copies[i].forward(x)
    })
}

/// `y = x Wᵀ` with a dense weight, as candle_nn::Linear multiplies.
struct DenseT(Tensor);

impl Module for DenseT {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.matmul(&self.0)
    }
}

/// `y = x Wᵀ` by candle-tp's small-m kernel (what the dense layers run for ≤ 16 rows).
struct SmallM(Tensor);

impl Module for SmallM {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        candle_tp::quant::matmul_small_m(x, &self.0)
    }
}

/// `y = x Wᵀ` summed in f64 (what a row-parallel layer runs), converted back to f32.
struct F64Sum(QuantMatMul);

impl Module for F64Sum {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.0.forward_f64(x)? {
            Some(y) => y.to_dtype(candle_core::DType::F32),
            None => candle_core::bail!("no f64 kernel for {:?}", self.0),
        }
    }
}

fn cases(n: usize, k: usize, footprint_mib: usize) -> Result<Vec<Case>> {
    let dev = Device::Cpu;
    let w = (seeded_uniform(&[n, k], (n * k) as u64, 0.05, &dev)? + 0.01)?;
    let q = |dt| -> Result<QTensor> { Ok(QTensor::quantize(&w, dt)?) };
    let copies = |bytes: usize| (footprint_mib << 20).div_ceil(bytes).max(1);
    let mut out = Vec::new();
    // candle-tp's kernel.
    let bytes = q(GgmlDType::Q4_1)?.storage_size_in_bytes();
    let mut ours = Vec::new();
    for _ in 0..copies(bytes) {
        let mm = QuantMatMul::new(q(GgmlDType::Q4_1)?)?;
        if mm.kernel().is_none() {
            bail!("QuantMatMul does not accelerate Q4_1 here");
        }
        ours.push(mm);
    }
    out.push(Case {
        impl_index: 0,
        bytes,
        run: cycle(ours),
    });
    for (impl_index, dt) in [
        (1, GgmlDType::Q4_1),
        (2, GgmlDType::Q4_0),
        (3, GgmlDType::Q8_0),
    ] {
        let bytes = q(dt)?.storage_size_in_bytes();
        let mms = (0..copies(bytes))
            .map(|_| Ok(QMatMul::from_qtensor(q(dt)?)?))
            .collect::<Result<Vec<_>>>()?;
        out.push(Case {
            impl_index,
            bytes,
            run: cycle(mms),
        });
    }
    let kquants = k.is_multiple_of(256);
    for (impl_index, dt, run) in [
        (6, GgmlDType::Q4_1, true),
        (7, GgmlDType::Q8_0, true),
        (8, GgmlDType::Q4K, kquants),
        (9, GgmlDType::Q4K, kquants),
        (10, GgmlDType::Q6K, kquants),
        (11, GgmlDType::Q6K, kquants),
    ] {
        if !run {
            continue;
        }
        let bytes = q(dt)?.storage_size_in_bytes();
        let n_copies = copies(bytes);
        let run = if IMPLS[impl_index].starts_with("candle-tp f64") {
            let mms = (0..n_copies)
                .map(|_| Ok(F64Sum(QuantMatMul::new(q(dt)?)?)))
                .collect::<Result<Vec<_>>>()?;
            cycle(mms)
        } else {
            let mms = (0..n_copies)
                .map(|_| Ok(QMatMul::from_qtensor(q(dt)?)?))
                .collect::<Result<Vec<_>>>()?;
            cycle(mms)
        };
        out.push(Case {
            impl_index,
            bytes,
            run,
        });
    }
    let bytes = n * k * 4;
    let dense = (0..copies(bytes))
        .map(|_| Ok(DenseT(w.copy()?.t()?)))
        .collect::<Result<Vec<_>>>()?;
    out.push(Case {
        impl_index: 4,
        bytes,
        run: cycle(dense),
    });
    let small = (0..copies(bytes))
        .map(|_| Ok(SmallM(w.copy()?)))
        .collect::<Result<Vec<_>>>()?;
    out.push(Case {
        impl_index: 5,
        bytes,
        run: cycle(small),
    });
    Ok(out)
}

/// Child: prints `shape m impl_index weight_bytes micros` samples, one per round and case.
fn child(args: &Args) -> Result<()> {
    for shape in &args.shapes {
        let (n, k) = parse_shape(shape)?;
        let cs = cases(n, k, args.footprint_mib)?;
        for &m in &args.m {
            let x = seeded_uniform(&[m, k], 7, 1.0, &Device::Cpu)?;
            // Warm up and size each batch to about batch_ms.
            let mut iters = Vec::new();
            for c in &cs {
                (c.run)(&x)?;
                let t = Instant::now();
                let mut reps = 0;
                while t.elapsed().as_secs_f64() < 0.01 {
                    (c.run)(&x)?;
                    reps += 1;
                }
                let per = t.elapsed().as_secs_f64() / reps as f64;
                iters.push(((args.batch_ms / 1e3 / per).ceil() as usize).max(1));
            }
            for _ in 0..args.rounds {
                for (c, &it) in cs.iter().zip(&iters) {
                    let t = Instant::now();
                    for _ in 0..it {
                        std::hint::black_box((c.run)(&x)?);
                    }
                    let us = t.elapsed().as_secs_f64() * 1e6 / it as f64;
                    println!("{shape} {m} {} {} {us}", c.impl_index, c.bytes);
                }
            }
        }
    }
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.child {
        return child(&args);
    }
    let exe = std::env::current_exe()?;
    // (shape, m, threads, impl) -> samples (µs); (shape, impl) -> weight bytes
    let mut samples: BTreeMap<(String, usize, usize, String), Vec<f64>> = BTreeMap::new();
    let mut weight_bytes: BTreeMap<(String, String), usize> = BTreeMap::new();
    let bar = progress::Bar::new(args.passes * args.threads.len(), "run", true);
    for pass in 0..args.passes {
        for &t in &args.threads {
            let step = format!("pass {}/{}: {t} thread(s)", pass + 1, args.passes);
            if !bar.visible() {
                eprintln!("{step}");
            }
            bar.set_message(step);
            let out = Command::new(&exe)
                .args(["--child", "--rounds", &args.rounds.to_string()])
                .args(["--batch-ms", &args.batch_ms.to_string()])
                .args(["--footprint-mib", &args.footprint_mib.to_string()])
                .args(["--shapes", &args.shapes.join(",")])
                .args([
                    "--m",
                    &args
                        .m
                        .iter()
                        .map(|m| m.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                ])
                .env("RAYON_NUM_THREADS", t.to_string())
                .env("CANDLE_NUM_THREADS", t.to_string())
                .output()?;
            if !out.status.success() {
                bail!(
                    "child ({t} threads) failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            for line in String::from_utf8(out.stdout)?.lines() {
                let f: Vec<&str> = line.split(' ').collect();
                let [shape, m, index, bytes, us] = f[..] else {
                    bail!("bad child line {line:?}")
                };
                let name = IMPLS[index.parse::<usize>()?].to_string();
                weight_bytes.insert((shape.into(), name.clone()), bytes.parse()?);
                samples
                    .entry((shape.into(), m.parse()?, t, name))
                    .or_default()
                    .push(us.parse()?);
            }
            bar.inc();
        }
    }
    bar.finish();
    let mut medians = BTreeMap::new();
    for ((shape, m, t, name), v) in samples.iter_mut() {
        let (n, k) = parse_shape(shape)?;
        let bytes = weight_bytes[&(shape.clone(), name.clone())];
        let us = median(v);
        let gbs = bytes as f64 / us / 1e3;
        println!(
            "{}",
            json!({"bench": "qmatmul", "n": n, "k": k, "m": m, "threads": t, "impl": name,
                   "footprint_mib": args.footprint_mib,
                   "median_us": (us * 10.0).round() / 10.0, "weight_bytes": bytes,
                   "gb_per_s": (gbs * 100.0).round() / 100.0, "samples": v.len()})
        );
        medians.insert((shape.clone(), *m, *t, name.clone()), (us, gbs));
    }
    println!();
    println!(
        "| shape (n x k) | m | threads | {} | tp Q4_1 speed-up vs candle Q4_1 | tp Q4_1 GB/s / candle Q4_0 GB/s | tp f32 small-m speed-up vs candle f32 |",
        IMPLS[..6]
            .iter()
            .map(|i| format!("{i} µs (GB/s)"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|---|---|{}---|---|---|", "---|".repeat(6));
    for shape in &args.shapes {
        for &m in &args.m {
            for &t in &args.threads {
                let get = |i: &str| medians[&(shape.clone(), m, t, i.to_string())];
                let cells: Vec<String> = IMPLS[..6]
                    .iter()
                    .map(|i| {
                        let (us, g) = get(i);
                        format!("{us:.1} ({g:.1})")
                    })
                    .collect();
                let (ours, ours_g) = get(IMPLS[0]);
                println!(
                    "| {shape} | {m} | {t} | {} | {:.2}x | {:.2} | {:.2}x |",
                    cells.join(" | "),
                    get(IMPLS[1]).0 / ours,
                    ours_g / get(IMPLS[2]).1,
                    get(IMPLS[4]).0 / get(IMPLS[5]).0
                );
            }
        }
    }
    println!();
    println!("Row-parallel (f64) kernels: time of the f32 product each replaces / its time (> 1: faster)");
    println!();
    println!("| shape (n x k) | m | threads | Q4_1: tp f32 / tp f64 | Q8_0: candle / tp f64 | Q4_K: candle / tp f64 | Q6_K: candle / tp f64 |");
    println!("|---|---|---|---|---|---|---|");
    for shape in &args.shapes {
        for &m in &args.m {
            for &t in &args.threads {
                let cells: Vec<String> = F64_PAIRS
                    .iter()
                    .map(|&(f, r)| {
                        let get =
                            |i: usize| medians.get(&(shape.clone(), m, t, IMPLS[i].to_string()));
                        match (get(f), get(r)) {
                            (Some((f64_us, _)), Some((ref_us, _))) => {
                                format!("{:.2}x", ref_us / f64_us)
                            }
                            _ => "–".to_string(),
                        }
                    })
                    .collect();
                println!("| {shape} | {m} | {t} | {} |", cells.join(" | "));
            }
        }
    }
    Ok(())
}
