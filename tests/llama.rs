//! The tensor-parallel Llama family against candle-transformers' single-process models
//! (`llama`, `qwen2`) built from the same weights: tiny random checkpoints written here, and
//! the real converted SmolLM2.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use candle_tp::models::FromCheckpoint;
use candle_tp::models::Llama;
use candle_tp::run_threads;
use candle_transformers::models::{llama as ref_llama, mistral as ref_mistral, qwen2 as ref_qwen2};
use common::{max_abs_diff, seeded};

#[derive(Clone)]
struct Tiny {
    arch: &'static str,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    layers: usize,
    vocab: usize,
    inter: usize,
    tie: bool,
    llama3_scaling: bool,
}

const GQA: Tiny = Tiny {
    arch: "LlamaForCausalLM",
    hidden: 48,
    heads: 6,
    kv_heads: 2,
    layers: 2,
    vocab: 101,
    inter: 40,
    tie: false,
    llama3_scaling: false,
};

const MHA9: Tiny = Tiny {
    arch: "LlamaForCausalLM",
    hidden: 72,
    heads: 9,
    kv_heads: 9,
    layers: 2,
    vocab: 101,
    inter: 40,
    tie: true,
    llama3_scaling: true,
};

const QWEN2: Tiny = Tiny {
    arch: "Qwen2ForCausalLM",
    hidden: 48,
    heads: 6,
    kv_heads: 3,
    layers: 2,
    vocab: 97,
    inter: 40,
    tie: false,
    llama3_scaling: false,
};

fn config_json(t: &Tiny) -> serde_json::Value {
    let mut c = serde_json::json!({
        "architectures": [t.arch],
        "hidden_size": t.hidden,
        "intermediate_size": t.inter,
        "vocab_size": t.vocab,
        "num_hidden_layers": t.layers,
        "num_attention_heads": t.heads,
        "num_key_value_heads": t.kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": t.tie,
        "hidden_act": "silu",
        "sliding_window": 64,
        "max_window_layers": t.layers,
        "use_sliding_window": false,
    });
    if t.llama3_scaling {
        // Small original_max_position_embeddings so that every branch of the scaling is used.
        c["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16});
    }
    c
}

fn tensors(t: &Tiny) -> Result<HashMap<String, Tensor>> {
    let hd = t.hidden / t.heads;
    let mut seed = 1u64;
    let mut w = |shape: &[usize], scale: f64, offset: f64| -> Result<Tensor> {
        seed += 1;
        Ok(((seeded(shape, seed) * scale)? + offset)?)
    };
    let mut m = HashMap::new();
    m.insert(
        "model.embed_tokens.weight".into(),
        w(&[t.vocab, t.hidden], 0.5, 0.0)?,
    );
    m.insert("model.norm.weight".into(), w(&[t.hidden], 0.1, 1.0)?);
    if !t.tie {
        m.insert("lm_head.weight".into(), w(&[t.vocab, t.hidden], 0.2, 0.0)?);
    }
    for l in 0..t.layers {
        let p = format!("model.layers.{l}");
        let s = 1.0 / (t.hidden as f64).sqrt();
        for (name, shape) in [
            ("self_attn.q_proj", [t.heads * hd, t.hidden]),
            ("self_attn.k_proj", [t.kv_heads * hd, t.hidden]),
            ("self_attn.v_proj", [t.kv_heads * hd, t.hidden]),
            ("self_attn.o_proj", [t.hidden, t.heads * hd]),
            ("mlp.gate_proj", [t.inter, t.hidden]),
            ("mlp.up_proj", [t.inter, t.hidden]),
            ("mlp.down_proj", [t.hidden, t.inter]),
        ] {
            m.insert(format!("{p}.{name}.weight"), w(&shape, 2.0 * s, 0.0)?);
        }
        if t.arch == "Qwen2ForCausalLM" {
            for (name, n) in [
                ("q_proj", t.heads),
                ("k_proj", t.kv_heads),
                ("v_proj", t.kv_heads),
            ] {
                m.insert(
                    format!("{p}.self_attn.{name}.bias"),
                    w(&[n * hd], 0.3, 0.0)?,
                );
            }
        }
        m.insert(
            format!("{p}.input_layernorm.weight"),
            w(&[t.hidden], 0.1, 1.0)?,
        );
        m.insert(
            format!("{p}.post_attention_layernorm.weight"),
            w(&[t.hidden], 0.1, 1.0)?,
        );
    }
    Ok(m)
}

fn write_checkpoint(
    dir: &Path,
    config: &serde_json::Value,
    tensors: &HashMap<String, Tensor>,
) -> Result<()> {
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(config)?)?;
    candle_core::safetensors::save(tensors, dir.join("model.safetensors"))?;
    Ok(())
}

