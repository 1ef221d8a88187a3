//! Decode speed of the tensor-parallel Llama against candle-transformers' `llama`, on the
//! same checkpoint, prompt and thread count.
//!
//! ```text
//! RAYON_NUM_THREADS=2 target/release/examples/bench_generate --impl candle-transformers --model DIR
//! RAYON_NUM_THREADS=2 target/release/examples/bench_generate --impl candle-tp --model DIR
//! target/release/tprun --standalone --nproc-per-node 2 target/release/examples/bench_generate --model DIR
//! scripts/bench-generate.sh      # SmolLM2 and a synthetic 2048-wide Llama, ratios in one run
//! RAYON_NUM_THREADS=2 target/release/examples/bench_generate --impl quantized_llama --model F.gguf
//! target/release/tprun --standalone --nproc-per-node 2 target/release/examples/bench_generate --model F.gguf --profile
//! scripts/bench-generate.sh --gguf [--llama-cpp]   # quantized: candle-tp, quantized_llama, f32, llama.cpp
//! ```
//!
//! `--dtype bf16|f16` runs a checkpoint directory in half precision (both implementations).
//! `--device cuda` runs both on the GPU (a build with the `cuda` feature).
//! `--model` is a checkpoint directory or a `.gguf` file (candle-tp keeps its blocks quantized;
//! `--impl quantized_llama` is candle-transformers' quantized Llama on the same file).
//! `--profile` adds the decode step's split: time in matmuls (every `ParallelWeight`), in
//! collectives (the process group's counters) and the rest, per token, on rank 0; and each
//! `--prefill-lens` run's (`prefill.N.profile_ms`).
//!
//! Greedy decoding from a fixed prompt of token ids (no tokenizer involved), prefill then
//! `--new-tokens` steps with the KV cache. Rank 0 prints one JSON line: `impl`, `world_size`,
//! `threads_per_rank`, `backend`, `prompt_tokens`, `new_tokens`, `prefill_ms`,
//! `tokens_per_s` (decode), `token_ids` (to check that both implementations agree), and for
//! candle-tp `comm`: the world group's backend, collectives and payload bytes per decode
//! token, and the payload rank 0 handed to the network per token (`cross_host_bytes_per_token`;
//! every rank's together: `job_cross_host_bytes_per_token`).
//!
//! `--pp N` (candle-tp) runs the ranks as N pipeline stages of world / N tensor-parallel ranks,
//! as `generate --pp`; `comm` then counts the world's, the tensor-parallel group's and the
//! stages' group's traffic (activations handed on, tokens handed back).
//!
//! `--prefill-lens 128,512` (candle-tp) adds prompt-processing speed as `llama-bench`'s `pp N`
//! measures it: after one warm-up forward, for each N a forward over a fresh prompt of N
//! tokens from an empty KV cache, timed to the sampled first token (`prefill` in the JSON
//! line: `{"N": {"ms", "tokens_per_s"}}`); the decode run follows from an empty cache.
//! `scripts/bench-llama-cpp.sh` runs it against llama.cpp's `llama-bench`.
//!
//! For a `.gguf` file the line also holds `weight_bytes_per_token`: the bytes of the tensors
//! one decode step reads (every tensor once, but only one row of the token embedding where
//! the file has a separate `output.weight`), the whole model's, whatever the world size.
//! Times tokens/s, it is the weight traffic that `examples/bench_memory` bounds.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_tp::generate::{DistributedSampler, SamplingParams};
use candle_tp::models::{CausalLm, FromCheckpoint, LlamaConfig, LoadOptions};
use candle_tp::pipeline::PipelineStage;
use clap::Parser;

#[path = "common/progress.rs"]
mod progress;
#[path = "common/rss.rs"]
mod rss;

#[derive(Parser, Debug)]
#[command(about = "Decode tokens/s: candle-tp's TP Llama vs candle-transformers' llama")]
struct Args {
    /// Checkpoint directory (config.json + model.safetensors) or a `.gguf` file.
    #[arg(long)]
    model: PathBuf,
    /// `candle-tp` (any world size, under tprun), `candle-transformers` (one process, a
    /// directory) or `quantized_llama` (candle-transformers, one process, a `.gguf` file).
    #[arg(long = "impl", default_value = "candle-tp")]
    implementation: String,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// Tokens to decode.
    #[arg(long, default_value_t = 32)]
    new_tokens: usize,
    /// Report the decode step's time in matmuls, collectives and the rest (candle-tp).
    #[arg(long)]
    profile: bool,
    /// Weight and activation dtype of a checkpoint directory: f32, bf16 or f16 (candle-tp and
    /// candle-transformers; a `.gguf` file keeps its own types).
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    dtype: DType,
    /// Prompt lengths whose prefill (first forward from an empty cache) is timed on its own
    /// before the decode run, comma-separated (candle-tp only).
    #[arg(long, value_delimiter = ',')]
    prefill_lens: Vec<usize>,
    /// Pipeline stages (candle-tp): the ranks split into this many stages of layers, each
    /// stage's layers split over world / N tensor-parallel ranks (as `generate --pp`).
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
    /// `cpu`, or `cuda` (the GPU of LOCAL_RANK; needs the `cuda` feature), for candle-tp and
    /// candle-transformers alike.
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    match s {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        other => Err(format!("{other}: expected f32, bf16 or f16")),
    }
}

