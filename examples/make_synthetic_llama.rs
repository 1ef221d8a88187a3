//! Writes a model with random weights and a real layout, for benchmarks at layer sizes where
//! tensor and expert parallelism pay: a Hugging Face checkpoint (config.json + safetensors, one
//! shard per layer so memory stays at one layer's size) and/or a llama.cpp GGUF.
//!
//! ```text
//! target/release/examples/make_synthetic_llama --out DIR      # hidden 2048, 16 heads, 8 KV heads,
//!                                                             # intermediate 5632, 4 layers
//! # ~1.07 B parameters (Llama 3.2 1B's shape) as an F16 GGUF that llama.cpp reads, with
//! # SmolLM2's tokenizer and vocabulary (49152) copied from its GGUF:
//! target/release/examples/make_synthetic_llama --gguf-out F16.gguf --tokenizer-gguf smollm2.gguf \
//!     --heads 32 --kv-heads 8 --intermediate 8192 --layers 16
//! # A Qwen3-MoE in Qwen3-30B-A3B's proportions at ~2 B parameters (64 experts, top-8), as
//! # both a checkpoint and a Q8_0 GGUF:
//! target/release/examples/make_synthetic_llama --family qwen3-moe --out DIR --gguf-out Q8_0.gguf \
//!     --gguf-type Q8_0 --tokenizer-gguf smollm2.gguf --hidden 1024 --heads 16 --kv-heads 4 \
//!     --head-dim 128 --layers 16 --experts 64 --experts-per-tok 8 --moe-intermediate 512
//! ```
//!
//! `--family mixtral` (or `--experts N` alone) writes a Mixtral (every MLP a sparse mixture of
//! N experts of width `--intermediate`); `--family qwen3-moe` a Qwen3-MoE (per-head q/k norms,
//! experts of width `--moe-intermediate`, top-k renormalised), for the expert-parallel
//! benchmarks (`--ep`). The GGUF is written from the checkpoint by
//! `candle_tp::convert::hf_to_gguf` (llama.cpp's names and metadata, experts stacked in 3-D
//! tensors); `llama-quantize` or `quantize_gguf` make other block types from an F16 one
//! (`scripts/make-gguf-models.sh`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Device, Tensor};
use candle_tp::convert::{
    hf_to_gguf, parse_ggml_dtype, tokenizer_metadata, ExpertLayout, GgufWriteOptions,
};
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Family {
    Llama,
    Mixtral,
    #[value(name = "qwen3-moe")]
    Qwen3Moe,
}

#[derive(Parser, Debug)]
#[command(about = "Write a random-weight Llama, Mixtral or Qwen3-MoE checkpoint and/or GGUF")]
struct Args {
    /// Output directory (created): a Hugging Face checkpoint.
    #[arg(long, required_unless_present = "gguf_out")]
    out: Option<PathBuf>,
    /// Output GGUF file; needs `--tokenizer-gguf`.
    #[arg(long, requires = "tokenizer_gguf")]
    gguf_out: Option<PathBuf>,
    /// The GGUF's matrix type (F16, F32, Q8_0, Q4_K, ...; rows that are not whole blocks fall
    /// back to Q8_0, as llama.cpp's quantizer does).
    #[arg(long, default_value = "F16")]
    gguf_type: String,
    /// Quantize the MoE routers (`ffn_gate_inp`) to `--gguf-type` too, as some third-party
    /// converters do (llama.cpp's quantizer, and this tool by default, keep them f32).
    #[arg(long)]
    quantize_router: bool,
    /// A GGUF whose tokenizer metadata (`tokenizer.*`) the model takes; its vocabulary size
    /// replaces `--vocab`.
    #[arg(long)]
    tokenizer_gguf: Option<PathBuf>,
    /// The family (`--experts` alone means mixtral).
    #[arg(long, value_enum, default_value = "llama")]
    family: Family,
    /// The checkpoint's dtype (f32, f16 or bf16).
    #[arg(long, default_value = "f32")]
    dtype: String,
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    #[arg(long, default_value_t = 16)]
    heads: usize,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    /// Rows per head (default hidden / heads).
    #[arg(long)]
    head_dim: Option<usize>,
    /// The dense MLP's width (Llama), each expert's (Mixtral).
    #[arg(long, default_value_t = 5632)]
    intermediate: usize,
    /// Each expert's width (Qwen3-MoE; default `--intermediate`).
    #[arg(long)]
    moe_intermediate: Option<usize>,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 32000)]
    vocab: usize,
    /// Draw the weights from this seed (the same seed and sizes write the same weights);
    /// without it, from candle's unseeded generator.
    #[arg(long)]
    seed: Option<u64>,
    /// Experts per mixture-of-experts layer (Mixtral, Qwen3-MoE).
    #[arg(long)]
    experts: Option<usize>,
    /// Experts each token is routed to.
    #[arg(long, default_value_t = 2)]
    experts_per_tok: usize,
}

