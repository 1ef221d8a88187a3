//! Batched decode speed: the server's decode step (`BatchDecoder`, continuous batching) at
//! several batch sizes, without HTTP, tokenizer or scheduler around it.
//!
//! ```text
//! target/release/tprun --standalone --nproc-per-node 2 target/release/examples/bench_batch_decode \
//!     --model ~/.cache/candle-tp/models/smollm2-135m-instruct.Q4_0.gguf --batch 1,8,16 --profile
//! ```
//!
//! For each batch size `B`, `B` greedy sequences with different prompts of `--prompt-len`
//! token ids join a fresh [`BatchDecoder`] (`--max-batch B`, as the server's), their prompts
//! are read (untimed), and then the steps that decode `--new-tokens` tokens for every
//! sequence are timed, all ranks starting together. Rank 0 prints one JSON line per batch
//! size: `batch`, `steps`, `step_ms`, `tokens_per_s` (generated tokens of all sequences per
//! second) and `x_batch_1` (its tokens/s over the first batch size's, same run); with
//! `--profile` also the step's split on rank 0: `matmul_ms` (every quantized or dense
//! product), `comm_ms` (the process group's collectives, waiting included) and `rest_ms`
//! (attention, norms, sampling, copies). `scripts/bench-serve.sh` measures the whole server.

use std::time::Instant;

use anyhow::{ensure, Result};
use candle_core::Device;
use candle_tp::generate::{BatchDecoder, SamplingParams, SeqOptions, SeqRequest};
use candle_tp::models::{CausalLm, FromCheckpoint, LoadOptions};
use candle_tp::pipeline::PipelineStage;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Batched decode tokens/s of the server's decode step at several batch sizes")]
struct Args {
    /// Checkpoint directory or `.gguf` file.
    #[arg(long)]
    model: std::path::PathBuf,
    /// Batch sizes, comma-separated; ratios are against the first.
    #[arg(long, value_delimiter = ',', default_value = "1,8,16")]
    batch: Vec<usize>,
    /// Prompt length in tokens (every sequence's; the ids differ between sequences).
    #[arg(long, default_value_t = 16)]
    prompt_len: usize,
    /// Tokens decoded per sequence (timed).
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Add the step's split on rank 0: matmuls, collectives and the rest.
    #[arg(long)]
    profile: bool,
    /// Precision of the KV cache: auto (the activations'), f32, f16 or bf16 (the server's
    /// `--kv-cache-dtype`).
    #[arg(long, default_value = "auto")]
    kv_cache_dtype: candle_tp::nn::KvCacheDtype,
}

/// `len` token ids of sequence `s`, spread over the vocabulary (no tokenizer involved).
fn prompt(s: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((s * 7919 + i * 104_729 + 17) % vocab.max(1)) as u32)
        .collect()
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        !args.batch.is_empty() && args.batch.iter().all(|&b| b > 0),
        "--batch needs batch sizes of at least 1, got {:?}",
        args.batch
    );
    ensure!(
        args.prompt_len > 0 && args.new_tokens > 1,
        "--prompt-len must be at least 1 and --new-tokens at least 2"
    );
    let device = Device::Cpu;
    // As the server: batch-invariant products.
    candle_tp::set_batch_invariant_matmul(true);
    let pg = candle_tp::init_from_env(&device)?;
    let (stage, tp) = PipelineStage::from_option(&pg, 1, None)?;
    let options = LoadOptions {
        progress: None,
        pipeline: stage,
        expert_parallel: None,
    };
    let mut model =
        CausalLm::from_path_with(&args.model, candle_core::DType::F32, &device, tp, options)?;
    model.set_kv_cache_dtype(args.kv_cache_dtype.0);
    let vocab = model.config().vocab_size;
    let max_seq_len = args.prompt_len + args.new_tokens + 1;
    let mut base = None;
    for &b in &args.batch {
        let mut dec = BatchDecoder::new(b, max_seq_len, 64)?;
        for s in 0..b {
            dec.add(
                &model,
                SeqRequest {
                    id: s as u64,
                    prompt: prompt(s, args.prompt_len, vocab),
                    max_tokens: args.new_tokens,
                    min_tokens: args.new_tokens,
                    params: SamplingParams::greedy(),
                    stop_ids: Vec::new(),
                    options: SeqOptions::default(),
                },
            )?;
        }
        // The prompts, until every sequence has its first token (a step may also decode a
        // second token of a sequence whose prompt was read first: counted here, untimed).
        let (mut first, mut started) = (0, std::collections::HashSet::new());
        while started.len() < b {
            let events = dec.step(&mut model)?;
            first += events.len();
            started.extend(events.iter().map(|e| e.id));
        }
        pg.barrier()?;
        candle_tp::set_matmul_timing(args.profile);
        let (mm0, comm0) = (candle_tp::matmul_time(), model.comm_stats());
        let t0 = Instant::now();
        let (mut steps, mut tokens) = (0usize, 0usize);
        while !dec.is_empty() {
            tokens += dec.step(&mut model)?.len();
            steps += 1;
        }
        let secs = t0.elapsed().as_secs_f64();
        candle_tp::set_matmul_timing(false);
        ensure!(
            first + tokens == b * args.new_tokens,
            "batch {b}: {} tokens decoded, {} expected",
            first + tokens,
            b * args.new_tokens
        );
        let tok_s = tokens as f64 / secs;
        let base = *base.get_or_insert(tok_s);
        let step_ms = secs / steps as f64 * 1e3;
        let mut line = serde_json::json!({
            "batch": b, "world_size": pg.size(), "steps": steps,
            "step_ms": step_ms, "tokens_per_s": tok_s, "x_batch_1": tok_s / base,
        });
        if args.profile {
            let per_step = |s: f64| s / steps as f64 * 1e3;
            let mm = per_step((candle_tp::matmul_time() - mm0).as_secs_f64());
            let comm = per_step(model.comm_stats().since(&comm0).total().time.as_secs_f64());
            line["matmul_ms"] = mm.into();
            line["comm_ms"] = comm.into();
            line["rest_ms"] = (step_ms - mm - comm).into();
        }
        if pg.rank() == 0 {
            println!("{line}");
        }
    }
    Ok(())
}
