//! Phi-3 under tensor parallelism against candle-transformers' `phi3`: a random checkpoint
//! with the fused `qkv_proj` and `gate_up_proj`, from which each rank reads its q, k, v and
//! gate, up row ranges; GQA with 6 heads and 2 KV heads (worlds 3 and 4 replicate KV heads),
//! an intermediate size of 38 (split 19 + 19, 13 + 13 + 12, 10 + 10 + 9 + 9) and a vocabulary
//! of 101.

mod common;

use anyhow::Result;
use candle_core::Tensor;
use candle_nn::VarBuilder;
use candle_transformers::models::phi3 as reference;
use common::families::{compare_family, ids_tensor, load_err, write_checkpoint, Weights, NORMS};

const HIDDEN: usize = 48;
const HEADS: usize = 6;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = HIDDEN / HEADS;
const LAYERS: usize = 3;
const VOCAB: usize = 101;
const INTER: usize = 38;

fn config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Phi3ForCausalLM"],
        "hidden_size": HIDDEN, "intermediate_size": INTER, "vocab_size": VOCAB,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 64, "original_max_position_embeddings": 64,
        "rope_scaling": null, "sliding_window": 63, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 100, "tie_word_embeddings": false,
    })
}

fn weights() -> Result<Weights> {
    let mut w = Weights::new(600);
    w.embeddings(VOCAB, HIDDEN, 1.0, false)?;
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        let qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM;
        w.linear(&format!("{p}.self_attn.qkv_proj"), qkv, HIDDEN)?;
        w.linear(&format!("{p}.self_attn.o_proj"), HIDDEN, HEADS * HEAD_DIM)?;
        w.linear(&format!("{p}.mlp.gate_up_proj"), 2 * INTER, HIDDEN)?;
        w.linear(&format!("{p}.mlp.down_proj"), HIDDEN, INTER)?;
        w.layer_norms(&p, &NORMS, HIDDEN, 1.0)?;
    }
    Ok(w)
}

fn phi3_reference(
    c: &reference::Config,
    vb: VarBuilder,
    ids: &[u32],
) -> candle_core::Result<Tensor> {
    reference::Model::new(c, vb)?.forward(&ids_tensor(ids)?, 0)
}

#[test]
fn phi3_fused_projections_match_candle_transformers_at_worlds_1_to_4() -> Result<()> {
    compare_family(config(), &weights()?, 1e-5, phi3_reference)?;
    Ok(())
}

/// Phi-4-mini's variant of the architecture: partial RoPE (`partial_rotary_factor` 0.75: 6
/// of each head's 8 features rotated) and the LM head tied to the embedding.
#[test]
fn phi4_mini_partial_rope_tied_matches_candle_transformers_at_worlds_1_to_4() -> Result<()> {
    let mut cfg = config();
    cfg["partial_rotary_factor"] = 0.75.into();
    cfg["tie_word_embeddings"] = true.into();
    let mut w = weights()?;
    w.map.remove("lm_head.weight");
    compare_family(cfg, &w, 1e-5, phi3_reference)?;
    Ok(())
}

#[test]
fn phi3_unsupported_options_are_named() -> Result<()> {
    let mut c = config();
    c["partial_rotary_factor"] = 0.1.into();
    let dir = write_checkpoint(&c, &weights()?)?;
    let e = load_err(dir.path(), 1);
    assert!(e.contains("partial_rotary_factor = 0.1"), "{e}");

    let mut c = config();
    c["rope_scaling"] =
        serde_json::json!({"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]});
    let dir = write_checkpoint(&c, &weights()?)?;
    let e = load_err(dir.path(), 1);
    assert!(
        e.contains("rope_scaling") && e.contains("Phi3ForCausalLM"),
        "{e}"
    );

    // A fused tensor of the wrong size names the tensor.
    let mut w = weights()?;
    w.linear(
        "model.layers.1.self_attn.qkv_proj",
        HEADS * HEAD_DIM,
        HIDDEN,
    )?;
    let dir = write_checkpoint(&config(), &w)?;
    let e = load_err(dir.path(), 2);
    assert!(
        e.contains("model.layers.1.self_attn.qkv_proj.weight"),
        "{e}"
    );
    Ok(())
}
