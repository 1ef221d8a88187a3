//! Llama GGUF → Hugging Face: the model configuration and the weights.
//!
//! Tensor names follow llama.cpp's `convert_hf_to_gguf.py` in reverse (`blk.N.attn_q.weight`
//! → `model.layers.N.self_attn.q_proj.weight`, ...). llama.cpp's converter permutes the rows
//! of `q_proj` and `k_proj` (`LlamaModel.permute`) so that its interleaved rotary kernel sees
//! each (x, y) rotation pair side by side; [`unpermute_rotary`] undoes it so that the
//! half-split rotary embedding of Hugging Face (and candle-transformers' `llama`) applies.
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, TensorInfo};
use candle_core::{Device, Error, Result, Tensor};
use serde_json::json;

use super::tokenizer::GgufTokenizer;
use super::Metadata;

/// The Llama model configuration read from GGUF metadata (`llama.*` keys and the tensor
/// table).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaGgufConfig {
    /// `general.name`, if present.
    pub name: Option<String>,
    /// `llama.embedding_length`.
    pub hidden_size: usize,
    /// `llama.feed_forward_length`.
    pub intermediate_size: usize,
    /// `llama.attention.head_count`.
    pub num_attention_heads: usize,
    /// `llama.attention.head_count_kv` (defaults to the head count).
    pub num_key_value_heads: usize,
    /// `llama.block_count`.
    pub num_hidden_layers: usize,
    /// `llama.attention.key_length`, or hidden size / head count.
    pub head_dim: usize,
    /// `llama.attention.layer_norm_rms_epsilon`.
    pub rms_norm_eps: f32,
    /// `llama.rope.freq_base` (defaults to 10000).
    pub rope_theta: f32,
    /// `llama.context_length`.
    pub max_position_embeddings: usize,
    /// `llama.vocab_size`, or the rows of `token_embd.weight`.
    pub vocab_size: usize,
    /// True when the GGUF has no `output.weight` (the LM head reuses the embedding).
    pub tie_word_embeddings: bool,
    /// True when the attention projections have biases (`blk.0.attn_q.bias`).
    pub attention_bias: bool,
    /// True when the MLP projections have biases (`blk.0.ffn_up.bias`).
    pub mlp_bias: bool,
}

