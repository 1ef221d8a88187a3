//! Decode speed of the tensor-parallel Llama against candle-transformers' `llama`, on the
//! same checkpoint, prompt and thread count.
//!
//! ```text
//! RAYON_NUM_THREADS=2 target/release/examples/bench_generate --impl candle-transformers --model DIR
//! RAYON_NUM_THREADS=2 target/release/examples/bench_generate --impl candle-tp --model DIR
//! target/release/tprun --standalone --nproc-per-node 2 target/release/examples/bench_generate --model DIR
//! scripts/bench-generate.sh      # SmolLM2 and a synthetic 2048-wide Llama, ratios in one run
//! ```
//!
//! Greedy decoding from a fixed prompt of token ids (no tokenizer involved), prefill then
//! `--new-tokens` steps with the KV cache. Rank 0 prints one JSON line: `impl`, `world_size`,
//! `threads_per_rank`, `backend`, `prompt_tokens`, `new_tokens`, `prefill_ms`,
//! `tokens_per_s` (decode), `token_ids` (to check that both implementations agree).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_tp::generate::{DistributedSampler, SamplingParams};
use candle_tp::models::{Llama, LlamaConfig};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Decode tokens/s: candle-tp's TP Llama vs candle-transformers' llama")]
struct Args {
    /// Checkpoint directory (config.json + model.safetensors).
    #[arg(long)]
    model: PathBuf,
    /// `candle-tp` (any world size, under tprun) or `candle-transformers` (one process).
    #[arg(long = "impl", default_value = "candle-tp")]
    implementation: String,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// Tokens to decode.
    #[arg(long, default_value_t = 32)]
    new_tokens: usize,
}

fn prompt(len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + 13) % vocab.max(1)) as u32)
        .collect()
}

fn backend() -> &'static str {
    if cfg!(feature = "mkl") {
        "mkl"
    } else {
        "gemm"
    }
}

fn run_candle_tp(args: &Args) -> Result<(usize, f64, f64, Vec<u32>, bool)> {
    let device = Device::Cpu;
    let pg = candle_tp::init_from_env(&device)?;
    let mut model = Llama::from_dir(&args.model, DType::F32, &device, pg.clone())?;
    let vocab = model.config().vocab_size;
    let ids = prompt(args.prompt_len, vocab);
    let mut sampler = DistributedSampler::new(SamplingParams::greedy());
    let t0 = Instant::now();
    let input = Tensor::new(ids.as_slice(), &device)?.unsqueeze(0)?;
    let logits = model.forward(&input, 0)?;
    let mut next = sampler.sample(&logits.squeeze(0)?, model.lm_head())?;
    let prefill = t0.elapsed().as_secs_f64();
    let mut out = vec![next];
    pg.barrier()?;
    let t1 = Instant::now();
    for step in 1..args.new_tokens {
        let input = Tensor::new(&[next], &device)?.unsqueeze(0)?;
        let logits = model.forward(&input, args.prompt_len + step - 1)?;
        next = sampler.sample(&logits.squeeze(0)?, model.lm_head())?;
        out.push(next);
    }
    let decode = t1.elapsed().as_secs_f64();
    Ok((pg.size(), prefill, decode, out, pg.rank() == 0))
}

fn run_candle_transformers(args: &Args) -> Result<(usize, f64, f64, Vec<u32>, bool)> {
    use candle_transformers::models::llama as ct;
    let device = Device::Cpu;
    let text = std::fs::read_to_string(args.model.join("config.json")).context("config.json")?;
    // Reject configs candle-transformers would misread (the check our loader does too).
    let _ = LlamaConfig::from_json(&text, &args.model.join("config.json").display().to_string())?;
    let cfg: ct::LlamaConfig = serde_json::from_str(&text)?;
    let cfg = cfg.into_config(false);
    let files = vec![args.model.join("model.safetensors")];
    // SAFETY: the checkpoint is not modified while mapped.
    let vb =
        unsafe { candle_nn::VarBuilder::from_mmaped_safetensors(&files, DType::F32, &device)? };
    let model = ct::Llama::load(vb, &cfg)?;
    let mut cache = ct::Cache::new(true, DType::F32, &cfg, &device)?;
    let ids = prompt(args.prompt_len, cfg.vocab_size);
    let t0 = Instant::now();
    let input = Tensor::new(ids.as_slice(), &device)?.unsqueeze(0)?;
    let mut next = model
        .forward(&input, 0, &mut cache)?
        .squeeze(0)?
        .argmax(0)?
        .to_scalar::<u32>()?;
    let prefill = t0.elapsed().as_secs_f64();
    let mut out = vec![next];
    let t1 = Instant::now();
    for step in 1..args.new_tokens {
        let input = Tensor::new(&[next], &device)?.unsqueeze(0)?;
        next = model
            .forward(&input, args.prompt_len + step - 1, &mut cache)?
            .squeeze(0)?
            .argmax(0)?
            .to_scalar::<u32>()?;
        out.push(next);
    }
    Ok((1, prefill, t1.elapsed().as_secs_f64(), out, true))
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.new_tokens < 2 {
        bail!("--new-tokens must be at least 2 (the first token comes from the prefill)");
    }
    let (world, prefill, decode, ids, print) = match args.implementation.as_str() {
        "candle-tp" => run_candle_tp(&args)?,
        "candle-transformers" => run_candle_transformers(&args)?,
        other => bail!("--impl {other}: expected candle-tp or candle-transformers"),
    };
    if print {
        println!(
            "{}",
            serde_json::json!({
                "impl": args.implementation,
                "model": args.model.file_name().map(|s| s.to_string_lossy().into_owned()),
                "world_size": world,
                "threads_per_rank": candle_core::utils::get_num_threads(),
                "backend": backend(),
                "prompt_tokens": args.prompt_len,
                "new_tokens": args.new_tokens,
                "prefill_ms": prefill * 1e3,
                "tokens_per_s": (args.new_tokens - 1) as f64 / decode,
                "token_ids": ids,
            })
        );
    }
    Ok(())
}
