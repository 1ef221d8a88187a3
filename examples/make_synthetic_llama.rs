//! Writes a Llama checkpoint with random weights and a real layout (config.json +
//! model.safetensors), for benchmarks at layer sizes where tensor parallelism pays.
//!
//! ```text
//! target/release/examples/make_synthetic_llama --out DIR      # hidden 2048, 16 heads, 8 KV heads,
//!                                                             # intermediate 5632, 4 layers
//! # ~1.07 B parameters (Llama 3.2 1B's shape) as an F16 GGUF that llama.cpp reads, with
//! # SmolLM2's tokenizer and vocabulary (49152) copied from its GGUF:
//! target/release/examples/make_synthetic_llama --gguf-out F16.gguf --tokenizer-gguf smollm2.gguf \
//!     --heads 32 --kv-heads 8 --intermediate 8192 --layers 16
//! ```
//!
//! `--experts 8 --experts-per-tok 2` writes a Mixtral instead (every MLP a sparse mixture of 8
//! experts of width `--intermediate`), for the expert-parallel benchmarks (`--ep`).
//!
//! The GGUF form is written tensor by tensor (each drawn in f32 and stored as f16, so memory
//! peaks at the f16 file's size), in llama.cpp's names (`blk.N.attn_q.weight`, ...), with tied
//! embeddings; `llama-quantize` makes the other block types from it
//! (`scripts/make-gguf-models.sh`).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Write a random-weight Llama checkpoint in Hugging Face layout")]
struct Args {
    /// Output directory (created): a Hugging Face checkpoint.
    #[arg(
        long,
        required_unless_present = "gguf_out",
        conflicts_with = "gguf_out"
    )]
    out: Option<PathBuf>,
    /// Output GGUF file (F16 weights), instead of `--out`; needs `--tokenizer-gguf`.
    #[arg(long, requires = "tokenizer_gguf")]
    gguf_out: Option<PathBuf>,
    /// A Llama GGUF whose tokenizer metadata (`tokenizer.*`) the `--gguf-out` file copies; its
    /// vocabulary size replaces `--vocab`.
    #[arg(long)]
    tokenizer_gguf: Option<PathBuf>,
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    #[arg(long, default_value_t = 16)]
    heads: usize,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    #[arg(long, default_value_t = 5632)]
    intermediate: usize,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 32000)]
    vocab: usize,
    /// Draw the weights from this seed (the same seed and sizes write the same weights);
    /// without it, from candle's unseeded generator.
    #[arg(long)]
    seed: Option<u64>,
    /// A Mixtral instead (`--out` only): every layer's MLP a sparse mixture of this many
    /// experts of width `--intermediate`, `--experts-per-tok` of them per token.
    #[arg(long, conflicts_with = "gguf_out")]
    experts: Option<usize>,
    /// Experts each token is routed to (with `--experts`).
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

/// Writes the `--gguf-out` form: F16 matrices, f32 norms, llama.cpp's names and metadata.
fn write_gguf(a: &Args, out: &std::path::Path, tok: &std::path::Path) -> Result<()> {
    let dev = Device::Cpu;
    let mut f = std::fs::File::open(tok).with_context(|| format!("opening {}", tok.display()))?;
    let src = gguf_file::Content::read(&mut f)
        .with_context(|| format!("{}: not a readable GGUF file", tok.display()))?;
    let mut md: Vec<(String, Value)> = src
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let vocab = match src.metadata.get("tokenizer.ggml.tokens") {
        Some(Value::Array(t)) => t.len(),
        _ => bail!("{}: no tokenizer.ggml.tokens array", tok.display()),
    };
    if !a.hidden.is_multiple_of(a.heads) || !a.heads.is_multiple_of(a.kv_heads) {
        bail!(
            "--hidden {} / --heads {} / --kv-heads {}: heads must divide hidden, KV heads heads",
            a.hidden,
            a.heads,
            a.kv_heads
        );
    }
    let hd = a.hidden / a.heads;
    let u = |v: usize| Value::U32(v as u32);
    md.extend([
        ("general.architecture".into(), Value::String("llama".into())),
        (
            "general.name".into(),
            Value::String(format!("synthetic-llama-{}x{}", a.layers, a.hidden)),
        ),
        ("general.file_type".into(), Value::U32(1)), // LLAMA_FTYPE_MOSTLY_F16
        ("llama.context_length".into(), u(4096)),
        ("llama.embedding_length".into(), u(a.hidden)),
        ("llama.block_count".into(), u(a.layers)),
        ("llama.feed_forward_length".into(), u(a.intermediate)),
        ("llama.rope.dimension_count".into(), u(hd)),
        ("llama.attention.head_count".into(), u(a.heads)),
        ("llama.attention.head_count_kv".into(), u(a.kv_heads)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-5),
        ),
        ("llama.rope.freq_base".into(), Value::F32(10000.0)),
        ("llama.vocab_size".into(), u(vocab)),
    ]);
    md.sort_by(|x, y| x.0.cmp(&y.0));
    let weights = Weights::new(a.seed);
    let mat = |rows: usize, cols: usize| -> Result<QTensor> {
        let t = weights.tensor(&[rows, cols], &dev)?;
        Ok(QTensor::quantize(&t, GgmlDType::F16)?)
    };
    let norm = || -> Result<QTensor> {
        Ok(QTensor::quantize(
            &Tensor::ones(a.hidden, DType::F32, &dev)?,
            GgmlDType::F32,
        )?)
    };
    let mut ts: Vec<(String, QTensor)> = vec![
        ("token_embd.weight".into(), mat(vocab, a.hidden)?),
        ("output_norm.weight".into(), norm()?),
    ];
    for l in 0..a.layers {
        let p = format!("blk.{l}");
        ts.push((format!("{p}.attn_norm.weight"), norm()?));
        ts.push((format!("{p}.attn_q.weight"), mat(a.heads * hd, a.hidden)?));
        ts.push((
            format!("{p}.attn_k.weight"),
            mat(a.kv_heads * hd, a.hidden)?,
        ));
        ts.push((
            format!("{p}.attn_v.weight"),
            mat(a.kv_heads * hd, a.hidden)?,
        ));
        ts.push((
            format!("{p}.attn_output.weight"),
            mat(a.hidden, a.heads * hd)?,
        ));
        ts.push((format!("{p}.ffn_norm.weight"), norm()?));
        ts.push((
            format!("{p}.ffn_gate.weight"),
            mat(a.intermediate, a.hidden)?,
        ));
        ts.push((format!("{p}.ffn_up.weight"), mat(a.intermediate, a.hidden)?));
        ts.push((
            format!("{p}.ffn_down.weight"),
            mat(a.hidden, a.intermediate)?,
        ));
    }
    let tmp = out.with_extension("gguf.partial");
    {
        let mut w = std::io::BufWriter::new(
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
        );
        let mdr: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tsr: Vec<(&str, &QTensor)> = ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut w, &mdr, &tsr)?;
    }
    std::fs::rename(&tmp, out)?;
    let params: usize = ts.iter().map(|(_, q)| q.shape().elem_count()).sum();
    eprintln!(
        "wrote {} ({:.1} M parameters, vocab {vocab})",
        out.display(),
        params as f64 / 1e6
    );
    Ok(())
}

