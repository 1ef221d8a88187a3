//! Qwen3 and Qwen3-MoE under tensor parallelism against candle-transformers' `qwen3` and
//! `qwen3_moe`: random checkpoints with per-head q/k norms, head_dim * heads != hidden_size,
//! GQA (6 heads, 3 KV heads, so worlds 2 and 3 split whole KV groups, 2 + 1 and 1 + 1 + 1,
//! and world 4 replicates KV heads) and a vocabulary of 101 (split unevenly at every world
//! above 1). Qwen3-MoE: sparse layers every second layer (`decoder_sparse_step` 2: layers 0
//! and 2 dense, layer 1 with 5 experts, top-2, weights not renormalised), expert width 22
//! (split unevenly at 3 and 4 ranks), tied head.

mod common;

use anyhow::Result;
use candle_transformers::models::{qwen3 as reference, qwen3_moe};
use common::families::{
    compare_family, compare_family_with, ids_tensor, load_err, write_checkpoint, Shape, Weights,
    MLP, NORMS,
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

fn moe_config() -> serde_json::Value {
    let mut c = config();
    for (k, v) in serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"], "tie_word_embeddings": true,
        "decoder_sparse_step": 2, "moe_intermediate_size": MOE_INTER,
        "num_experts_per_tok": 2, "num_experts": EXPERTS, "norm_topk_prob": false,
        "mlp_only_layers": [],
    })
    .as_object()
    .into_iter()
    .flatten()
    {
        c[k] = v.clone();
    }
    c
}

/// Qwen3 weights, or with `moe` Qwen3-MoE's (tied head, experts in every second layer).
fn weights_of(moe: bool) -> Result<Weights> {
    let mut w = Weights::new(if moe { 900 } else { 300 });
    w.embeddings(VOCAB, HIDDEN, 1.0, moe)?;
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        w.attention(&p, SHAPE)?;
        // Norm weights far from 1, so that a norm applied to the wrong heads shows.
        w.qk_norms(&p, HEAD_DIM, 1.0)?;
        if moe && (l + 1) % 2 == 0 {
            let router_scale = 2.0 / (HIDDEN as f64).sqrt();
            w.moe(
                &format!("{p}.mlp"),
                (HIDDEN, MOE_INTER, EXPERTS),
                MLP,
                router_scale,
            )?;
        } else {
            w.gated_mlp(&format!("{p}.mlp"), MLP, INTER, HIDDEN)?;
        }
        w.layer_norms(&p, &NORMS, HIDDEN, 1.0)?;
    }
    Ok(w)
}

fn weights() -> Result<Weights> {
    weights_of(false)
}

#[test]
fn qwen3_matches_candle_transformers_at_worlds_1_to_4() -> Result<()> {
    // Measured: at most 1.2e-6 (f32 summation order); the bound is 1e-4.
    compare_family(config(), &weights()?, 1e-5, |c, vb, ids| {
        reference::ModelForCausalLM::new(c, vb)?.forward(&ids_tensor(ids)?, 0)
    })?;
    Ok(())
}

/// Issue 45, item 3: the same checkpoint written as a `qwen3` GGUF (f32; q/k rows not
/// permuted, `attn_q_norm` / `attn_k_norm`) and read back at worlds 1-2.
#[test]
fn qwen3_gguf_matches_candle_transformers() -> Result<()> {
    let dir = write_checkpoint(&config(), &weights()?)?;
    let gguf = common::moe_gguf::write_gguf(
        dir.path(),
        "q.gguf",
        candle_core::quantized::GgmlDType::F32,
        candle_tp::convert::ExpertLayout::Stacked,
    )?;
    let cfg: reference::Config = serde_json::from_value(config())?;
    let expected = common::families::reference(|ids| {
        let vb = common::families::reference_vb(dir.path())?;
        let mut m = reference::ModelForCausalLM::new(&cfg, vb)?;
        Ok(m.forward(&ids_tensor(ids)?, 0)?.flatten_all()?)
    })?;
    common::families::check_worlds(&gguf, &expected, &[1, 2], 1e-4)?;
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

#[test]
fn qwen3_moe_matches_candle_transformers_at_worlds_1_to_4() -> Result<()> {
    compare_family(moe_config(), &weights_of(true)?, 1e-5, |c, vb, ids| {
        qwen3_moe::ModelForCausalLM::new(c, vb)?.forward(&ids_tensor(ids)?, 0)
    })?;
    Ok(())
}

/// Issue 45: Qwen3-MoE with whole experts per rank (`LoadOptions::expert_parallel`).
#[test]
fn qwen3_moe_expert_parallel_matches_candle_transformers_at_worlds_1_to_4() -> Result<()> {
    compare_family_with(
        moe_config(),
        &weights_of(true)?,
        1e-5,
        Some(0),
        |c, vb, ids| qwen3_moe::ModelForCausalLM::new(c, vb)?.forward(&ids_tensor(ids)?, 0),
    )?;
    Ok(())
}

#[test]
fn qwen3_moe_bad_input_gives_clear_errors() -> Result<()> {
    let mut w = weights_of(true)?;
    w.map
        .remove("model.layers.1.mlp.experts.4.down_proj.weight");
    let dir = write_checkpoint(&moe_config(), &w)?;
    let e = load_err(dir.path(), 3);
    assert!(
        e.contains("model.layers.1.mlp.experts.4.down_proj.weight"),
        "{e}"
    );

    let mut c = moe_config();
    c["num_experts_per_tok"] = 6.into();
    let dir = write_checkpoint(&c, &weights_of(true)?)?;
    let e = load_err(dir.path(), 1);
    assert!(
        e.contains("num_experts_per_tok = 6") && e.contains("5"),
        "{e}"
    );

    let mut c = moe_config();
    c.as_object_mut().map(|o| o.remove("moe_intermediate_size"));
    let dir = write_checkpoint(&c, &weights_of(true)?)?;
    let e = load_err(dir.path(), 1);
    assert!(
        e.contains("moe_intermediate_size") && e.contains("config.json"),
        "{e}"
    );
    Ok(())
}
