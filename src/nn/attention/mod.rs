//! Tensor-parallel causal self-attention (Llama family): q/k/v column-parallel, o
//! row-parallel, rotary position embeddings, causal mask, KV cache, MHA and GQA.
//!
//! Heads are split across ranks, unevenly where needed (9 heads on 2 ranks is 5 + 4):
//! - with `world <= num_kv_heads`, each rank owns whole KV groups (`Partition::new(kv, world)`)
//!   and exactly the query heads of those groups;
//! - with `world > num_kv_heads`, the query heads are split (in units of one head) and each
//!   rank loads the KV heads its query heads need (a KV head may live on several ranks).
//!
//! Every rank runs the same ops (only the sizes differ), so collectives line up. The shape
//! and the head split are in `heads`, the attention probabilities (fused softmax, mask, GQA
//! groups) in `scores`.

use std::ops::Range;

use crate::nn::RmsNorm;
use candle_core::{DType, Module, Result, Tensor};

use crate::comm::ProcessGroup;
use crate::loader::ShardedVarBuilder;
use crate::nn::{
    load_rms_norm, ColumnParallelLinear, LayerKvCache, ParallelWeight, RotaryEmbedding,
    RowParallelLinear,
};
use crate::ops::copy_to_tp;
use crate::Partition;

mod heads;
mod rows;
mod scores;

use heads::kv_group;
pub use heads::{AttentionConfig, HeadAssignment, Llama3RopeScaling};

/// A key or value projection: column-parallel when KV heads are split, otherwise the rank's
/// (possibly overlapping) KV heads as a plain linear layer.
#[derive(Debug, Clone)]
enum KvProj {
    Split(ColumnParallelLinear),
    Replicated(ParallelWeight),
}

impl KvProj {
    fn rows_invariant(&self) -> bool {
        match self {
            Self::Split(l) => l.parallel_weight().rows_invariant(),
            Self::Replicated(w) => w.rows_invariant(),
        }
    }

    /// The k or v projection: rows `offset..offset + num_kv_heads * head_dim` of the tensor
    /// under `vb` (`k_proj`/`v_proj` with offset 0, or the fused `qkv_proj` of `total` rows).
    fn load(
        cfg: &AttentionConfig,
        heads: &HeadAssignment,
        vb: &ShardedVarBuilder,
        offset: usize,
        total: usize,
    ) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let out = cfg.num_kv_heads * hd;
        if heads.kv_split {
            let part = Partition::with_unit(out, vb.pg().size(), hd).map_err(|e| {
                candle_core::Error::msg(format!(
                    "'{}': cannot split {out} key/value features over {} ranks: {e}",
                    vb.prefix(),
                    vb.pg().size()
                ))
            })?;
            let r = part.range(vb.pg().rank());
            let w = load_rows(vb, total, h, offset + r.start..offset + r.end, cfg.qkv_bias)?;
            return Ok(Self::Split(ColumnParallelLinear::from_weight(
                w,
                h,
                part,
                vb.pg().clone(),
            )?));
        }
        let rows = offset + heads.kv_heads.start * hd..offset + heads.kv_heads.end * hd;
        Ok(Self::Replicated(load_rows(
            vb,
            total,
            h,
            rows,
            cfg.qkv_bias,
        )?))
    }

    fn forward_local(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Split(l) => l.forward_local(x),
            Self::Replicated(l) => l.forward(x),
        }
    }

    /// Replicated KV heads would get a partial gradient on each rank that holds them (only
    /// its own query heads' share), so a backward through trainable replicated weights is
    /// refused with the sizes instead of silently training on partial gradients.
    fn refuse_training(&self, heads: &HeadAssignment, pg: &ProcessGroup, what: &str) -> Result<()> {
        let Self::Replicated(l) = self else {
            return Ok(());
        };
        // A quantized weight never tracks gradients; only a dense one can.
        let weight_trains = l.dense_weight().is_ok_and(|w| w.track_op());
        if weight_trains || l.bias().is_some_and(|b| b.track_op()) {
            candle_core::bail!(
                "attention {what} on rank {} of {}: KV heads {:?} are replicated on several ranks \
                 (the world exceeds the number of KV heads), so their gradients would be partial \
                 on each rank; training through replicated KV heads is not supported: use a \
                 tensor-parallel size <= num_key_value_heads (or detach the weights for inference)",
                pg.rank(),
                pg.size(),
                heads.kv_heads
            );
        }
        Ok(())
    }
}

