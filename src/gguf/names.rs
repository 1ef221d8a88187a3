//! llama.cpp tensor names and their Hugging Face equivalents, per [`GgufFamily`].
//!
//! Tensor names follow llama.cpp's `convert_hf_to_gguf.py` in reverse (`blk.N.attn_q.weight`
//! → `model.layers.N.self_attn.q_proj.weight`, ...). A layer's experts stacked in one 3-D
//! tensor (`blk.N.ffn_gate_exps.weight`) stand for one Hugging Face matrix per expert
//! ([`HfTarget::Experts`]).

use candle_core::{Error, Result};

use super::{GgufFamily, LlamaGgufConfig};

/// What a GGUF tensor is on the Hugging Face side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HfTarget {
    /// One tensor of this name.
    One(String),
    /// A layer's experts stacked on the first dimension: slice `e` is the tensor `names[e]`.
    Experts(Vec<String>),
}

/// The Hugging Face name of the llama.cpp tensor `gguf_name` of a dense Llama, `None` when it
/// has no Llama equivalent.
pub fn hf_tensor_name(gguf_name: &str) -> Option<String> {
    match hf_target(GgufFamily::Llama, 0, gguf_name)? {
        HfTarget::One(name) => Some(name),
        HfTarget::Experts(_) => None,
    }
}