fn tiny_checkpoint(t: &Tiny) -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    write_checkpoint(dir.path(), &config_json(t), &tensors(t)?)?;
    Ok(dir)
}

/// The single-process reference: candle-transformers' model for the checkpoint.
enum Reference {
    Llama(ref_llama::Llama, ref_llama::Cache),
    Qwen2(ref_qwen2::ModelForCausalLM),
}

impl Reference {
    fn load(dir: &Path, cfg_llama: Option<ref_llama::Config>) -> Result<Self> {
        let text = std::fs::read(dir.join("config.json"))?;
        let vb = unsafe {
            VarBuilder::from_mmaped_safetensors(
                &[dir.join("model.safetensors")],
                DType::F32,
                &Device::Cpu,
            )?
        };
        let v: serde_json::Value = serde_json::from_slice(&text)?;
        if v["architectures"][0] == "Qwen2ForCausalLM" {
            let cfg: ref_qwen2::Config = serde_json::from_slice(&text)?;
            return Ok(Self::Qwen2(ref_qwen2::ModelForCausalLM::new(&cfg, vb)?));
        }
        let cfg = match cfg_llama {
            Some(c) => c,
            None => serde_json::from_slice::<ref_llama::LlamaConfig>(&text)?.into_config(false),
        };
        let cache = ref_llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu)?;
        Ok(Self::Llama(ref_llama::Llama::load(vb, &cfg)?, cache))
    }

    /// Last-position logits `[vocab]`.
    fn forward(&mut self, ids: &[u32], pos: usize) -> Result<Tensor> {
        let x = Tensor::new(ids, &Device::Cpu)?.unsqueeze(0)?;
        Ok(match self {
            Self::Llama(m, cache) => m.forward(&x, pos, cache)?.squeeze(0)?,
            Self::Qwen2(m) => m.forward(&x, pos)?.flatten_all()?,
        })
    }
}

fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?)
}

/// Prompt logits and a greedy continuation of `n` tokens (with the KV cache), by the reference.
fn reference_run(
    dir: &Path,
    cfg: Option<ref_llama::Config>,
    prompt: &[u32],
    n: usize,
) -> Result<(Tensor, Vec<u32>)> {
    let mut m = Reference::load(dir, cfg)?;
    let logits = m.forward(prompt, 0)?;
    let mut ids = vec![argmax(&logits)?];
    let mut pos = prompt.len();
    while ids.len() < n {
        let l = m.forward(&ids[ids.len() - 1..], pos)?;
        pos += 1;
        ids.push(argmax(&l)?);
    }
    Ok((logits, ids))
}