/// Rows `rows` of `weight` (`[total, in_features]`) and, with `bias`, of `bias` under `vb`.
fn load_rows(
    vb: &ShardedVarBuilder,
    total: usize,
    in_features: usize,
    rows: Range<usize>,
    bias: bool,
) -> Result<ParallelWeight> {
    let ranges = std::slice::from_ref(&rows);
    let w = vb.get_weight_ranges((total, in_features), "weight", 0, ranges)?;
    let b = if bias {
        Some(vb.get_ranges(total, "bias", 0, ranges)?)
    } else {
        None
    };
    ParallelWeight::from_shard(w, b)
}

/// Causal self-attention with heads split across the ranks of a group, and a KV cache.
///
/// Weights are loaded under Hugging Face's names (`q_proj`, `k_proj`, `v_proj`, `o_proj`).
/// With one rank it computes what candle-transformers' Llama attention computes.
#[derive(Debug, Clone)]
pub struct ParallelAttention {
    q_proj: ColumnParallelLinear,
    k_proj: KvProj,
    v_proj: KvProj,
    o_proj: RowParallelLinear,
    heads: HeadAssignment,
    /// Local query head -> local KV head; `None` for MHA (no expansion).
    kv_index: Option<Tensor>,
    /// `g` when local query heads `g·j .. g·j + g` all read local KV head `j` (GQA's groups,
    /// whole on this rank): the attention then runs per KV head on `g · seq` query rows, with
    /// no copy of the cache expanded to every query head.
    kv_group: Option<usize>,
    /// For the fused CPU attention, the local query heads of each local KV head where they
    /// are not even (a KV group split across ranks: 9 heads in 3 groups over 4 ranks gives
    /// rank 2 heads 5 and 6, one of group 1 and one of group 2); `None` where they are.
    fused_groups: Option<Vec<usize>>,
    head_dim: usize,
    sliding_window: Option<usize>,
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    scale: Option<f64>,
    softcap: Option<f64>,
    pg: ProcessGroup,
    /// The cache of the single-sequence API ([`ParallelAttention::forward`]).
    kv_cache: LayerKvCache,
}

impl ParallelAttention {
    /// Whether the projections' product rows do not depend on the row count
    /// ([`ParallelWeight::rows_invariant`]); the rest of the attention is per row and per
    /// sequence.
    pub fn rows_invariant(&self) -> bool {
        self.q_proj.parallel_weight().rows_invariant()
            && self.k_proj.rows_invariant()
            && self.v_proj.rows_invariant()
            && self.o_proj.parallel_weight().rows_invariant()
    }

    /// Loads the layer from `vb` (the `self_attn` prefix) with its group's rank and size.
    pub fn load(cfg: &AttentionConfig, vb: ShardedVarBuilder) -> Result<Self> {
        let pg = vb.pg().clone();
        let heads = HeadAssignment::new(
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            pg.size(),
            pg.rank(),
        )
        .map_err(|e| candle_core::Error::msg(format!("'{}': {e}", vb.prefix())))?;
        if cfg.sliding_window == Some(0) {
            candle_core::bail!("'{}': sliding_window must be at least 1", vb.prefix());
        }
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let q_out = cfg.num_heads * hd;
        let unit = heads.q_part.unit();
        let kv_out = cfg.num_kv_heads * hd;
        let (q_proj, k_proj, v_proj) = if cfg.fused_qkv {
            let qkv = vb.pp("qkv_proj");
            let total = q_out + 2 * kv_out;
            let r = heads.q_part.range(pg.rank());
            let w = load_rows(&qkv, total, h, r, cfg.qkv_bias)?;
            let q = ColumnParallelLinear::from_weight(w, h, heads.q_part, pg.clone())?;
            let k = KvProj::load(cfg, &heads, &qkv, q_out, total)?;
            let v = KvProj::load(cfg, &heads, &qkv, q_out + kv_out, total)?;
            (q, k, v)
        } else {
            let q = ColumnParallelLinear::load(h, q_out, cfg.qkv_bias, unit, vb.pp("q_proj"))?;
            let k = KvProj::load(cfg, &heads, &vb.pp("k_proj"), 0, kv_out)?;
            let v = KvProj::load(cfg, &heads, &vb.pp("v_proj"), 0, kv_out)?;
            (q, k, v)
        };
        let qk_norm = match cfg.qk_norm {
            None => None,
            Some(spec) => Some((
                load_rms_norm(hd, spec, &vb.pp("q_norm"))?,
                load_rms_norm(hd, spec, &vb.pp("k_norm"))?,
            )),
        };
        let o_proj = RowParallelLinear::load(q_out, h, cfg.o_bias, unit, vb.pp("o_proj"))?;
        let n_rep = cfg.num_heads / cfg.num_kv_heads;
        let (kv_index, kv_group, fused_groups) = if n_rep == 1 {
            (None, None, None)
        } else {
            let idx = heads.kv_index(n_rep);
            let group = kv_group(&idx, heads.kv_heads.len());
            // The local heads are consecutive, so each local KV head's are too.
            let counts = (0..heads.kv_heads.len() as u32)
                .map(|j| idx.iter().filter(|&&h| h == j).count())
                .collect::<Vec<_>>();
            let uneven = counts.windows(2).any(|w| w[0] != w[1]);
            let n = idx.len();
            let idx = Tensor::from_vec(idx, n, vb.device())?;
            (Some(idx), group, uneven.then_some(counts))
        };
        Ok(Self {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            heads,
            kv_index,
            kv_group,
            fused_groups,
            head_dim: hd,
            sliding_window: cfg.sliding_window,
            qk_norm,
            scale: cfg.softmax_scale,
            softcap: cfg.logit_softcapping,
            pg,
            kv_cache: LayerKvCache::new(),
        })
    }