fn main() -> Result<()> {
    let a = Args::parse();
    if let (Some(out), Some(tok)) = (&a.gguf_out, &a.tokenizer_gguf) {
        return write_gguf(&a, out, tok);
    }
    let out = a.out.clone().context("--out or --gguf-out is required")?;
    let dev = Device::Cpu;
    let hd = a.hidden / a.heads;
    let weights = Weights::new(a.seed);
    let rand = |shape: &[usize]| weights.tensor(shape, &dev);
    let mut t: HashMap<String, Tensor> = HashMap::new();
    t.insert(
        "model.embed_tokens.weight".into(),
        rand(&[a.vocab, a.hidden])?,
    );
    t.insert(
        "model.norm.weight".into(),
        Tensor::ones(a.hidden, DType::F32, &dev)?,
    );
    for l in 0..a.layers {
        let p = format!("model.layers.{l}");
        t.insert(
            format!("{p}.self_attn.q_proj.weight"),
            rand(&[a.heads * hd, a.hidden])?,
        );
        t.insert(
            format!("{p}.self_attn.k_proj.weight"),
            rand(&[a.kv_heads * hd, a.hidden])?,
        );
        t.insert(
            format!("{p}.self_attn.v_proj.weight"),
            rand(&[a.kv_heads * hd, a.hidden])?,
        );
        t.insert(
            format!("{p}.self_attn.o_proj.weight"),
            rand(&[a.hidden, a.heads * hd])?,
        );
        if let Some(experts) = a.experts {
            // Mixtral's names: the router `gate`, each expert's w1 (gate), w3 (up), w2 (down).
            let moe = format!("{p}.block_sparse_moe");
            t.insert(format!("{moe}.gate.weight"), rand(&[experts, a.hidden])?);
            for e in 0..experts {
                let x = format!("{moe}.experts.{e}");
                t.insert(format!("{x}.w1.weight"), rand(&[a.intermediate, a.hidden])?);
                t.insert(format!("{x}.w3.weight"), rand(&[a.intermediate, a.hidden])?);
                t.insert(format!("{x}.w2.weight"), rand(&[a.hidden, a.intermediate])?);
            }
        } else {
            t.insert(
                format!("{p}.mlp.gate_proj.weight"),
                rand(&[a.intermediate, a.hidden])?,
            );
            t.insert(
                format!("{p}.mlp.up_proj.weight"),
                rand(&[a.intermediate, a.hidden])?,
            );
            t.insert(
                format!("{p}.mlp.down_proj.weight"),
                rand(&[a.hidden, a.intermediate])?,
            );
        }
        t.insert(
            format!("{p}.input_layernorm.weight"),
            Tensor::ones(a.hidden, DType::F32, &dev)?,
        );
        t.insert(
            format!("{p}.post_attention_layernorm.weight"),
            Tensor::ones(a.hidden, DType::F32, &dev)?,
        );
    }
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "num_hidden_layers": a.layers,
        "vocab_size": a.vocab,
        "head_dim": hd,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": true,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    });
    if let Some(experts) = a.experts {
        config["architectures"] = serde_json::json!(["MixtralForCausalLM"]);
        config["model_type"] = serde_json::json!("mixtral");
        config["num_local_experts"] = serde_json::json!(experts);
        config["num_experts_per_tok"] = serde_json::json!(a.experts_per_tok);
        config["tie_word_embeddings"] = serde_json::json!(false);
        t.insert("lm_head.weight".into(), rand(&[a.vocab, a.hidden])?);
    }
    let tmp = out.with_extension("partial");
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    candle_core::safetensors::save(&t, tmp.join("model.safetensors"))?;
    std::fs::write(
        tmp.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    if out.exists() {
        std::fs::remove_dir_all(&out)?;
    }
    std::fs::rename(&tmp, &out)?;
    let params: usize = t.values().map(|x| x.elem_count()).sum();
    eprintln!(
        "wrote {} ({:.1} M parameters)",
        out.display(),
        params as f64 / 1e6
    );
    Ok(())
}
