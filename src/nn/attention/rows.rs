//! A batched decode step's attention in one pass: one new token of each of several sequences,
//! each against its own KV cache.
//!
//! The general path ([`ParallelAttention::forward_batch`]) runs each sequence's rows through
//! their own ops (slices of q, k and v, RoPE, the cache, the fused attention, a transpose):
//! about ten tensor ops per sequence and layer, which at 16 sequences of a small model cost
//! more than the attention itself. When every sequence brings one token, this path rotates
//! all the rows at their own positions at once ([`RotaryEmbedding::apply_rows`]), appends each
//! row's key and value to its cache, and runs the fused kernel over every row in one call
//! ([`causal_attention_rows`]), writing the output in the row-major layout `o_proj` reads. The
//! values are the general path's, bit for bit (the same arithmetic on the same inputs;
//! `tests/batch_decode.rs` and `tests/batch_invariance.rs` compare batched decoding with each
//! sequence decoded alone).

use candle_core::{DType, Result, Tensor};

use super::ParallelAttention;
use crate::nn::{LayerKvCache, RotaryEmbedding};
use crate::ops::attention::{causal_attention_rows, fused_inputs};

impl ParallelAttention {
    /// The attention output `[1, rows, local_heads · head_dim]` (before `o_proj`) of `q`
    /// `[1, rows, local_heads, head_dim]`, `k` and `v` `[1, rows, local_kv_heads, head_dim]`
    /// (before RoPE), row `i` the one new token of `seqs[i]`, whose cache it extends; `None`
    /// (nothing appended) where the fused path does not apply: a sequence with several new
    /// rows (a prompt), one sequence, soft-capped scores, a cache kept in bf16, or tensors the
    /// fused kernel does not take (`ops::attention::fused_inputs`:
    /// not on the CPU, tracking gradients, `q` not f32).
    pub(super) fn attend_rows(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rope: &RotaryEmbedding,
        seqs: &mut [(usize, &mut LayerKvCache)],
    ) -> Result<Option<Tensor>> {
        // The fused kernel reads caches of f32 or f16 (a bf16 cache takes the general path).
        let fused_cache = |c: &LayerKvCache| {
            matches!(
                c.storage_dtype(),
                None | Some(DType::F32) | Some(DType::F16)
            )
        };
        if seqs.len() < 2
            || seqs.iter().any(|(n, cache)| *n != 1 || !fused_cache(cache))
            || q.dim(0)? != 1
            || self.softcap.is_some()
            || !fused_inputs(q, k, v)
        {
            return Ok(None);
        }
        let (_, rows, nkv, hd) = k.dims4()?;
        let positions: Vec<usize> = seqs.iter().map(|(_, cache)| cache.len()).collect();
        let q = rope.apply_rows(q, &positions)?;
        let k = rope.apply_rows(k, &positions)?;
        let v = v.contiguous()?;
        let mut caches = Vec::with_capacity(rows);
        for (i, (_, cache)) in seqs.iter_mut().enumerate() {
            // Row i as a one-position step `[1, kv_heads, 1, head_dim]` (a view: the rows are
            // contiguous).
            let row = |t: &Tensor| t.narrow(1, i, 1)?.reshape((1, nkv, 1, hd));
            caches.push(cache.append(&row(&k)?, &row(&v)?)?);
        }
        let (scale, groups) = (self.score_scale(hd), self.fused_groups.as_deref());
        match causal_attention_rows(&q, &caches, scale, self.sliding_window, groups)? {
            Some(y) => Ok(Some(y)),
            // The caches hold this step's rows already: no fallback may append them again.
            None => candle_core::bail!(
                "attention: the batched decode path refused its caches after appending to them"
            ),
        }
    }
}
