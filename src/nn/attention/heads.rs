//! The attention's shape ([`AttentionConfig`]) and how its heads split across ranks
//! ([`HeadAssignment`]): whole KV groups per rank where the world allows, replicated KV heads
//! otherwise.

use std::ops::Range;

use candle_core::Result;

use crate::nn::RmsNormSpec;
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
    /// A gated MLP can take the difference back ([`crate::nn::GatedMlp::load_balanced`]) where
    /// the two share one all-reduce; the Llama-family decoders all-reduce after each, so they
    /// split their MLPs evenly (balanced, each rank waited at one of the two).
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

/// `Some(g)` when `kv_index` (local query head -> local KV head) is `g` times KV head 0, then
/// `g` times KV head 1, and so on up to the last of the rank's `kv_heads` (GQA's groups,
/// `g > 1`, each whole on this rank).
pub(super) fn kv_group(kv_index: &[u32], kv_heads: usize) -> Option<usize> {
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
