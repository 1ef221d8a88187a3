//! Sentence embeddings with a tensor-parallel BERT encoder (all-MiniLM-L6-v2 by default).
//!
//! ```text
//! echo "The cat sits on the mat." | cargo run --release --example embed -- --normalize
//! cargo build --release --bin tprun --example embed
//! target/release/tprun --standalone --nproc-per-node 2 target/release/examples/embed \
//!     --text "The cat sits on the mat." --text "A dog runs." --normalize
//! ```
//!
//! Rank 0 reads the sentences (every `--text`, else the lines of `--input FILE`, else the lines
//! of standard input: `tprun` gives its workers no standard input), tokenizes them and sends
//! the token ids to the other ranks; every rank loads only its share of the weights, and
//! rank 0 prints one JSON line per sentence: `{"text", "token_ids", "embedding"}`. The
//! embedding is the sentence-transformers mean pooling over the tokens, L2-normalised with
//! `--normalize` (sentence-transformers' `Normalize` module).

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::DType;
use candle_tp::models::bert::BertModel;
use candle_tp::models::FromCheckpoint;
use candle_tp::ProcessGroup;
use clap::Parser;
use tokenizers::{Tokenizer, TruncationParams};

#[derive(Parser, Debug)]
#[command(about = "Sentence embeddings from a tensor-parallel BERT encoder")]
struct Args {
    /// Model directory (config.json, model.safetensors, tokenizer.json). Default:
    /// $CANDLE_TP_HOME/models/all-minilm-l6-v2 ($CANDLE_TP_HOME defaults to ~/.cache/candle-tp).
    #[arg(long)]
    model: Option<PathBuf>,
    /// A sentence to embed (repeatable). Without it, the lines of --input or standard input.
    #[arg(long)]
    text: Vec<String>,
    /// A file with one sentence per line ("-" is standard input).
    #[arg(long)]
    input: Option<PathBuf>,
    /// L2-normalise the embeddings, as sentence-transformers' Normalize module.
    #[arg(long)]
    normalize: bool,
    /// Truncate sentences to this many tokens. Default: max_seq_length of
    /// sentence_bert_config.json, else max_position_embeddings.
    #[arg(long)]
    max_length: Option<usize>,
    /// Weight dtype: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Device: `cpu`, or `cuda` (GPU `LOCAL_RANK`, NCCL between ranks; needs
    /// `--features cuda,nccl`).
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn default_model_dir() -> Result<PathBuf> {
    Ok(candle_tp::models::models_dir()?.join("all-minilm-l6-v2"))
}

fn read_lines(r: impl BufRead, what: &str) -> Result<Vec<String>> {
    r.lines()
        .collect::<std::io::Result<Vec<_>>>()
        .with_context(|| format!("reading sentences from {what}"))
}

fn sentences(args: &Args) -> Result<Vec<String>> {
    if !args.text.is_empty() {
        return Ok(args.text.clone());
    }
    match &args.input {
        Some(p) if p.as_os_str() != "-" => {
            let f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
            read_lines(std::io::BufReader::new(f), &p.display().to_string())
        }
        _ => read_lines(std::io::stdin().lock(), "standard input"),
    }
}

/// The truncation length sentence-transformers uses: `max_seq_length` of
/// sentence_bert_config.json, capped by the position table.
fn max_length(args: &Args, dir: &Path, max_positions: usize) -> Result<usize> {
    let len = match args.max_length {
        Some(n) => n,
        None => {
            let p = dir.join("sentence_bert_config.json");
            match std::fs::read_to_string(&p) {
                Ok(text) => {
                    let v: serde_json::Value = serde_json::from_str(&text)
                        .with_context(|| format!("parsing {}", p.display()))?;
                    match v.get("max_seq_length").and_then(|m| m.as_u64()) {
                        Some(n) => n as usize,
                        None => max_positions,
                    }
                }
                Err(_) => max_positions,
            }
        }
    };
    if len == 0 || len > max_positions {
        bail!("max length {len} must be in 1..={max_positions} (max_position_embeddings)");
    }
    Ok(len)
}

fn tokenize(dir: &Path, texts: &[String], max_len: usize) -> Result<Vec<Vec<u32>>> {
    let path = dir.join("tokenizer.json");
    let mut tok = Tokenizer::from_file(&path)
        .map_err(|e| anyhow!("cannot load tokenizer {}: {e}", path.display()))?;
    // The MiniLM tokenizer.json pads (and truncates) to 128 tokens: no padding here (the
    // model pads the batch itself, with the attention mask), truncation at the model's length.
    tok.with_padding(None);
    tok.with_truncation(Some(TruncationParams {
        max_length: max_len,
        ..Default::default()
    }))
    .map_err(|e| anyhow!("setting truncation to {max_len}: {e}"))?;
    texts
        .iter()
        .map(|t| {
            tok.encode(t.as_str(), true)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| anyhow!("tokenizing {t:?}: {e}"))
        })
        .collect()
}