/// The same with the tensor-parallel model on `world` threads; per rank: (full prompt
/// logits, this rank's local logits, generated ids).
fn parallel_run(
    dir: &Path,
    world: usize,
    prompt: &[u32],
    n: usize,
) -> Result<Vec<(Tensor, Tensor, Vec<u32>)>> {
    let dir = dir.to_path_buf();
    let prompt = prompt.to_vec();
    Ok(run_threads(world, move |pg| {
        let mut m = Llama::from_dir(&dir, DType::F32, &Device::Cpu, pg)?;
        let x = Tensor::new(prompt.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
        let local = m.forward(&x, 0)?.squeeze(0)?;
        m.clear_kv_cache();
        let full = m.forward_gathered(&x, 0)?.squeeze(0)?;
        let mut ids = vec![full.argmax(D::Minus1)?.to_scalar::<u32>()?];
        let mut pos = prompt.len();
        while ids.len() < n {
            let x = Tensor::new(&ids[ids.len() - 1..], &Device::Cpu)?.unsqueeze(0)?;
            let l = m.forward_gathered(&x, pos)?;
            pos += 1;
            ids.push(l.argmax(D::Minus1)?.squeeze(0)?.to_scalar::<u32>()?);
        }
        Ok((full, local, ids))
    })?)
}

fn check_against_reference(
    dir: &Path,
    cfg: Option<ref_llama::Config>,
    worlds: &[usize],
    prompt: &[u32],
    n: usize,
    tol: f32,
) -> Result<()> {
    let (ref_logits, ref_ids) = reference_run(dir, cfg, prompt, n)?;
    for &world in worlds {
        let ranks = parallel_run(dir, world, prompt, n)?;
        let locals: Vec<Tensor> = ranks.iter().map(|r| r.1.clone()).collect();
        let joined = Tensor::cat(&locals, 0)?;
        for (rank, (full, _, ids)) in ranks.iter().enumerate() {
            let err = max_abs_diff(full, &ref_logits)?;
            eprintln!("world {world} rank {rank}: max |logits - reference| = {err:e}");
            if err > tol {
                bail!("world {world} rank {rank}: logits differ by {err} (> {tol})");
            }
            let err = max_abs_diff(&joined, full)?;
            if err > 1e-6 {
                bail!("world {world}: local logits joined differ from gathered by {err}");
            }
            if ids != &ref_ids {
                bail!("world {world} rank {rank}: greedy ids {ids:?} != reference {ref_ids:?}");
            }
        }
    }
    Ok(())
}

/// 12 heads in 3 KV groups of 4: at world 5 (heads 3, 3, 2, 2, 2) rank 1 holds one head of
/// group 0 and two of group 1, rank 3 one of group 1 and one of group 2: uneven local groups.
const GQA12: Tiny = Tiny {
    arch: "LlamaForCausalLM",
    hidden: 48,
    heads: 12,
    kv_heads: 3,
    layers: 2,
    vocab: 101,
    inter: 40,
    tie: false,
    llama3_scaling: false,
};

const PROMPT: [u32; 7] = [3, 17, 42, 90, 5, 64, 23];

#[test]
fn tiny_gqa_matches_candle_transformers_at_every_world() -> Result<()> {
    // 6 heads, 2 KV heads: worlds 1 and 2 own whole KV groups, 3/4/6 replicate KV heads.
    let dir = tiny_checkpoint(&GQA)?;
    check_against_reference(dir.path(), None, &[1, 2, 3, 4, 6], &PROMPT, 8, 1e-4)
}

/// KV groups split across ranks so that a rank's local groups are uneven (world 5: 1 + 2
/// heads on rank 1), which the fused CPU attention takes as they are: prefill and decode
/// against candle-transformers, as at worlds whose groups are even.
#[test]
fn uneven_local_kv_groups_match_candle_transformers() -> Result<()> {
    let dir = tiny_checkpoint(&GQA12)?;
    check_against_reference(dir.path(), None, &[1, 4, 5], &PROMPT, 8, 1e-4)
}

/// A context past `GROUPED_MIN_POSITIONS` (128), where GQA's groups attend per KV head
/// instead of on the cache expanded to every query head: a 130-token prefill (the grouped
/// path with its causal mask) and decoding on it, against candle-transformers, at worlds that
/// own whole KV groups (1, 2) and that replicate KV heads (3).
#[test]
fn tiny_gqa_long_context_matches_candle_transformers() -> Result<()> {
    let dir = tiny_checkpoint(&GQA)?;
    let prompt: Vec<u32> = (0..130u32).map(|i| (i * 37 + 11) % 101).collect();
    check_against_reference(dir.path(), None, &[1, 2, 3], &prompt, 6, 1e-4)
}

#[test]
fn tiny_mha_uneven_heads_tied_llama3_rope() -> Result<()> {
    // 9 heads on 2 ranks = 5 + 4, on 4 = 3 + 2 + 2 + 2; tied head; Llama 3 RoPE scaling.
    let dir = tiny_checkpoint(&MHA9)?;
    check_against_reference(dir.path(), None, &[1, 2, 4], &PROMPT, 8, 1e-4)
}

#[test]
fn tiny_qwen2_qkv_bias_matches_candle_transformers_qwen2() -> Result<()> {
    let dir = tiny_checkpoint(&QWEN2)?;
    check_against_reference(dir.path(), None, &[1, 2, 4], &PROMPT, 8, 1e-4)
}

const MISTRAL: Tiny = Tiny {
    arch: "MistralForCausalLM",
    ..GQA
};

/// Last-position logits of candle-transformers' `mistral` for every prefix of `seq` from
/// `from` tokens on, each prefilled from scratch (its KV-cache path applies no window).
fn mistral_reference(
    dir: &Path,
    cfg: &ref_mistral::Config,
    seq: &[u32],
    from: usize,
) -> Result<Vec<Tensor>> {
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(
            &[dir.join("model.safetensors")],
            DType::F32,
            &Device::Cpu,
        )?
    };
    let mut m = ref_mistral::Model::new(cfg, vb)?;
    (from..=seq.len())
        .map(|n| {
            m.clear_kv_cache();
            let x = Tensor::new(&seq[..n], &Device::Cpu)?.unsqueeze(0)?;
            Ok(m.forward(&x, 0)?.flatten_all()?)
        })
        .collect()
}

