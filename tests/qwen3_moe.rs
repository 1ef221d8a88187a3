//! Qwen3-MoE under tensor parallelism against candle-transformers' `qwen3_moe`: a random
//! checkpoint with q/k norms, 6 heads and 3 KV heads of width 8 on a model width of 40,
//! sparse layers every second layer (`decoder_sparse_step` 2: layers 0 and 2 dense, layer 1
//! with 5 experts, top-2, weights not renormalised), expert width 22 and dense width 36 (both
//! split unevenly at 3 and 4 ranks), and a vocabulary of 101.

mod common;

use anyhow::Result;
use candle_transformers::models::qwen3_moe as reference;
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
const MOE_INTER: usize = 22;
const EXPERTS: usize = 5;

fn config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": HIDDEN, "intermediate_size": INTER, "vocab_size": VOCAB,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "attention_bias": false,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 64,
        "sliding_window": null, "max_window_layers": LAYERS, "use_sliding_window": false,
        "tie_word_embeddings": true, "hidden_act": "silu",
        "decoder_sparse_step": 2, "moe_intermediate_size": MOE_INTER,
        "num_experts_per_tok": 2, "num_experts": EXPERTS, "norm_topk_prob": false,
        "mlp_only_layers": [],
    })
}

fn weights() -> Result<Weights> {
    let mut w = Weights::new(900);
    let shape = Shape {
        hidden: HIDDEN,
        heads: HEADS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
    };
    w.embeddings(VOCAB, HIDDEN, 1.0, true)?;
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        w.attention(&p, shape)?;
        w.qk_norms(&p, HEAD_DIM, 1.0)?;
        if (l + 1) % 2 == 0 {
            w.linear(&format!("{p}.mlp.gate"), EXPERTS, HIDDEN)?;
            for e in 0..EXPERTS {
                w.gated_mlp(&format!("{p}.mlp.experts.{e}"), MLP, MOE_INTER, HIDDEN)?;
            }
        } else {
            w.gated_mlp(&format!("{p}.mlp"), MLP, INTER, HIDDEN)?;
        }
        w.layer_norms(&p, &NORMS, HIDDEN, 1.0)?;
    }
    Ok(w)
}

#[test]
fn qwen3_moe_matches_candle_transformers_at_worlds_1_to_4() -> Result<()> {
    compare_family(config(), &weights()?, 1e-5, |c, vb, ids| {
        reference::ModelForCausalLM::new(c, vb)?.forward(&ids_tensor(ids)?, 0)
    })?;
    Ok(())
}

#[test]
fn qwen3_moe_bad_input_gives_clear_errors() -> Result<()> {
    let mut w = weights()?;
    w.map
        .remove("model.layers.1.mlp.experts.4.down_proj.weight");
    let dir = write_checkpoint(&config(), &w)?;
    let e = load_err(dir.path(), 3);
    assert!(
        e.contains("model.layers.1.mlp.experts.4.down_proj.weight"),
        "{e}"
    );

    let mut c = config();
    c["num_experts_per_tok"] = 6.into();
    let dir = write_checkpoint(&c, &weights()?)?;
    let e = load_err(dir.path(), 1);
    assert!(
        e.contains("num_experts_per_tok = 6") && e.contains("5"),
        "{e}"
    );

    let mut c = config();
    c.as_object_mut().map(|o| o.remove("moe_intermediate_size"));
    let dir = write_checkpoint(&c, &weights()?)?;
    let e = load_err(dir.path(), 1);
    assert!(
        e.contains("moe_intermediate_size") && e.contains("config.json"),
        "{e}"
    );
    Ok(())
}
