//! The f64 quantized product as a candle op: the local product of a row-parallel layer,
//! whose f64 partials the ranks all-reduce and round to f32 once, so that worlds 1, 2 and 3
//! compute the same values (see `candle_tp_kernels::f64_dot`; the driver is
//! `candle_tp_kernels::f64_matmul`).

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape};
use candle_tp_kernels::q4_1::Kernel;
use std::sync::Arc;

use super::types::QuantType;

/// Whether [`crate::quant::QuantMatMul::forward_f64`] has a kernel for weights of this type
/// ([`QuantType::sums_in_f64`]).
pub fn has_f64_kernel(dtype: GgmlDType) -> bool {
    QuantType::of(dtype).sums_in_f64()
}

/// The f64 product as a candle op (CPU, f32 input, f64 or f32 output; inference only).
#[derive(Clone)]
pub(crate) struct F64MatMul {
    pub(crate) w: Arc<QTensor>,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) kernel: Kernel,
    /// Round the f64 sums to an f32 output (a column-parallel layer, which needs no f64
    /// reduction) instead of returning f64.
    pub(crate) f32_out: bool,
}

impl CustomOp1 for F64MatMul {
    fn name(&self) -> &'static str {
        "quantized-matmul-f64"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let shape = layout.shape();
        let dtype = self.w.dtype();
        let k = shape.dims().last().copied().unwrap_or(0);
        if shape.rank() == 0 || k != self.k {
            candle_core::bail!(
                "QuantMatMul (f64): input {shape:?} does not end in k = {}: the {dtype:?} weight is [n, k] = [{}, {}]",
                self.k,
                self.n,
                self.k
            )
        }
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("QuantMatMul (f64): input {shape:?} is not contiguous")
        };
        let x = &storage.as_slice::<f32>()?[start..end];
        let m = shape.elem_count() / k.max(1);
        let mut dst = vec![0f64; m * self.n];
        let data = self.w.data()?;
        let Some(matmul) = QuantType::of(dtype).f64_matmul else {
            candle_core::bail!("QuantMatMul (f64): no f64 kernel for {dtype:?} weights")
        };
        matmul(self.kernel, (m, k, self.n), x, &data, &mut dst)?;
        let mut out = shape.dims().to_vec();
        *out.last_mut().expect("rank checked above") = self.n;
        let storage = if self.f32_out {
            CpuStorage::F32(dst.into_iter().map(|v| v as f32).collect())
        } else {
            CpuStorage::F64(dst)
        };
        Ok((storage, Shape::from(out)))
    }
}
