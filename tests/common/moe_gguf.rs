//! Small Mixtral and Qwen3-MoE checkpoints and their GGUF files (`convert::hf_to_gguf`), with
//! the candle-transformers references, for `gguf_moe.rs` and `gguf_moe_dequantized.rs`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use candle_tp::convert::{hf_to_gguf, ExpertLayout, GgufWriteOptions};
use candle_transformers::models::{mixtral, qwen3_moe};

use super::families::{
    ids_tensor, parallel_run_with, reference, reference_vb, Expected, RankRun, Shape, Weights, MLP,
    NORMS,
};
use super::max_abs_diff;

/// Qwen3-MoE's width; Mixtral's is twice it, so that its attention output's columns split
/// over 4 ranks in whole Q8_0 blocks (128 / 4 = 32) and every rank runs the quantized kernel.
pub const HIDDEN: usize = 64;
pub const MIXTRAL_HIDDEN: usize = 128;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const LAYERS: usize = 2;
pub const VOCAB: usize = 96;
pub const INTER: usize = 64;
pub const TOP_K: usize = 2;
/// Mixtral: 5 experts (3 + 2 at ep 2, 2 + 1 + 1 + 1 at ep 4); head_dim = hidden / heads
/// (candle-transformers' `quantized_llama` derives it so).
pub const MIXTRAL_EXPERTS: usize = 5;
/// Qwen3-MoE: 6 experts; head_dim 32, so heads * head_dim (128) != hidden (64).
pub const QWEN_EXPERTS: usize = 6;
pub const QWEN_HEAD_DIM: usize = 32;

pub fn mixtral_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": MIXTRAL_HIDDEN, "intermediate_size": INTER, "vocab_size": VOCAB,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 64, "sliding_window": 64, "hidden_act": "silu",
        "num_local_experts": MIXTRAL_EXPERTS, "num_experts_per_tok": TOP_K,
        "tie_word_embeddings": false, "use_flash_attn": false,
    })
}

pub fn qwen_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": HIDDEN, "intermediate_size": 96, "vocab_size": VOCAB,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": QWEN_HEAD_DIM, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 64, "hidden_act": "silu",
        "attention_bias": false, "use_sliding_window": false, "sliding_window": null,
        "max_window_layers": LAYERS, "tie_word_embeddings": true,
        "decoder_sparse_step": 1, "moe_intermediate_size": INTER, "mlp_only_layers": [],
        "num_experts": QWEN_EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": true,
    })
}

pub fn mixtral_weights() -> Result<Weights> {
    let mut w = Weights::new(4500);
    let shape = Shape {
        hidden: MIXTRAL_HIDDEN,
        heads: HEADS,
        kv_heads: KV_HEADS,
        head_dim: MIXTRAL_HIDDEN / HEADS,
    };
    w.embeddings(VOCAB, MIXTRAL_HIDDEN, 1.0, false)?;
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        w.attention(&p, shape)?;
        w.moe(
            &format!("{p}.block_sparse_moe"),
            (MIXTRAL_HIDDEN, INTER, MIXTRAL_EXPERTS),
            ["w1", "w3", "w2"],
            0.6,
        )?;
        w.layer_norms(&p, &NORMS, MIXTRAL_HIDDEN, 1.0)?;
    }
    Ok(w)
}

pub fn qwen_weights() -> Result<Weights> {
    let mut w = Weights::new(4600);
    let shape = Shape {
        hidden: HIDDEN,
        heads: HEADS,
        kv_heads: KV_HEADS,
        head_dim: QWEN_HEAD_DIM,
    };
    w.embeddings(VOCAB, HIDDEN, 1.0, true)?;
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        w.attention(&p, shape)?;
        w.qk_norms(&p, QWEN_HEAD_DIM, 1.0)?;
        w.moe(&format!("{p}.mlp"), (HIDDEN, INTER, QWEN_EXPERTS), MLP, 0.6)?;
        w.layer_norms(&p, &NORMS, HIDDEN, 1.0)?;
    }
    Ok(w)
}