    /// Which heads this rank holds.
    pub fn heads(&self) -> &HeadAssignment {
        &self.heads
    }

    /// The query projection.
    pub fn q_proj(&self) -> &ColumnParallelLinear {
        &self.q_proj
    }

    /// The output projection.
    pub fn o_proj(&self) -> &RowParallelLinear {
        &self.o_proj
    }

    /// The group the heads are split over.
    pub fn pg(&self) -> &ProcessGroup {
        &self.pg
    }

    /// Positions held in the layer's own KV cache (the single-sequence API).
    pub fn cached_len(&self) -> usize {
        self.kv_cache.len()
    }

    /// Empties the layer's own KV cache (a new sequence).
    pub fn clear_kv_cache(&mut self) {
        self.kv_cache.clear();
    }

    /// Attention over `x` `[batch, seq, hidden]` at positions `index_pos..index_pos+seq`,
    /// appending this step's keys and values to the layer's own cache. Returns
    /// `[batch, seq, hidden]`, all-reduced (the same on every rank).
    pub fn forward(
        &mut self,
        x: &Tensor,
        index_pos: usize,
        rope: &RotaryEmbedding,
    ) -> Result<Tensor> {
        if index_pos != self.cached_len() {
            candle_core::bail!(
                "attention: index_pos {index_pos} does not follow the {} cached positions (clear the cache for a new sequence)",
                self.cached_len()
            );
        }
        let mut cache = std::mem::take(&mut self.kv_cache);
        let seq_len = x.dims3()?.1;
        let out = self.forward_batch(x, rope, &mut [(seq_len, &mut cache)]);
        self.kv_cache = cache;
        out
    }

    /// Attention over the new tokens of several sequences at once, `x` `[batch, tokens,
    /// hidden]` holding each sequence's rows one after the other (`seqs[i].0` rows for
    /// sequence `i`, which continues at position `seqs[i].1.len()` and whose keys and values
    /// are appended to `seqs[i].1`). The projections run once over all the rows; rotary
    /// embeddings, the cache and the attention itself per sequence. Returns `[batch, tokens,
    /// hidden]`, all-reduced.
    pub fn forward_batch(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        seqs: &mut [(usize, &mut LayerKvCache)],
    ) -> Result<Tensor> {
        let (b, total, _) = x.dims3()?;
        let rows: usize = seqs.iter().map(|(n, _)| n).sum();
        if rows != total || seqs.iter().any(|(n, _)| *n == 0) {
            candle_core::bail!(
                "attention: the batch has {total} rows but its {} sequences have {:?} new tokens (each at least one, summing to the rows)",
                seqs.len(),
                seqs.iter().map(|(n, _)| *n).collect::<Vec<_>>()
            );
        }
        self.k_proj
            .refuse_training(&self.heads, &self.pg, "k_proj")?;
        self.v_proj
            .refuse_training(&self.heads, &self.pg, "v_proj")?;
        let hd = self.head_dim;
        let nq = self.heads.q_heads.len();
        let nkv = self.heads.kv_heads.len();
        let x = copy_to_tp(x, &self.pg)?;
        // q, k and v of quantized weights of one type read x quantized once.
        let (q, k, v) = crate::quant::share_activations(|| -> Result<_> {
            Ok((
                self.q_proj.forward_local(&x)?,
                self.k_proj.forward_local(&x)?,
                self.v_proj.forward_local(&x)?,
            ))
        })?;
        let mut q = q.reshape((b, total, nq, hd))?;
        let mut k = k.reshape((b, total, nkv, hd))?;
        if let Some((q_norm, k_norm)) = &self.qk_norm {
            // The replicated [head_dim] weight normalises each local head.
            q = q_norm.forward(&q)?;
            k = k_norm.forward(&k)?;
        }
        let v = v.reshape((b, total, nkv, hd))?;
        // A decode step of several sequences: every row in one pass.
        if let Some(y) = self.attend_rows(&q, &k, &v, rope, seqs)? {
            return self.o_proj.forward(&y);
        }
        let q = q.transpose(1, 2)?.contiguous()?;
        let k = k.transpose(1, 2)?.contiguous()?;
        let v = v.transpose(1, 2)?;
        let mut ys = Vec::with_capacity(seqs.len());
        let mut offset = 0;
        for (n, cache) in seqs.iter_mut() {
            let (q, k, v) = if *n == total {
                (q.clone(), k.clone(), v.clone())
            } else {
                (
                    q.narrow(2, offset, *n)?.contiguous()?,
                    k.narrow(2, offset, *n)?.contiguous()?,
                    v.narrow(2, offset, *n)?,
                )
            };
            ys.push(self.attend(&q, &k, &v, rope, cache)?);
            offset += *n;
        }
        let y = if ys.len() == 1 {
            ys.pop().expect("one sequence")
        } else {
            Tensor::cat(&ys, 1)?
        };
        self.o_proj.forward(&y)
    }

