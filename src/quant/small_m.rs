//! `y = x · Wᵀ` on the CPU for a few activation rows (a decode step, one sequence or a
//! continuous batch of them), reading each weight row once for all rows.
//!
//! Candle 0.11.1's CPU matmul has two costs this avoids:
//! - **f32, 2-16 rows**: one activation row goes to a gemv, but two or more go to the `gemm`
//!   crate, which packs the weight panel on every call: `[m, 576] × [576, 768]` takes 36 µs at
//!   m = 1 and 200-325 µs at m = 2-16 on one EPYC core, so a batch of decode streams cost
//!   nearly as much as running them one after another.
//! - **bf16 / f16**: candle widens both operands to new f32 vectors on every call (bf16 then
//!   decodes at ~0.3× the f32 speed instead of the ~2× half the bytes allow; measured in
//!   `docs/PERFORMANCE.md`, "Half precision decode"), and f16 goes to a gemm that packs and
//!   converts panels.
//!
//! Here the `candle-tp-kernels` crate's [`small_m`](candle_tp_kernels::small_m) kernel
//! multiplies tiles of 4 weight rows × 3 activation rows in registers (bf16 and f16 widened
//! on the fly), with f32 accumulation and one rounding to the half type at the end. Each
//! output is one accumulator chain in a fixed order whatever the batch: a row's result is
//! bit-identical alone and among 15 others (batch invariance), which is what lets a server's
//! batched decode give exactly the tokens of a single-stream decode.
//!
//! Used by the parallel layers for CPU inputs of at most [`SMALL_M_MAX_ROWS`] rows that do not
//! track gradients; larger products (prefill, training) keep candle's matmul.

use candle_core::{DType, Device, Result, Tensor, WithDType};
use candle_tp_kernels::small_m::{self, WeightElem};
use half::{bf16, f16};
use rayon::prelude::*;

/// Activation rows up to which [`matmul_small_m`] is used instead of candle's matmul.
pub const SMALL_M_MAX_ROWS: usize = 16;

/// Weight rows per rayon task at least (a multiple of the kernel's tiles).
const MIN_ROWS_PER_TASK: usize = 32;

/// `x · Wᵀ` for `x` `[.., k]` and `w` `[n, k]` of the same dtype (f32, bf16 or f16), on the
/// CPU: `[.., n]` in that dtype. Any number of rows works; it pays off up to
/// [`SMALL_M_MAX_ROWS`]. No gradient is recorded (the layers use it for inference only).
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// let w = Tensor::randn(0f32, 1.0, (8, 64), &Device::Cpu)?.to_dtype(DType::BF16)?;
/// let x = Tensor::randn(0f32, 1.0, (3, 64), &Device::Cpu)?.to_dtype(DType::BF16)?;
/// let y = candle_tp::quant::matmul_small_m(&x, &w)?;
/// assert_eq!(y.dims(), &[3, 8]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn matmul_small_m(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (n, k) = w.dims2()?;
    let xk = x.dim(candle_core::D::Minus1)?;
    if x.dtype() != w.dtype() || !matches!(w.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        candle_core::bail!(
            "small-m matmul: x is {:?} and W is {:?}, both must be f32, both bf16 or both f16",
            x.dtype(),
            w.dtype()
        )
    }
    if !x.device().is_cpu() || !w.device().is_cpu() {
        candle_core::bail!("small-m matmul: a CPU kernel, given tensors on another device")
    }
    if xk != k {
        candle_core::bail!(
            "small-m matmul: x {:?} has {xk} features, W {:?} expects {k}",
            x.dims(),
            w.dims()
        )
    }
    match w.dtype() {
        DType::F32 => run::<f32>(x, w, n, k),
        DType::BF16 => run::<bf16>(x, w, n, k),
        _ => run::<f16>(x, w, n, k),
    }
}