/// Rank 0's token ids, sent to every rank: the count, the lengths, then the ids.
fn share_ids(pg: &ProcessGroup, ids: Vec<Vec<u32>>) -> Result<Vec<Vec<u32>>> {
    let mut n = [ids.len() as u32];
    pg.broadcast_slice(&mut n, 0)?;
    let mut lens: Vec<u32> = if pg.rank() == 0 {
        ids.iter().map(|s| s.len() as u32).collect()
    } else {
        vec![0; n[0] as usize]
    };
    pg.broadcast_slice(&mut lens, 0)?;
    let total: usize = lens.iter().map(|&l| l as usize).sum();
    let mut flat: Vec<u32> = if pg.rank() == 0 {
        ids.concat()
    } else {
        vec![0; total]
    };
    pg.broadcast_slice(&mut flat, 0)?;
    let mut out = Vec::with_capacity(lens.len());
    let mut at = 0;
    for l in lens {
        out.push(flat[at..at + l as usize].to_vec());
        at += l as usize;
    }
    Ok(out)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = candle_tp::device_from_arg(&args.device)?;
    let pg = candle_tp::init_from_env(&device)?;
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => default_model_dir()?,
    };
    let dtype = candle_tp::dtype_from_arg(&args.dtype)?;

    let t0 = Instant::now();
    let model = BertModel::from_dir(&dir, dtype, &device, pg.clone()).with_context(|| {
        format!(
            "loading the BERT model from {} (scripts/fetch-models.sh fetches the default one)",
            dir.display()
        )
    })?;
    let load_s = t0.elapsed().as_secs_f64();

    let (texts, ids) = if pg.rank() == 0 {
        let texts = sentences(&args)?;
        let max_len = max_length(&args, &dir, model.config().max_position_embeddings)?;
        let ids = tokenize(&dir, &texts, max_len)?;
        (texts, ids)
    } else {
        (Vec::new(), Vec::new())
    };
    let ids = share_ids(&pg, ids)?;
    if ids.is_empty() {
        if pg.rank() == 0 {
            eprintln!(
                "no sentences to embed (give --text, --input FILE, or lines on standard input)"
            );
        }
        return Ok(());
    }

    let t1 = Instant::now();
    let emb = model
        .embed(&ids, args.normalize)?
        .to_dtype(DType::F32)?
        .to_vec2::<f32>()?;
    let embed_s = t1.elapsed().as_secs_f64();

    if pg.rank() == 0 {
        for ((text, token_ids), embedding) in texts.iter().zip(&ids).zip(&emb) {
            let line = serde_json::json!({
                "text": text,
                "token_ids": token_ids,
                "embedding": embedding,
            });
            println!("{line}");
        }
        eprintln!(
            "embedded {} sentences on {} rank(s): load {load_s:.3} s, forward {embed_s:.3} s",
            ids.len(),
            pg.size()
        );
    }
    Ok(())
}
