//! Text generation with a tensor-parallel decoder of any supported family (Llama, Mistral,
//! Qwen2/3, Qwen3-MoE, Gemma 2/3, Phi-3, Mixtral: `config.json` `architectures` picks it;
//! SmolLM2-135M-Instruct by default).
//!
//! ```text
//! cargo run --release --example generate -- --prompt "The capital of France is"
//! cargo build --release --bin tprun --example generate
//! target/release/tprun --standalone --nproc-per-node 2 target/release/examples/generate \
//!     --chat --prompt "What is tensor parallelism?" --max-new-tokens 64
//! ```
//!
//! Every rank loads only its share of the weights. Rank 0 tokenizes the prompt (rendering the
//! checkpoint's chat template with `--chat`) and sends the ids to the others; every rank runs
//! the same decode loop, and the next token is drawn from the vocabulary-parallel logits
//! without gathering them (all ranks draw the same token). Rank 0 streams the text as it is
//! produced and ends with one JSON line: `world_size`, `prompt_tokens`, `generated_tokens`,
//! `token_ids`, `tokens_per_s` (decode), `prefill_ms` and `prefill_tokens_per_s` (the first
//! forward, over the whole prompt: prompt tokens / its time), `load_s`, `rss_bytes` (anonymous
//! resident memory of each rank after loading).

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_tp::chat_template::{special_token, ChatInput, ChatTemplate, Value};
use candle_tp::generate::{DistributedSampler, SamplingParams};
use candle_tp::models::CausalLm;
use candle_tp::ops::gather_from_tp;
use candle_tp::ProcessGroup;
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokenizers::Tokenizer;

#[derive(Parser, Debug)]
#[command(
    about = "Text generation with a tensor-parallel decoder (Llama, Qwen, Gemma, Phi-3, Mixtral families)"
)]
struct Args {
    /// Model directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json),
    /// or a llama.cpp `.gguf` file (quantized weights kept quantized, tokenizer and chat
    /// template from its metadata). Default: $CANDLE_TP_HOME/models/smollm2-135m-instruct ($CANDLE_TP_HOME defaults to
    /// ~/.cache/candle-tp).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt (the user message with --chat).
    #[arg(long, default_value = "Tensor parallelism splits a model")]
    prompt: String,
    /// Render the prompt with the checkpoint's chat template (tokenizer_config.json).
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most (generation also stops at an end-of-sequence token).
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Sample only among the k most likely tokens.
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample only among the most likely tokens whose probability reaches p.
    #[arg(long)]
    top_p: Option<f64>,
    /// Seed of the sampler (the same on every rank).
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
    /// Device: cpu.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weight dtype: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Rank 0 writes the full logits of the prompt's last position here: a JSON array if the
    /// name ends in .json, else raw little-endian f32.
    #[arg(long)]
    logits_out: Option<PathBuf>,
}

fn default_model_dir() -> Result<PathBuf> {
    Ok(candle_tp::models::models_dir()?.join("smollm2-135m-instruct"))
}

fn parse_device(s: &str) -> Result<Device> {
    // "cpu", or "cuda" (the GPU of LOCAL_RANK; a build without the cuda feature says how to
    // rebuild).
    Ok(candle_tp::device_from_arg(s)?)
}

/// This process's anonymous resident memory (`RssAnon` of /proc/self/status), in bytes.
fn rss_anon_bytes() -> Result<i64> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("RssAnon:"))
        .context("no RssAnon line in /proc/self/status")?;
    let kb: i64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("cannot parse {line:?}"))?;
    Ok(kb * 1024)
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The tokenizer, the `tokenizer_config.json` settings (special tokens, chat template) and a
/// `chat_template.jinja` to fall back on: from a model directory's files, or built from a
/// GGUF file's metadata.
fn load_tokenizer(model: &Path) -> Result<(Tokenizer, serde_json::Value, PathBuf)> {
    if model
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        let src = candle_tp::loader::GgufSource::open(model)?;
        let json = serde_json::to_vec(&src.tokenizer().tokenizer_json()?)?;
        let tok = Tokenizer::from_bytes(json)
            .map_err(|e| anyhow!("{}: building the tokenizer: {e}", model.display()))?;
        let cfg = src
            .tokenizer()
            .tokenizer_config_json(src.config().max_position_embeddings);
        return Ok((tok, cfg, model.with_extension("jinja")));
    }
    let tok_path = model.join("tokenizer.json");
    let tok = Tokenizer::from_file(&tok_path)
        .map_err(|e| anyhow!("loading {}: {e}", tok_path.display()))?;
    let tc = model.join("tokenizer_config.json");
    let cfg = if tc.is_file() {
        read_json(&tc)?
    } else {
        serde_json::Value::Null
    };
    Ok((tok, cfg, model.join("chat_template.jinja")))
}