/// Every matrix of `w` replaced by its `dtype` blocks dequantized: what a `dtype` file holds.
/// The routers (`….gate.weight`) stay f32 there, as llama.cpp's quantizer keeps them.
pub fn dequantized(w: &Weights, dtype: GgmlDType) -> Result<Weights> {
    let mut out = Weights::new(0);
    for (name, t) in &w.map {
        let t = if t.rank() == 2 && !name.ends_with(".gate.weight") {
            QTensor::quantize(t, dtype)?.dequantize(&Device::Cpu)?
        } else {
            t.clone()
        };
        out.map.insert(name.clone(), t);
    }
    Ok(out)
}

/// A byte-level vocabulary of `vocab` tokens with one merge: the smallest `tokenizer.*`
/// metadata the GGUF reader takes.
pub fn tokenizer(vocab: usize) -> Vec<(String, Value)> {
    let mut tokens: Vec<String> = ["Ġ", "a", "b", "ab"].map(String::from).to_vec();
    while tokens.len() < vocab {
        tokens.push(format!("t{}", tokens.len()));
    }
    let s = |v: &str| Value::String(v.to_string());
    vec![
        ("tokenizer.ggml.model".into(), s("gpt2")),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.iter().map(|t| s(t)).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(vec![s("a b")])),
        // The last token, which the prompts of the tests do not hold.
        (
            "tokenizer.ggml.eos_token_id".into(),
            Value::U32(vocab as u32 - 1),
        ),
    ]
}

/// Writes `dir`'s checkpoint as `name` in `dir`, the routers in f32.
pub fn write_gguf(
    dir: &Path,
    name: &str,
    dtype: GgmlDType,
    experts: ExpertLayout,
) -> Result<PathBuf> {
    write_gguf_router(dir, name, dtype, experts, false)
}

/// [`write_gguf`], with the routers quantized to `dtype` too when `quantize_router`.
pub fn write_gguf_router(
    dir: &Path,
    name: &str,
    dtype: GgmlDType,
    experts: ExpertLayout,
    quantize_router: bool,
) -> Result<PathBuf> {
    let out = dir.join(name);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)?;
    let vocab = config["vocab_size"].as_u64().unwrap_or(0) as usize;
    let options = GgufWriteOptions {
        dtype,
        experts,
        tokenizer: tokenizer(vocab),
        quantize_router,
    };
    hf_to_gguf(dir, &options, &out)?;
    Ok(out)
}

pub fn mixtral_reference(dir: &Path) -> Result<Expected> {
    let cfg: mixtral::Config = serde_json::from_value(mixtral_config())?;
    reference(|ids| {
        let mut m = mixtral::Model::new(&cfg, reference_vb(dir)?)?;
        Ok(m.forward(&ids_tensor(ids)?, 0)?.flatten_all()?)
    })
}

pub fn qwen_reference(dir: &Path) -> Result<Expected> {
    let cfg: qwen3_moe::Config = serde_json::from_value(qwen_config())?;
    reference(|ids| {
        let mut m = qwen3_moe::ModelForCausalLM::new(&cfg, reference_vb(dir)?)?;
        Ok(m.forward(&ids_tensor(ids)?, 0)?.flatten_all()?)
    })
}

/// Rank 0's run at `world` ranks, tensor-parallel or in `ep` expert groups.
pub fn run(path: &Path, world: usize, ep: Option<usize>) -> Result<RankRun> {
    Ok(parallel_run_with(path, world, ep)?.swap_remove(0))
}

/// Tensor-parallel at 2, expert-parallel at 2 and 4 (whole experts per rank) and ep 2 x tp 2
/// against `one` (world 1): the same greedy ids, every position's logits within 1e-4.
pub fn parallel_against_world1(path: &Path, one: &RankRun, what: &str) -> Result<()> {
    for (world, ep) in [(2, None), (2, Some(2)), (4, Some(4)), (4, Some(2))] {
        let r = run(path, world, ep)?;
        let err = max_abs_diff(&r.all, &one.all)?;
        let layout = match ep {
            None => format!("tp {world}"),
            Some(ep) => format!("ep {ep} x tp {}", world / ep),
        };
        eprintln!("{what}: {layout}, max |logits - world 1| {err:.2e}");
        if err > 1e-4 {
            bail!("{what}: {layout} logits differ from world 1 by {err}");
        }
        if r.ids != one.ids {
            bail!(
                "{what}: {layout} greedy ids {:?} != world 1 {:?}",
                r.ids,
                one.ids
            );
        }
    }
    Ok(())
}
