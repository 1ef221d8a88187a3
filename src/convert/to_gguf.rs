//! Hugging Face → GGUF: a checkpoint directory (`config.json` + safetensors) written as the
//! GGUF file llama.cpp's `convert_hf_to_gguf.py` would write, for the families
//! [`GgufFamily`] lists (Llama, Mixtral, Qwen3, Qwen3-MoE).
//!
//! - Names are llama.cpp's, found through the loader's own mapping ([`hf_target`]), so a file
//!   written here reads back under the names it was written from.
//! - The q/k rows of the `llama` architecture are permuted into llama.cpp's interleaved
//!   rotary order (`LlamaModel.permute`), the inverse of [`super::unpermute_rotary`].
//! - A layer's experts are stacked into one 3-D tensor per projection (`ffn_gate_exps`,
//!   what llama.cpp writes today), or, for Mixtral with [`ExpertLayout::PerExpert`], written
//!   one matrix per expert (`ffn_gate.N`, the layout of older Mixtral files, which
//!   candle-transformers' `quantized_llama` reads).
//! - Matrices are stored as the requested type (F32, F16 or a block type, with the fallback
//!   of [`super::requantize_gguf`] for rows that are not whole blocks); vectors and the
//!   routers (`ffn_gate_inp`) stay f32, as llama.cpp's quantizer keeps them.
//! - The tokenizer is the `tokenizer.*` metadata of another GGUF ([`tokenizer_metadata`]), or
//!   any the caller builds.
//!
//! What makes the project's own MoE test and benchmark files (`make_synthetic_llama`).

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Error, Result, Tensor};
use serde_json::Value as Json;

use super::quantize::{file_type, quantize_as, write_gguf_file};
use crate::gguf::{hf_target, rotary_heads_of, GgufFamily, HfTarget};
use crate::loader::{SafetensorsSource, TensorSource};

/// How a mixture-of-experts layer's experts are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertLayout {
    /// One 3-D tensor per projection, `[experts, rows, cols]` (`ffn_gate_exps`).
    #[default]
    Stacked,
    /// One matrix per expert (`ffn_gate.N`); Mixtral only, as llama.cpp wrote it before the
    /// 3-D tensors.
    PerExpert,
}

/// What [`hf_to_gguf`] writes.
#[derive(Debug, Clone)]
pub struct GgufWriteOptions {
    /// The matrices' type (vectors stay f32).
    pub dtype: GgmlDType,
    /// How experts are stored.
    pub experts: ExpertLayout,
    /// The `tokenizer.*` metadata to write ([`tokenizer_metadata`]).
    pub tokenizer: Vec<(String, Value)>,
    /// Whether the mixture-of-experts routers (`ffn_gate_inp`) are quantized to `dtype` too,
    /// as some third-party converters leave them. `false` keeps them f32, as llama.cpp's
    /// quantizer does (and [`super::requantize_gguf`] always).
    pub quantize_router: bool,
}

/// What [`hf_to_gguf`] wrote.
#[derive(Debug, Clone)]
pub struct GgufWriteSummary {
    /// The family written.
    pub family: GgufFamily,
    /// Tensors in the file.
    pub tensors: usize,
    /// Parameters in the file.
    pub parameters: usize,
}

/// The `tokenizer.*` metadata of the GGUF file `path`, to copy into another file.
pub fn tokenizer_metadata(path: &Path) -> Result<Vec<(String, Value)>> {
    let mut f = std::fs::File::open(path)
        .map_err(|e| Error::Msg(format!("cannot open {}: {e}", path.display())))?;
    let content = gguf_file::Content::read(&mut f)
        .map_err(|e| Error::Msg(format!("{}: not a readable GGUF file: {e}", path.display())))?;
    let md: Vec<(String, Value)> = content
        .metadata
        .into_iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .collect();
    if md.is_empty() {
        candle_core::bail!("{}: no tokenizer.* metadata", path.display());
    }
    Ok(md)
}

/// The `config.json` values the GGUF metadata needs.
struct HfConfig {
    family: GgufFamily,
    hidden: usize,
    intermediate: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    layers: usize,
    eps: f64,
    rope_theta: f64,
    context: usize,
    vocab: usize,
    tied: bool,
    /// (experts, top-k, expert width).
    experts: Option<(usize, usize, usize)>,
}

