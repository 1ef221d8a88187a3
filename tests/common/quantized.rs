//! The exact product of quantized operands, the reference of the quantized kernels' tests.
//!
//! The crate's Q8_0 and k-quant kernels sum each block's exact integer product times its
//! scales in f64: they must equal this product up to one f32 rounding. candle's own `QMatMul`
//! is no tight reference for them: candle 0.11.1 picks different activation formats on
//! AVX-512 VNNI and AVX-VNNI CPUs (see `candle_tp_kernels::kernel::cpu_features`).

use anyhow::{bail, ensure, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// Every block type of the GGUF files the Llama family ships in (llama.cpp's Q4_0 … Q6_K
/// mixes), which the crate repacks and sums in f64 on the CPU.
pub const LLAMA_GGUF_TYPES: [GgmlDType; 8] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// What a Q4_0, Q5_0, Q8_0, Q4_K or Q6_K product multiplies, as candle's own code makes it, in
/// f64: the weight dequantized by candle, and the activations quantized by candle to the type's
/// ggml activation format (Q8_0 for Q4_0, Q5_0 and Q8_0 weights, Q8K for the k-quants) read from candle's block
/// bytes (`d · q`, exact in f64). Returns the product `[m, n]` summed in f64 and, per output,
/// `Σ |w x|` (what bounds the rounding of candle's f32 dequantization of the weight).
pub fn exact_product(w: &QTensor, x: &Tensor) -> Result<(Vec<f64>, Vec<f64>)> {
    let (n, k) = w.shape().dims2()?;
    let (m, kx) = x.dims2()?;
    ensure!(k == kx, "weight [{n}, {k}] against input [{m}, {kx}]");
    let wd: Vec<f64> = w
        .dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f64::from)
        .collect();
    // The activation format: its type, values and bytes per block, and where `qs` starts.
    let (act, block, size, off) = match w.dtype() {
        GgmlDType::Q4_0 | GgmlDType::Q5_0 | GgmlDType::Q8_0 => (GgmlDType::Q8_0, 32, 34, 2),
        GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K => (GgmlDType::Q8K, 256, 292, 4),
        other => bail!("no exact reference for {other:?}"),
    };
    // Q8_0's scale is an f16, Q8K's an f32, at the start of the block.
    let d_of = |b: &[u8]| -> f64 {
        if act == GgmlDType::Q8_0 {
            half::f16::from_le_bytes([b[0], b[1]]).to_f64()
        } else {
            f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64
        }
    };
    let qx = QTensor::quantize(x, act)?;
    let bytes = qx.data()?;
    ensure!(bytes.len() == m * k / block * size, "{act:?} block size");
    let xd: Vec<f64> = bytes
        .chunks_exact(size)
        .flat_map(|b| {
            let d = d_of(b);
            b[off..off + block]
                .iter()
                .map(move |&q| d * (q as i8) as f64)
        })
        .collect();
    let (mut y, mut mag) = (vec![0f64; m * n], vec![0f64; m * n]);
    for i in 0..m {
        for j in 0..n {
            for t in 0..k {
                let p = xd[i * k + t] * wd[j * k + t];
                y[i * n + j] += p;
                mag[i * n + j] += p.abs();
            }
        }
    }
    Ok((y, mag))
}