    /// One sequence's attention: `q` `[batch, local_heads, seq, head_dim]`, `k`/`v`
    /// `[batch, local_kv_heads, seq, head_dim]` before RoPE, at positions starting at
    /// `cache.len()`. Returns `[batch, seq, local_heads * head_dim]` (before `o_proj`).
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rope: &RotaryEmbedding,
        cache: &mut LayerKvCache,
    ) -> Result<Tensor> {
        let (b, nq, seq_len, hd) = q.dims4()?;
        let index_pos = cache.len();
        let q = rope.apply(q, index_pos)?;
        let k = rope.apply(k, index_pos)?;
        let (k, v) = cache.append(&k, v)?;
        // One fused op on the CPU in f32: a decode step reads each KV head's keys and values
        // once for its group (even or not), a prompt goes in blocks of query rows against
        // packed keys, masked blocks skipped (a soft-cap or gradients take the general path).
        if self.softcap.is_none() {
            let scale = self.score_scale(hd);
            let fused = crate::ops::attention::causal_attention(
                &q,
                &k,
                &v,
                scale,
                self.sliding_window,
                self.fused_groups.as_deref(),
            )?;
            if let Some(y) = fused {
                return y.transpose(1, 2)?.reshape((b, seq_len, nq * hd));
            }
        }
        // A cache kept in another precision (f16) is widened for the general path.
        let (k, v) = if k.dtype() != q.dtype() {
            (k.to_dtype(q.dtype())?, v.to_dtype(q.dtype())?)
        } else {
            (k, v)
        };
        match self.kv_group {
            Some(g) if index_pos + seq_len >= GROUPED_MIN_POSITIONS => {
                return self.attend_grouped(&q, &k, &v, g, index_pos)
            }
            _ => {}
        }
        let (k, v) = match &self.kv_index {
            None => (k, v),
            // The cache's views are strided (`LayerKvCache::append`); `index_select` wants
            // contiguous input.
            Some(idx) => (
                k.contiguous()?.index_select(idx, 1)?,
                v.contiguous()?.index_select(idx, 1)?,
            ),
        };
        let in_dtype = q.dtype();
        let q = q.to_dtype(DType::F32)?;
        let k = k.to_dtype(DType::F32)?;
        let v = v.to_dtype(DType::F32)?;
        let att = self.probabilities(&q, &k, hd, (1, seq_len), index_pos)?;
        let y = att.matmul(&v)?.to_dtype(in_dtype)?;
        y.transpose(1, 2)?.reshape((b, seq_len, nq * hd))
    }
}

/// Cached positions from which GQA's groups attend per KV head ([`ParallelAttention`]'s
/// `attend_grouped`) instead of on the cache expanded to every query head: the expansion
/// copies the whole cache each step, which grows with the context; measured on SmolLM2 Q4_0
/// decode at world 1 (2026-11-26, noisy host), 300 positions decode 1.15x faster grouped, 33
/// positions about 0.92x (the one-row products of the expanded form are the faster there).
const GROUPED_MIN_POSITIONS: usize = 128;