/// Per decode token on this rank: matmul, collective and total milliseconds.
type Profile = Option<(f64, f64, f64)>;

/// Each `--prefill-lens` run.
/// `(prompt length, seconds, with --profile the seconds in matmuls and in collectives)`.
type Prefills = Vec<(usize, f64, Option<(f64, f64)>)>;

/// Times a prefill of each of `lens` tokens from an empty KV cache (after one warm-up
/// forward), every rank starting together; the cache is left empty.
fn timed_prefills(
    device: &Device,
    model: &mut CausalLm,
    sampler: &mut DistributedSampler,
    pg: &candle_tp::ProcessGroup,
    lens: &[usize],
    profile: bool,
) -> Result<Prefills> {
    let vocab = model.config().vocab_size;
    let max_pos = model.config().max_position_embeddings;
    if let Some(&n) = lens.iter().find(|&&n| n == 0 || n > max_pos) {
        bail!("--prefill-lens {n}: expected 1..={max_pos} (the model's max_position_embeddings)");
    }
    let mut run = |n: usize| -> Result<(f64, Option<(f64, f64)>)> {
        model.clear_kv_cache();
        let ids = prompt(n, vocab);
        pg.barrier()?;
        candle_tp::set_matmul_timing(profile);
        let (mm0, comm0) = (candle_tp::matmul_time(), model.comm_stats());
        let t0 = Instant::now();
        let input = Tensor::new(ids.as_slice(), device)?.unsqueeze(0)?;
        let logits = model.forward_stage(&input, 0)?;
        sampler.sample_stage(logits.as_ref(), model)?;
        let seconds = t0.elapsed().as_secs_f64();
        candle_tp::set_matmul_timing(false);
        let split = profile.then(|| {
            let mm = (candle_tp::matmul_time() - mm0).as_secs_f64();
            (
                mm,
                model.comm_stats().since(&comm0).total().time.as_secs_f64(),
            )
        });
        Ok((seconds, split))
    };
    if !lens.is_empty() {
        run(lens[0].min(32))?; // warm-up, as llama-bench's
    }
    let out = lens
        .iter()
        .map(|&n| {
            let (seconds, split) = run(n)?;
            Ok((n, seconds, split))
        })
        .collect::<Result<Prefills>>()?;
    model.clear_kv_cache();
    Ok(out)
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

/// The decode loop's progress bar (a terminal only; an atomic add per token otherwise).
fn decode_bar(args: &Args, show: bool) -> progress::Bar {
    let bar = progress::Bar::new(args.new_tokens - 1, "token", show);
    bar.set_message(format!("{} decode", args.implementation));
    bar
}

/// What one implementation measured: world size, prefill and decode seconds, the greedy
/// tokens, whether this process prints, the decode profile and the `--prefill-lens` runs.
type Measured = (usize, f64, f64, Vec<u32>, bool, Profile, Prefills, Comm);

/// What rank 0's world group moved per decode token (candle-tp): `backend`,
/// `collectives_per_token`, `bytes_per_token` (payload), `cross_host_bytes_per_token` (payload
/// handed to the network, zero on one host), and `rss_bytes` (every rank's anonymous memory
/// once loaded, which `main` moves to the report's top level).
type Comm = Option<serde_json::Value>;

fn run_candle_tp(args: &Args) -> Result<Measured> {
    let device = candle_tp::device_from_arg(&args.device)?;
    // Prefill and decode as the server and examples/generate do (docs/PERFORMANCE.md,
    // "Batched decode").
    candle_tp::set_batch_invariant_matmul(true);
    let pg = candle_tp::init_from_env(&device)?;
    let (stage, tp) = PipelineStage::from_option(&pg, args.pp, args.pp_layers.clone())?;
    let options = LoadOptions {
        progress: None,
        pipeline: stage,
        expert_parallel: args.ep,
    };
    let mut model = CausalLm::from_path_with(&args.model, args.dtype, &device, tp, options)?;
    // Every rank's memory once loaded (before the KV cache grows).
    let mut rss = vec![0i64; pg.size()];
    pg.all_gather_slice(&[rss::rss_anon_bytes()?], &mut rss)?;
    let vocab = model.config().vocab_size;
    let ids = prompt(args.prompt_len, vocab);
    let mut sampler = DistributedSampler::new(SamplingParams::greedy());
    let prefills = timed_prefills(
        &device,
        &mut model,
        &mut sampler,
        &pg,
        &args.prefill_lens,
        args.profile,
    )?;
    let t0 = Instant::now();
    let input = Tensor::new(ids.as_slice(), &device)?.unsqueeze(0)?;
    let logits = model.forward_stage(&input, 0)?;
    let mut next = sampler.sample_stage(logits.as_ref(), &model)?;
    let prefill = t0.elapsed().as_secs_f64();
    let mut out = vec![next];
    pg.barrier()?;
    candle_tp::set_matmul_timing(args.profile);
    // The tensor-parallel group's and, on a pipeline, the stages' and the world's traffic.
    let (mm0, comm0) = (candle_tp::matmul_time(), model.comm_stats());
    let bar = decode_bar(args, pg.rank() == 0);
    let t1 = Instant::now();
    for step in 1..args.new_tokens {
        let input = Tensor::new(&[next], &device)?.unsqueeze(0)?;
        let logits = model.forward_stage(&input, args.prompt_len + step - 1)?;
        next = sampler.sample_stage(logits.as_ref(), &model)?;
        out.push(next);
        bar.inc();
    }
    let decode = t1.elapsed().as_secs_f64();
    bar.finish();
    candle_tp::set_matmul_timing(false);
    let steps = (args.new_tokens - 1) as f64;
    let moved = model.comm_stats().since(&comm0).total();
    let profile = args.profile.then(|| {
        let mm = (candle_tp::matmul_time() - mm0).as_secs_f64();
        let comm = moved.time.as_secs_f64();
        (mm / steps * 1e3, comm / steps * 1e3, decode / steps * 1e3)
    });
    // What every rank handed to the network: a pipeline's stages do not move the same.
    let mut each = vec![0i64; pg.size()];
    pg.all_gather_slice(&[moved.cross_host_bytes as i64], &mut each)?;
    let comm = serde_json::json!({
        "backend": pg.backend(),
        "pipeline_parallel_size": args.pp,
        "collectives_per_token": moved.calls as f64 / steps,
        "bytes_per_token": moved.payload_bytes as f64 / steps,
        "cross_host_bytes_per_token": moved.cross_host_bytes as f64 / steps,
        "job_cross_host_bytes_per_token": each.iter().sum::<i64>() as f64 / steps,
        // Hoisted to the report's top level by `main`.
        "rss_bytes": rss,
    });
    Ok((
        pg.size(),
        prefill,
        decode,
        out,
        pg.rank() == 0,
        profile,
        prefills,
        Some(comm),
    ))
}

fn run_quantized_llama(args: &Args) -> Result<Measured> {
    use candle_transformers::models::quantized_llama::ModelWeights;
    let device = candle_tp::device_from_arg(&args.device)?;
    let mut f = std::fs::File::open(&args.model)
        .with_context(|| format!("opening {}", args.model.display()))?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut f)?;
    let vocab = content
        .tensor_infos
        .get("token_embd.weight")
        .context("no token_embd.weight")?
        .shape
        .dims()[0];
    let mut model = ModelWeights::from_gguf(content, &mut f, &device)?;
    let ids = prompt(args.prompt_len, vocab);
    single_process_greedy(args, &ids, |x, pos| model.forward(x, pos))
}