impl LlamaGgufConfig {
    /// Reads the configuration; refuses architectures other than `llama`, rope scaling and
    /// partial rotary embeddings (which the Hugging Face `llama` config here cannot express).
    pub fn from_metadata(meta: &Metadata, tensors: &HashMap<String, TensorInfo>) -> Result<Self> {
        let file = meta.path().display();
        let arch = meta.str("general.architecture")?;
        if arch != "llama" {
            candle_core::bail!(
                "{file}: general.architecture is {arch:?}; only \"llama\" GGUF files can be converted"
            );
        }
        let hidden_size = meta.usize("llama.embedding_length")?;
        let num_attention_heads = meta.usize("llama.attention.head_count")?;
        let num_key_value_heads = match meta.opt_u64("llama.attention.head_count_kv")? {
            Some(_) => meta.usize("llama.attention.head_count_kv")?,
            None => num_attention_heads,
        };
        if num_attention_heads == 0
            || num_key_value_heads == 0
            || num_attention_heads % num_key_value_heads != 0
        {
            candle_core::bail!(
                "{file}: llama.attention.head_count = {num_attention_heads} is not a positive \
                 multiple of llama.attention.head_count_kv = {num_key_value_heads}"
            );
        }
        let head_dim = match meta.opt_u64("llama.attention.key_length")? {
            Some(_) => meta.usize("llama.attention.key_length")?,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    candle_core::bail!(
                        "{file}: llama.embedding_length = {hidden_size} is not divisible by \
                         llama.attention.head_count = {num_attention_heads}"
                    );
                }
                hidden_size / num_attention_heads
            }
        };
        if let Some(v) = meta.opt_u64("llama.attention.value_length")? {
            if v != head_dim as u64 {
                candle_core::bail!(
                    "{file}: llama.attention.value_length = {v} differs from the key length \
                     {head_dim}; not supported"
                );
            }
        }
        if let Some(r) = meta.opt_u64("llama.rope.dimension_count")? {
            if r != head_dim as u64 {
                candle_core::bail!(
                    "{file}: llama.rope.dimension_count = {r} differs from the head dim \
                     {head_dim} (partial rotary embeddings are not supported)"
                );
            }
        }
        if let Some(t) = meta.opt_str("llama.rope.scaling.type")? {
            if t != "none" {
                candle_core::bail!(
                    "{file}: llama.rope.scaling.type = {t:?} is not supported by the converter"
                );
            }
        }
        let embd = tensors
            .get("token_embd.weight")
            .ok_or_else(|| Error::Msg(format!("{file}: tensor token_embd.weight is missing")))?;
        let embd_dims = embd.shape.dims();
        if embd_dims.len() != 2 || embd_dims[1] != hidden_size {
            candle_core::bail!(
                "{file}: tensor token_embd.weight has shape {embd_dims:?}, expected [vocab, {hidden_size}]"
            );
        }
        let vocab_size = match meta.opt_u64("llama.vocab_size")? {
            Some(_) => meta.usize("llama.vocab_size")?,
            None => embd_dims[0],
        };
        if vocab_size != embd_dims[0] {
            candle_core::bail!(
                "{file}: llama.vocab_size = {vocab_size} but token_embd.weight has {} rows",
                embd_dims[0]
            );
        }
        Ok(Self {
            name: meta.opt_str("general.name")?.map(str::to_string),
            hidden_size,
            intermediate_size: meta.usize("llama.feed_forward_length")?,
            num_attention_heads,
            num_key_value_heads,
            num_hidden_layers: meta.usize("llama.block_count")?,
            head_dim,
            rms_norm_eps: meta.f32("llama.attention.layer_norm_rms_epsilon")?,
            rope_theta: meta.opt_f32("llama.rope.freq_base")?.unwrap_or(10_000.0),
            max_position_embeddings: meta.usize("llama.context_length")?,
            vocab_size,
            tie_word_embeddings: !tensors.contains_key("output.weight"),
            attention_bias: tensors.contains_key("blk.0.attn_q.bias"),
            mlp_bias: tensors.contains_key("blk.0.ffn_up.bias"),
        })
    }

    /// The Hugging Face `config.json` (`LlamaForCausalLM`, float32). `rope_theta` is written
    /// both top-level (older readers, candle-transformers) and in `rope_parameters`
    /// (transformers 5).
    pub fn to_hf_config(&self, tok: &GgufTokenizer) -> Result<serde_json::Value> {
        let mut c = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "mlp_bias": self.mlp_bias,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "pretraining_tp": 1,
            "rms_norm_eps": f64::from(self.rms_norm_eps),
            "rope_theta": f64::from(self.rope_theta),
            "rope_parameters": {
                "rope_theta": f64::from(self.rope_theta),
                "rope_type": "default",
            },
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": "float32",
            "torch_dtype": "float32",
            "use_cache": true,
            "vocab_size": self.vocab_size,
        });
        let obj = c
            .as_object_mut()
            .ok_or_else(|| Error::Msg("config.json: not an object".to_string()))?;
        for (key, id) in [
            ("bos_token_id", tok.bos_token_id),
            ("eos_token_id", tok.eos_token_id),
            ("pad_token_id", tok.pad_token_id),
            ("unk_token_id", tok.unk_token_id),
        ] {
            if let Some(id) = id {
                obj.insert(key.to_string(), json!(id));
            }
        }
        if let Some(name) = &self.name {
            obj.insert("_name_or_path".to_string(), json!(name));
        }
        Ok(c)
    }

    /// The Hugging Face `generation_config.json`: the special token ids.
    pub fn to_generation_config(&self, tok: &GgufTokenizer) -> serde_json::Value {
        let mut c = serde_json::Map::new();
        c.insert("_from_model_config".to_string(), json!(true));
        for (key, id) in [
            ("bos_token_id", tok.bos_token_id),
            ("eos_token_id", tok.eos_token_id),
            ("pad_token_id", tok.pad_token_id),
        ] {
            if let Some(id) = id {
                c.insert(key.to_string(), json!(id));
            }
        }
        c.insert("use_cache".to_string(), json!(true));
        serde_json::Value::Object(c)
    }

    /// The shape the Hugging Face tensor `hf_name` must have, `None` for unknown names.
    pub fn expected_shape(&self, hf_name: &str) -> Option<Vec<usize>> {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let (q, kv) = (
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        );
        let shape = match hf_name {
            "model.embed_tokens.weight" | "lm_head.weight" => vec![v, h],
            "model.norm.weight" => vec![h],
            _ => {
                let rest = hf_name.strip_prefix("model.layers.")?;
                let (_, rest) = rest.split_once('.')?;
                match rest {
                    "input_layernorm.weight" | "post_attention_layernorm.weight" => vec![h],
                    "self_attn.q_proj.weight" => vec![q, h],
                    "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![kv, h],
                    "self_attn.o_proj.weight" => vec![h, q],
                    "self_attn.q_proj.bias" => vec![q],
                    "self_attn.k_proj.bias" | "self_attn.v_proj.bias" => vec![kv],
                    "self_attn.o_proj.bias" | "mlp.down_proj.bias" => vec![h],
                    "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![i, h],
                    "mlp.down_proj.weight" => vec![h, i],
                    "mlp.gate_proj.bias" | "mlp.up_proj.bias" => vec![i],
                    _ => return None,
                }
            }
        };
        Some(shape)
    }

    /// The Hugging Face tensor names a checkpoint with this configuration must contain.
    pub fn required_tensors(&self) -> Vec<String> {
        let mut names = vec![
            "model.embed_tokens.weight".to_string(),
            "model.norm.weight".to_string(),
        ];
        if !self.tie_word_embeddings {
            names.push("lm_head.weight".to_string());
        }
        for l in 0..self.num_hidden_layers {
            for suffix in [
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
            ] {
                names.push(format!("model.layers.{l}.{suffix}"));
            }
        }
        names
    }
}

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

