//! llama.cpp tensor names and their Hugging Face equivalents.
//!
//! Tensor names follow llama.cpp's `convert_hf_to_gguf.py` in reverse (`blk.N.attn_q.weight`
//! → `model.layers.N.self_attn.q_proj.weight`, ...).

use candle_core::{Error, Result};

use super::LlamaGgufConfig;

/// The Hugging Face name of the llama.cpp tensor `gguf_name`, `None` when it has no
/// Llama equivalent.
pub fn hf_tensor_name(gguf_name: &str) -> Option<String> {
    match gguf_name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".to_string()),
        "output_norm.weight" => return Some("model.norm.weight".to_string()),
        "output.weight" => return Some("lm_head.weight".to_string()),
        _ => {}
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let hf = match part {
        "attn_norm" if kind == "weight" => "input_layernorm",
        "ffn_norm" if kind == "weight" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// The Hugging Face name of the GGUF tensor `gguf_name` of shape `dims`, checked against the
/// configuration: the name must have a Llama equivalent and the shape must be the one the
/// metadata implies. `file` names the file in errors. The loader and the converter both check
/// a file's tensor table with it.
pub fn checked_hf_name(
    cfg: &LlamaGgufConfig,
    file: &str,
    gguf_name: &str,
    dims: &[usize],
) -> Result<String> {
    let hf = hf_tensor_name(gguf_name).ok_or_else(|| {
        Error::Msg(format!(
            "{file}: tensor {gguf_name} (shape {dims:?}) has no Hugging Face Llama equivalent"
        ))
    })?;
    let expected = cfg.expected_shape(&hf).ok_or_else(|| {
        Error::Msg(format!(
            "{file}: tensor {gguf_name} ({hf}) is not expected in this model"
        ))
    })?;
    if dims != expected.as_slice() {
        candle_core::bail!(
            "{file}: tensor {gguf_name} ({hf}) has shape {dims:?}, expected {expected:?} from the \
             metadata"
        );
    }
    Ok(hf)
}

/// How many heads' rows llama.cpp permuted into its interleaved rotary order in the Hugging
/// Face tensor `hf_name`: the attention heads for `q_proj`, the KV heads for `k_proj`, `None`
/// for every other tensor.
pub fn rotary_heads(cfg: &LlamaGgufConfig, hf_name: &str) -> Option<usize> {
    if hf_name.contains(".self_attn.q_proj.") {
        Some(cfg.num_attention_heads)
    } else if hf_name.contains(".self_attn.k_proj.") {
        Some(cfg.num_key_value_heads)
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
}