/// Prefill `ids`, then greedy decode with `forward(input, index_pos)` (full logits
/// `[1, vocab]`), timing both: the loop of the single-process references.
fn single_process_greedy(
    args: &Args,
    ids: &[u32],
    mut forward: impl FnMut(&Tensor, usize) -> candle_core::Result<Tensor>,
) -> Result<Measured> {
    let device = candle_tp::device_from_arg(&args.device)?;
    let mut argmax = |x: &Tensor, pos: usize| -> Result<u32> {
        Ok(forward(x, pos)?.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?)
    };
    let t0 = Instant::now();
    let mut next = argmax(&Tensor::new(ids, &device)?.unsqueeze(0)?, 0)?;
    let prefill = t0.elapsed().as_secs_f64();
    let mut out = vec![next];
    let bar = decode_bar(args, true);
    let t1 = Instant::now();
    for step in 1..args.new_tokens {
        let input = Tensor::new(&[next], &device)?.unsqueeze(0)?;
        next = argmax(&input, args.prompt_len + step - 1)?;
        out.push(next);
        bar.inc();
    }
    let decode = t1.elapsed().as_secs_f64();
    bar.finish();
    Ok((1, prefill, decode, out, true, None, Vec::new(), None))
}

fn run_candle_transformers(args: &Args) -> Result<Measured> {
    use candle_transformers::models::llama as ct;
    let device = candle_tp::device_from_arg(&args.device)?;
    let text = std::fs::read_to_string(args.model.join("config.json")).context("config.json")?;
    // Reject configs candle-transformers would misread (the check our loader does too).
    let _ = LlamaConfig::from_json(&text, &args.model.join("config.json").display().to_string())?;
    let cfg: ct::LlamaConfig = serde_json::from_str(&text)?;
    let cfg = cfg.into_config(false);
    let files = vec![args.model.join("model.safetensors")];
    // SAFETY: the checkpoint is not modified while mapped.
    let vb =
        unsafe { candle_nn::VarBuilder::from_mmaped_safetensors(&files, args.dtype, &device)? };
    let model = ct::Llama::load(vb, &cfg)?;
    let mut cache = ct::Cache::new(true, args.dtype, &cfg, &device)?;
    let ids = prompt(args.prompt_len, cfg.vocab_size);
    single_process_greedy(args, &ids, |x, pos| model.forward(x, pos, &mut cache))
}

