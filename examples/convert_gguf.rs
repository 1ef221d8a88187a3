//! Converts a llama.cpp GGUF (Llama architecture, byte-level BPE vocabulary) into a Hugging
//! Face checkpoint directory: config.json, generation_config.json, model.safetensors (f32),
//! tokenizer.json, tokenizer_config.json, chat_template.jinja.
//!
//! ```text
//! cargo run --release --example convert_gguf -- --gguf model.gguf --out model-dir
//! ```
//!
//! Under a terminal, stderr shows a progress bar over the tensors (indicatif); on a pipe or a
//! file (CI logs, `scripts/fetch-models.sh` under a log) nothing but the summary is printed.
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use candle_tp::convert::ConvertStep;
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Convert a Llama GGUF file into a Hugging Face checkpoint directory.
#[derive(Parser, Debug)]
struct Args {
    /// The GGUF file to read.
    #[arg(long)]
    gguf: PathBuf,
    /// The directory to write (created if missing).
    #[arg(long)]
    out: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let start = Instant::now();
    // indicatif draws only on a terminal anyway; the explicit test keeps the bar (and its
    // final line) out of pipes even when TERM tricks it.
    let bar = if std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} tensor {pos}/{len}  {msg}  {elapsed} (eta {eta})")
            .map_err(|e| anyhow::anyhow!("progress bar template: {e}"))?,
    );
    let summary = candle_tp::convert::convert_gguf_with_progress(
        &args.gguf,
        &args.out,
        &mut |step| match step {
            ConvertStep::Tensor { done, total, name } => {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
                bar.set_message(name.to_string());
            }
            ConvertStep::Writing => bar.set_message("writing model.safetensors"),
        },
    )
    .with_context(|| {
        format!(
            "converting {} into {}",
            args.gguf.display(),
            args.out.display()
        )
    })?;
    bar.finish_and_clear();
    let c = &summary.config;
    println!(
        "converted {} in {:.1}s: {} layers, hidden {}, {} heads ({} KV), vocab {}, {} tensors",
        args.gguf.display(),
        start.elapsed().as_secs_f64(),
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.vocab_size,
        summary.num_tensors
    );
    for f in &summary.files {
        println!("  wrote {}", f.display());
    }
    Ok(())
}
