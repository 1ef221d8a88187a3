//! Attention's fused CPU ops in f32, over `candle_tp_kernels::attention`: causal attention in
//! one op (a decode step's each KV head's keys and values read once for its whole GQA group;
//! a prompt's in blocks of query rows against packed keys, masked blocks skipped; instead of
//! two matmuls, a mask and a softmax), and a prompt's causal softmax in one op (scale, mask
//! and softmax in one pass, no masked score exponentiated) for the paths that keep candle's
//! matmuls.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use candle_tp_kernels::attention::{AttentionShape, CacheView};
use candle_tp_kernels::kernel::Kernel;

/// The fused op (CPU, f32, inference only: it has no backward).
struct CausalAttention {
    scale: f32,
    window: Option<usize>,
    /// Query heads per KV head, where they are not `heads / kv_heads` each.
    groups: Option<Vec<usize>>,
}

impl CausalAttention {
    /// The view of keys or values `[batch, kv_heads, positions, head_dim]` of any strides
    /// whose last is 1 (the KV cache's buffers are `[.., capacity, head_dim]`).
    fn view<'a, T>(&self, name: &str, data: &'a [T], l: &Layout) -> Result<CacheView<'a, T>> {
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

    /// The kernel on `q` against keys and values in f32 or f16 (the same for both: a KV
    /// cache of either precision), into `out`.
    fn run(
        &self,
        q: &[f32],
        (s2, l2): (&CpuStorage, &Layout),
        (s3, l3): (&CpuStorage, &Layout),
        shape: AttentionShape,
        out: &mut [f32],
    ) -> Result<()> {
        let kernel = Kernel::detect();
        use candle_tp_kernels::attention::causal_attention_groups as attend;
        let groups = self.groups.as_deref();
        match (s2, s3) {
            (CpuStorage::F32(k), CpuStorage::F32(v)) => {
                let (k, v) = (self.view("keys", k, l2)?, self.view("values", v, l3)?);
                attend(kernel, q, k, v, shape, groups, self.window, self.scale, out)
            }
            (CpuStorage::F16(k), CpuStorage::F16(v)) => {
                let (k, v) = (self.view("keys", k, l2)?, self.view("values", v, l3)?);
                attend(kernel, q, k, v, shape, groups, self.window, self.scale, out)
            }
            _ => candle_core::bail!(
                "{}: keys ({:?}) and values ({:?}) must both be f32 or both f16",
                self.name(),
                s2.dtype(),
                s3.dtype()
            ),
        }
    }
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "candle-tp-causal-attention"
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
        let (Some((q0, q1)), [batch, q_heads, queries, head_dim]) =
            (l1.contiguous_offsets(), l1.dims())
        else {
            candle_core::bail!(
                "{}: q of shape {:?} must be contiguous [batch, heads, queries, head_dim]",
                self.name(),
                l1.dims()
            )
        };
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
        let shape = AttentionShape {
            batch: *batch,
            q_heads: *q_heads,
            kv_heads: l2.dims()[1],
            queries: *queries,
            positions: l2.dims()[2],
            head_dim: *head_dim,
        };
        let mut out = vec![0f32; q1 - q0];
        self.run(&q[q0..q1], (s2, l2), (s3, l3), shape, &mut out)?;
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// Whether the fused op takes these inputs: on the CPU, without gradients, `q` in f32 and
/// the keys and values both f32 or both f16 (a KV cache kept in half precision).
pub(crate) fn fused_inputs(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let plain = |t: &Tensor| t.device().is_cpu() && !t.track_op();
    [q, k, v].into_iter().all(plain)
        && q.dtype() == DType::F32
        && k.dtype() == v.dtype()
        && matches!(k.dtype(), DType::F32 | DType::F16)
}

