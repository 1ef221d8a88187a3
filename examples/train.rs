//! Trains a small Llama-style byte-level language model with tensor, sequence and data
//! parallelism, on the project's own documentation (compiled in: no download).
//!
//! ```text
//! cargo build --release --bin tprun --example train
//! target/release/tprun --standalone --nproc-per-node 4 target/release/examples/train \
//!     --tp 2 --dp 2 --sequence-parallel --steps 50 --save /tmp/tiny-llama
//! target/release/examples/generate --model /tmp/tiny-llama --prompt "Tensor "
//! ```
//!
//! - Model: 4 layers, hidden 256, 8 heads, 4 KV heads, gated MLP 688 (flags change them);
//!   `--experts N --top-k K` makes every layer's MLP a Mixtral-style sparse MoE of N such
//!   MLPs, split over the tensor-parallel ranks or, with `--ep N`, whole in N groups of them.
//! - Tokenizer: bytes. Token id = byte value (vocabulary 256); the checkpoint gets a
//!   `tokenizer.json` (byte-level BPE with no merges) that maps text to the same ids, so
//!   `examples/generate` reads and writes text.
//! - Data: README.md and docs/*.md. Step `i` reads `--batch` windows of `--seq + 1` bytes at
//!   offsets drawn from `--seed` and `i`; DP rank `d` takes its `batch / dp` of them, so every
//!   layout sees the same global batch and logs the same loss as one process.
//! - Pipeline parallelism (`--pp N`): the layers split into N stages of world / (N · dp)
//!   tensor-parallel ranks each; every step runs the local batch as `--micro-batches`
//!   micro-batches through the `--schedule` (1F1B or GPipe) with gradient accumulation, and
//!   the tied embedding's gradients are summed between the first and the last stage. The last
//!   JSON line then reports each rank's peak activation bytes and idle fraction under the
//!   schedule, beside the bubble `(p - 1) / (m + p - 1)`.
//! - Output (rank 0): one JSON line per step `{"step","loss","tokens_per_s"}` (and
//!   `"router_aux_loss"`, the load-balancing part of the loss, with `--experts` and
//!   `--router-aux-loss-coef`) on stdout, a
//!   progress bar on stderr (indicatif; drawn only when stderr is a terminal, so not under
//!   tprun, whose ranks write to pipes), then `{"activation_bytes_per_rank": {...}}`: bytes of the
//!   tensors the autograd graph keeps for backward after one forward, with and without
//!   sequence parallelism, for every rank.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use candle_tp::pipeline::{train_step, Kind, MicroBatch, PipelineStage};
use candle_tp::train::{
    activation_bytes, all_reduce_grads, vocab_parallel_cross_entropy, Dropout, SplitMix64,
    TrainConfig, TrainInit, TrainLlama,
};
use candle_tp::{DeviceMesh, ReduceOp};
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

const CORPUS: [&str; 3] = [
    include_str!("../README.md"),
    include_str!("../docs/ARCHITECTURE.md"),
    include_str!("../docs/PARALLEL_MODES.md"),
];