/// Mistral's sliding window, Hugging Face's semantics (a query sees `w` positions, its own
/// included) against candle-transformers' `mistral`, whose mask keeps `w + 1`: the reference
/// runs with `w - 1`. The tensor-parallel model prefills the prompt (longer than the window)
/// and then decodes with its KV cache, where the window must also hold.
#[test]
fn tiny_mistral_sliding_window_matches_candle_transformers_mistral() -> Result<()> {
    let w = 3usize;
    let mut cfg = config_json(&MISTRAL);
    cfg["sliding_window"] = w.into();
    let dir = tempfile::tempdir()?;
    write_checkpoint(dir.path(), &cfg, &tensors(&MISTRAL)?)?;
    let seq: Vec<u32> = PROMPT.iter().chain(&[11, 7, 29, 60]).copied().collect();
    let mut ref_cfg: ref_mistral::Config = serde_json::from_value(cfg.clone())?;
    ref_cfg.sliding_window = Some(w - 1);
    let expected = mistral_reference(dir.path(), &ref_cfg, &seq, PROMPT.len())?;
    // Negative control: without any window the logits are far from these.
    ref_cfg.sliding_window = None;
    let unwindowed = mistral_reference(dir.path(), &ref_cfg, &seq, PROMPT.len())?;
    let gap = max_abs_diff(
        &expected[expected.len() - 1],
        &unwindowed[unwindowed.len() - 1],
    )?;
    assert!(
        gap > 1e-2,
        "the window should change the logits (gap {gap})"
    );
    for world in [1, 2] {
        let (d, s) = (dir.path().to_path_buf(), seq.clone());
        let ranks = run_threads(world, move |pg| {
            let mut m = Llama::from_dir(&d, DType::F32, &Device::Cpu, pg)?;
            let n0 = PROMPT.len();
            let x = Tensor::new(&s[..n0], &Device::Cpu)?.unsqueeze(0)?;
            let mut out = vec![m.forward_gathered(&x, 0)?.flatten_all()?];
            for n in n0..s.len() {
                let x = Tensor::new(&s[n..n + 1], &Device::Cpu)?.unsqueeze(0)?;
                out.push(m.forward_gathered(&x, n)?.flatten_all()?);
            }
            Ok(out)
        })?;
        for (rank, got) in ranks.iter().enumerate() {
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                let err = max_abs_diff(g, e)?;
                eprintln!(
                    "world {world} rank {rank} position {}: max |diff| = {err:e}",
                    PROMPT.len() + i - 1
                );
                if err > 1e-4 {
                    bail!(
                        "world {world} rank {rank}: logits at prefix {} differ by {err}",
                        PROMPT.len() + i
                    );
                }
            }
        }
    }
    Ok(())
}

