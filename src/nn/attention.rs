//! Tensor-parallel causal self-attention (Llama family): q/k/v column-parallel, o
//! row-parallel, rotary position embeddings, causal mask, KV cache, MHA and GQA.
//!
//! Heads are split across ranks, unevenly where needed (9 heads on 2 ranks is 5 + 4):
//! - with `world <= num_kv_heads`, each rank owns whole KV groups (`Partition::new(kv, world)`)
//!   and exactly the query heads of those groups;
//! - with `world > num_kv_heads`, the query heads are split (in units of one head) and each
//!   rank loads the KV heads its query heads need (a KV head may live on several ranks).
//!
//! Every rank runs the same ops (only the sizes differ), so collectives line up.

use std::ops::Range;

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::RmsNorm;

use crate::comm::ProcessGroup;
use crate::loader::ShardedVarBuilder;
use crate::nn::{
    load_rms_norm, ColumnParallelLinear, LayerKvCache, ParallelWeight, RmsNormSpec,
    RotaryEmbedding, RowParallelLinear,
};
use crate::ops::copy_to_tp;
use crate::Partition;

/// Llama 3 `rope_scaling` (`"rope_type": "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    /// `factor`.
    pub factor: f32,
    /// `low_freq_factor`.
    pub low_freq_factor: f32,
    /// `high_freq_factor`.
    pub high_freq_factor: f32,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: usize,
}

/// Shape and position-encoding settings of one attention layer.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionConfig {
    /// Model width (input and output features).
    pub hidden_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (equal to `num_heads` for MHA).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Whether q/k/v have a bias (Qwen2).
    pub qkv_bias: bool,
    /// Whether o_proj has a bias.
    pub o_bias: bool,
    /// RoPE base.
    pub rope_theta: f32,
    /// Llama 3 frequency scaling, if any.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Positions for which the rotary tables are computed.
    pub max_position_embeddings: usize,
    /// Sliding-window attention (Mistral): a query at position `p` sees the keys at positions
    /// `p - w + 1 ..= p` only, `w` keys including its own, as Hugging Face transformers masks
    /// it. `None`: every earlier position.
    pub sliding_window: Option<usize>,
    /// Per-head RmsNorm of queries and keys before RoPE (Qwen3, Gemma 3): `q_norm.weight` and
    /// `k_norm.weight` (`[head_dim]`) are replicated and applied to each local head.
    pub qk_norm: Option<RmsNormSpec>,
    /// Scale of the attention scores; `None` is `1 / sqrt(head_dim)` (Gemma sets
    /// `query_pre_attn_scalar^-1/2`).
    pub softmax_scale: Option<f64>,
    /// Attention-logit soft-capping `c` (Gemma 2): the scaled scores become
    /// `c * tanh(scores / c)` before the mask.
    pub logit_softcapping: Option<f64>,
    /// q, k and v are one fused `qkv_proj` tensor `[(heads + 2 kv_heads) * head_dim, hidden]`
    /// (Phi-3): each rank reads its q, k and v row ranges out of it.
    pub fused_qkv: bool,
    /// Partial RoPE (Phi-4-mini's `partial_rotary_factor`): only the first `rotary_dim`
    /// features of each head are rotated. `None`: the whole head.
    pub rotary_dim: Option<usize>,
}

impl AttentionConfig {
    /// Where `world` ranks split this attention unevenly: the ranks that hold one KV group
    /// more than the others (the first `num_kv_heads % world`, as [`HeadAssignment`] splits
    /// whole groups), and that group's multiply-adds per token per model feature, its q, k,
    /// v and o rows (`head_dim · (2 · heads per group + 2)`). `(0, 0.0)` where the groups
    /// split evenly, where KV heads are replicated (`world > num_kv_heads`) or for one rank.
    /// A gated MLP on the same ranks evens the load out ([`crate::nn::GatedMlp::load_balanced`]).
    ///
    /// ```
    /// use candle_tp::nn::AttentionConfig;
    /// // SmolLM2-135M: 9 heads of 64 in 3 KV groups; on 2 ranks the first holds 2 groups.
    /// let cfg = AttentionConfig::new(576, 9, 3, 64, 1e5, 2048);
    /// assert_eq!(cfg.uneven_groups(2), (1, 512.0));
    /// assert_eq!(cfg.uneven_groups(3), (0, 0.0));
    /// ```
    pub fn uneven_groups(&self, world: usize) -> (usize, f64) {
        let kv = self.num_kv_heads;
        if world <= 1 || kv == 0 || world > kv || kv.is_multiple_of(world) {
            return (0, 0.0);
        }
        let group = self.num_heads / kv;
        (kv % world, (self.head_dim * (2 * group + 2)) as f64)
    }

