//! `candle-tp-serve`: an OpenAI-compatible HTTP server over the tensor-parallel ranks, with
//! continuous batching.
//!
//! ```text
//! cargo build --release --features server --bin tprun --bin candle-tp-serve
//! target/release/tprun --standalone --nproc-per-node 2 target/release/candle-tp-serve \
//!     --model ~/.cache/candle-tp/models/smollm2-135m-instruct --port 8000
//! curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \
//!     -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}'
//! ```
//!
//! Every rank loads its share of the model and runs the same scheduler loop; rank 0 alone
//! serves HTTP (127.0.0.1 by default) and broadcasts each step's decision to the others
//! through the process group. SIGTERM or Ctrl-C: in-flight requests end with an error, every
//! rank leaves its loop and exits 0.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_tp::generate::BatchDecoder;
use candle_tp::models::CausalLm;
use candle_tp::serve::{self, AppState, ModelText};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "OpenAI-compatible server over tensor-parallel ranks (run it under tprun)")]
struct Args {
    /// Model directory (config.json, model.safetensors, tokenizer.json,
    /// tokenizer_config.json) or a llama.cpp `.gguf` file. Default:
    /// $CANDLE_TP_HOME/models/smollm2-135m-instruct.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The model's name in the API (`model` field, /v1/models). Default: the file or
    /// directory name.
    #[arg(long)]
    model_name: Option<String>,
    /// Address to listen on (rank 0).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (rank 0); 0 picks a free one (printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Sequences decoded together at most.
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// Requests waiting for a slot at most; beyond, requests are answered 503.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Longest sequence (prompt and completion), capped by the model's
    /// max_position_embeddings.
    #[arg(long, default_value_t = 2048)]
    max_seq_len: usize,
    /// Prompt tokens read per step at most (so a long prompt does not stall running streams).
    #[arg(long, default_value_t = 64)]
    prefill_chunk: usize,
    /// Device: cpu (or cuda with the cuda feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weight dtype for safetensors checkpoints: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
}

/// Set by SIGTERM/SIGINT on the ranks other than 0, which wait for rank 0's shutdown plan.
static SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    SIGNALLED.store(true, Ordering::SeqCst);
}

/// Ranks other than 0 keep running on SIGTERM/SIGINT: rank 0 gets the same signal from
/// tprun and broadcasts the shutdown, so every rank leaves at the same step.
fn defer_signals() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGINT, handler);
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    // A request's tokens must not depend on what else is in its batch (and batches of 2-16
    // rows must read each weight once): the small-m kernel for f32 too.
    candle_tp::set_batch_invariant_matmul(true);
    let device = candle_tp::device_from_arg(&args.device)?;
    let dtype = candle_tp::dtype_from_arg(&args.dtype)?;
    let pg = candle_tp::init_from_env(&device)?;
    if pg.rank() != 0 {
        defer_signals();
    }
    let path = match &args.model {
        Some(p) => p.clone(),
        None => candle_tp::models::models_dir()?.join("smollm2-135m-instruct"),
    };
    let t0 = Instant::now();
    let mut model = CausalLm::from_path(&path, dtype, &device, pg.clone()).with_context(|| {
        format!(
            "loading {} on rank {} of {}",
            path.display(),
            pg.rank(),
            pg.size()
        )
    })?;
    let max_seq_len = args.max_seq_len.min(model.config().max_position_embeddings);
    let mut dec = BatchDecoder::new(args.max_batch, max_seq_len, args.prefill_chunk)?;
    if pg.rank() != 0 {
        serve::run_follower(&mut model, &mut dec)?;
        return Ok(());
    }

    let text = ModelText::load(&path)?;
    let eos = text.eos_ids(&model.config().eos_token_ids);
    let name = args
        .model_name
        .clone()
        .unwrap_or_else(|| serve::default_model_name(&path));
    let (queue, inbox) = serve::queue(args.max_queue);
    let state = AppState {
        model_name: name.clone(),
        text: Arc::new(text),
        eos,
        max_seq_len,
        vocab_size: model.config().vocab_size,
        queue: queue.clone(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let addr = format!("{}:{}", args.host, args.port);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(&addr))
        .with_context(|| format!("listening on {addr}"))?;
    let local: SocketAddr = listener.local_addr()?;
    let (stop_http, stopped) = tokio::sync::oneshot::channel::<()>();
    let http = {
        let queue = queue.clone();
        std::thread::Builder::new()
            .name("http".into())
            .spawn(move || {
                rt.block_on(async move {
                    let q = queue.clone();
                    tokio::spawn(async move {
                        wait_for_signal().await;
                        eprintln!("shutting down: ending in-flight requests");
                        q.shutdown();
                    });
                    let app = serve::router(state);
                    let r = axum::serve(listener, app)
                        .with_graceful_shutdown(async move {
                            let _ = stopped.await;
                        })
                        .await;
                    if let Err(e) = r {
                        eprintln!("http server: {e}");
                        queue.shutdown();
                    }
                })
            })?
    };
    println!(
        "{}",
        serde_json::json!({
            "listening": format!("http://{local}"), "model": name, "world_size": pg.size(),
            "max_batch": args.max_batch, "max_seq_len": max_seq_len,
            "load_s": t0.elapsed().as_secs_f64(),
        })
    );
    let result = serve::run_leader(&mut model, &mut dec, inbox, Duration::from_secs(10));
    let _ = stop_http.send(());
    // The handlers already got their errors; give the connections a moment to close.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !http.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Err(e) = result {
        bail!("rank 0: the serving loop failed: {e}");
    }
    Ok(())
}

async fn wait_for_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cannot watch SIGTERM: {e}");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