fn run<T: WithDType + WeightElem>(x: &Tensor, w: &Tensor, n: usize, k: usize) -> Result<Tensor> {
    let mut out_dims = x.dims().to_vec();
    *out_dims.last_mut().expect("x has a last dim") = n;
    let m: usize = x.dims()[..x.rank() - 1].iter().product();
    let xs: Vec<f32> = x.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
    let w = w.contiguous()?;
    let (storage, layout) = w.storage_and_layout();
    let ws: &[T] = match &*storage {
        candle_core::Storage::Cpu(s) => &s.as_slice::<T>()?[layout.start_offset()..][..n * k],
        _ => candle_core::bail!("small-m matmul: W is not in CPU memory"),
    };
    // Computed weight-row major ([n, m]) so each task owns one contiguous slice.
    let mut yt = vec![0f32; n * m];
    if m > 0 && n > 0 {
        let threads = rayon::current_num_threads();
        let rows = if threads == 1 {
            n
        } else {
            n.div_ceil(4 * threads)
                .next_multiple_of(8)
                .max(MIN_ROWS_PER_TASK)
        };
        let task = |(t, out): (usize, &mut [f32])| {
            let first = t * rows;
            let count = out.len() / m;
            small_m::matmul_rows(&xs, m, k, &ws[first * k..][..count * k], out);
        };
        if n <= rows {
            task((0, &mut yt));
        } else {
            yt.par_chunks_mut(rows * m).enumerate().for_each(task);
        }
    }
    let mut y = vec![T::from_f64(0.0); m * n];
    if m > 0 {
        for (i, row) in yt.chunks(m).enumerate() {
            for (j, v) in row.iter().enumerate() {
                y[j * n + i] = T::from_f64(*v as f64);
            }
        }
    }
    Tensor::from_vec(y, out_dims, &Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_an_f32_matmul_of_the_same_values() -> Result<()> {
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (m, k, n) in [(1, 64, 40), (3, 576, 200), (16, 100, 7), (2, 0, 5)] {
                let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?.to_dtype(dtype)?;
                let x = Tensor::randn(0f32, 1.0, (1, m, k), &dev)?.to_dtype(dtype)?;
                let got = matmul_small_m(&x, &w)?;
                assert_eq!(got.dtype(), dtype);
                let got = got.to_dtype(DType::F32)?;
                // The reference: the same halves widened, an f32 matmul, one rounding (what
                // candle does for bf16; its f16 gemm accumulates in lower precision).
                let want = x
                    .to_dtype(DType::F32)?
                    .broadcast_matmul(&w.to_dtype(DType::F32)?.t()?)?
                    .to_dtype(dtype)?
                    .to_dtype(DType::F32)?;
                assert_eq!(got.dims(), want.dims());
                let g = got.flatten_all()?.to_vec1::<f32>()?;
                let r = want.flatten_all()?.to_vec1::<f32>()?;
                for (a, b) in g.iter().zip(&r) {
                    assert!(
                        a.is_finite(),
                        "{dtype:?} ({m}, {k}, {n}): non-finite output"
                    );
                    // Both accumulate in f32 (in other orders): the sums differ by a few f32
                    // ulps of the terms' scale (about sqrt(k)), whatever the output's size (a
                    // sum near 0 by cancellation keeps that absolute error). Each then rounds
                    // once to the output type: one more ulp of a half type (2^-8 relative for
                    // bf16, 2^-11 for f16) at most.
                    let order = 1e-5 * (b.abs() + (k as f32).sqrt());
                    let tol = match dtype {
                        DType::BF16 => b.abs() / 128.0 + order,
                        DType::F16 => b.abs() / 1024.0 + order,
                        _ => order,
                    };
                    assert!(
                        (a - b).abs() <= tol,
                        "{dtype:?} ({m}, {k}, {n}): {a} vs {b}"
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn a_row_gets_the_same_bits_alone_and_in_a_batch() -> Result<()> {
        // 200 weight rows: split between rayon tasks on a multi-core machine.
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let w = Tensor::randn(0f32, 1.0, (200, 100), &dev)?.to_dtype(dtype)?;
            let x = Tensor::randn(0f32, 1.0, (16, 100), &dev)?.to_dtype(dtype)?;
            let all = matmul_small_m(&x, &w)?.to_dtype(DType::F32)?;
            for j in [0, 5, 15] {
                let one = matmul_small_m(&x.narrow(0, j, 1)?, &w)?.to_dtype(DType::F32)?;
                let (a, b) = (
                    one.flatten_all()?.to_vec1::<f32>()?,
                    all.get(j)?.to_vec1::<f32>()?,
                );
                assert!(a.iter().all(|v| v.is_finite()));
                let same = a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same, "{dtype:?}: row {j} alone differs from row {j} of 16");
            }
        }
        Ok(())
    }

    #[test]
    fn refuses_mismatched_inputs() {
        let dev = Device::Cpu;
        let w = Tensor::zeros((4, 8), DType::BF16, &dev).unwrap();
        let x = Tensor::zeros((1, 9), DType::BF16, &dev).unwrap();
        let e = matmul_small_m(&x, &w).unwrap_err().to_string();
        assert!(e.contains("9 features") && e.contains("expects 8"), "{e}");
        let x = Tensor::zeros((1, 8), DType::F16, &dev).unwrap();
        let e = matmul_small_m(&x, &w).unwrap_err().to_string();
        assert!(e.contains("F16") && e.contains("BF16"), "{e}");
    }
}
