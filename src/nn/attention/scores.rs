//! [`ParallelAttention`]'s attention probabilities: the fused CPU softmax where it applies,
//! else candle's scores, causal (and sliding-window) mask and softmax; and the GQA form that
//! attends per KV head without expanding the cache.

use candle_core::{DType, Device, Result, Tensor};

use super::ParallelAttention;

impl ParallelAttention {
    /// The attention probabilities `softmax(scale · q · kᵀ)` under the causal mask (and the
    /// sliding window) from the fused CPU softmax, for `seq_len` query rows per head (row `r`
    /// of `q` `[.., rows, head_dim]` being query `r % seq_len`); `None` where it does not
    /// apply (a soft-cap, another device or dtype, gradients), for the general path.
    fn fused_softmax(
        &self,
        q: &Tensor,
        k: &Tensor,
        hd: usize,
        seq_len: usize,
    ) -> Result<Option<Tensor>> {
        let applies = self.softcap.is_none()
            && q.device().is_cpu()
            && q.dtype() == DType::F32
            && !q.track_op()
            && !k.track_op();
        if !applies {
            return Ok(None);
        }
        let scale = self.score_scale(hd);
        let raw = q.matmul(&k.t()?)?;
        crate::ops::attention::causal_softmax(&raw, scale, seq_len, self.sliding_window)
    }

    /// The attention probabilities of `q` `[b, heads, g · seq, head_dim]` against `k` under
    /// the causal mask (and the sliding window), row `j · seq + i` of a head being query
    /// position `index_pos + i` (`(g, seq)`: `g` GQA query heads per KV head in one matrix,
    /// or 1): the fused softmax where it applies, else candle's scores, mask and softmax.
    pub(super) fn probabilities(
        &self,
        q: &Tensor,
        k: &Tensor,
        hd: usize,
        (g, seq_len): (usize, usize),
        index_pos: usize,
    ) -> Result<Tensor> {
        if let Some(att) = self.fused_softmax(q, k, hd, seq_len)? {
            return Ok(att);
        }
        let att = self.scores(q, k, hd)?;
        let att = match attention_mask(seq_len, index_pos, self.sliding_window, att.device())? {
            None => att,
            Some(mask) => {
                let (b, heads, rows, kv_len) = att.dims4()?;
                let att = att.reshape((b, heads, g, seq_len, kv_len))?;
                let mask = mask.broadcast_as(att.shape())?;
                let neg =
                    Tensor::new(f32::NEG_INFINITY, att.device())?.broadcast_as(att.shape())?;
                mask.where_cond(&neg, &att)?
                    .reshape((b, heads, rows, kv_len))?
            }
        };
        candle_nn::ops::softmax_last_dim(&att)
    }

    /// The scale of the scores: the model's, or `1/√head_dim`.
    pub(super) fn score_scale(&self, hd: usize) -> f64 {
        self.scale.unwrap_or(1.0 / (hd as f64).sqrt())
    }

    /// `q · kᵀ`, scaled (by `1/√head_dim` unless the model gives its scale) and soft-capped
    /// where the model caps (Gemma 2).
    fn scores(&self, q: &Tensor, k: &Tensor, hd: usize) -> Result<Tensor> {
        let att = match self.scale {
            None => (q.matmul(&k.t()?)? / (hd as f64).sqrt())?,
            Some(s) => (q.matmul(&k.t()?)? * s)?,
        };
        match self.softcap {
            None => Ok(att),
            Some(c) => (att / c)?.tanh()? * c,
        }
    }

    /// [`Self::attend`]'s attention for GQA groups of `g` query heads per KV head (after the
    /// rotary embeddings and the cache): each KV head's keys and values against its `g` query
    /// heads' rows at once (`[batch, kv_heads, g · seq, head_dim]`), the same products as with
    /// the cache expanded to every query head, without that copy of the whole cache per step.
    pub(super) fn attend_grouped(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: usize,
        index_pos: usize,
    ) -> Result<Tensor> {
        let (b, nq, seq_len, hd) = q.dims4()?;
        let nkv = nq / g;
        let in_dtype = q.dtype();
        let q = q.to_dtype(DType::F32)?.reshape((b, nkv, g * seq_len, hd))?;
        let k = k.to_dtype(DType::F32)?;
        let v = v.to_dtype(DType::F32)?;
        let att = self.probabilities(&q, &k, hd, (g, seq_len), index_pos)?;
        let y = att
            .matmul(&v)?
            .reshape((b, nq, seq_len, hd))?
            .to_dtype(in_dtype)?;
        y.transpose(1, 2)?.reshape((b, seq_len, nq * hd))
    }
}

/// `mask[i][j] = 1` where query `index_pos + i` must not see key `j`: a later key, or (with a
/// sliding window `w`) a key `w` or more positions back. `None` when nothing is masked (one
/// query that sees the whole cache).
fn attention_mask(
    seq_len: usize,
    index_pos: usize,
    window: Option<usize>,
    device: &Device,
) -> Result<Option<Tensor>> {
    let kv_len = index_pos + seq_len;
    let w = window.unwrap_or(usize::MAX);
    if seq_len == 1 && kv_len <= w {
        return Ok(None);
    }
    let mask: Vec<u8> = (0..seq_len)
        .flat_map(|i| {
            let p = index_pos + i;
            (0..kv_len).map(move |j| u8::from(j > p || p - j >= w))
        })
        .collect();
    Ok(Some(Tensor::from_slice(&mask, (seq_len, kv_len), device)?))
}