/// Causal `softmax(scale · q · kᵀ) · v`: `q` `[batch, heads, queries, head_dim]` holds the
/// last `queries` of the positions of `k`, `v` `[batch, kv_heads, positions, head_dim]` (query
/// head `h` reads KV head `h / (heads / kv_heads)`, or with `groups` the KV head whose group of
/// consecutive heads holds it; any strides with contiguous rows), each
/// row seeing the positions up to its own, or with a sliding `window` the last `window` of
/// them; as the fused CPU op. `None` where it does not apply (another device or dtype, a
/// tensor that tracks gradients: the op has no backward; or a prompt on a CPU without AVX2,
/// whose row-by-row kernel is slower than candle's gemm), for the caller's general path.
pub(crate) fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
    groups: Option<&[usize]>,
) -> Result<Option<Tensor>> {
    if !fused_inputs(q, k, v) || (q.dim(2)? > 1 && Kernel::detect() == Kernel::Scalar) {
        return Ok(None);
    }
    let op = CausalAttention {
        scale: scale as f32,
        window,
        groups: groups.map(<[usize]>::to_vec),
    };
    Ok(Some(q.contiguous()?.apply_op3_no_bwd(k, v, &op)?))
}

/// The new rows of several sequences, each sequence's against its own cache, in one pass (a
/// batched step; CPU, f32, inference only): `q` `[1, rows, heads, head_dim]` (rows first, as
/// the projections and [`RotaryEmbedding::apply_rows`](crate::nn::RotaryEmbedding::apply_rows)
/// give them) holds `counts[i]` rows of sequence `i` after those of the sequences before it
/// (one for a decoding sequence, a prompt's chunk for a joining one), `caches[i]` its keys
/// and values `[1, kv_heads, positions_i, head_dim]` (its rows the last `counts[i]`
/// positions; any strides with contiguous rows, as the KV cache's views). Returns `[1, rows,
/// heads · head_dim]`, each sequence's rows what [`causal_attention`] gives them alone (the
/// same kernel on the same values: a chunk's query rows are gathered head by head, as the
/// general path's transpose lays them out, and its outputs scattered back to rows), without
/// a tensor op per sequence. `None` where [`causal_attention`] would not apply (another
/// device or dtype, gradients).
pub(crate) fn causal_attention_rows(
    q: &Tensor,
    caches: &[(Tensor, Tensor)],
    counts: &[usize],
    scale: f64,
    window: Option<usize>,
    groups: Option<&[usize]>,
) -> Result<Option<Tensor>> {
    if !caches.iter().all(|(k, v)| fused_inputs(q, k, v)) {
        return Ok(None);
    }
    let (one, rows, heads, head_dim) = q.dims4()?;
    if one != 1 || counts.len() != caches.len() || counts.iter().sum::<usize>() != rows {
        candle_core::bail!(
            "attention rows: q {:?} against {} caches of {counts:?} rows (expected [1, {}, \
             heads, head_dim], one count per cache)",
            q.dims(),
            caches.len(),
            counts.iter().sum::<usize>()
        )
    }
    let q = q.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let (candle_core::Storage::Cpu(CpuStorage::F32(qd)), Some((q0, _))) =
        (&*qs, ql.contiguous_offsets())
    else {
        candle_core::bail!("attention rows: q is not contiguous f32 on the CPU")
    };
    let op = CausalAttention {
        scale: scale as f32,
        window,
        groups: groups.map(<[usize]>::to_vec),
    };
    let width = heads * head_dim;
    let mut out = vec![0f32; rows * width];
    // A chunk's query rows head by head (`[heads, n, head_dim]`), and its outputs.
    let (mut chunk_q, mut chunk_out) = (Vec::new(), Vec::new());
    let mut first = 0;
    for (i, ((k, v), &n)) in caches.iter().zip(counts).enumerate() {
        let (kd, vd) = (k.dims(), v.dims());
        if kd != vd || kd.len() != 4 || kd[0] != 1 || kd[3] != head_dim || kd[2] < n.max(1) {
            candle_core::bail!(
                "attention rows: sequence {i}'s keys {kd:?} and values {vd:?} for its {n} rows \
                 (expected [1, kv_heads, positions, {head_dim}], the same for both, with at \
                 least its rows' positions)"
            )
        }
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (candle_core::Storage::Cpu(ks), candle_core::Storage::Cpu(vs)) = (&*ks, &*vs) else {
            candle_core::bail!("attention rows: sequence {i}'s cache is not on the CPU")
        };
        let shape = AttentionShape {
            batch: 1,
            q_heads: heads,
            kv_heads: kd[1],
            queries: n,
            positions: kd[2],
            head_dim,
        };
        let q = &qd[q0 + first * width..q0 + (first + n) * width];
        let out = &mut out[first * width..(first + n) * width];
        if n == 1 {
            op.run(q, (ks, kl), (vs, vl), shape, out)?;
        } else {
            // Row r, head h at `(r · heads + h) · head_dim` becomes `(h · n + r) · head_dim`.
            chunk_q.clear();
            for h in 0..heads {
                for r in 0..n {
                    let at = (r * heads + h) * head_dim;
                    chunk_q.extend_from_slice(&q[at..at + head_dim]);
                }
            }
            chunk_out.resize(n * width, 0.0);
            op.run(&chunk_q, (ks, kl), (vs, vl), shape, &mut chunk_out)?;
            for h in 0..heads {
                for r in 0..n {
                    let (to, from) = ((r * heads + h) * head_dim, (h * n + r) * head_dim);
                    out[to..to + head_dim].copy_from_slice(&chunk_out[from..from + head_dim]);
                }
            }
        }
        first += n;
    }
    drop(qs);
    Ok(Some(Tensor::from_vec(out, (1, rows, width), q.device())?))
}

