//! Converts a llama.cpp GGUF (Llama architecture, byte-level BPE vocabulary) into a Hugging
//! Face checkpoint directory: config.json, generation_config.json, model.safetensors (f32),
//! tokenizer.json, tokenizer_config.json, chat_template.jinja.
//!
//! ```text
//! cargo run --release --example convert_gguf -- --gguf model.gguf --out model-dir
//! ```
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;

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
    let summary = candle_tp::convert::convert_gguf(&args.gguf, &args.out).with_context(|| {
        format!(
            "converting {} into {}",
            args.gguf.display(),
            args.out.display()
        )
    })?;
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