fn load_err(dir: &Path, world: usize) -> String {
    let dir = dir.to_path_buf();
    match run_threads(world, move |pg| {
        Llama::from_dir(&dir, DType::F32, &Device::Cpu, pg).map(|_| ())
    }) {
        Ok(_) => String::from("<loaded without error>"),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(err: &str, words: &[&str]) {
    for w in words {
        assert!(err.contains(w), "error should mention '{w}': {err}");
    }
}

#[test]
fn bad_input_gives_clear_errors() -> Result<()> {
    let empty = tempfile::tempdir()?;
    assert_mentions(&load_err(empty.path(), 1), &["config.json"]);

    let mut t = tensors(&GQA)?;
    t.remove("model.layers.1.mlp.up_proj.weight");
    let missing = tempfile::tempdir()?;
    write_checkpoint(missing.path(), &config_json(&GQA), &t)?;
    assert_mentions(
        &load_err(missing.path(), 2),
        &["model.layers.1.mlp.up_proj.weight"],
    );

    let ok = tiny_checkpoint(&GQA)?;
    assert_mentions(&load_err(ok.path(), 7), &["7", "6", "num_attention_heads"]);

    let mut c = config_json(&GQA);
    c["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    let arch = tempfile::tempdir()?;
    write_checkpoint(arch.path(), &c, &tensors(&GQA)?)?;
    assert_mentions(
        &load_err(arch.path(), 1),
        &["GPT2LMHeadModel", "config.json"],
    );

    let mut c = config_json(&GQA);
    c.as_object_mut()
        .context("config object")?
        .remove("rope_theta");
    let theta = tempfile::tempdir()?;
    write_checkpoint(theta.path(), &c, &tensors(&GQA)?)?;
    assert_mentions(&load_err(theta.path(), 1), &["rope_theta", "config.json"]);

    // rope_theta inside rope_parameters (transformers 5) is read.
    let mut c = config_json(&GQA);
    c.as_object_mut()
        .context("config object")?
        .remove("rope_theta");
    c["rope_parameters"] = serde_json::json!({"rope_theta": 10000.0, "rope_type": "default"});
    let nested = tempfile::tempdir()?;
    write_checkpoint(nested.path(), &c, &tensors(&GQA)?)?;
    assert_eq!(load_err(nested.path(), 2), "<loaded without error>");

    // Sliding windows: Qwen2's per-layer windows are refused, a zero window is an error.
    let mut c = config_json(&QWEN2);
    c["use_sliding_window"] = true.into();
    let qwen_window = tempfile::tempdir()?;
    write_checkpoint(qwen_window.path(), &c, &tensors(&QWEN2)?)?;
    assert_mentions(
        &load_err(qwen_window.path(), 1),
        &["use_sliding_window", "Qwen2"],
    );
    let mut c = config_json(&MISTRAL);
    c["sliding_window"] = 0.into();
    let zero_window = tempfile::tempdir()?;
    write_checkpoint(zero_window.path(), &c, &tensors(&MISTRAL)?)?;
    assert_mentions(&load_err(zero_window.path(), 1), &["sliding_window = 0"]);
    Ok(())
}

fn smollm2_dir() -> Result<PathBuf> {
    let dir = candle_tp::models::models_dir()?.join("smollm2-135m-instruct");
    if !dir.join("config.json").is_file() || !dir.join("model.safetensors").is_file() {
        bail!(
            "the converted SmolLM2 checkpoint is missing from {}: run scripts/fetch-models.sh",
            dir.display()
        );
    }
    Ok(dir)
}

/// candle-transformers' config for SmolLM2, read from config.json independently of ours
/// (its own parser would default rope_theta, which transformers 5 nests in rope_parameters).
fn smollm2_reference_config(dir: &Path) -> Result<ref_llama::Config> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)?;
    let theta = v["rope_theta"]
        .as_f64()
        .or_else(|| v["rope_parameters"]["rope_theta"].as_f64())
        .context("rope_theta")?;
    let mut obj = v.clone();
    obj["rope_theta"] = serde_json::json!(theta);
    if let Some(o) = obj.as_object_mut() {
        o.remove("rope_parameters");
    }
    let cfg: ref_llama::LlamaConfig = serde_json::from_value(obj)?;
    let cfg = cfg.into_config(false);
    let head_dim = v["head_dim"].as_u64().map(|d| d as usize);
    if head_dim.is_some_and(|d| d * cfg.num_attention_heads != cfg.hidden_size) {
        bail!("candle-transformers' llama assumes head_dim = hidden_size / heads");
    }
    Ok(cfg)
}

#[test]
fn smollm2_matches_candle_transformers_at_world_1_2_3() -> Result<()> {
    let dir = smollm2_dir()?;
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
        .map_err(|e| anyhow::anyhow!("tokenizer.json: {e}"))?;
    let enc = tok
        .encode("The capital of France is", false)
        .map_err(|e| anyhow::anyhow!("encode: {e}"))?;
    let prompt = enc.get_ids().to_vec();
    let cfg = smollm2_reference_config(&dir)?;
    check_against_reference(&dir, Some(cfg), &[1, 2, 3], &prompt, 32, 1e-3)
}
