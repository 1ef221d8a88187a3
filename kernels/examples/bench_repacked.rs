//! Speed of the repacked quantized products ([`candle_tp_kernels::repack`]) with each kernel
//! this CPU runs (scalar excluded: it is the reference, not a contender), one thread, as
//! decode (m = 1) and prefill tiles (m = 4, 8) run them, on SmolLM2's 1536 × 576 and a 1 B
//! Llama's 5632 × 2048 (enough copies cycled through to stream 64 MiB from memory). Rounds
//! interleave the kernels; the table gives each kernel's median time per call, the AVX2
//! kernel's time over the fastest kernel's (`ratio`), and where the CPU runs more than two
//! kernels, the one before the fastest over it (`prev/last`: AVX-512 VNNI against AMX).
//!
//! ```text
//! cargo run --release -p candle-tp-kernels --example bench_repacked [ROUNDS]
//! BT=Q8_0 BM=1 cargo run --release -p candle-tp-kernels --example bench_repacked  # one type, any m
//! ```

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use candle_tp_kernels::kernel::Kernel;
use candle_tp_kernels::repack::{RepackFn, RepackedMatMul};
use std::sync::Arc;
use std::time::Instant;

mod common;

fn main() -> candle_core::Result<()> {
    let (rounds, kernels, pool) = common::setup();
    let types: [(GgmlDType, RepackFn); 8] = [
        (GgmlDType::Q4_0, candle_tp_kernels::q4_0x4::repack),
        (GgmlDType::Q4_1, candle_tp_kernels::q4_1x4::repack),
        (GgmlDType::Q5_0, candle_tp_kernels::q5_0x4::repack),
        (GgmlDType::Q5_1, candle_tp_kernels::q5_1x4::repack),
        (GgmlDType::Q8_0, candle_tp_kernels::q8_0x4::repack),
        (GgmlDType::Q4K, candle_tp_kernels::q4_kx4::repack),
        (GgmlDType::Q5K, candle_tp_kernels::q5_kx4::repack),
        (GgmlDType::Q6K, candle_tp_kernels::q6_kx4::repack),
    ];
    let names: Vec<String> = kernels.iter().map(|k| format!("{} µs", k.name())).collect();
    println!(
        "{:<6} {:>11} {:>3} {} {:>7} {:>9}",
        "type",
        "n x k",
        "m",
        names.iter().map(|n| format!("{n:>14}")).collect::<String>(),
        "ratio",
        "prev/last"
    );
    for (n, k) in [(1536usize, 576usize), (5632, 2048)] {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
        for (dtype, repack) in types {
            if k % dtype.block_size() != 0 {
                continue;
            }
            // BT=TYPE: that type only.
            if std::env::var("BT").is_ok_and(|t| t != format!("{dtype:?}")) {
                continue;
            }
            let q = QTensor::quantize(&w, dtype)?;
            let bytes = q.data()?;
            let copies = (64usize << 20).div_ceil(bytes.len()).clamp(1, 64);
            let ws: Vec<Arc<dyn RepackedMatMul>> = (0..copies)
                .map(|_| repack(&bytes, n, k))
                .collect::<candle_core::Result<_>>()?;
            // BM=M: that number of activation rows only (any number).
            let ms = match std::env::var("BM") {
                Ok(m) => vec![m.parse::<usize>().map_err(|e| {
                    candle_core::Error::Msg(format!("BM={m}: not a row count ({e})"))
                })?],
                Err(_) => vec![1, 2, 4, 8, 64],
            };
            for m in ms {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 7919) % 255) as f32 - 127.0)
                    .collect();
                let mut y = vec![0f32; m * n];
                // Calls per timing: about 20 ms of the slowest kernel.
                let mut times = vec![Vec::new(); kernels.len()];
                let start = Instant::now();
                ws[0].matmul_f32(kernels[0], m, &x, &mut y)?;
                let calls = ((0.02 / start.elapsed().as_secs_f64()) as usize).clamp(3, 2000);
                for _ in 0..rounds {
                    for (t, &kernel) in kernels.iter().enumerate() {
                        let s = pool.install(|| -> candle_core::Result<f64> {
                            let start = Instant::now();
                            for c in 0..calls {
                                ws[c % copies].matmul_f32(kernel, m, &x, &mut y)?;
                            }
                            Ok(start.elapsed().as_secs_f64() / calls as f64)
                        })?;
                        times[t].push(s);
                    }
                }
                let median = |v: &mut Vec<f64>| {
                    v.sort_by(f64::total_cmp);
                    v[v.len() / 2]
                };
                let meds: Vec<f64> = times.iter_mut().map(median).collect();
                let avx2 = kernels
                    .iter()
                    .position(|k| *k == Kernel::Avx2)
                    .map(|i| meds[i]);
                let last = *meds.last().expect("a kernel");
                let prev = meds.len().checked_sub(2).map_or(f64::NAN, |i| meds[i]);
                println!(
                    "{:<6} {:>11} {:>3} {} {:>7.2} {:>9.2}",
                    format!("{dtype:?}"),
                    format!("{n}x{k}"),
                    m,
                    meds.iter()
                        .map(|t| format!("{:>14.1}", t * 1e6))
                        .collect::<String>(),
                    avx2.map_or(f64::NAN, |a| a / last),
                    prev / last
                );
            }
        }
    }
    Ok(())
}