/// The bytes of the tensors one decode step of a GGUF model reads: every tensor once, except
/// the token embedding (one row) where the file has a separate `output.weight` (where it has
/// none, the LM head reads the embedding whole). `None` for a checkpoint directory.
fn weight_bytes_per_token(model: &std::path::Path) -> Result<Option<usize>> {
    if model.extension().and_then(|e| e.to_str()) != Some("gguf") {
        return Ok(None);
    }
    let file = std::fs::File::open(model).with_context(|| format!("opening {model:?}"))?;
    // SAFETY: read-only map of a file this process does not modify.
    let map = unsafe { memmap2::Mmap::map(&file) }?;
    let header = candle_tp::gguf::scan(&map, &model.to_string_lossy())?;
    let tied = !header.tensors.iter().any(|t| t.name == "output.weight");
    Ok(Some(
        header
            .tensors
            .iter()
            .map(|t| match t.name.as_str() {
                "token_embd.weight" if !tied => t.len / t.dims.first().copied().unwrap_or(1).max(1),
                _ => t.len,
            })
            .sum(),
    ))
}

fn main() -> Result<()> {
    let args = Args::parse();
    // As generate and candle-tp-serve: freed op outputs stay in the process for the next
    // forward (no page faults), for every implementation measured.
    candle_tp::retain_freed_memory();
    if args.new_tokens < 2 {
        bail!("--new-tokens must be at least 2 (the first token comes from the prefill)");
    }
    if !args.prefill_lens.is_empty() && args.implementation != "candle-tp" {
        bail!("--prefill-lens is measured for --impl candle-tp only");
    }
    let (world, prefill, decode, ids, print, profile, prefills, comm) =
        match args.implementation.as_str() {
            "candle-tp" => run_candle_tp(&args)?,
            "candle-transformers" => run_candle_transformers(&args)?,
            "quantized_llama" => run_quantized_llama(&args)?,
            other => {
                bail!("--impl {other}: expected candle-tp, candle-transformers or quantized_llama")
            }
        };
    if print {
        let mut report = serde_json::json!({
                "impl": args.implementation,
                "model": args.model.file_name().map(|s| s.to_string_lossy().into_owned()),
                "world_size": world,
                "expert_parallel": args.ep,
                "dtype": format!("{:?}", args.dtype).to_lowercase(),
                "device": args.device,
                "threads_per_rank": candle_core::utils::get_num_threads(),
                "backend": backend(),
                "prompt_tokens": args.prompt_len,
                "new_tokens": args.new_tokens,
                "prefill_ms": prefill * 1e3,
                "tokens_per_s": (args.new_tokens - 1) as f64 / decode,
                "token_ids": ids,
        });
        if !prefills.is_empty() {
            let map: serde_json::Map<String, serde_json::Value> = prefills
                .iter()
                .map(|&(n, s, split)| {
                    let mut v = serde_json::json!({"ms": s * 1e3, "tokens_per_s": n as f64 / s});
                    if let Some((mm, comm)) = split {
                        v["profile_ms"] = serde_json::json!({
                            "matmul": mm * 1e3,
                            "collectives": comm * 1e3,
                            "rest": (s - mm - comm) * 1e3,
                        });
                    }
                    (n.to_string(), v)
                })
                .collect();
            report["prefill"] = serde_json::Value::Object(map);
        }
        if let Some((mm, comm, total)) = profile {
            report["profile_ms_per_token"] = serde_json::json!({
                "matmul": mm,
                "collectives": comm,
                "rest": total - mm - comm,
                "total": total,
            });
        }
        if let Some(mut c) = comm {
            if let Some(rss) = c.as_object_mut().and_then(|o| o.remove("rss_bytes")) {
                report["rss_bytes"] = rss;
            }
            report["comm"] = c;
        }
        if let Some(bytes) = weight_bytes_per_token(&args.model)? {
            report["weight_bytes_per_token"] = bytes.into();
        }
        println!("{report}");
    }
    Ok(())
}
