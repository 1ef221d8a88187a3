//! Gemma 2 and Gemma 3 under tensor parallelism against candle-transformers' `gemma2` and
//! `gemma3`: random checkpoints with `(1 + w)` norms (weights near 0), head_dim 16 with 6
//! heads on a width of 40, GQA (6 heads, 2 KV heads: worlds 3 and 4 replicate KV heads),
//! a vocabulary of 101, the tied vocabulary-parallel head, sandwich norms and the embedding
//! scale. Gemma 2 adds attention and final-logit soft-capping (small caps, so that they bite);
//! Gemma 3 adds q/k norms and alternating local (window 4, RoPE base 1e4) and global (RoPE
//! base 1e6) layers, with a prompt and a decode longer than the window.

mod common;

use anyhow::Result;
use candle_core::Tensor;
use candle_transformers::models::{gemma2, gemma3};
use common::families::{
    check_worlds, compare_family, ids_tensor, reference as run_reference, reference_vb,
    write_checkpoint, Shape, Weights, MLP, NORMS, PROMPT,
};
use common::max_abs_diff;

const HIDDEN: usize = 40;
const HEADS: usize = 6;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const LAYERS: usize = 3;
const VOCAB: usize = 101;
const INTER: usize = 36;
const WINDOW: usize = 4;

fn config(arch: &str) -> serde_json::Value {
    let mut c = serde_json::json!({
        "architectures": [arch],
        "hidden_size": HIDDEN, "intermediate_size": INTER, "vocab_size": VOCAB,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "attention_bias": false,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": HEAD_DIM,
        "tie_word_embeddings": true,
    });
    if arch == "Gemma2ForCausalLM" {
        // candle-transformers' gemma2 windows every layer (Hugging Face: the even ones), so
        // the window is kept longer than the sequence here; Gemma 3 tests the windows.
        c["rope_theta"] = 10000.0.into();
        c["sliding_window"] = 64.into();
        c["attn_logit_softcapping"] = 5.0.into();
        c["final_logit_softcapping"] = 3.0.into();
    } else {
        c["rope_theta"] = 1000000.0.into();
        c["rope_local_base_freq"] = 10000.0.into();
        c["sliding_window"] = WINDOW.into();
        c["sliding_window_pattern"] = 2.into();
        c["attn_logit_softcapping"] = serde_json::Value::Null;
        c["final_logit_softcapping"] = serde_json::Value::Null;
    }
    c
}

fn weights(gemma3: bool) -> Result<Weights> {
    let mut w = Weights::new(if gemma3 { 500 } else { 400 });
    let shape = Shape {
        hidden: HIDDEN,
        heads: HEADS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
    };
    // Gemma norms scale by 1 + w: weights around 0. The head is tied.
    w.embeddings(VOCAB, HIDDEN, 0.0, true)?;
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        w.attention(&p, shape)?;
        if gemma3 {
            w.qk_norms(&p, HEAD_DIM, 0.0)?;
        }
        w.gated_mlp(&format!("{p}.mlp"), MLP, INTER, HIDDEN)?;
        let sandwich = ["pre_feedforward_layernorm", "post_feedforward_layernorm"];
        w.layer_norms(&p, &NORMS, HIDDEN, 0.0)?;
        w.layer_norms(&p, &sandwich, HIDDEN, 0.0)?;
    }
    Ok(w)
}

#[test]
fn gemma2_matches_candle_transformers_at_worlds_1_to_4() -> Result<()> {
    let w = weights(false)?;
    let err = compare_family(config("Gemma2ForCausalLM"), &w, 1e-5, |c, vb, ids| {
        let logits = gemma2::Model::new(false, c, vb)?.forward(&ids_tensor(ids)?, 0)?;
        // The caps bite: the largest reference logit is well into tanh's bend.
        let top = logits.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        if top < 1.5 {
            candle_core::bail!("final soft-capping barely used: max |logit| {top}");
        }
        Ok(logits)
    })?;
    assert!(err < 1e-5);
    Ok(())
}

fn gemma3_reference(dir: &std::path::Path, cfg: &gemma3::Config, ids: &[u32]) -> Result<Tensor> {
    let mut m = gemma3::Model::new(false, cfg, reference_vb(dir)?)?;
    let mut last = None;
    for (pos, id) in ids.iter().enumerate() {
        last = Some(m.forward(&ids_tensor(&[*id])?, pos)?.flatten_all()?);
    }
    last.ok_or_else(|| anyhow::anyhow!("empty prompt"))
}

#[test]
fn gemma3_local_global_layers_match_candle_transformers_at_worlds_1_to_4() -> Result<()> {
    let cfg = config("Gemma3ForCausalLM");
    let dir = write_checkpoint(&cfg, &weights(true)?)?;
    let ref_cfg: gemma3::Config = serde_json::from_value(cfg)?;
    let expected = run_reference(|ids| gemma3_reference(dir.path(), &ref_cfg, ids))?;
    // Negative control: without the window the prompt's last logits are far from these.
    let mut wide = ref_cfg.clone();
    wide.sliding_window = 64;
    let unwindowed = gemma3_reference(dir.path(), &wide, &PROMPT)?;
    let gap = max_abs_diff(&unwindowed, &expected.logits.get(PROMPT.len() - 1)?)?;
    assert!(
        gap > 1e-2,
        "the window should change the logits (gap {gap})"
    );
    check_worlds(dir.path(), &expected, &[1, 2, 3, 4], 1e-5)?;
    Ok(())
}
