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
//! without gathering them (all ranks draw the same token). With `--pp N` the ranks form N
//! pipeline stages of world / N tensor-parallel ranks each (consecutive ranks share a stage):
//! each stage holds its layers only, activations go from stage to stage, and the last stage
//! samples and sends the token back to the others. Rank 0 streams the text as it is
//! produced and ends with one JSON line: `world_size`, `pipeline_parallel_size`,
//! `layers` (each rank's), `prompt_tokens`, `generated_tokens`,
//! `token_ids`, `tokens_per_s` (decode), `prefill_ms` and `prefill_tokens_per_s` (the first
//! forward, over the whole prompt: prompt tokens / its time), `load_s`, `rss_bytes` (anonymous
//! resident memory of each rank after loading).

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_tp::generate::{DistributedSampler, SamplingParams};
use candle_tp::models::{CausalLm, FromCheckpoint, LoadOptions};
use candle_tp::ops::gather_from_tp;
use candle_tp::pipeline::PipelineStage;

#[path = "common/rss.rs"]
mod rss;
use candle_tp::text::{ChatMessage, ModelText, TextStream};
use candle_tp::ProcessGroup;
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rss::rss_anon_bytes;

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
    /// The prompt as token ids (`504,3575,282`), instead of `--prompt`: what another
    /// implementation is given, so that both read the same tokens whatever their tokenizers
    /// add (a BOS, a space).
    #[arg(long, value_delimiter = ',', conflicts_with = "chat")]
    prompt_ids: Option<Vec<u32>>,
    /// Render the prompt with the checkpoint's chat template (tokenizer_config.json).
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most (generation also stops at an end-of-sequence token).
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// Keep generating past an end-of-sequence token, to `--max-new-tokens` (llama.cpp's
    /// `--ignore-eos`).
    #[arg(long)]
    ignore_eos: bool,
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
    /// The first rank of the last pipeline stage (rank 0 without a pipeline) writes the full
    /// logits of the prompt's last position here: a JSON array if the name ends in .json,
    /// else raw little-endian f32.
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// Pipeline stages: the ranks split into this many stages of layers, each stage's layers
    /// split over world / N tensor-parallel ranks.
    #[arg(long, visible_alias = "pipeline-parallel-size", default_value_t = 1)]
    pp: usize,
    /// Layers per pipeline stage (`10,10,10`), instead of as even as possible.
    #[arg(long, value_delimiter = ',')]
    pp_layers: Option<Vec<usize>>,
    /// Mixture-of-experts layers expert-parallel in N groups of the tensor-parallel ranks
    /// (`--ep` alone: one group per rank): each group holds whole experts (a share of them),
    /// split over its ranks, instead of every expert split across every rank; with one rank
    /// per group, tokens can go to their experts' ranks by all-to-all. Dense models ignore it.
    #[arg(long, num_args = 0..=1, default_missing_value = "0", value_name = "N")]
    ep: Option<usize>,
}

fn default_model_dir() -> Result<PathBuf> {
    Ok(candle_tp::models::models_dir()?.join("smollm2-135m-instruct"))
}

fn parse_device(s: &str) -> Result<Device> {
    // "cpu", or "cuda" (the GPU of LOCAL_RANK; a build without the cuda feature says how to
    // rebuild).
    Ok(candle_tp::device_from_arg(s)?)
}

/// Rank 0's text side (tokenizer, chat template: `candle_tp::text`, as the server's), prompt
/// ids and end-of-sequence ids.
fn prepare(args: &Args, dir: &Path, model: &CausalLm) -> Result<(ModelText, Vec<u32>, Vec<u32>)> {
    let text = ModelText::load(dir)?;
    let ids = if let Some(ids) = &args.prompt_ids {
        let vocab = model.config().vocab_size;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            bail!("--prompt-ids: token {bad} is not in the model's vocabulary of {vocab}");
        }
        ids.clone()
    } else if args.chat {
        let user = ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
            extra: Default::default(),
        };
        let rendered = text
            .render_chat(&[user])
            .context("--chat needs the checkpoint's chat template")?;
        text.encode(&rendered, false)?
    } else {
        text.encode(&args.prompt, true)?
    };
    if ids.is_empty() {
        bail!("the prompt {:?} has no tokens", args.prompt);
    }
    let eos = if args.ignore_eos {
        Vec::new()
    } else {
        text.eos_ids(&model.config().eos_token_ids)
    };
    Ok((text, ids, eos))
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

/// Prints the generated text as it becomes decodable.
struct Streamer {
    text: ModelText,
    stream: TextStream,
}

impl Streamer {
    fn push(&mut self, id: u32) -> Result<()> {
        print!("{}", self.stream.push(&self.text, id)?);
        std::io::stdout().flush()?;
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        print!("{}", self.stream.finish(&self.text)?);
        Ok(())
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    // The same kernels as candle-tp-serve, so a prompt decoded here and through the server
    // gets the same tokens.
    candle_tp::set_batch_invariant_matmul(true);
    // Freed op outputs stay in the process for the next forward (no page faults).
    candle_tp::retain_freed_memory();
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
    let (stage, tp) = PipelineStage::from_option(&pg, args.pp, args.pp_layers.clone())?;
    let options = LoadOptions {
        progress: Some(progress),
        pipeline: stage,
        expert_parallel: args.ep,
    };
    let mut model = CausalLm::from_path_with(&dir, dtype, &device, tp.clone(), options)
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
    let range = model.layer_range();
    let mut layers = vec![0u32; 2 * pg.size()];
    pg.all_gather_slice(&[range.start as u32, range.end as u32], &mut layers)?;

    let (mut streamer, ids, eos) = if pg.rank() == 0 {
        let (text, ids, eos) = prepare(&args, &dir, &model)?;
        let stream = TextStream::new(Vec::new());
        (Some(Streamer { text, stream }), ids, eos)
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
    let mut logits = model.forward_stage(&x, 0)?;
    let prefill_s = t_prefill.elapsed().as_secs_f64();
    if let (Some(path), Some(l), Some(head)) = (&args.logits_out, &logits, model.lm_head()) {
        let full = gather_from_tp(l, &tp, head.partition())?;
        if tp.rank() == 0 {
            write_logits(path, &full)?;
        }
    }
    let mut generated: Vec<u32> = Vec::new();
    let mut pos = prompt.len();
    let mut t_decode = None;
    while generated.len() < args.max_new_tokens {
        let next = sampler.sample_stage(logits.as_ref(), &model)?;
        generated.push(next);
        if let Some(s) = streamer.as_mut() {
            s.push(next)?;
        }
        if eos.contains(&next) || generated.len() == args.max_new_tokens || pos + 1 >= max_pos {
            break;
        }
        if t_decode.is_none() {
            t_decode = Some(Instant::now());
        }
        let x = Tensor::new(&[next], &device)?.unsqueeze(0)?;
        logits = model.forward_stage(&x, pos)?;
        pos += 1;
    }
    // Decode speed: the tokens after the first (the first comes from the prompt pass).
    let tokens_per_s = match t_decode {
        Some(t) if generated.len() > 1 => (generated.len() - 1) as f64 / t.elapsed().as_secs_f64(),
        _ => 0.0,
    };
    if let Some(s) = streamer.as_mut() {
        s.finish()?;
    }
    if pg.rank() == 0 {
        println!();
        let report = serde_json::json!({
            "world_size": pg.size(),
            "pipeline_parallel_size": args.pp,
            "layers": layers.chunks(2).map(|r| [r[0], r[1]]).collect::<Vec<_>>(),
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