/// Undoes llama.cpp's rotary row permutation of a q or k projection (weight `[n_head *
/// head_dim, in]` or bias `[n_head * head_dim]`).
///
/// llama.cpp writes `w.reshape(n_head, 2, head_dim / 2, ...).swapaxes(1, 2)`, which puts row
/// `j * head_dim / 2 + i` of each head at `2 * i + j`; the inverse is
/// `w.reshape(n_head, head_dim / 2, 2, ...).swapaxes(1, 2)`. Pass the number of query heads for
/// q and the number of KV heads for k.
pub fn unpermute_rotary(t: &Tensor, n_head: usize) -> Result<Tensor> {
    let dims = t.dims();
    let rows = dims.first().copied().unwrap_or(0);
    if n_head == 0 || rows == 0 || rows % (2 * n_head) != 0 {
        candle_core::bail!(
            "rotary unpermute: {rows} rows cannot be split into {n_head} heads of an even size \
             (shape {dims:?})"
        );
    }
    let half = rows / n_head / 2;
    let mut split = vec![n_head, half, 2];
    split.extend_from_slice(&dims[1..]);
    t.reshape(split)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

/// Reads every tensor of the GGUF, dequantizes it to f32 and returns it under its Hugging
/// Face name with the Hugging Face row order. Every tensor must be known and have the shape
/// the configuration implies; every required tensor must be present. `progress(done, total,
/// hf_name)` is called after each tensor.
pub fn convert_weights<R: Read + Seek>(
    content: &Content,
    reader: &mut R,
    cfg: &LlamaGgufConfig,
    path: &Path,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<HashMap<String, Tensor>> {
    let file = path.display();
    let by_name: BTreeMap<&String, &TensorInfo> = content.tensor_infos.iter().collect();
    let total = by_name.len();
    let mut out = HashMap::with_capacity(by_name.len());
    for (name, info) in by_name {
        let hf = hf_tensor_name(name).ok_or_else(|| {
            Error::Msg(format!(
                "{file}: tensor {name} (shape {:?}) has no Hugging Face Llama equivalent",
                info.shape.dims()
            ))
        })?;
        let expected = cfg.expected_shape(&hf).ok_or_else(|| {
            Error::Msg(format!(
                "{file}: tensor {name} ({hf}) is not expected in this model"
            ))
        })?;
        if info.shape.dims() != expected.as_slice() {
            candle_core::bail!(
                "{file}: tensor {name} ({hf}) has shape {:?}, expected {expected:?} from the \
                 metadata",
                info.shape.dims()
            );
        }
        if let Some(layer) = layer_index(&hf) {
            if layer >= cfg.num_hidden_layers {
                candle_core::bail!(
                    "{file}: tensor {name} belongs to layer {layer} but llama.block_count is {}",
                    cfg.num_hidden_layers
                );
            }
        }
        let ctx = |e: Error| {
            Error::Msg(format!(
                "{file}: tensor {name} ({:?}, shape {:?}): {e}",
                info.ggml_dtype,
                info.shape.dims()
            ))
        };
        let qt = content.tensor(reader, name, &Device::Cpu).map_err(ctx)?;
        let mut t = qt
            .dequantize(&Device::Cpu)
            .and_then(|t| t.to_dtype(candle_core::DType::F32))
            .map_err(ctx)?;
        if hf.contains(".self_attn.q_proj.") {
            t = unpermute_rotary(&t, cfg.num_attention_heads).map_err(ctx)?;
        } else if hf.contains(".self_attn.k_proj.") {
            t = unpermute_rotary(&t, cfg.num_key_value_heads).map_err(ctx)?;
        }
        if out.insert(hf.clone(), t).is_some() {
            candle_core::bail!("{file}: two tensors map to {hf}");
        }
        progress(out.len(), total, &hf);
    }
    for req in cfg.required_tensors() {
        if !out.contains_key(&req) {
            candle_core::bail!("{file}: no tensor maps to the required {req}");
        }
    }
    Ok(out)
}

fn layer_index(hf_name: &str) -> Option<usize> {
    let rest = hf_name.strip_prefix("model.layers.")?;
    rest.split_once('.')?.0.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's `LlamaModel.permute`, written the way `convert_hf_to_gguf.py` does it.
    fn llama_cpp_permute(w: &Tensor, n_head: usize) -> Result<Tensor> {
        let dims = w.dims().to_vec();
        let mut split = vec![n_head, 2, dims[0] / n_head / 2];
        split.extend_from_slice(&dims[1..]);
        w.reshape(split)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape(dims)
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() -> Result<()> {
        let w = Tensor::arange(0f32, 3.0 * 8.0 * 5.0, &Device::Cpu)?.reshape((24, 5))?;
        let p = llama_cpp_permute(&w, 3)?;
        assert_ne!(p.to_vec2::<f32>()?, w.to_vec2::<f32>()?);
        let back = unpermute_rotary(&p, 3)?;
        assert_eq!(back.to_vec2::<f32>()?, w.to_vec2::<f32>()?);
        // Head 0, head_dim 8: gguf row 2i + j holds hf row j * 4 + i.
        let rows: Vec<f32> = p.get_on_dim(1, 0)?.to_vec1()?;
        assert_eq!(&rows[..8], &[0., 20., 5., 25., 10., 30., 15., 35.]);
        let b = Tensor::arange(0f32, 12.0, &Device::Cpu)?;
        let pb = llama_cpp_permute(&b, 2)?;
        assert_eq!(
            unpermute_rotary(&pb, 2)?.to_vec1::<f32>()?,
            b.to_vec1::<f32>()?
        );
        Ok(())
    }

    #[test]
    fn unpermute_rejects_bad_sizes() {
        let w = Tensor::zeros((10, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = unpermute_rotary(&w, 3).unwrap_err().to_string();
        assert!(err.contains("10 rows") && err.contains("3 heads"), "{err}");
    }

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
