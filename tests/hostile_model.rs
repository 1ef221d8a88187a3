//! Hostile checkpoints at the model level: a `config.json` that disagrees with the weights
//! (sizes, layer count, dtype), or asks for absurd sizes, gives an error that names the tensor
//! (or the config key) and both sizes: never a panic or a huge allocation. The header-level
//! cases (offsets, header lengths, overflowing shapes, index paths) are in
//! `tests/loader_safetensors.rs`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_tp::models::FromCheckpoint;
use candle_tp::models::Llama;
use candle_tp::{run_threads, ProcessGroup};

const HIDDEN: usize = 32;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const INTER: usize = 48;
const VOCAB: usize = 64;
const LAYERS: usize = 2;

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Result<Self> {
        let n = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "candle-tp-hostile-{tag}-{}-{n}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "vocab_size": VOCAB,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "tie_word_embeddings": true,
        "hidden_act": "silu",
    })
}

fn weights() -> Result<HashMap<String, Tensor>> {
    let hd = HIDDEN / HEADS;
    let dev = Device::Cpu;
    let w = |shape: &[usize]| Tensor::ones(shape, DType::F32, &dev);
    let mut m = HashMap::new();
    m.insert("model.embed_tokens.weight".into(), w(&[VOCAB, HIDDEN])?);
    m.insert("model.norm.weight".into(), w(&[HIDDEN])?);
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("self_attn.q_proj.weight", vec![HEADS * hd, HIDDEN]),
            ("self_attn.k_proj.weight", vec![KV_HEADS * hd, HIDDEN]),
            ("self_attn.v_proj.weight", vec![KV_HEADS * hd, HIDDEN]),
            ("self_attn.o_proj.weight", vec![HIDDEN, HEADS * hd]),
            ("mlp.gate_proj.weight", vec![INTER, HIDDEN]),
            ("mlp.up_proj.weight", vec![INTER, HIDDEN]),
            ("mlp.down_proj.weight", vec![HIDDEN, INTER]),
            ("input_layernorm.weight", vec![HIDDEN]),
            ("post_attention_layernorm.weight", vec![HIDDEN]),
        ] {
            m.insert(format!("{p}.{name}"), w(&shape)?);
        }
    }
    Ok(m)
}

fn write_model(dir: &Path, cfg: &serde_json::Value, w: &HashMap<String, Tensor>) -> Result<()> {
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(cfg)?)?;
    candle_core::safetensors::save(w, dir.join("model.safetensors"))?;
    Ok(())
}

/// The error of loading `dir` on `world` ranks (every rank must fail), as text.
fn load_error(dir: &Path, world: usize) -> String {
    let dir = dir.to_path_buf();
    let result = if world == 1 {
        Llama::from_dir(&dir, DType::F32, &Device::Cpu, ProcessGroup::single()).map(|_| vec![()])
    } else {
        run_threads(world, move |pg| {
            Llama::from_dir(&dir, DType::F32, &Device::Cpu, pg).map(|_| ())
        })
    };
    match result {
        Ok(_) => panic!("loading a hostile checkpoint on {world} rank(s) succeeded"),
        Err(e) => format!("{e:#}"),
    }
}

fn assert_mentions(msg: &str, words: &[&str]) {
    for w in words {
        assert!(msg.contains(w), "error {msg:?} does not mention {w:?}");
    }
}

#[test]
fn the_valid_model_loads_on_one_and_two_ranks() -> Result<()> {
    let dir = TempDir::new("valid")?;
    write_model(&dir.0, &config(), &weights()?)?;
    Llama::from_dir(&dir.0, DType::F32, &Device::Cpu, ProcessGroup::single())?;
    let d = dir.0.clone();
    run_threads(2, move |pg| {
        Llama::from_dir(&d, DType::F32, &Device::Cpu, pg).map(|_| ())
    })?;
    Ok(())
}

#[test]
fn config_sizes_that_disagree_with_the_weights_name_the_tensor_and_both_shapes() -> Result<()> {
    let cases: &[(&str, serde_json::Value, &[&str])] = &[
        (
            "hidden_size",
            serde_json::json!(48),
            &["model.embed_tokens.weight", "[64, 32]", "[64, 48]"],
        ),
        (
            "vocab_size",
            serde_json::json!(80),
            &["model.embed_tokens.weight", "[64, 32]", "80"],
        ),
        (
            "intermediate_size",
            serde_json::json!(64),
            &["model.layers.0.mlp.", "[48, 32]", "64"],
        ),
        (
            "num_key_value_heads",
            serde_json::json!(4),
            &["model.layers.0.self_attn.k_proj.weight", "[16, 32]", "32"],
        ),
    ];
    for world in [1, 2] {
        for (key, value, words) in cases {
            let dir = TempDir::new(key)?;
            let mut cfg = config();
            cfg[*key] = value.clone();
            write_model(&dir.0, &cfg, &weights()?)?;
            let msg = load_error(&dir.0, world);
            assert_mentions(&msg, words);
        }
    }
    Ok(())
}

#[test]
fn more_layers_in_the_config_than_in_the_weights_names_the_missing_tensor() -> Result<()> {
    let dir = TempDir::new("layers")?;
    let mut cfg = config();
    cfg["num_hidden_layers"] = serde_json::json!(LAYERS + 1);
    write_model(&dir.0, &cfg, &weights()?)?;
    for world in [1, 2] {
        let msg = load_error(&dir.0, world);
        assert_mentions(&msg, &["model.layers.2.", "not in the checkpoint"]);
    }
    Ok(())
}

#[test]
fn weights_of_a_dtype_the_model_cannot_use_are_named() -> Result<()> {
    let dir = TempDir::new("dtype")?;
    let mut w = weights()?;
    let name = "model.layers.1.mlp.up_proj.weight";
    w.insert(
        name.into(),
        Tensor::zeros((INTER, HIDDEN), DType::I32, &Device::Cpu)?,
    );
    write_model(&dir.0, &config(), &w)?;
    for world in [1, 2] {
        let msg = load_error(&dir.0, world);
        assert_mentions(&msg, &[name, "I32", "not supported"]);
    }
    Ok(())
}

#[test]
fn absurd_config_sizes_are_refused_before_allocating() -> Result<()> {
    let cases: &[(&str, serde_json::Value, &[&str])] = &[
        (
            "max_position_embeddings",
            serde_json::json!(1u64 << 40),
            &["max_position_embeddings", "1099511627776"],
        ),
        (
            "hidden_size",
            serde_json::json!(1u64 << 40),
            // head_dim = hidden_size / heads = 2^38: refused by the RoPE bound.
            &["head_dim = 274877906944", "out of range"],
        ),
        (
            "num_attention_heads",
            serde_json::json!(0),
            &["num_attention_heads"],
        ),
        (
            "head_dim",
            serde_json::json!(1u64 << 40),
            &["head_dim = 1099511627776", "out of range"],
        ),
    ];
    for (key, value, words) in cases {
        let dir = TempDir::new(key)?;
        let mut cfg = config();
        cfg[*key] = value.clone();
        write_model(&dir.0, &cfg, &weights()?)?;
        let msg = load_error(&dir.0, 1);
        assert_mentions(&msg, words);
    }
    Ok(())
}
