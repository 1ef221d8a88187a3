//! A batched step's attention in one pass: the new rows of several sequences (one token of
//! each decoding sequence, a chunk of a joining sequence's prompt), each against its own KV
//! cache.
//!
//! The general path ([`ParallelAttention::forward_batch`]) runs each sequence's rows through
//! their own ops (slices of q, k and v, RoPE, the cache, the fused attention, a transpose):
//! about ten tensor ops per sequence and layer, which at 16 sequences of a small model cost
//! more than the attention itself. This path rotates all the rows at their own positions at
//! once ([`RotaryEmbedding::apply_rows`]), appends each sequence's keys and values to its
//! cache, and runs the fused kernel over every sequence's rows in one call
//! ([`causal_attention_rows`]), writing the output in the row-major layout `o_proj` reads. The
//! values are the general path's, bit for bit (the same arithmetic on the same inputs;
//! `tests/batch_decode.rs` and `tests/batch_invariance.rs` compare batched decoding, prompt
//! chunks beside decoding rows included, with each sequence decoded alone).

use candle_core::{DType, Result, Tensor};

use super::ParallelAttention;
use crate::nn::{LayerKvCache, RotaryEmbedding};
use crate::ops::attention::{causal_attention_rows, fused_inputs};
use candle_tp_kernels::kernel::Kernel;

impl ParallelAttention {
    /// The attention output `[1, rows, local_heads · head_dim]` (before `o_proj`) of `q`
    /// `[1, rows, local_heads, head_dim]`, `k` and `v` `[1, rows, local_kv_heads, head_dim]`
    /// (before RoPE), the rows of `seqs[i]` (`seqs[i].0` of them: one token, or a chunk of
    /// a prompt) after those of `seqs[..i]`, extending its cache; `None` (nothing appended)
    /// where the fused path does not apply: one sequence, soft-capped scores, a cache kept in
    /// bf16, a prompt chunk on the scalar kernel (which [`crate::ops::attention`] leaves to
    /// the general path), or tensors the fused kernel does not take
    /// (`ops::attention::fused_inputs`: not on the CPU, tracking gradients, `q` not f32).
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
        let chunk = seqs.iter().any(|(n, _)| *n > 1);
        if seqs.len() < 2
            || seqs.iter().any(|(_, cache)| !fused_cache(cache))
            || (chunk && Kernel::detect() == Kernel::Scalar)
            || q.dim(0)? != 1
            || self.softcap.is_some()
            || !fused_inputs(q, k, v)
        {
            return Ok(None);
        }
        let (_, _, nkv, hd) = k.dims4()?;
        // Each row's position: its sequence's cached length, plus its place in the chunk.
        let positions: Vec<usize> = seqs
            .iter()
            .flat_map(|(n, cache)| cache.len()..cache.len() + n)
            .collect();
        let q = rope.apply_rows(q, &positions)?;
        let k = rope.apply_rows(k, &positions)?;
        let v = v.contiguous()?;
        let mut caches = Vec::with_capacity(seqs.len());
        let mut first = 0;
        for (n, cache) in seqs.iter_mut() {
            // The sequence's rows as an `n`-position step `[1, kv_heads, n, head_dim]` (one
            // row: a view, the rows being contiguous; a chunk: the transposed view).
            let rows = |t: &Tensor| match *n {
                1 => t.narrow(1, first, 1)?.reshape((1, nkv, 1, hd)),
                n => t.narrow(1, first, n)?.transpose(1, 2),
            };
            caches.push(cache.append(&rows(&k)?, &rows(&v)?)?);
            first += *n;
        }
        let counts: Vec<usize> = seqs.iter().map(|(n, _)| *n).collect();
        let (scale, groups) = (self.score_scale(hd), self.fused_groups.as_deref());
        let window = self.sliding_window;
        match causal_attention_rows(&q, &caches, &counts, scale, window, groups)? {
            Some(y) => Ok(Some(y)),
            // The caches hold this step's rows already: no fallback may append them again.
            None => candle_core::bail!(
                "attention: the batched decode path refused its caches after appending to them"
            ),
        }
    }
}
