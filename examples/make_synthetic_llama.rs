//! Writes a Llama checkpoint with random weights and a real layout (config.json +
//! model.safetensors), for benchmarks at layer sizes where tensor parallelism pays.
//!
//! ```text
//! target/release/examples/make_synthetic_llama --out DIR      # hidden 2048, 16 heads, 8 KV heads,
//!                                                             # intermediate 5632, 4 layers
//! ```

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Write a random-weight Llama checkpoint in Hugging Face layout")]
struct Args {
    /// Output directory (created).
    #[arg(long)]
    out: PathBuf,
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
}

fn main() -> Result<()> {
    let a = Args::parse();
    let dev = Device::Cpu;
    let hd = a.hidden / a.heads;
    let rand = |shape: &[usize]| -> Result<Tensor> { Ok(Tensor::randn(0f32, 0.02, shape, &dev)?) };
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
        t.insert(
            format!("{p}.input_layernorm.weight"),
            Tensor::ones(a.hidden, DType::F32, &dev)?,
        );
        t.insert(
            format!("{p}.post_attention_layernorm.weight"),
            Tensor::ones(a.hidden, DType::F32, &dev)?,
        );
    }
    let config = serde_json::json!({
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
    let tmp = a.out.with_extension("partial");
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    candle_core::safetensors::save(&t, tmp.join("model.safetensors"))?;
    std::fs::write(
        tmp.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    if a.out.exists() {
        std::fs::remove_dir_all(&a.out)?;
    }
    std::fs::rename(&tmp, &a.out)?;
    let params: usize = t.values().map(|x| x.elem_count()).sum();
    eprintln!(
        "wrote {} ({:.1} M parameters)",
        a.out.display(),
        params as f64 / 1e6
    );
    Ok(())
}
