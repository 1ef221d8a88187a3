//! A decode step's attention (one query row per head against the KV cache) as one Candle op on
//! the CPU in f32: `candle_tp_kernels::attention`, which reads each KV head's cache once for
//! its whole GQA group, instead of two matmuls and a softmax.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use candle_tp_kernels::attention::{CacheView, DecodeShape};
use candle_tp_kernels::kernel::Kernel;

/// The fused op (CPU, f32, inference only: it has no backward).
struct DecodeAttention {
    scale: f32,
}

impl DecodeAttention {
    /// The view of keys or values `[batch, kv_heads, positions, head_dim]` of any strides
    /// whose last is 1 (the KV cache's buffers are `[.., capacity, head_dim]`).
    fn view<'a>(&self, name: &str, s: &'a CpuStorage, l: &Layout) -> Result<CacheView<'a>> {
        let CpuStorage::F32(data) = s else {
            candle_core::bail!("{}: {name} must be f32, got {:?}", self.name(), s.dtype())
        };
        let stride = l.stride();
        if l.dims().len() != 4 || stride[3] != 1 {
            candle_core::bail!(
                "{}: {name} of shape {:?} and strides {stride:?}: expected [batch, kv_heads, \
                 positions, head_dim] with contiguous rows",
                self.name(),
                l.dims()
            )
        }
        Ok(CacheView {
            data,
            offset: l.start_offset(),
            batch: stride[0],
            head: stride[1],
            pos: stride[2],
        })
    }
}

impl CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        "candle-tp-decode-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(q) = s1 else {
            candle_core::bail!("{}: q must be f32, got {:?}", self.name(), s1.dtype())
        };
        let (Some((q0, q1)), [batch, q_heads, 1, head_dim]) = (l1.contiguous_offsets(), l1.dims())
        else {
            candle_core::bail!(
                "{}: q of shape {:?} must be contiguous [batch, heads, 1, head_dim]",
                self.name(),
                l1.dims()
            )
        };
        let (k, v) = (self.view("keys", s2, l2)?, self.view("values", s3, l3)?);
        if l2.dims() != l3.dims() || l2.dims()[0] != *batch || l2.dims()[3] != *head_dim {
            candle_core::bail!(
                "{}: q {:?}, keys {:?} and values {:?} disagree (expected keys and values \
                 [{batch}, kv_heads, positions, {head_dim}])",
                self.name(),
                l1.dims(),
                l2.dims(),
                l3.dims()
            )
        }
        let shape = DecodeShape {
            batch: *batch,
            q_heads: *q_heads,
            kv_heads: l2.dims()[1],
            positions: l2.dims()[2],
            head_dim: *head_dim,
        };
        let mut out = vec![0f32; q1 - q0];
        candle_tp_kernels::attention::decode_attention(
            Kernel::detect(),
            &q[q0..q1],
            k,
            v,
            shape,
            self.scale,
            &mut out,
        )?;
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// `softmax(scale · q · kᵀ) · v` for one query row per head, `q` `[batch, heads, 1, head_dim]`
/// against the cache `k`, `v` `[batch, kv_heads, positions, head_dim]` (query head `h` reads
/// KV head `h / (heads / kv_heads)`; any strides with contiguous rows), as the fused CPU op.
/// `None` where it does not apply (another device or dtype, or a tensor that tracks
/// gradients: the op has no backward), for the caller's general path.
pub(crate) fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
) -> Result<Option<Tensor>> {
    let cpu_f32 = [q, k, v]
        .iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32 && !t.track_op());
    if !cpu_f32 || q.dim(2)? != 1 {
        return Ok(None);
    }
    let op = DecodeAttention {
        scale: scale as f32,
    };
    Ok(Some(q.contiguous()?.apply_op3_no_bwd(k, v, &op)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, IndexOp};

    /// Against Candle's own matmuls and softmax on the cache expanded to every query head,
    /// with keys and values strided as the KV cache's buffers (a narrowed capacity).
    #[test]
    fn is_candles_attention_on_strided_caches() -> Result<()> {
        let dev = Device::Cpu;
        let (b, nq, nkv, d, cap, len) = (2, 6, 2, 16, 40, 33);
        let q = Tensor::randn(0f32, 1.0, (b, nq, 1, d), &dev)?;
        let kbuf = Tensor::randn(0f32, 1.0, (b, nkv, cap, d), &dev)?;
        let vbuf = Tensor::randn(0f32, 1.0, (b, nkv, cap, d), &dev)?;
        let (k, v) = (kbuf.narrow(2, 0, len)?, vbuf.narrow(2, 0, len)?);
        assert!(!k.is_contiguous());
        let scale = 1.0 / (d as f64).sqrt();
        let got = decode_attention(&q, &k, &v, scale)?.expect("the fused path applies");
        let g = nq / nkv;
        let expand = |t: &Tensor| -> Result<Tensor> {
            let heads: Vec<Tensor> = (0..nq)
                .map(|h| t.i((.., h / g..h / g + 1)))
                .collect::<Result<_>>()?;
            Tensor::cat(&heads, 1)?.contiguous()
        };
        let (ke, ve) = (expand(&k)?, expand(&v)?);
        let att = (q.matmul(&ke.t()?)? * scale)?;
        let want = candle_nn::ops::softmax_last_dim(&att)?.matmul(&ve)?;
        assert_eq!(got.dims(), want.dims());
        let diff: Vec<f32> = (got - want)?.abs()?.flatten_all()?.to_vec1()?;
        assert!(diff.iter().all(|x| x.is_finite()), "{diff:?}");
        let max = diff.iter().cloned().fold(0f32, f32::max);
        assert!(max < 1e-5, "max |diff| {max}");
        Ok(())
    }

    #[test]
    fn tracked_or_other_dtypes_take_the_general_path() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 2, 1, 4), DType::F32, &dev)?;
        let k = Tensor::zeros((1, 2, 3, 4), DType::F32, &dev)?;
        let var = candle_core::Var::from_tensor(&q)?;
        assert!(decode_attention(var.as_tensor(), &k, &k, 1.0)?.is_none());
        let kb = k.to_dtype(DType::BF16)?;
        assert!(decode_attention(&q.to_dtype(DType::BF16)?, &kb, &kb, 1.0)?.is_none());
        let q2 = Tensor::zeros((1, 2, 2, 4), DType::F32, &dev)?;
        assert!(decode_attention(&q2, &k, &k, 1.0)?.is_none());
        Ok(())
    }
}