#[derive(Parser, Debug)]
#[command(about = "Train a small Llama-style LM with TP, SP and DP")]
struct Args {
    /// Tensor-parallel size (default: world size / (dp · pp)).
    #[arg(long)]
    tp: Option<usize>,
    /// Pipeline stages (the slowest axis: a stage's TP group is consecutive ranks).
    #[arg(long, visible_alias = "pipeline-parallel-size", default_value_t = 1)]
    pp: usize,
    /// Micro-batches per step (each DP rank's batch is split into this many).
    #[arg(long, default_value_t = 1)]
    micro_batches: usize,
    /// Pipeline schedule: 1f1b or gpipe.
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Data-parallel size.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Sequence parallelism (Megatron-SP) in the tensor-parallel groups.
    #[arg(long)]
    sequence_parallel: bool,
    /// Optimizer steps.
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Seed of the initialisation, the data order and dropout.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Global batch (sequences per step, split over DP).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Sequence length (tokens).
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// A text file to train on instead of the built-in corpus (the project's README,
    /// ARCHITECTURE and PARALLEL_MODES, as compiled in): the tests pass a fixed one, so that
    /// editing the docs does not change their batches.
    #[arg(long)]
    corpus: Option<std::path::PathBuf>,
    /// Decoder layers.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads.
    #[arg(long, default_value_t = 4)]
    kv_heads: usize,
    /// Gated MLP width.
    #[arg(long, default_value_t = 688)]
    intermediate: usize,
    /// Experts per layer: Mixtral-style sparse MoE layers (0: dense gated MLPs).
    #[arg(long, default_value_t = 0)]
    experts: usize,
    /// Experts each token is routed to, with `--experts`.
    #[arg(long, default_value_t = 2)]
    top_k: usize,
    /// Weight of the MoE layers' load-balancing loss (Megatron-core's per-layer form, 1 per
    /// layer when balanced), added to the logged loss.
    #[arg(long, default_value_t = 0.0)]
    router_aux_loss_coef: f64,
    /// Expert parallelism, as `--ep` of generate and serve: the MoE layers' experts whole in N
    /// groups of consecutive ranks of the tensor-parallel group, each expert split over its
    /// group's ranks (N = the TP size, or 0: whole experts on each rank). Without it every
    /// expert is split column/row over the whole group.
    #[arg(long)]
    ep: Option<usize>,
    /// Dropout on the residual branches (shared seed: equal across layouts).
    #[arg(long, default_value_t = 0.0)]
    hidden_dropout: f64,
    /// Dropout on attention probabilities (per-rank seeds inside the TP region).
    #[arg(long, default_value_t = 0.0)]
    attention_dropout: f64,
    /// Label smoothing of the cross-entropy.
    #[arg(long, default_value_t = 0.0)]
    label_smoothing: f64,
    /// Write the trained model here (config.json, model.safetensors, tokenizer.json).
    #[arg(long)]
    save: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

/// GPT-2's byte → printable character map (the ByteLevel pre-tokenizer's alphabet).
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (u32::from('!')..=u32::from('~')).collect();
    printable.extend(u32::from('¡')..=u32::from('¬'));
    printable.extend(u32::from('®')..=u32::from('ÿ'));
    let mut extra = 0;
    (0u32..256)
        .map(|b| {
            let c = if printable.contains(&b) {
                b
            } else {
                extra += 1;
                255 + extra
            };
            char::from_u32(c).unwrap_or('?')
        })
        .collect()
}

/// A byte-level BPE `tokenizer.json` with no merges: token id = byte value.
fn tokenizer_json() -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> = byte_chars()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), serde_json::json!(i)))
        .collect();
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    })
}