/// The causal softmax of a prompt's scores as one op (CPU, f32, inference only).
struct CausalSoftmax {
    scale: f32,
    queries: usize,
    window: Option<usize>,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "candle-tp-causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(x) = s else {
            candle_core::bail!("{}: scores must be f32, got {:?}", self.name(), s.dtype())
        };
        let (Some((x0, x1)), Some(&positions)) = (l.contiguous_offsets(), l.dims().last()) else {
            candle_core::bail!(
                "{}: scores of shape {:?} must be contiguous, positions last",
                self.name(),
                l.dims()
            )
        };
        let mut out = vec![0f32; x1 - x0];
        candle_tp_kernels::attention::causal_softmax(
            Kernel::detect(),
            &x[x0..x1],
            &mut out,
            (self.queries, positions),
            self.window,
            self.scale,
        )?;
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

/// `softmax(scale · scores)` over each row's visible positions (0 at the others): the rows of
/// `scores` `[.., rows, positions]` are query rows `r % queries` of the last `queries`
/// positions, each seeing the positions up to its own, or the last `window` of them; as the
/// fused CPU op. `None` where it does not apply (another device or dtype, or gradients).
pub(crate) fn causal_softmax(
    scores: &Tensor,
    scale: f64,
    queries: usize,
    window: Option<usize>,
) -> Result<Option<Tensor>> {
    if !scores.device().is_cpu() || scores.dtype() != DType::F32 || scores.track_op() {
        return Ok(None);
    }
    let op = CausalSoftmax {
        scale: scale as f32,
        queries,
        window,
    };
    Ok(Some(scores.contiguous()?.apply_op1_no_bwd(&op)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, IndexOp};

    /// `[rows, len]`: −∞ where row `i` (position `len − rows + i`) must not look (a later
    /// position, or one `window` or more back), 0 elsewhere; written out independently of the
    /// kernels' own bounds.
    fn additive_mask(rows: usize, len: usize, window: Option<usize>) -> Result<Tensor> {
        let w = window.unwrap_or(usize::MAX);
        let mask: Vec<f32> = (0..rows)
            .flat_map(|i| {
                let p = len - rows + i;
                (0..len).map(move |j| {
                    if j > p || p - j >= w {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
            })
            .collect();
        Tensor::from_vec(mask, (rows, len), &Device::Cpu)
    }

    /// The largest `|a − b|`, after checking that every difference is finite (a NaN would
    /// pass any tolerance).
    fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        let diff: Vec<f32> = (a - b)?.abs()?.flatten_all()?.to_vec1()?;
        assert!(diff.iter().all(|x| x.is_finite()), "{diff:?}");
        Ok(diff.iter().cloned().fold(0f32, f32::max))
    }

    /// Against Candle's own matmuls, causal mask and softmax on the cache expanded to every
    /// query head, with keys and values strided as the KV cache's buffers (a narrowed
    /// capacity): a decode row, a prompt's last 5 rows and a whole prompt of 33 (on the scalar
    /// kernel prompts must take the general path instead).
    #[test]
    fn is_candles_attention_on_strided_caches() -> Result<()> {
        for rows in [1, 5, 33] {
            is_candles_attention(rows)?;
        }
        Ok(())
    }

    fn is_candles_attention(rows: usize) -> Result<()> {
        let dev = Device::Cpu;
        let (b, nq, nkv, d, cap, len) = (2, 6, 2, 16, 40, 33);
        let q = Tensor::randn(0f32, 1.0, (b, nq, rows, d), &dev)?;
        let kbuf = Tensor::randn(0f32, 1.0, (b, nkv, cap, d), &dev)?;
        let vbuf = Tensor::randn(0f32, 1.0, (b, nkv, cap, d), &dev)?;
        let (k, v) = (kbuf.narrow(2, 0, len)?, vbuf.narrow(2, 0, len)?);
        assert!(!k.is_contiguous());
        let scale = 1.0 / (d as f64).sqrt();
        let fused = causal_attention(&q, &k, &v, scale, None, None)?;
        if rows > 1 && Kernel::detect() == Kernel::Scalar {
            // Without AVX2 (or with the scalar kernel forced) prompts keep candle's matmuls.
            assert!(
                fused.is_none(),
                "a prompt takes the general path on the scalar kernel"
            );
            return Ok(());
        }
        let got = fused.expect("the fused path applies");
        let g = nq / nkv;
        let expand = |t: &Tensor| -> Result<Tensor> {
            let heads: Vec<Tensor> = (0..nq)
                .map(|h| t.i((.., h / g..h / g + 1)))
                .collect::<Result<_>>()?;
            Tensor::cat(&heads, 1)?.contiguous()
        };
        let (ke, ve) = (expand(&k)?, expand(&v)?);
        let att = (q.matmul(&ke.t()?)? * scale)?;
        let att = att.broadcast_add(&additive_mask(rows, len, None)?)?;
        let want = candle_nn::ops::softmax_last_dim(&att)?.matmul(&ve)?;
        assert_eq!(got.dims(), want.dims());
        let max = max_abs_diff(&got, &want)?;
        assert!(max < 1e-5, "max |diff| {max}");
        Ok(())
    }

    /// The prompt's softmax against candle's scale, mask and softmax.
    #[test]
    fn causal_softmax_is_candles_masked_softmax() -> Result<()> {
        let dev = Device::Cpu;
        let (rows, len) = (6, 20);
        let scores = Tensor::randn(0f32, 3.0, (2, 3, rows, len), &dev)?;
        let got = causal_softmax(&scores, 0.5, rows, Some(8))?.expect("fused");
        let masked = (scores * 0.5)?.broadcast_add(&additive_mask(rows, len, Some(8))?)?;
        let want = candle_nn::ops::softmax_last_dim(&masked)?;
        let max = max_abs_diff(&got, &want)?;
        assert!(max < 1e-6, "max |diff| {max}");
        Ok(())
    }

    #[test]
    fn tracked_or_other_dtypes_take_the_general_path() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 2, 1, 4), DType::F32, &dev)?;
        let k = Tensor::zeros((1, 2, 3, 4), DType::F32, &dev)?;
        let var = candle_core::Var::from_tensor(&q)?;
        assert!(causal_attention(var.as_tensor(), &k, &k, 1.0, None, None)?.is_none());
        let kb = k.to_dtype(DType::BF16)?;
        assert!(causal_attention(&q.to_dtype(DType::BF16)?, &kb, &kb, 1.0, None, None)?.is_none());
        Ok(())
    }
}
