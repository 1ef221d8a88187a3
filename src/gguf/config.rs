//! The model configuration of a GGUF file (the `{arch}.*` keys of its family and the tensor
//! table), and the Hugging Face `config.json` / `generation_config.json` it corresponds to.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::TensorInfo;
use candle_core::{Error, Result};
use serde_json::json;

use super::{GgufExperts, GgufFamily, GgufTokenizer, Metadata};

/// The model configuration read from GGUF metadata (the `{arch}.*` keys of a
/// [`GgufFamily`] and the tensor table). The key names below are `llama`'s; a `qwen3` or
/// `qwen3moe` file has the same keys under its own prefix.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaGgufConfig {
    /// `general.name`, if present.
    pub name: Option<String>,
    /// The family (`general.architecture`, and whether it has experts).
    pub family: GgufFamily,
    /// The experts of a mixture-of-experts family (`{arch}.expert_count`, ...).
    pub experts: Option<GgufExperts>,
    /// `llama.embedding_length`.
    pub hidden_size: usize,
    /// `llama.feed_forward_length` (for `qwen3moe`, where no layer is dense, the expert
    /// width when the key is absent).
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
    /// Reads the configuration of a `llama` (Llama, Mixtral), `qwen3` or `qwen3moe` file;
    /// refuses other architectures, rope scaling and partial rotary embeddings (which the
    /// Hugging Face configs here cannot express).
    pub fn from_metadata(meta: &Metadata, tensors: &HashMap<String, TensorInfo>) -> Result<Self> {
        let file = meta.path().display();
        let arch = meta.str("general.architecture")?;
        if !GgufFamily::ARCHITECTURES.contains(&arch) {
            candle_core::bail!(
                "{file}: general.architecture is {arch:?}; supported: {:?}",
                GgufFamily::ARCHITECTURES
            );
        }
        let key = |k: &str| format!("{arch}.{k}");
        let hidden_size = meta.usize(&key("embedding_length"))?;
        let num_attention_heads = meta.usize(&key("attention.head_count"))?;
        let num_key_value_heads = match meta.opt_u64(&key("attention.head_count_kv"))? {
            Some(_) => meta.usize(&key("attention.head_count_kv"))?,
            None => num_attention_heads,
        };
        if num_attention_heads == 0
            || num_key_value_heads == 0
            || num_attention_heads % num_key_value_heads != 0
        {
            candle_core::bail!(
                "{file}: {arch}.attention.head_count = {num_attention_heads} is not a positive \
                 multiple of {arch}.attention.head_count_kv = {num_key_value_heads}"
            );
        }
        let head_dim = match meta.opt_u64(&key("attention.key_length"))? {
            Some(_) => meta.usize(&key("attention.key_length"))?,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    candle_core::bail!(
                        "{file}: {arch}.embedding_length = {hidden_size} is not divisible by \
                         {arch}.attention.head_count = {num_attention_heads}"
                    );
                }
                hidden_size / num_attention_heads
            }
        };
        if let Some(v) = meta.opt_u64(&key("attention.value_length"))? {
            if v != head_dim as u64 {
                candle_core::bail!(
                    "{file}: {arch}.attention.value_length = {v} differs from the key length \
                     {head_dim}; not supported"
                );
            }
        }
        if let Some(r) = meta.opt_u64(&key("rope.dimension_count"))? {
            if r != head_dim as u64 {
                candle_core::bail!(
                    "{file}: {arch}.rope.dimension_count = {r} differs from the head dim \
                     {head_dim} (partial rotary embeddings are not supported)"
                );
            }
        }
        if let Some(t) = meta.opt_str(&key("rope.scaling.type"))? {
            if t != "none" {
                candle_core::bail!(
                    "{file}: {arch}.rope.scaling.type = {t:?} is not supported by the converter"
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
        let vocab_size = match meta.opt_u64(&key("vocab_size"))? {
            Some(_) => meta.usize(&key("vocab_size"))?,
            None => embd_dims[0],
        };
        if vocab_size != embd_dims[0] {
            candle_core::bail!(
                "{file}: {arch}.vocab_size = {vocab_size} but token_embd.weight has {} rows",
                embd_dims[0]
            );
        }
        let count = match meta.opt_u64(&key("expert_count"))? {
            Some(_) => meta.usize(&key("expert_count"))?,
            None => 0,
        };
        let family = GgufFamily::of(arch, count).ok_or_else(|| {
            Error::Msg(format!(
                "{file}: general.architecture {arch:?} with {arch}.expert_count = {count} is not \
                 a family the crate reads"
            ))
        })?;
        let feed_forward = match meta.opt_u64(&key("feed_forward_length"))? {
            Some(_) => Some(meta.usize(&key("feed_forward_length"))?),
            None => None,
        };
        let experts = if family.is_moe() {
            let used = meta.usize(&key("expert_used_count"))?;
            let width = match family {
                GgufFamily::Mixtral => meta.usize(&key("feed_forward_length"))?,
                _ => meta.usize(&key("expert_feed_forward_length"))?,
            };
            if count == 0 || used == 0 || used > count {
                candle_core::bail!(
                    "{file}: {arch}.expert_used_count = {used} must be in 1..={count} \
                     ({arch}.expert_count)"
                );
            }
            Some(GgufExperts {
                count,
                used,
                intermediate_size: width,
            })
        } else {
            None
        };
        let intermediate_size = match (feed_forward, experts) {
            (Some(i), _) => i,
            (None, Some(e)) => e.intermediate_size,
            (None, None) => meta.usize(&key("feed_forward_length"))?,
        };
        Ok(Self {
            name: meta.opt_str("general.name")?.map(str::to_string),
            family,
            experts,
            hidden_size,
            intermediate_size,
            num_attention_heads,
            num_key_value_heads,
            num_hidden_layers: meta.usize(&key("block_count"))?,
            head_dim,
            rms_norm_eps: meta.f32(&key("attention.layer_norm_rms_epsilon"))?,
            rope_theta: meta.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            max_position_embeddings: meta.usize(&key("context_length"))?,
            vocab_size,
            tie_word_embeddings: !tensors.contains_key("output.weight"),
            attention_bias: tensors.contains_key("blk.0.attn_q.bias"),
            mlp_bias: tensors.contains_key("blk.0.ffn_up.bias"),
        })
    }

    /// The Hugging Face `config.json` of the family (`LlamaForCausalLM`,
    /// `MixtralForCausalLM`, `Qwen3ForCausalLM` or `Qwen3MoeForCausalLM`; float32).
    /// `rope_theta` is written both top-level (older readers, candle-transformers) and in
    /// `rope_parameters` (transformers 5).
    pub fn to_hf_config(&self, tok: &GgufTokenizer) -> Result<serde_json::Value> {
        let family = self.family;
        let mut c = json!({
            "architectures": [family.hf_architecture()],
            "model_type": family.model_type(),
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
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
        let extra = match (family, self.experts) {
            (GgufFamily::Llama, _) => json!({ "mlp_bias": self.mlp_bias, "pretraining_tp": 1 }),
            (GgufFamily::Qwen3, _) => json!({ "use_sliding_window": false }),
            (GgufFamily::Mixtral, Some(e)) => json!({
                "num_local_experts": e.count,
                "num_experts_per_tok": e.used,
                "sliding_window": null,
                "router_aux_loss_coef": 0.02,
            }),
            // llama.cpp's `qwen3moe` graph renormalises the top-k weights and has every
            // layer sparse.
            (GgufFamily::Qwen3Moe, Some(e)) => json!({
                "use_sliding_window": false,
                "num_experts": e.count,
                "num_experts_per_tok": e.used,
                "moe_intermediate_size": e.intermediate_size,
                "norm_topk_prob": true,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }),
            (f, None) => candle_core::bail!("{f:?}: a mixture-of-experts family without experts"),
        };
        if let (Some(c), serde_json::Value::Object(extra)) = (c.as_object_mut(), extra) {
            c.extend(extra);
        }
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

    /// The shape the Hugging Face tensor `hf_name` must have, `None` for names the family
    /// does not have.
    pub fn expected_shape(&self, hf_name: &str) -> Option<Vec<usize>> {
        let (h, v) = (self.hidden_size, self.vocab_size);
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
                    "self_attn.q_norm.weight" | "self_attn.k_norm.weight"
                        if self.family.has_qk_norm() =>
                    {
                        vec![self.head_dim]
                    }
                    _ => return self.feed_forward_shape(rest),
                }
            }
        };
        Some(shape)
    }

    /// The shape of a feed-forward tensor, `rest` the name under `model.layers.N.`.
    fn feed_forward_shape(&self, rest: &str) -> Option<Vec<usize>> {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let Some(e) = self.experts else {
            return Some(match rest {
                "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![i, h],
                "mlp.down_proj.weight" => vec![h, i],
                "mlp.gate_proj.bias" | "mlp.up_proj.bias" => vec![i],
                "mlp.down_proj.bias" => vec![h],
                _ => return None,
            });
        };
        let rest = rest
            .strip_prefix(self.family.feed_forward())?
            .strip_prefix('.')?;
        if rest == "gate.weight" {
            return Some(vec![e.count, h]);
        }
        let (expert, proj) = rest.strip_prefix("experts.")?.split_once('.')?;
        if expert.parse::<usize>().ok()? >= e.count {
            return None;
        }
        let [gate, up, down] = self.family.expert_projections();
        let proj = proj.strip_suffix(".weight")?;
        let w = e.intermediate_size;
        if proj == gate || proj == up {
            Some(vec![w, h])
        } else if proj == down {
            Some(vec![h, w])
        } else {
            None
        }
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
        let mut per_layer: Vec<String> = [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
        ]
        .map(str::to_string)
        .to_vec();
        if self.family.has_qk_norm() {
            per_layer.extend([
                "self_attn.q_norm.weight".into(),
                "self_attn.k_norm.weight".into(),
            ]);
        }
        match self.experts {
            None => per_layer.extend(
                [
                    "mlp.gate_proj.weight",
                    "mlp.up_proj.weight",
                    "mlp.down_proj.weight",
                ]
                .map(str::to_string),
            ),
            Some(e) => {
                let ff = self.family.feed_forward();
                per_layer.push(format!("{ff}.gate.weight"));
                for x in 0..e.count {
                    for p in self.family.expert_projections() {
                        per_layer.push(format!("{ff}.experts.{x}.{p}.weight"));
                    }
                }
            }
        }
        for l in 0..self.num_hidden_layers {
            names.extend(per_layer.iter().map(|s| format!("model.layers.{l}.{s}")));
        }
        names
    }

    /// Checks that every tensor of [`Self::required_tensors`] is present (`has(hf_name)`);
    /// the error names `file` and the first one missing.
    pub fn check_required(&self, file: &str, has: impl Fn(&str) -> bool) -> Result<()> {
        for req in self.required_tensors() {
            if !has(&req) {
                candle_core::bail!("{file}: no tensor maps to the required {req}");
            }
        }
        Ok(())
    }
}