/// The global batch of step `step`: inputs and targets `[batch, seq]`.
fn global_batch(corpus: &[u8], args: &Args, step: usize) -> Result<(Vec<u32>, Vec<u32>)> {
    let span = args.seq + 1;
    if corpus.len() <= span {
        bail!(
            "the corpus ({} bytes) is shorter than a window of {span}",
            corpus.len()
        );
    }
    let mut rng =
        SplitMix64::new(args.seed ^ (step as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for _ in 0..args.batch {
        let at = (rng.next_u64() % (corpus.len() - span) as u64) as usize;
        let w = &corpus[at..at + span];
        x.extend(w[..args.seq].iter().map(|&b| u32::from(b)));
        y.extend(w[1..].iter().map(|&b| u32::from(b)));
    }
    Ok((x, y))
}

fn main() -> Result<()> {
    let args = Args::parse();
    // A step allocates and frees activations of megabytes: keep them for the next step rather
    // than take fresh zeroed pages from the kernel each time (measured on the 2-core Zen 5,
    // the MoE model of scripts/bench-train-moe.sh: 1.04-1.18x tokens/s at world 1, 1.05-1.11x
    // at 2 ranks).
    candle_tp::retain_freed_memory();
    let dev = Device::Cpu;
    let world = candle_tp::init_from_env(&dev)?;
    let pp = args.pp.max(1);
    let tp = args.tp.unwrap_or(world.size() / (args.dp * pp).max(1));
    if args.dp == 0 || tp == 0 || tp * args.dp * pp != world.size() {
        bail!(
            "--tp {tp} x --dp {} x --pp {pp} must equal the world size {}",
            args.dp,
            world.size()
        );
    }
    if args.batch % (args.dp * args.micro_batches.max(1)) != 0 {
        bail!(
            "--batch {} must be a multiple of --dp {} x --micro-batches {}",
            args.batch,
            args.dp,
            args.micro_batches
        );
    }
    let kind = match args.schedule.as_str() {
        "1f1b" => Kind::OneFOneB,
        "gpipe" => Kind::GPipe,
        other => bail!("--schedule {other}: expected 1f1b or gpipe"),
    };
    if pp > 1 && args.save.is_some() {
        bail!("--save with --pp {pp}: saving a model split into pipeline stages is not supported yet (train with --pp 1 to save)");
    }
    // DP x TP, or PP x DP x TP with a pipeline; the data-parallel coordinate is the axis
    // before the last either way.
    let mesh = if pp > 1 {
        DeviceMesh::pp_dp_tp(&world, pp, tp)?
    } else {
        DeviceMesh::dp_tp(&world, tp)?
    };
    let axes = mesh.dims().len();
    let (Some(dp_pg), Some(tp_pg)) = (
        mesh.group_along(axes - 2).cloned(),
        mesh.group_along(axes - 1).cloned(),
    ) else {
        bail!("the mesh has no dp/tp groups");
    };
    let stage = if pp > 1 {
        Some(PipelineStage::from_mesh(&mesh, None)?)
    } else {
        None
    };
    let lead = world.rank() == 0;
    let cfg = TrainConfig {
        vocab_size: 256,
        hidden_size: args.hidden,
        intermediate_size: args.intermediate,
        num_hidden_layers: args.layers,
        num_attention_heads: args.heads,
        num_key_value_heads: args.kv_heads,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        max_position_embeddings: args.seq.max(256),
        tie_word_embeddings: true,
        initializer_range: 0.02,
        num_local_experts: args.experts,
        num_experts_per_tok: args.top_k,
        router_aux_loss_coef: args.router_aux_loss_coef,
    };
    let init = TrainInit::new(args.seed);
    cfg.declare(&init)?;
    let mut vb = init
        .var_builder(DType::F32, &dev, tp_pg.clone())
        .with_expert_parallel(args.ep)?;
    if let Some(stage) = stage {
        vb = vb.with_pipeline(stage);
    }
    let mut model = TrainLlama::load(&cfg, vb, args.sequence_parallel)?;
    let params = init.params()?;
    let vars = init.vars()?;
    // Gradients each TP rank holds in part (routers; norms with SP): summed over the group.
    let partial = model.partial_gradient_params();
    let partial_vars: Vec<_> = params
        .iter()
        .filter(|p| partial.contains(&p.name))
        .map(|p| p.var.clone())
        .collect();
    let mut opt = AdamW::new(
        vars.clone(),
        ParamsAdamW {
            lr: args.lr,
            ..Default::default()
        },
    )?;
    let corpus: Vec<u8> = match &args.corpus {
        Some(path) => {
            std::fs::read(path).with_context(|| format!("--corpus {}", path.display()))?
        }
        None => CORPUS.concat().into_bytes(),
    };
    let local_b = args.batch / args.dp;
    let d = mesh.coord()[axes - 2];
    let rows = d * local_b..(d + 1) * local_b;
    let n_local = local_b * args.seq;
    let bar = if lead && !args.quiet {
        ProgressBar::with_draw_target(Some(args.steps as u64), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} step {pos}/{len}  {msg}  {elapsed} (eta {eta})")
            .map_err(|e| anyhow::anyhow!("progress bar template: {e}"))?,
    );
    let mut last_report = [0f32; 2];
    for step in 0..args.steps {
        let t0 = Instant::now();
        let (x, y) = global_batch(&corpus, &args, step)?;
        let x = Tensor::from_vec(
            x[rows.start * args.seq..rows.end * args.seq].to_vec(),
            (local_b, args.seq),
            &dev,
        )?;
        let y = Tensor::from_vec(
            y[rows.start * args.seq..rows.end * args.seq].to_vec(),
            n_local,
            &dev,
        )?;
        let drop = Dropout {
            seed: args.seed,
            step: step as u64,
            hidden: args.hidden_dropout,
            attention: args.attention_dropout,
            // This data-parallel rank's rows of the global batch: its masks are theirs.
            first_row: rows.start as u64,
        };
        // The local batch in micro-batches through the schedule (one forward and backward
        // without a pipeline and with one micro-batch).
        let m = args.micro_batches.max(1);
        let rows_per = local_b / m;
        let mbs = (0..m)
            .map(|i| {
                Ok(MicroBatch {
                    ids: x.narrow(0, i * rows_per, rows_per)?,
                    targets: y.narrow(0, i * rows_per * args.seq, rows_per * args.seq)?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let part = *model.vocab_partition();
        let report = train_step(&model, kind, &mbs, &vars, &drop, |logits, targets| {
            vocab_parallel_cross_entropy(logits, targets, &part, &tp_pg, args.label_smoothing, None)
        })?;
        last_report = [
            report.peak_activation_bytes as f32,
            report.idle_fraction() as f32,
        ];
        let mut grads = report.grads;
        all_reduce_grads(&mut grads, &partial_vars, &tp_pg, false)?;
        all_reduce_grads(&mut grads, &vars, &dp_pg, true)?;
        opt.step(&grads)?;
        let mut l = [report.loss, report.aux_loss];
        dp_pg.all_reduce_slice(&mut l, ReduceOp::Sum)?;
        let (loss, aux) = (l[0] / args.dp as f32, l[1] / args.dp as f32);
        let tps = (args.batch * args.seq) as f64 / t0.elapsed().as_secs_f64();
        if lead {
            let mut line = serde_json::json!({"step": step, "loss": loss, "tokens_per_s": tps});
            if args.experts > 0 && args.router_aux_loss_coef != 0.0 {
                // The load-balancing part of `loss` (coefficient x 1 per layer when balanced).
                line["router_aux_loss"] = aux.into();
            }
            println!("{line}");
            bar.set_message(format!("loss {loss:.4}, {tps:.0} tok/s"));
            bar.inc(1);
        }
    }
    bar.finish();
    if pp > 1 {
        // The last step's pipeline figures of every rank.
        let mut all = vec![0f32; 2 * world.size()];
        world.all_gather_slice(&last_report, &mut all)?;
        if lead {
            let m = args.micro_batches.max(1);
            println!(
                "{}",
                serde_json::json!({"pipeline": {
                    "pp": pp, "tp": tp, "dp": args.dp, "micro_batches": m,
                    "schedule": args.schedule,
                    "peak_activation_bytes_per_rank":
                        all.iter().step_by(2).map(|&b| b as u64).collect::<Vec<_>>(),
                    "idle_fraction_per_rank": all.iter().skip(1).step_by(2).collect::<Vec<_>>(),
                    "bubble_theory": (pp - 1) as f64 / (m + pp - 1) as f64,
                }})
            );
        }
        return Ok(());
    }
    // Activation memory of one forward (what backward would keep), both layouts.
    let (x, _) = global_batch(&corpus, &args, 0)?;
    let x = Tensor::from_vec(
        x[rows.start * args.seq..rows.end * args.seq].to_vec(),
        (local_b, args.seq),
        &dev,
    )?;
    let mut bytes = [0i64; 2];
    for (i, sp) in [false, true].into_iter().enumerate() {
        model.set_sequence_parallel(sp);
        let logits = model.forward(&x, &Dropout::off())?;
        bytes[i] = activation_bytes(&logits) as i64;
    }
    model.set_sequence_parallel(args.sequence_parallel);
    let mut all = vec![0i64; 2 * world.size()];
    world.all_gather_slice(&bytes, &mut all)?;
    if lead {
        let no_sp: Vec<i64> = all.iter().step_by(2).copied().collect();
        let sp: Vec<i64> = all.iter().skip(1).step_by(2).copied().collect();
        println!(
            "{}",
            serde_json::json!({"activation_bytes_per_rank": {"without_sp": no_sp, "with_sp": sp}, "tp": tp, "dp": args.dp})
        );
    }
    if let Some(dir) = &args.save {
        let write = mesh.coord()[0] == 0;
        init.save_safetensors_dir(dir, &cfg.hf_config_json(None, None)?, &tp_pg, write)?;
        if lead {
            let tok = dir.join("tokenizer.json");
            std::fs::write(&tok, serde_json::to_string(&tokenizer_json())?)
                .with_context(|| format!("writing {}", tok.display()))?;
            eprintln!("saved {}", dir.display());
        }
        world.barrier()?;
    }
    Ok(())
}