impl HfConfig {
    fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::Msg(format!("cannot read {}: {e}", path.display())))?;
        let c: Json = serde_json::from_str(&text)
            .map_err(|e| Error::Msg(format!("{}: invalid JSON: {e}", path.display())))?;
        let file = path.display();
        let arch = c["architectures"][0].as_str().unwrap_or_default();
        let family = match arch {
            "LlamaForCausalLM" => GgufFamily::Llama,
            "MixtralForCausalLM" => GgufFamily::Mixtral,
            "Qwen3ForCausalLM" => GgufFamily::Qwen3,
            "Qwen3MoeForCausalLM" => GgufFamily::Qwen3Moe,
            other => candle_core::bail!(
                "{file}: architectures[0] = {other:?}; a GGUF is written for LlamaForCausalLM, \
                 MixtralForCausalLM, Qwen3ForCausalLM and Qwen3MoeForCausalLM"
            ),
        };
        let int = |k: &str| -> Result<usize> {
            c[k].as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| Error::Msg(format!("{file}: '{k}' is not a non-negative integer")))
        };
        let opt_int = |k: &str| c.get(k).and_then(Json::as_u64).map(|v| v as usize);
        let hidden = int("hidden_size")?;
        let heads = int("num_attention_heads")?;
        if heads == 0 {
            candle_core::bail!("{file}: num_attention_heads = 0");
        }
        let experts = match family {
            GgufFamily::Mixtral => Some((
                int("num_local_experts")?,
                int("num_experts_per_tok")?,
                int("intermediate_size")?,
            )),
            GgufFamily::Qwen3Moe => {
                // llama.cpp's qwen3moe graph renormalises the top-k weights, in every layer.
                if c["norm_topk_prob"].as_bool() != Some(true)
                    || opt_int("decoder_sparse_step").unwrap_or(1) != 1
                    || c["mlp_only_layers"]
                        .as_array()
                        .is_some_and(|a| !a.is_empty())
                {
                    candle_core::bail!(
                        "{file}: a qwen3moe GGUF has every layer sparse with renormalised \
                         top-k weights; this config has norm_topk_prob = {}, \
                         decoder_sparse_step = {}, mlp_only_layers = {}",
                        c["norm_topk_prob"],
                        c["decoder_sparse_step"],
                        c["mlp_only_layers"]
                    );
                }
                Some((
                    int("num_experts")?,
                    int("num_experts_per_tok")?,
                    int("moe_intermediate_size")?,
                ))
            }
            _ => None,
        };
        Ok(Self {
            family,
            hidden,
            intermediate: opt_int("intermediate_size")
                .or(experts.map(|e| e.2))
                .ok_or_else(|| Error::Msg(format!("{file}: 'intermediate_size' is not set")))?,
            heads,
            kv_heads: opt_int("num_key_value_heads").unwrap_or(heads),
            head_dim: opt_int("head_dim").unwrap_or(hidden / heads),
            layers: int("num_hidden_layers")?,
            eps: c["rms_norm_eps"].as_f64().unwrap_or(1e-6),
            rope_theta: c["rope_theta"]
                .as_f64()
                .or(c["rope_parameters"]["rope_theta"].as_f64())
                .unwrap_or(10_000.0),
            context: opt_int("max_position_embeddings").unwrap_or(4096),
            vocab: int("vocab_size")?,
            tied: c["tie_word_embeddings"].as_bool().unwrap_or(false),
            experts,
        })
    }

    fn metadata(&self, dtype: GgmlDType) -> Vec<(String, Value)> {
        let arch = self.family.arch();
        let u = |v: usize| Value::U32(v as u32);
        let mut md = vec![
            (
                "general.architecture".to_string(),
                Value::String(arch.into()),
            ),
            (
                "general.file_type".to_string(),
                Value::U32(file_type(dtype).unwrap_or(0)),
            ),
        ];
        let mut key = |k: &str, v: Value| md.push((format!("{arch}.{k}"), v));
        key("context_length", u(self.context));
        key("embedding_length", u(self.hidden));
        key("block_count", u(self.layers));
        key("feed_forward_length", u(self.intermediate));
        key("attention.head_count", u(self.heads));
        key("attention.head_count_kv", u(self.kv_heads));
        key("attention.key_length", u(self.head_dim));
        key("attention.value_length", u(self.head_dim));
        key("rope.dimension_count", u(self.head_dim));
        key(
            "attention.layer_norm_rms_epsilon",
            Value::F32(self.eps as f32),
        );
        key("rope.freq_base", Value::F32(self.rope_theta as f32));
        key("vocab_size", u(self.vocab));
        if let Some((count, used, width)) = self.experts {
            key("expert_count", u(count));
            key("expert_used_count", u(used));
            if self.family == GgufFamily::Qwen3Moe {
                key("expert_feed_forward_length", u(width));
            }
        }
        md
    }

    /// The llama.cpp names of the file's tensors, in llama.cpp's order.
    fn gguf_names(&self, has: impl Fn(&str) -> bool, layout: ExpertLayout) -> Vec<String> {
        let mut names = vec!["token_embd.weight".to_string()];
        for l in 0..self.layers {
            let p = format!("blk.{l}");
            let mut parts = vec!["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output"];
            if self.family.has_qk_norm() {
                parts.extend(["attn_q_norm", "attn_k_norm"]);
            }
            parts.push("ffn_norm");
            for part in parts {
                names.push(format!("{p}.{part}.weight"));
                let bias = format!("{p}.{part}.bias");
                if self.hf_name(&bias).is_some_and(|hf| has(&hf)) {
                    names.push(bias);
                }
            }
            let ffn = ["ffn_gate", "ffn_up", "ffn_down"];
            match (self.experts, layout) {
                (None, _) => names.extend(ffn.map(|f| format!("{p}.{f}.weight"))),
                (Some(_), ExpertLayout::Stacked) => {
                    names.push(format!("{p}.ffn_gate_inp.weight"));
                    names.extend(ffn.map(|f| format!("{p}.{f}_exps.weight")));
                }
                (Some((count, _, _)), ExpertLayout::PerExpert) => {
                    names.push(format!("{p}.ffn_gate_inp.weight"));
                    for e in 0..count {
                        names.extend(ffn.map(|f| format!("{p}.{f}.{e}.weight")));
                    }
                }
            }
        }
        names.push("output_norm.weight".to_string());
        if !self.tied {
            names.push("output.weight".to_string());
        }
        names
    }

    fn hf_name(&self, gguf: &str) -> Option<String> {
        match hf_target(self.family, 0, gguf)? {
            HfTarget::One(hf) => Some(hf),
            HfTarget::Experts(_) => None,
        }
    }
}

