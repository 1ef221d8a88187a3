//! Qwen3 under tensor parallelism against candle-transformers' `qwen3`: a random checkpoint
//! with per-head q/k norms, head_dim * heads != hidden_size, GQA (6 heads, 3 KV heads, so
//! worlds 2 and 3 split whole KV groups, 2 + 1 and 1 + 1 + 1, and world 4 replicates KV
//! heads) and a vocabulary of 101 (split unevenly at every world > 1).

mod common;

use anyhow::Result;
use candle_transformers::models::qwen3 as reference;
use common::families::{
    compare_family, ids_tensor, load_err, write_checkpoint, Shape, Weights, MLP, NORMS,
};

const HIDDEN: usize = 40;
const HEADS: usize = 6;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 8;
const LAYERS: usize = 3;
const VOCAB: usize = 101;
const INTER: usize = 36;

fn config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": HIDDEN, "intermediate_size": INTER, "vocab_size": VOCAB,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "attention_bias": false,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 64,
        "sliding_window": null, "max_window_layers": LAYERS, "use_sliding_window": false,
        "tie_word_embeddings": false, "hidden_act": "silu", "eos_token_id": 100,
    })
}

const SHAPE: Shape = Shape {
    hidden: HIDDEN,
    heads: HEADS,
    kv_heads: KV_HEADS,
    head_dim: HEAD_DIM,
};

fn weights() -> Result<Weights> {
    let mut w = Weights::new(300);
    w.embeddings(VOCAB, HIDDEN, 1.0, false)?;
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        w.attention(&p, SHAPE)?;
        // Norm weights far from 1, so that a norm applied to the wrong heads shows.
        w.qk_norms(&p, HEAD_DIM, 1.0)?;
        w.gated_mlp(&format!("{p}.mlp"), MLP, INTER, HIDDEN)?;
        w.layer_norms(&p, &NORMS, HIDDEN, 1.0)?;
    }
    Ok(w)
}

#[test]
fn qwen3_matches_candle_transformers_at_worlds_1_to_4() -> Result<()> {
    // Measured: at most 1.1e-6 (f32 summation order); the bound is 1e-4.
    compare_family(config(), &weights()?, 1e-5, |c, vb, ids| {
        reference::ModelForCausalLM::new(c, vb)?.forward(&ids_tensor(ids)?, 0)
    })?;
    Ok(())
}

#[test]
fn qwen3_bad_input_gives_clear_errors() -> Result<()> {
    let mut w = weights()?;
    w.map.remove("model.layers.2.self_attn.k_norm.weight");
    let dir = write_checkpoint(&config(), &w)?;
    let e = load_err(dir.path(), 2);
    assert!(e.contains("model.layers.2.self_attn.k_norm.weight"), "{e}");

    let dir = write_checkpoint(&config(), &weights()?)?;
    let e = load_err(dir.path(), 7);
    assert!(e.contains("7") && e.contains("num_attention_heads"), "{e}");

    let mut c = config();
    c["architectures"] = serde_json::json!(["Olmo2ForCausalLM"]);
    let dir = write_checkpoint(&c, &weights()?)?;
    let e = load_err(dir.path(), 1);
    for word in [
        "Olmo2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
        "config.json",
    ] {
        assert!(e.contains(word), "error should name {word}: {e}");
    }
    Ok(())
}
