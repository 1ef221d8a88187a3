//! Writes other quantizations of a Llama GGUF (same metadata, tokenizer and chat template)
//! with Candle's `QTensor::quantize` and GGUF writer, so that tests and benchmarks cover
//! several block types on a real model.
//!
//! ```text
//! cargo run --release --example quantize_gguf -- --dtype Q8_0 Q4_K Q6_K   # SmolLM2, into the model cache
//! cargo run --release --example quantize_gguf -- --src in.gguf --out out.gguf --dtype Q4_0
//! ```

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::quantized::GgmlDType;
use candle_tp::convert::{parse_ggml_dtype, requantize_gguf};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Requantize a Llama GGUF (default: SmolLM2 from the model cache)")]
struct Args {
    /// Target types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K).
    #[arg(long, num_args = 1.., default_values = ["Q8_0", "Q4_K", "Q6_K"])]
    dtype: Vec<String>,
    /// Source GGUF; without it, SmolLM2's shipped Q4_1 file in $CANDLE_TP_HOME/models.
    #[arg(long)]
    src: Option<PathBuf>,
    /// Output file (with --src, one --dtype).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    for d in &args.dtype {
        let dtype = parse_ggml_dtype(d)?;
        match (&args.src, &args.out) {
            (Some(src), Some(out)) => {
                if args.dtype.len() != 1 {
                    bail!("--src/--out take exactly one --dtype");
                }
                let counts = requantize_gguf(src, dtype, out)?;
                println!("{}: {counts:?}", out.display());
            }
            (None, None) => println!("{}", smollm2_gguf(dtype)?.display()),
            _ => bail!("give both --src and --out, or neither"),
        }
    }
    Ok(())
}

/// SmolLM2's `dtype` GGUF in the model cache, written from the shipped Q4_1 file when missing
/// (an existing file is kept).
fn smollm2_gguf(dtype: GgmlDType) -> Result<PathBuf> {
    let dir = candle_tp::models::models_dir()?;
    let shipped = dir.join("smollm2-135m-instruct.Q4_1.gguf");
    if dtype == GgmlDType::Q4_1 {
        return Ok(shipped);
    }
    let name = format!("{dtype:?}").replace('K', "_K");
    let path = dir.join(format!("smollm2-135m-instruct.{name}.gguf"));
    if !path.is_file() {
        if !shipped.is_file() {
            bail!(
                "{} is missing: run scripts/fetch-models.sh",
                shipped.display()
            );
        }
        requantize_gguf(&shipped, dtype, &path)?;
    }
    Ok(path)
}
