//! RmsNorm `x / rms(x) · w` over the last dimension as one op, summed as llama.cpp's ggml
//! sums it: each square rounded to f32, the squares added in f64 in order, the mean rounded to
//! f32, `scale = 1 / sqrtf(mean + eps)` in f32, then `(x · scale) · w` in f32.
//!
//! candle-nn's fused `rms_norm` adds the squares in f32 and divides by the root, which differs
//! from ggml in the last bit of most outputs. A GGUF model's activations are quantized to 8
//! bits before each product, so a last-bit difference now and then rounds one activation to
//! the neighbouring step; with ggml's arithmetic the norms give llama.cpp's values bit for bit
//! and that source of disagreement is gone. The sum in f64 is also the more accurate.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, D};

use super::cpu_slice::contiguous_f32;

/// The op (CPU, f32, no backward: callers that track gradients use candle-nn's form).
struct GgmlRmsNorm {
    eps: f32,
}

/// One row: `dst = (x · scale) · w`.
fn rms_row(x: &[f32], w: &[f32], eps: f32, dst: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0f32 / (mean + eps).sqrt();
    for ((d, &v), &w) in dst.iter_mut().zip(x).zip(w) {
        *d = v * scale * w;
    }
}

impl CustomOp2 for GgmlRmsNorm {
    fn name(&self) -> &'static str {
        "candle-tp-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(self.name(), "x", s1, l1)?;
        let w = contiguous_f32(self.name(), "weight", s2, l2)?;
        let n = w.len();
        if n == 0 || l1.shape().dims().last() != Some(&n) {
            candle_core::bail!(
                "{}: x of shape {:?} against a weight of {n} elements",
                self.name(),
                l1.shape()
            )
        }
        let mut out = vec![0f32; x.len()];
        let rows = x.len() / n;
        // Rows in parallel where there are enough to pay for it (a prompt); each row alone.
        if rows >= 16 {
            use rayon::prelude::*;
            out.par_chunks_mut(n)
                .zip(x.par_chunks(n))
                .for_each(|(d, x)| rms_row(x, w, self.eps, d));
        } else {
            for (d, x) in out.chunks_mut(n).zip(x.chunks(n)) {
                rms_row(x, w, self.eps, d);
            }
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// `x / rms(x) · w` over the last dimension of `x`, `w` of that size: in ggml's arithmetic
/// for contiguous f32 tensors on the CPU that track no gradient, candle-nn's `rms_norm`
/// otherwise (and candle-nn's differentiable form where they track one).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let n = w.dims1()?;
    if x.dim(D::Minus1)? != n {
        candle_core::bail!(
            "rms_norm: x of shape {:?} against a weight of {n} elements",
            x.dims()
        )
    }
    let ggml = x.device().is_cpu()
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && !x.track_op()
        && !w.track_op();
    if ggml {
        x.contiguous()?
            .apply_op2_no_bwd(&w.contiguous()?, &GgmlRmsNorm { eps: eps as f32 })
    } else if x.track_op() || w.track_op() {
        candle_nn::ops::rms_norm_slow(x, w, eps as f32)
    } else {
        candle_nn::ops::rms_norm(&x.contiguous()?, w, eps as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Against the same arithmetic written with Candle's ops in f64 (the squares rounded to
    /// f32 first, as ggml rounds them), bit for bit; and within 1e-6 of candle-nn's.
    #[test]
    fn matches_ggml_arithmetic_and_candle_nn() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 2f32, (40, 96), &dev)?;
        let w = Tensor::randn(1f32, 0.5f32, 96, &dev)?;
        let eps = 1e-6;
        let ours = rms_norm(&x, &w, eps)?;
        let sq = x.sqr()?.to_dtype(DType::F64)?;
        let mean = (sq.sum_keepdim(D::Minus1)? / 96.0)?.to_dtype(DType::F32)?;
        let scale = ((mean + eps)?.sqrt()?.recip())?;
        let want = x.broadcast_mul(&scale)?.broadcast_mul(&w)?;
        let got: Vec<f32> = ours.flatten_all()?.to_vec1()?;
        assert!(got.iter().all(|v| v.is_finite()));
        // Candle sums f64 rows pairwise, not in order: allow the last bit of the mean.
        let d = (&ours - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d <= 2e-6, "against the same arithmetic: {d}");
        let nn = candle_nn::ops::rms_norm(&x, &w, eps as f32)?;
        let d = (&ours - &nn)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d <= 1e-5, "against candle-nn: {d}");
        // One row by hand, in order, exactly.
        let row: Vec<f32> = x.get(3)?.to_vec1()?;
        let wv: Vec<f32> = w.to_vec1()?;
        let s: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0f32 / ((s / 96.0) as f32 + 1e-6f32).sqrt();
        let want: Vec<f32> = row.iter().zip(&wv).map(|(&v, &w)| v * scale * w).collect();
        assert_eq!(ours.get(3)?.to_vec1::<f32>()?, want);
        Ok(())
    }

    #[test]
    fn a_weight_of_the_wrong_size_is_an_error() -> Result<()> {
        let x = Tensor::zeros((2, 8), DType::F32, &Device::Cpu)?;
        let w = Tensor::ones(6, DType::F32, &Device::Cpu)?;
        let e = rms_norm(&x, &w, 1e-5).unwrap_err().to_string();
        assert!(e.contains("[2, 8]") && e.contains("6 elements"), "{e}");
        Ok(())
    }
}