/// llama.cpp's rotary permutation of a q or k projection's rows (`LlamaModel.permute`):
/// within each head, the half-split pairs `(i, i + d/2)` become neighbours `(2i, 2i + 1)`.
/// The inverse of [`super::unpermute_rotary`].
pub(crate) fn permute_rotary(t: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        candle_core::bail!("rotary permute: {rows} rows are not {heads} heads of an even size");
    }
    let mut split = vec![heads, 2, rows / heads / 2];
    split.extend_from_slice(&dims[1..]);
    t.reshape(split)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

/// Writes the Hugging Face checkpoint `dir` as the GGUF file `out` (through a temporary name).
/// Errors name the checkpoint and the tensor.
pub fn hf_to_gguf(dir: &Path, options: &GgufWriteOptions, out: &Path) -> Result<GgufWriteSummary> {
    let cfg = HfConfig::read(dir)?;
    if options.experts == ExpertLayout::PerExpert && cfg.family != GgufFamily::Mixtral {
        candle_core::bail!(
            "{}: one matrix per expert is Mixtral's older layout; {} is written stacked",
            dir.display(),
            cfg.family.hf_architecture()
        );
    }
    // The loader's reader of a checkpoint directory (one file, or an index and its shards).
    let st = SafetensorsSource::from_dir(dir)?;
    let has = |hf: &str| matches!(st.shape(hf), Ok(Some(_)));
    let load = |hf: &str| -> Result<Tensor> {
        st.load(hf, DType::F32, &Device::Cpu)
            .map_err(|e| Error::Msg(format!("{}: tensor {hf}: {e}", dir.display())))
    };
    let count = cfg.experts.map_or(0, |e| e.0);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut parameters = 0;
    for name in cfg.gguf_names(has, options.experts) {
        let w = match hf_target(cfg.family, count, &name) {
            Some(HfTarget::One(hf)) => {
                let w = load(&hf)?;
                // The q/k rows of the `llama` architecture, in llama.cpp's rotary order.
                match rotary_heads_of(cfg.family, (cfg.heads, cfg.kv_heads), &hf) {
                    Some(heads) => permute_rotary(&w, heads).map_err(|e| {
                        Error::Msg(format!("{}: tensor {name}: {e}", dir.display()))
                    })?,
                    None => w,
                }
            }
            Some(HfTarget::Experts(names)) => {
                let parts = names
                    .iter()
                    .map(|hf| load(hf))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::stack(&parts, 0)?
            }
            None => candle_core::bail!("internal: {name} has no Hugging Face name"),
        };
        parameters += w.elem_count();
        let q = quantize_as(&name, &w, options.dtype, options.quantize_router)
            .map_err(|e| Error::Msg(format!("{}: tensor {name}: {e}", dir.display())))?;
        tensors.push((name, q));
    }
    let mut metadata = cfg.metadata(options.dtype);
    metadata.extend(options.tokenizer.iter().cloned());
    write_gguf_file(out, metadata, &tensors)?;
    Ok(GgufWriteSummary {
        family: cfg.family,
        tensors: tensors.len(),
        parameters,
    })
}