/// The checkpoint's chat template applied to one user message, with the generation prompt
/// (rendered as transformers renders it: `candle_tp::chat_template`, as the server does).
fn render_chat(
    cfg: &serde_json::Value,
    jinja: &Path,
    model: &Path,
    prompt: &str,
) -> Result<String> {
    let origin = if model.is_dir() {
        model.join("tokenizer_config.json")
    } else {
        model.to_path_buf()
    };
    let template = ChatTemplate::from_tokenizer_config(cfg, &origin, jinja)
        .context("--chat needs the checkpoint's chat template")?;
    let user = Value::from_serialize(serde_json::json!({"role": "user", "content": prompt}));
    Ok(template.render(&ChatInput::new(vec![user]))?)
}

/// Rank 0's prompt ids and end-of-sequence ids.
fn prepare(args: &Args, dir: &Path, model: &CausalLm) -> Result<(Tokenizer, Vec<u32>, Vec<u32>)> {
    let (tok, cfg, jinja) = load_tokenizer(dir)?;
    let (text, add_special) = if args.chat {
        (render_chat(&cfg, &jinja, dir, &args.prompt)?, false)
    } else {
        (args.prompt.clone(), true)
    };
    let ids = tok
        .encode(text.as_str(), add_special)
        .map_err(|e| anyhow!("tokenizing the prompt: {e}"))?
        .get_ids()
        .to_vec();
    if ids.is_empty() {
        bail!("the prompt {:?} has no tokens", args.prompt);
    }
    let mut eos = model.config().eos_token_ids.clone();
    if let Some(id) = special_token(&cfg, "eos_token").and_then(|t| tok.token_to_id(&t)) {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    Ok((tok, ids, eos))
}

/// Sends rank 0's `ids` and `eos` to every rank.
fn share(pg: &ProcessGroup, ids: Vec<u32>, eos: Vec<u32>) -> Result<(Vec<u32>, Vec<u32>)> {
    let mut n = [ids.len() as u32, eos.len() as u32];
    pg.broadcast_slice(&mut n, 0)?;
    let mut flat = if pg.rank() == 0 {
        [ids, eos].concat()
    } else {
        vec![0; (n[0] + n[1]) as usize]
    };
    pg.broadcast_slice(&mut flat, 0)?;
    let eos = flat.split_off(n[0] as usize);
    Ok((flat, eos))
}

fn write_logits(path: &Path, logits: &Tensor) -> Result<()> {
    let v: Vec<f32> = logits.flatten_all()?.to_vec1()?;
    let bytes = if path.extension().is_some_and(|e| e == "json") {
        serde_json::to_vec(&v)?
    } else {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    };
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// Prints the newly decodable part of the generated text.
struct Streamer {
    tok: Tokenizer,
    printed: usize,
}

impl Streamer {
    fn push(&mut self, ids: &[u32]) -> Result<()> {
        let text = self
            .tok
            .decode(ids, true)
            .map_err(|e| anyhow!("decoding: {e}"))?;
        if text.ends_with('\u{FFFD}') {
            return Ok(()); // an incomplete UTF-8 sequence: wait for the next token
        }
        if let Some(new) = text.get(self.printed..) {
            print!("{new}");
            std::io::stdout().flush()?;
            self.printed = text.len();
        }
        Ok(())
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    // The same kernels as candle-tp-serve, so a prompt decoded here and through the server
    // gets the same tokens.
    candle_tp::set_batch_invariant_matmul(true);
    let device = parse_device(&args.device)?;
    let dtype = candle_tp::dtype_from_arg(&args.dtype)?;
    let pg = candle_tp::init_from_env(&device)?;
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => default_model_dir()?,
    };
    let t0 = Instant::now();
    // Rank 0's tensors as a progress bar, on a terminal only (under tprun stderr is a pipe).
    let bar = if pg.rank() == 0 && std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} loading tensor {pos}/{len}  {msg}  {elapsed}")
            .map_err(|e| anyhow!("progress bar template: {e}"))?,
    );
    let shown = bar.clone();
    let progress = Arc::new(move |done: usize, total: usize, name: &str| {
        shown.set_length(total as u64);
        shown.set_position(done as u64);
        shown.set_message(name.to_string());
    });
    let mut model = CausalLm::from_path_with_progress(&dir, dtype, &device, pg.clone(), progress)
        .with_context(|| {
        format!(
            "loading {} on rank {} of {}",
            dir.display(),
            pg.rank(),
            pg.size()
        )
    })?;
    bar.finish_and_clear();
    let load_s = t0.elapsed().as_secs_f64();
    let mut rss = vec![0i64; pg.size()];
    pg.all_gather_slice(&[rss_anon_bytes()?], &mut rss)?;

    let (mut streamer, ids, eos) = if pg.rank() == 0 {
        let (tok, ids, eos) = prepare(&args, &dir, &model)?;
        (Some(Streamer { tok, printed: 0 }), ids, eos)
    } else {
        (None, Vec::new(), Vec::new())
    };
    let (prompt, eos) = share(&pg, ids, eos)?;
    let max_pos = model.config().max_position_embeddings;
    if prompt.len() >= max_pos {
        bail!(
            "the prompt has {} tokens, the model at most {max_pos}",
            prompt.len()
        );
    }

    let mut sampler = DistributedSampler::new(SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    });
    let t_prefill = Instant::now();
    let x = Tensor::new(prompt.as_slice(), &device)?.unsqueeze(0)?;
    let mut logits = model.forward(&x, 0)?.squeeze(0)?;
    let prefill_s = t_prefill.elapsed().as_secs_f64();
    if let Some(path) = &args.logits_out {
        let full = gather_from_tp(&logits, &pg, model.lm_head().partition())?;
        if pg.rank() == 0 {
            write_logits(path, &full)?;
        }
    }
    let mut generated: Vec<u32> = Vec::new();
    let mut pos = prompt.len();
    let mut t_decode = None;
    while generated.len() < args.max_new_tokens {
        let next = sampler.sample(&logits, model.lm_head())?;
        generated.push(next);
        if let Some(s) = streamer.as_mut() {
            s.push(&generated)?;
        }
        if eos.contains(&next) || generated.len() == args.max_new_tokens || pos + 1 >= max_pos {
            break;
        }
        if t_decode.is_none() {
            t_decode = Some(Instant::now());
        }
        let x = Tensor::new(&[next], &device)?.unsqueeze(0)?;
        logits = model.forward(&x, pos)?.squeeze(0)?;
        pos += 1;
    }
    // Decode speed: the tokens after the first (the first comes from the prompt pass).
    let tokens_per_s = match t_decode {
        Some(t) if generated.len() > 1 => (generated.len() - 1) as f64 / t.elapsed().as_secs_f64(),
        _ => 0.0,
    };
    if pg.rank() == 0 {
        println!();
        let report = serde_json::json!({
            "world_size": pg.size(),
            "prompt_tokens": prompt.len(),
            "generated_tokens": generated.len(),
            "token_ids": generated,
            "tokens_per_s": tokens_per_s,
            "prefill_ms": prefill_s * 1e3,
            "prefill_tokens_per_s": prompt.len() as f64 / prefill_s,
            "load_s": load_s,
            "rss_bytes": rss,
            "backend": if cfg!(feature = "mkl") { "mkl" } else { "gemm" },
            "threads_per_rank": candle_core::utils::get_num_threads(),
        });
        println!("{report}");
    }
    Ok(())
}