/// The weights' generator: N(0, 0.02²) values from candle's unseeded `randn`, or with a seed
/// from a SplitMix64 stream (Box–Muller), in the order the tensors are drawn.
struct Weights(Option<std::cell::Cell<u64>>);

impl Weights {
    fn new(seed: Option<u64>) -> Self {
        Self(seed.map(std::cell::Cell::new))
    }

    fn tensor(&self, shape: &[usize], dev: &Device) -> Result<Tensor> {
        let Some(state) = &self.0 else {
            return Ok(Tensor::randn(0f32, 0.02, shape, dev)?);
        };
        let next = || {
            let z = state.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
            state.set(z);
            let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        // In (0, 1): 53 random bits, offset by half a step.
        let unit = |v: u64| ((v >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let n: usize = shape.iter().product();
        let mut v = Vec::with_capacity(n + 1);
        while v.len() < n {
            let (r, t) = (
                (-2.0 * unit(next()).ln()).sqrt(),
                std::f64::consts::TAU * unit(next()),
            );
            v.extend([(0.02 * r * t.cos()) as f32, (0.02 * r * t.sin()) as f32]);
        }
        v.truncate(n);
        Ok(Tensor::from_vec(v, shape, dev)?)
    }
}

/// The model's shape, resolved from the arguments.
struct Model {
    family: Family,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    moe_intermediate: usize,
    experts: usize,
    top_k: usize,
    layers: usize,
    vocab: usize,
    tied: bool,
}

impl Model {
    fn of(a: &Args, vocab: usize) -> Result<Self> {
        let family = match (a.family, a.experts) {
            (Family::Llama, Some(_)) => Family::Mixtral,
            (f, _) => f,
        };
        let experts = match family {
            Family::Llama => 0,
            _ => a
                .experts
                .context("--family mixtral / qwen3-moe needs --experts N")?,
        };
        if a.heads == 0 || a.kv_heads == 0 || !a.heads.is_multiple_of(a.kv_heads) {
            bail!(
                "--heads {} must be a positive multiple of --kv-heads {}",
                a.heads,
                a.kv_heads
            );
        }
        let head_dim = match a.head_dim {
            Some(d) => d,
            None if a.hidden.is_multiple_of(a.heads) => a.hidden / a.heads,
            None => bail!(
                "--hidden {} is not divisible by --heads {}",
                a.hidden,
                a.heads
            ),
        };
        if experts > 0 && (a.experts_per_tok == 0 || a.experts_per_tok > experts) {
            bail!(
                "--experts-per-tok {} must be in 1..={experts}",
                a.experts_per_tok
            );
        }
        Ok(Self {
            family,
            hidden: a.hidden,
            heads: a.heads,
            kv_heads: a.kv_heads,
            head_dim,
            intermediate: a.intermediate,
            moe_intermediate: a.moe_intermediate.unwrap_or(a.intermediate),
            experts,
            top_k: a.experts_per_tok,
            layers: a.layers,
            vocab,
            tied: family == Family::Llama,
        })
    }

    fn config(&self) -> serde_json::Value {
        let mut c = serde_json::json!({
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "num_hidden_layers": self.layers,
            "vocab_size": self.vocab,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": self.tied,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
        });
        let extra = match self.family {
            Family::Llama => serde_json::json!({
                "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            }),
            Family::Mixtral => serde_json::json!({
                "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": self.experts, "num_experts_per_tok": self.top_k,
            }),
            Family::Qwen3Moe => serde_json::json!({
                "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "use_sliding_window": false,
                "num_experts": self.experts, "num_experts_per_tok": self.top_k,
                "moe_intermediate_size": self.moe_intermediate, "norm_topk_prob": true,
                "decoder_sparse_step": 1, "mlp_only_layers": [],
            }),
        };
        if let (Some(c), serde_json::Value::Object(extra)) = (c.as_object_mut(), extra) {
            c.extend(extra);
        }
        c
    }

    /// One layer's tensors (`layer` = `None`: the embeddings, final norm and head), drawn in
    /// a fixed order from `w`.
    fn tensors(
        &self,
        layer: Option<usize>,
        w: &Weights,
        dtype: DType,
    ) -> Result<HashMap<String, Tensor>> {
        let dev = Device::Cpu;
        let mut t = HashMap::new();
        let mut mat = |name: String, shape: &[usize]| -> Result<()> {
            t.insert(name, w.tensor(shape, &dev)?.to_dtype(dtype)?);
            Ok(())
        };
        let (h, hd) = (self.hidden, self.head_dim);
        let Some(l) = layer else {
            mat("model.embed_tokens.weight".into(), &[self.vocab, h])?;
            if !self.tied {
                mat("lm_head.weight".into(), &[self.vocab, h])?;
            }
            t.insert("model.norm.weight".into(), Tensor::ones(h, dtype, &dev)?);
            return Ok(t);
        };
        let p = format!("model.layers.{l}");
        mat(
            format!("{p}.self_attn.q_proj.weight"),
            &[self.heads * hd, h],
        )?;
        mat(
            format!("{p}.self_attn.k_proj.weight"),
            &[self.kv_heads * hd, h],
        )?;
        mat(
            format!("{p}.self_attn.v_proj.weight"),
            &[self.kv_heads * hd, h],
        )?;
        mat(
            format!("{p}.self_attn.o_proj.weight"),
            &[h, self.heads * hd],
        )?;
        let (ff, names, width) = match self.family {
            Family::Llama => (
                "mlp",
                ["gate_proj", "up_proj", "down_proj"],
                self.intermediate,
            ),
            Family::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"], self.intermediate),
            Family::Qwen3Moe => (
                "mlp",
                ["gate_proj", "up_proj", "down_proj"],
                self.moe_intermediate,
            ),
        };
        let [g, u, d] = names;
        if self.family == Family::Llama {
            mat(format!("{p}.mlp.{g}.weight"), &[width, h])?;
            mat(format!("{p}.mlp.{u}.weight"), &[width, h])?;
            mat(format!("{p}.mlp.{d}.weight"), &[h, width])?;
        } else {
            mat(format!("{p}.{ff}.gate.weight"), &[self.experts, h])?;
            for e in 0..self.experts {
                let x = format!("{p}.{ff}.experts.{e}");
                mat(format!("{x}.{g}.weight"), &[width, h])?;
                mat(format!("{x}.{u}.weight"), &[width, h])?;
                mat(format!("{x}.{d}.weight"), &[h, width])?;
            }
        }
        if self.family == Family::Qwen3Moe {
            for n in ["self_attn.q_norm", "self_attn.k_norm"] {
                t.insert(format!("{p}.{n}.weight"), Tensor::ones(hd, dtype, &dev)?);
            }
        }
        for n in ["input_layernorm", "post_attention_layernorm"] {
            t.insert(format!("{p}.{n}.weight"), Tensor::ones(h, dtype, &dev)?);
        }
        Ok(t)
    }
}

/// Writes the checkpoint into `dir` (through a temporary name): one safetensors shard per
/// layer and one for the rest, with `model.safetensors.index.json`. Returns the parameters.
fn write_checkpoint(m: &Model, w: &Weights, dtype: DType, dir: &Path) -> Result<usize> {
    let tmp = dir.with_extension("partial");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let shards = m.layers + 1;
    let mut weight_map = BTreeMap::new();
    let mut params = 0;
    for (i, layer) in std::iter::once(None)
        .chain((0..m.layers).map(Some))
        .enumerate()
    {
        let t = m.tensors(layer, w, dtype)?;
        let file = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
        for (name, x) in &t {
            weight_map.insert(name.clone(), file.clone());
            params += x.elem_count();
        }
        candle_core::safetensors::save(&t, tmp.join(&file))?;
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(
        tmp.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index)?,
    )?;
    std::fs::write(
        tmp.join("config.json"),
        serde_json::to_string_pretty(&m.config())?,
    )?;
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::rename(&tmp, dir)?;
    Ok(params)
}

fn main() -> Result<()> {
    let a = Args::parse();
    let tokenizer: Option<Vec<(String, Value)>> = a
        .tokenizer_gguf
        .as_deref()
        .map(tokenizer_metadata)
        .transpose()?;
    let vocab = match tokenizer.as_ref().and_then(|t| {
        t.iter()
            .find(|(k, _)| k == "tokenizer.ggml.tokens")
            .map(|(_, v)| v.clone())
    }) {
        Some(Value::Array(tokens)) => tokens.len(),
        Some(_) => bail!("tokenizer.ggml.tokens is not an array"),
        None => a.vocab,
    };
    let m = Model::of(&a, vocab)?;
    let dtype = match a.dtype.as_str() {
        "f32" => DType::F32,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        d => bail!("--dtype {d}: expected f32, f16 or bf16"),
    };
    let w = Weights::new(a.seed);
    // Only a GGUF asked for: the checkpoint goes to a scratch directory next to it, in f16.
    let (dir, scratch) = match (&a.out, &a.gguf_out) {
        (Some(out), _) => (out.clone(), false),
        (None, Some(g)) => (g.with_extension("hf"), true),
        (None, None) => bail!("--out or --gguf-out is required"),
    };
    let dtype = if scratch { DType::F16 } else { dtype };
    let params = write_checkpoint(&m, &w, dtype, &dir)?;
    eprintln!(
        "wrote {} ({:.1} M parameters, vocab {vocab})",
        dir.display(),
        params as f64 / 1e6
    );
    if let (Some(out), Some(tokenizer)) = (&a.gguf_out, tokenizer) {
        let options = GgufWriteOptions {
            dtype: parse_ggml_dtype(&a.gguf_type)?,
            experts: ExpertLayout::Stacked,
            tokenizer,
            quantize_router: a.quantize_router,
        };
        let s = hf_to_gguf(&dir, &options, out)?;
        eprintln!(
            "wrote {} ({} tensors, {:?}, {})",
            out.display(),
            s.tensors,
            s.family,
            a.gguf_type
        );
        if scratch {
            std::fs::remove_dir_all(&dir)?;
        }
    }
    Ok(())
}