    /// Plain (grouped-query) attention: no biases, full unscaled RoPE, no window, scores
    /// scaled by `1 / sqrt(head_dim)`, separate q/k/v. Families set their hooks on top.
    pub fn new(
        hidden_size: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        rope_theta: f32,
        max_position_embeddings: usize,
    ) -> Self {
        Self {
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            qkv_bias: false,
            o_bias: false,
            rope_theta,
            rope_scaling: None,
            max_position_embeddings,
            sliding_window: None,
            qk_norm: None,
            softmax_scale: None,
            logit_softcapping: None,
            fused_qkv: false,
            rotary_dim: None,
        }
    }
}

/// Which heads one rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadAssignment {
    /// How the query features (`num_heads * head_dim`) are split; also o_proj's input split.
    pub q_part: Partition,
    /// Global indices of this rank's query heads.
    pub q_heads: Range<usize>,
    /// Global indices of the KV heads this rank holds.
    pub kv_heads: Range<usize>,
    /// Whether the KV heads are split without overlap (`world <= num_kv_heads`); otherwise
    /// they are replicated where query heads of one group land on several ranks.
    pub kv_split: bool,
}

impl HeadAssignment {
    /// The heads of `rank` among `world` ranks.
    pub fn new(
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        world: usize,
        rank: usize,
    ) -> Result<Self> {
        if num_kv_heads == 0 || num_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
            candle_core::bail!(
                "attention: num_attention_heads = {num_heads} must be a positive multiple of num_key_value_heads = {num_kv_heads}"
            );
        }
        if world > num_heads {
            candle_core::bail!(
                "attention: cannot split {num_heads} attention heads over a world of {world} ranks (world size must be at most the number of heads)"
            );
        }
        let n_rep = num_heads / num_kv_heads;
        let err = |e| {
            candle_core::Error::msg(format!(
                "attention: cannot split {num_heads} heads ({num_kv_heads} KV heads) over {world} ranks: {e}"
            ))
        };
        if world <= num_kv_heads {
            // Whole KV groups: a unit is the n_rep query heads of one group.
            let q_part =
                Partition::with_unit(num_heads * head_dim, world, n_rep * head_dim).map_err(err)?;
            let kv = Partition::new(num_kv_heads, world)
                .map_err(err)?
                .range(rank);
            Ok(Self {
                q_part,
                q_heads: kv.start * n_rep..kv.end * n_rep,
                kv_heads: kv,
                kv_split: true,
            })
        } else {
            let q_part =
                Partition::with_unit(num_heads * head_dim, world, head_dim).map_err(err)?;
            let r = q_part.range(rank);
            let q_heads = r.start / head_dim..r.end / head_dim;
            let kv_heads = q_heads.start / n_rep..(q_heads.end - 1) / n_rep + 1;
            Ok(Self {
                q_part,
                q_heads,
                kv_heads,
                kv_split: false,
            })
        }
    }

    /// For each local query head, the index of its KV head among the local KV heads.
    pub fn kv_index(&self, n_rep: usize) -> Vec<u32> {
        self.q_heads
            .clone()
            .map(|h| (h / n_rep - self.kv_heads.start) as u32)
            .collect()
    }
}

/// A key or value projection: column-parallel when KV heads are split, otherwise the rank's
/// (possibly overlapping) KV heads as a plain linear layer.
#[derive(Debug, Clone)]
enum KvProj {
    Split(ColumnParallelLinear),
    Replicated(ParallelWeight),
}

