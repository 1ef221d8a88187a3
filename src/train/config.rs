//! The shape of [`super::TrainLlama`]: a Llama `config.json`'s fields (with Mixtral's for
//! mixture-of-experts layers), and the `config.json` a saved checkpoint carries.

use candle_core::Result;
use serde::{Deserialize, Serialize};

use super::init::{Init, TrainInit};
use crate::nn::MoeConfig;

/// Shape of the model (the fields of a Llama `config.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the gated MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA); divides `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Longest sequence (RoPE table).
    pub max_position_embeddings: usize,
    /// Whether the LM head shares the embedding table.
    pub tie_word_embeddings: bool,
    /// Standard deviation of the normal initialisation of matrices.
    #[serde(default = "default_std")]
    pub initializer_range: f64,
    /// Experts of each layer's sparse MoE (Mixtral's `num_local_experts`, each a gated MLP
    /// of width `intermediate_size`); 0: every layer has one dense gated MLP.
    #[serde(default)]
    pub num_local_experts: usize,
    /// Experts each token is routed to (top-k; their weights renormalised, as Mixtral's),
    /// with MoE layers.
    #[serde(default = "default_top_k")]
    pub num_experts_per_tok: usize,
    /// Weight of the MoE layers' load-balancing loss (Hugging Face's field name;
    /// Megatron-core's per-layer form, see [`TrainLlama::take_aux_loss`](super::TrainLlama::take_aux_loss)); 0: none.
    #[serde(default)]
    pub router_aux_loss_coef: f64,
}

fn default_std() -> f64 {
    0.02
}

fn default_top_k() -> usize {
    2
}

impl TrainConfig {
    /// `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    pub(super) fn check(&self) -> Result<()> {
        let (h, nh, nkv) = (
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
        );
        if nh == 0 || nkv == 0 || nh % nkv != 0 || h % nh != 0 {
            candle_core::bail!(
                "TrainConfig: hidden_size {h}, num_attention_heads {nh}, num_key_value_heads {nkv}: heads must divide hidden_size and KV heads the heads"
            );
        }
        let (e, k) = (self.num_local_experts, self.num_experts_per_tok);
        if e > 0 && (k == 0 || k > e) {
            candle_core::bail!(
                "TrainConfig: num_experts_per_tok {k} must be between 1 and num_local_experts {e}"
            );
        }
        Ok(())
    }

    /// The sparse MoE of every layer (Mixtral's names: router `gate`, experts
    /// `experts.N.{w1,w3,w2}` under `block_sparse_moe`), or `None` for dense MLPs.
    pub fn moe(&self) -> Option<MoeConfig> {
        (self.num_local_experts > 0).then(|| MoeConfig {
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_experts: self.num_local_experts,
            num_experts_per_tok: self.num_experts_per_tok,
            norm_topk_prob: true,
            act: candle_nn::Activation::Silu,
            router: "gate".into(),
            expert_names: ["w1".into(), "w3".into(), "w2".into()],
        })
    }

    /// Every parameter's name, full shape and initialiser (Llama's: normal(0, σ) for
    /// matrices, ones for norms).
    pub fn param_specs(&self) -> Vec<(String, Vec<usize>, Init)> {
        let (h, i, v, hd) = (
            self.hidden_size,
            self.intermediate_size,
            self.vocab_size,
            self.head_dim(),
        );
        let normal = Init::Normal(self.initializer_range);
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h], normal)];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            out.push((
                format!("{p}.input_layernorm.weight"),
                vec![h],
                Init::Const(1.0),
            ));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                Init::Const(1.0),
            ));
            let q = self.num_attention_heads * hd;
            let kv = self.num_key_value_heads * hd;
            out.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h], normal));
            out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h], normal));
            out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h], normal));
            out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q], normal));
            if self.num_local_experts == 0 {
                out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h], normal));
                out.push((format!("{p}.mlp.up_proj.weight"), vec![i, h], normal));
                out.push((format!("{p}.mlp.down_proj.weight"), vec![h, i], normal));
                continue;
            }
            let moe = format!("{p}.block_sparse_moe");
            let e = self.num_local_experts;
            out.push((format!("{moe}.gate.weight"), vec![e, h], normal));
            for x in 0..e {
                for (n, shape) in [("w1", [i, h]), ("w3", [i, h]), ("w2", [h, i])] {
                    out.push((
                        format!("{moe}.experts.{x}.{n}.weight"),
                        shape.to_vec(),
                        normal,
                    ));
                }
            }
        }
        out.push(("model.norm.weight".to_string(), vec![h], Init::Const(1.0)));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), vec![v, h], normal));
        }
        out
    }

    /// Declares every parameter in `init`.
    pub fn declare(&self, init: &TrainInit) -> Result<()> {
        for (name, shape, how) in self.param_specs() {
            init.declare(name, shape, how)?;
        }
        Ok(())
    }

    /// A Hugging Face `config.json` for this model (`LlamaForCausalLM`, or
    /// `MixtralForCausalLM` with experts).
    pub fn hf_config_json(&self, bos: Option<u32>, eos: Option<u32>) -> Result<String> {
        let mut v =
            serde_json::to_value(self).map_err(|e| candle_core::Error::msg(e.to_string()))?;
        if let Some(o) = v.as_object_mut() {
            let (arch, model_type) = if self.num_local_experts > 0 {
                // No sliding window in training: one as long as the positions.
                o.insert("sliding_window".into(), self.max_position_embeddings.into());
                ("MixtralForCausalLM", "mixtral")
            } else {
                o.remove("num_local_experts");
                o.remove("num_experts_per_tok");
                o.remove("router_aux_loss_coef");
                ("LlamaForCausalLM", "llama")
            };
            o.insert("architectures".into(), serde_json::json!([arch]));
            o.insert("model_type".into(), model_type.into());
            o.insert("hidden_act".into(), "silu".into());
            o.insert("head_dim".into(), self.head_dim().into());
            o.insert("torch_dtype".into(), "float32".into());
            o.insert("attention_bias".into(), false.into());
            o.insert("bos_token_id".into(), serde_json::json!(bos));
            o.insert("eos_token_id".into(), serde_json::json!(eos));
        }
        serde_json::to_string_pretty(&v).map_err(|e| candle_core::Error::msg(e.to_string()))
    }
}