/// What the llama.cpp tensor `gguf_name` is in a `family` model with `experts` experts per
/// layer, `None` when the family has no such tensor.
pub fn hf_target(family: GgufFamily, experts: usize, gguf_name: &str) -> Option<HfTarget> {
    let one = |s: &str| Some(HfTarget::One(s.to_string()));
    match gguf_name {
        "token_embd.weight" => return one("model.embed_tokens.weight"),
        "output_norm.weight" => return one("model.norm.weight"),
        "output.weight" => return one("lm_head.weight"),
        _ => {}
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let at = |hf: &str| Some(HfTarget::One(format!("model.layers.{layer}.{hf}.{kind}")));
    let weight = kind == "weight";
    match part {
        "attn_norm" if weight => return at("input_layernorm"),
        "ffn_norm" if weight => return at("post_attention_layernorm"),
        "attn_q" => return at("self_attn.q_proj"),
        "attn_k" => return at("self_attn.k_proj"),
        "attn_v" => return at("self_attn.v_proj"),
        "attn_output" => return at("self_attn.o_proj"),
        "attn_q_norm" if weight && family.has_qk_norm() => return at("self_attn.q_norm"),
        "attn_k_norm" if weight && family.has_qk_norm() => return at("self_attn.k_norm"),
        _ => {}
    }
    if !family.is_moe() {
        return match part {
            "ffn_gate" => at("mlp.gate_proj"),
            "ffn_up" => at("mlp.up_proj"),
            "ffn_down" => at("mlp.down_proj"),
            _ => None,
        };
    }
    if !weight {
        return None;
    }
    let ff = family.feed_forward();
    let [gate, up, down] = family.expert_projections();
    let expert =
        |e: usize, proj: &str| format!("model.layers.{layer}.{ff}.experts.{e}.{proj}.weight");
    let proj = |p: &str| match p {
        "ffn_gate" => Some(gate),
        "ffn_up" => Some(up),
        "ffn_down" => Some(down),
        _ => None,
    };
    if part == "ffn_gate_inp" {
        return at(&format!("{ff}.gate"));
    }
    if let Some(p) = part.strip_suffix("_exps").and_then(proj) {
        return Some(HfTarget::Experts(
            (0..experts).map(|e| expert(e, p)).collect(),
        ));
    }
    // Mixtral files written before the 3-D tensors: one matrix per expert, `ffn_gate.N`.
    let (p, e) = part.split_once('.')?;
    Some(HfTarget::One(expert(e.parse().ok()?, proj(p)?)))
}

/// What the GGUF tensor `gguf_name` of shape `dims` is on the Hugging Face side, checked
/// against the configuration: the family must have the name and the shape must be the one the
/// metadata implies (for stacked experts, `[expert_count, ...]` of one expert's shape).
/// `file` names the file in errors. The loader and the converter both check a file's tensor
/// table with it.
pub fn checked_hf_target(
    cfg: &LlamaGgufConfig,
    file: &str,
    gguf_name: &str,
    dims: &[usize],
) -> Result<HfTarget> {
    let count = cfg.experts.map_or(0, |e| e.count);
    let target = hf_target(cfg.family, count, gguf_name).ok_or_else(|| {
        Error::Msg(format!(
            "{file}: tensor {gguf_name} (shape {dims:?}) has no Hugging Face {} equivalent",
            cfg.family.hf_architecture()
        ))
    })?;
    let check = |hf: &str, dims: &[usize]| -> Result<()> {
        let expected = cfg.expected_shape(hf).ok_or_else(|| {
            Error::Msg(format!(
                "{file}: tensor {gguf_name} ({hf}) is not expected in this model"
            ))
        })?;
        if dims != expected.as_slice() {
            candle_core::bail!(
                "{file}: tensor {gguf_name} ({hf}) has shape {dims:?}, expected {expected:?} from \
                 the metadata"
            );
        }
        Ok(())
    };
    match &target {
        HfTarget::One(hf) => check(hf, dims)?,
        HfTarget::Experts(names) => {
            if dims.len() != 3 || dims[0] != count {
                candle_core::bail!(
                    "{file}: tensor {gguf_name} has shape {dims:?}; expected [{count}, rows, cols] \
                     ({}.expert_count = {count})",
                    cfg.family.arch()
                );
            }
            for hf in names {
                check(hf, &dims[1..])?;
            }
        }
    }
    Ok(target)
}

/// How many heads' rows llama.cpp permuted into its interleaved rotary order in the Hugging
/// Face tensor `hf_name`: the attention heads for `q_proj`, the KV heads for `k_proj` (in the
/// `llama` architecture only), `None` for every other tensor.
pub fn rotary_heads(cfg: &LlamaGgufConfig, hf_name: &str) -> Option<usize> {
    rotary_heads_of(
        cfg.family,
        (cfg.num_attention_heads, cfg.num_key_value_heads),
        hf_name,
    )
}

/// [`rotary_heads`] from the family and its `(attention heads, KV heads)`: what the loader
/// undoes and the writer ([`crate::convert::hf_to_gguf`]) does.
pub fn rotary_heads_of(
    family: GgufFamily,
    (heads, kv_heads): (usize, usize),
    hf_name: &str,
) -> Option<usize> {
    if !family.rotary_permuted() {
        None
    } else if hf_name.contains(".self_attn.q_proj.") {
        Some(heads)
    } else if hf_name.contains(".self_attn.k_proj.") {
        Some(kv_heads)
    } else {
        None
    }
}

/// The layer index of the Hugging Face tensor `hf_name` (`model.layers.N.…`), `None` for
/// tensors outside the layers.
pub fn layer_index(hf_name: &str) -> Option<usize> {
    let rest = hf_name.strip_prefix("model.layers.")?;
    rest.split_once('.')?.0.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_names() {
        assert_eq!(
            hf_tensor_name("blk.12.attn_k.weight").as_deref(),
            Some("model.layers.12.self_attn.k_proj.weight")
        );
        assert_eq!(
            hf_tensor_name("blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.post_attention_layernorm.weight")
        );
        assert_eq!(
            hf_tensor_name("output.weight").as_deref(),
            Some("lm_head.weight")
        );
        assert_eq!(hf_tensor_name("blk.0.attn_norm.bias"), None);
        assert_eq!(hf_tensor_name("rope_freqs.weight"), None);
        assert_eq!(hf_tensor_name("blk.x.attn_q.weight"), None);
    }

    #[test]
    fn expert_names() {
        let t = |f, n| hf_target(f, 3, n);
        let one = |s: &str| Some(HfTarget::One(s.to_string()));
        assert_eq!(
            t(GgufFamily::Mixtral, "blk.1.ffn_gate_inp.weight"),
            one("model.layers.1.block_sparse_moe.gate.weight")
        );
        assert_eq!(
            t(GgufFamily::Mixtral, "blk.1.ffn_down_exps.weight"),
            Some(HfTarget::Experts(
                (0..3)
                    .map(|e| format!("model.layers.1.block_sparse_moe.experts.{e}.w2.weight"))
                    .collect()
            ))
        );
        // The older Mixtral layout: one matrix per expert.
        assert_eq!(
            t(GgufFamily::Mixtral, "blk.0.ffn_up.2.weight"),
            one("model.layers.0.block_sparse_moe.experts.2.w3.weight")
        );
        assert_eq!(
            t(GgufFamily::Qwen3Moe, "blk.4.ffn_gate_exps.weight"),
            Some(HfTarget::Experts(
                (0..3)
                    .map(|e| format!("model.layers.4.mlp.experts.{e}.gate_proj.weight"))
                    .collect()
            ))
        );
        assert_eq!(
            t(GgufFamily::Qwen3Moe, "blk.0.attn_k_norm.weight"),
            one("model.layers.0.self_attn.k_norm.weight")
        );
        // Names of another family are refused, not mapped to something else.
        assert_eq!(t(GgufFamily::Llama, "blk.0.attn_k_norm.weight"), None);
        assert_eq!(t(GgufFamily::Llama, "blk.0.ffn_gate_exps.weight"), None);
        assert_eq!(t(GgufFamily::Qwen3Moe, "blk.0.ffn_gate.weight"), None);
        assert_eq!(t(GgufFamily::Mixtral, "blk.0.ffn_gate_exps.bias"), None);
    }
}
