//! `silu(gate) · up` (the gated MLP's SwiGLU) as one Candle op with autograd: on the CPU in f32,
//! one pass with a vector exponential (`candle_tp_kernels::swiglu`); elsewhere Candle's `silu`
//! and product.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::cpu_slice::contiguous_f32;

/// The fused op (CPU, f32); its backward is written with Candle's ops.
struct SiluMul;

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "candle-tp-silu-mul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let gate = contiguous_f32(self.name(), "gate", s1, l1)?;
        let up = contiguous_f32(self.name(), "up", s2, l2)?;
        if l1.shape() != l2.shape() {
            candle_core::bail!(
                "{}: gate {:?} and up {:?} differ in shape",
                self.name(),
                l1.shape(),
                l2.shape()
            )
        }
        let mut out = vec![0f32; gate.len()];
        candle_tp_kernels::swiglu::silu_mul(gate, up, &mut out);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    /// `d up = g · silu(gate)`, `d gate = g · up · σ(gate) · (1 + gate · (1 − σ(gate)))`.
    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (gate, up) = (gate.detach(), up.detach());
        let sigmoid = candle_nn::ops::sigmoid(&gate)?;
        let silu = (&gate * &sigmoid)?;
        let d_up = (grad * &silu)?;
        let slope = (&sigmoid * ((&gate * (1.0 - &sigmoid)?)? + 1.0)?)?;
        let d_gate = ((grad * &up)? * slope)?;
        Ok((Some(d_gate), Some(d_up)))
    }
}

/// `silu(gate) · up`, elementwise (Llama's gated MLP): one pass on the CPU for f32 tensors of
/// the same shape (`silu` within an ulp or so of Candle's, see `candle_tp_kernels::swiglu`),
/// Candle's `silu` and product otherwise. Differentiable in both arguments.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let gate = Tensor::new(&[-1.0f32, 0.0, 2.0], &Device::Cpu)?;
/// let up = Tensor::new(&[3.0f32, 5.0, 0.5], &Device::Cpu)?;
/// let y = candle_tp::ops::silu_mul(&gate, &up)?;
/// let want = (gate.silu()? * &up)?;
/// let d: f32 = (y - want)?.abs()?.max(0)?.to_scalar()?;
/// assert!(d <= 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.device().is_cpu() && gate.dtype() == DType::F32 && up.dtype() == DType::F32 {
        if gate.shape() != up.shape() {
            candle_core::bail!(
                "silu_mul: gate {:?} and up {:?} differ in shape",
                gate.shape(),
                up.shape()
            )
        }
        gate.contiguous()?.apply_op2(&up.contiguous()?, SiluMul)
    } else {
        gate.silu()? * up
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
        let v: Vec<f32> = (a - b)?.abs()?.flatten_all()?.to_vec1()?;
        assert!(
            v.iter().all(|e| e.is_finite()),
            "non-finite difference: {v:?}"
        );
        Ok(v.into_iter().fold(0f32, f32::max))
    }

    /// The fused op's value and both gradients against Candle's `silu(gate) * up` through
    /// Candle's own backward (a non-contiguous gate included).
    #[test]
    fn value_and_gradients_are_candles() -> Result<()> {
        let dev = Device::Cpu;
        let gate = Var::from_tensor(&(crate::rng::seeded_uniform(&[5, 13], 1, 1.0, &dev)? * 6.0)?)?;
        let up = Var::from_tensor(&crate::rng::seeded_uniform(&[13, 5], 2, 1.0, &dev)?)?;
        let dy = crate::rng::seeded_uniform(&[13, 5], 3, 1.0, &dev)?;
        let run = |fused: bool| -> Result<(Tensor, Tensor, Tensor)> {
            let g = gate.as_tensor().t()?; // [13, 5], not contiguous
            let y = if fused {
                silu_mul(&g, up.as_tensor())?
            } else {
                (g.silu()? * up.as_tensor())?
            };
            let grads = (&y * &dy)?.sum_all()?.backward()?;
            let gg = grads.get(gate.as_tensor()).cloned().expect("d gate");
            let gu = grads.get(up.as_tensor()).cloned().expect("d up");
            Ok((y, gg, gu))
        };
        let (a, b) = (run(true)?, run(false)?);
        assert!(max_abs(&a.0, &b.0)? <= 1e-5, "value");
        assert!(max_abs(&a.1, &b.1)? <= 1e-5, "d gate");
        assert!(max_abs(&a.2, &b.2)? <= 1e-5, "d up");
        // The gradient is not the trivial one.
        assert!(a.1.abs()?.sum_all()?.to_scalar::<f32>()? > 1.0);
        Ok(())
    }

    #[test]
    fn other_dtypes_take_candles_ops_and_bad_shapes_are_errors() -> Result<()> {
        let dev = Device::Cpu;
        let g = Tensor::new(&[1.0f64, -2.0], &dev)?;
        let u = Tensor::new(&[3.0f64, 4.0], &dev)?;
        let y: Vec<f64> = silu_mul(&g, &u)?.to_vec1()?;
        let want: Vec<f64> = (g.silu()? * &u)?.to_vec1()?;
        assert_eq!(y, want);
        let e = silu_mul(
            &Tensor::zeros((2, 3), DType::F32, &dev)?,
            &Tensor::zeros((3, 2), DType::F32, &dev)?,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("[2, 3]") && e.contains("[3, 2]"), "{e}");
        Ok(())
    }
}