impl KvProj {
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
        let (kv_index, kv_group) = if n_rep == 1 {
            (None, None)
        } else {
            let idx = heads.kv_index(n_rep);
            let group = kv_group(&idx, heads.kv_heads.len());
            let n = idx.len();
            (Some(Tensor::from_vec(idx, n, vb.device())?), group)
        };
        Ok(Self {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            heads,
            kv_index,
            kv_group,
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
        let q = q.transpose(1, 2)?.contiguous()?;
        let k = k.transpose(1, 2)?.contiguous()?;
        let v = v.reshape((b, total, nkv, hd))?.transpose(1, 2)?;
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
        // once for its group, a prompt goes in blocks of query rows against packed keys,
        // masked blocks skipped (GQA's groups as `kv_group` finds them; an irregular head
        // split, a soft-cap or gradients take the general path).
        let groups_regular = self.kv_index.is_none() || self.kv_group.is_some();
        if self.softcap.is_none() && groups_regular {
            let scale = self.score_scale(hd);
            let fused =
                crate::ops::attention::causal_attention(&q, &k, &v, scale, self.sliding_window)?;
            if let Some(y) = fused {
                return y.transpose(1, 2)?.reshape((b, seq_len, nq * hd));
            }
        }
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
    fn probabilities(
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
    fn score_scale(&self, hd: usize) -> f64 {
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
    fn attend_grouped(
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

/// `Some(g)` when `kv_index` (local query head -> local KV head) is `g` times KV head 0, then
/// `g` times KV head 1, and so on up to the last of the rank's `kv_heads` (GQA's groups,
/// `g > 1`, each whole on this rank).
fn kv_group(kv_index: &[u32], kv_heads: usize) -> Option<usize> {
    let heads = kv_index.last().map(|&h| h as usize + 1)?;
    if heads != kv_heads {
        return None;
    }
    let g = kv_index.len() / heads;
    let regular = g > 1
        && g * heads == kv_index.len()
        && kv_index
            .iter()
            .enumerate()
            .all(|(i, &h)| h as usize == i / g);
    regular.then_some(g)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_kv_groups_when_world_le_kv_heads() -> Result<()> {
        // 9 heads, 3 KV heads, 2 ranks: groups 2 + 1 -> q heads 6 + 3.
        let a0 = HeadAssignment::new(9, 3, 4, 2, 0)?;
        let a1 = HeadAssignment::new(9, 3, 4, 2, 1)?;
        assert_eq!((a0.q_heads.clone(), a0.kv_heads.clone()), (0..6, 0..2));
        assert_eq!((a1.q_heads.clone(), a1.kv_heads.clone()), (6..9, 2..3));
        assert_eq!(a0.q_part.sizes(), vec![24, 12]);
        assert_eq!(a0.kv_index(3), vec![0, 0, 0, 1, 1, 1]);
        assert_eq!(kv_group(&a0.kv_index(3), 2), Some(3));
        assert_eq!(kv_group(&a1.kv_index(3), 1), Some(3));
        Ok(())
    }

    #[test]
    fn replicated_kv_when_world_gt_kv_heads() -> Result<()> {
        // 9 heads, 3 KV heads, 4 ranks: q heads 3, 2, 2, 2.
        let a: Vec<_> = (0..4)
            .map(|r| HeadAssignment::new(9, 3, 2, 4, r))
            .collect::<Result<_>>()?;
        let q: Vec<_> = a.iter().map(|a| a.q_heads.clone()).collect();
        let kv: Vec<_> = a.iter().map(|a| a.kv_heads.clone()).collect();
        assert_eq!(q, vec![0..3, 3..5, 5..7, 7..9]);
        assert_eq!(kv, vec![0..1, 1..2, 1..3, 2..3]);
        assert_eq!(a[2].kv_index(3), vec![0, 1]);
        // One query head per KV head, or uneven groups: the expanded path.
        assert_eq!(kv_group(&a[2].kv_index(3), 2), None);
        assert_eq!(kv_group(&[0, 0, 1], 2), None);
        assert_eq!(kv_group(&[0, 1, 0, 1], 2), None);
        // A local KV head that no query head reads.
        assert_eq!(kv_group(&[0, 0, 0, 0], 2), None);
        Ok(())
    }

    #[test]
    fn mha_uneven_and_too_many_ranks() -> Result<()> {
        let a = HeadAssignment::new(9, 9, 8, 2, 0)?;
        assert_eq!(a.q_heads, 0..5);
        assert!(HeadAssignment::new(9, 9, 8, 10, 0).is_err());
        assert!(HeadAssignment::new(9, 4, 8, 2, 0).is_err());
        Ok(())
    }
}
