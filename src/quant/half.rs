//! `y = x · Wᵀ` for bf16 and f16 weights on the CPU at decode sizes, without widening W.
//!
//! Candle 0.11.1 has no bf16 gemm kernel on the CPU: `CpuStorage::matmul` widens both operands
//! to new f32 vectors, multiplies, and narrows the result back, on every call. For a decode
//! step (a few activation rows) that reads each weight twice, writes it once at twice its
//! size and faults in fresh pages for it: bf16 decodes at ~0.3× the f32 speed instead of the
//! ~2× that half the weight bytes allow (measured in `docs/PERFORMANCE.md`, "Half precision
//! decode"). f16 goes to the `gemm` crate's f16 kernel, which packs and converts panels and
//! gains less than half the bytes promise at one activation row. Here each weight row is
//! widened in registers while it is streamed (a bf16 is the top half of an f32: a 16-bit
//! shift; an f16 goes through F16C's `vcvtph2ps`), the dot products accumulate in f32, and
//! the result is rounded to the half type once, as candle's own paths round it.
//!
//! Used by the parallel layers for CPU half-precision inputs of at most
//! [`HALF_GEMV_MAX_ROWS`] rows; larger products (prefill) keep candle's matmul, where the
//! widening is amortised.

use candle_core::{DType, Device, Result, Tensor, WithDType};
use candle_tp_kernels::half_dot;
use half::{bf16, f16};
use rayon::prelude::*;

/// Activation rows up to which [`matmul_half`] is used instead of candle's matmul.
pub const HALF_GEMV_MAX_ROWS: usize = 16;

/// Weight rows per rayon task at least.
const MIN_ROWS_PER_TASK: usize = 16;

/// A 16-bit float the kernel widens on the fly.
trait Half: WithDType + Into<f32> {
    /// `x · w` (the `candle-tp-kernels` dot product for this type).
    fn dot(x: &[f32], w: &[Self]) -> f32;
}

impl Half for bf16 {
    fn dot(x: &[f32], w: &[Self]) -> f32 {
        half_dot::dot_bf16(x, w)
    }
}

impl Half for f16 {
    fn dot(x: &[f32], w: &[Self]) -> f32 {
        half_dot::dot_f16(x, w)
    }
}

/// `x · Wᵀ` for `x` `[.., k]` and `w` `[n, k]`, both bf16 or both f16, on the CPU: `[.., n]` in
/// the same dtype.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// let w = Tensor::randn(0f32, 1.0, (8, 64), &Device::Cpu)?.to_dtype(DType::BF16)?;
/// let x = Tensor::randn(0f32, 1.0, (1, 64), &Device::Cpu)?.to_dtype(DType::BF16)?;
/// let y = candle_tp::quant::matmul_half(&x, &w)?;
/// assert_eq!(y.dims(), &[1, 8]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn matmul_half(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (n, k) = w.dims2()?;
    let xk = x.dim(candle_core::D::Minus1)?;
    if x.dtype() != w.dtype() || !matches!(w.dtype(), DType::BF16 | DType::F16) {
        candle_core::bail!(
            "half matmul: x is {:?} and W is {:?}, both must be bf16 or both f16",
            x.dtype(),
            w.dtype()
        )
    }
    if !x.device().is_cpu() || !w.device().is_cpu() {
        candle_core::bail!("half matmul: a CPU kernel, given tensors on another device")
    }
    if xk != k {
        candle_core::bail!(
            "half matmul: x {:?} has {xk} features, W {:?} expects {k}",
            x.dims(),
            w.dims()
        )
    }
    match w.dtype() {
        DType::BF16 => run::<bf16>(x, w, n, k),
        _ => run::<f16>(x, w, n, k),
    }
}

fn run<T: Half>(x: &Tensor, w: &Tensor, n: usize, k: usize) -> Result<Tensor> {
    let mut out_dims = x.dims().to_vec();
    *out_dims.last_mut().expect("x has a last dim") = n;
    let m: usize = x.dims()[..x.rank() - 1].iter().product();
    let xs: Vec<f32> = x
        .flatten_all()?
        .to_vec1::<T>()?
        .into_iter()
        .map(Into::into)
        .collect();
    let w = w.contiguous()?;
    let (storage, layout) = w.storage_and_layout();
    let ws: &[T] = match &*storage {
        candle_core::Storage::Cpu(s) => &s.as_slice::<T>()?[layout.start_offset()..][..n * k],
        _ => candle_core::bail!("half matmul: W is not in CPU memory"),
    };
    // Computed weight-row major ([n, m]) so each task owns one contiguous slice.
    let mut yt = vec![0f32; n * m];
    if m > 0 && n > 0 && k > 0 {
        let threads = rayon::current_num_threads();
        let rows = if threads == 1 {
            n
        } else {
            n.div_ceil(4 * threads).max(MIN_ROWS_PER_TASK)
        };
        let task = |(t, out): (usize, &mut [f32])| {
            for (i, y) in out.chunks_mut(m).enumerate() {
                let wrow = &ws[(t * rows + i) * k..][..k];
                for (j, yj) in y.iter_mut().enumerate() {
                    *yj = T::dot(&xs[j * k..][..k], wrow);
                }
            }
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
    fn matches_an_f32_matmul_of_the_same_halves() -> Result<()> {
        let dev = Device::Cpu;
        for dtype in [DType::BF16, DType::F16] {
            for (m, k, n) in [(1, 64, 40), (3, 576, 200), (16, 100, 7), (2, 0, 5)] {
                let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?.to_dtype(dtype)?;
                let x = Tensor::randn(0f32, 1.0, (1, m, k), &dev)?.to_dtype(dtype)?;
                let got = matmul_half(&x, &w)?;
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
                    // Both accumulate in f32 (in other orders) and round once to the half type:
                    // at most one ulp of it apart (2^-8 relative for bf16, 2^-11 for f16).
                    let ulp = if dtype == DType::BF16 {
                        1.0 / 128.0
                    } else {
                        1.0 / 1024.0
                    };
                    assert!(
                        (a - b).abs() <= ulp * b.abs() + 1e-5,
                        "{dtype:?} ({m}, {k}, {n}): {a} vs {b}"
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn refuses_mismatched_inputs() {
        let dev = Device::Cpu;
        let w = Tensor::zeros((4, 8), DType::BF16, &dev).unwrap();
        let x = Tensor::zeros((1, 9), DType::BF16, &dev).unwrap();
        let e = matmul_half(&x, &w).unwrap_err().to_string();
        assert!(e.contains("9 features") && e.contains("expects 8"), "{e}");
        let x = Tensor::zeros((1, 8), DType::F16, &dev).unwrap();
        let e = matmul_half(&x, &w).unwrap_err().to_string();
        assert!(e.contains("F16") && e.contains("BF16"), "{e}");
    }
}
