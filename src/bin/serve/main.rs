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
//! rank leaves its loop and exits 0. A rank other than 0 that alone gets the signal (rank 0
//! never hears of it) leaves by it after a grace (`signals.rs`); tprun then ends the job.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_tp::generate::BatchDecoder;
use candle_tp::models::bert::BertModel;
use candle_tp::models::{CausalLm, FromCheckpoint, LoadOptions};
use candle_tp::pipeline::PipelineStage;
use candle_tp::serve::{self, embeddings, limits, AppState, ModelText};
use clap::Parser;

mod signals;
use signals::{defer_signals, wait_for_signal};

#[derive(Parser, Debug)]
#[command(about = "OpenAI-compatible server over tensor-parallel ranks (run it under tprun)")]
struct Args {
    /// Model directory (config.json, model.safetensors, tokenizer.json,
    /// tokenizer_config.json) or a llama.cpp `.gguf` file. Default:
    /// $CANDLE_TP_HOME/models/smollm2-135m-instruct. A BERT sentence-embedding checkpoint
    /// (config.json's model_type "bert", e.g. all-minilm-l6-v2) is served on /v1/embeddings.
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
    /// Clients must send `Authorization: Bearer KEY` (401 otherwise) on /v1/*, /tokenize and
    /// /detokenize; /health and /metrics stay open. Default: $CANDLE_TP_API_KEY, else none.
    #[arg(long)]
    api_key: Option<String>,
    /// The largest request body read, in bytes; a larger one is a 400 naming the limit,
    /// before any of it is parsed or tokenized.
    #[arg(long, default_value_t = serve::DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// Connections served at once; one more is answered 503 `too_many_connections` and
    /// closed.
    #[arg(long, default_value_t = limits::DEFAULT_MAX_CONNECTIONS, value_parser = at_least_one)]
    max_connections: usize,
    /// Seconds a connection has to send a request's headers, from its opening or the end of
    /// its last answer; then it is closed (idle keep-alive connections, slowloris clients).
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = positive_seconds)]
    header_timeout: Duration,
    /// Seconds a request's body has to arrive once its headers have; then 408
    /// `request_timeout` and the connection is closed.
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = positive_seconds)]
    body_timeout: Duration,
    /// Seconds an answer may wait for the client to read any of it (its TCP window full);
    /// then the connection is closed and its request dropped (a stream's decode slot freed).
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = positive_seconds)]
    send_timeout: Duration,
    /// Tokenizing jobs (chat templates, tokenizers, grammars, building large answers) run
    /// at once on their own threads. Default: the machine's cores, at least 2.
    #[arg(long, value_parser = at_least_one)]
    max_tokenize_jobs: Option<usize>,
    /// Seconds a request waits for a tokenizing job; then 503 `tokenizer_busy`.
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = positive_seconds)]
    tokenize_wait: Duration,
    /// Seconds between keep-alive comments on a server-sent event stream that has nothing
    /// else to send (a request queued behind others); 0: none.
    #[arg(long, value_name = "SECS", default_value = "15", value_parser = seconds_or_zero)]
    sse_keep_alive: Duration,
    /// Pipeline stages: the ranks split into this many stages of layers, each stage's layers
    /// split over world / N tensor-parallel ranks (HTTP stays on rank 0, the first stage).
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
    /// Precision of the KV cache: auto (the activations'), f32, f16 or bf16. f16 halves the
    /// cache's memory per sequence (llama.cpp's default), at a rounding of the cached keys and
    /// values; the CPU's attention reads it as it is (with AVX2), so long contexts decode faster
    /// than with f32 (SmolLM2, 16 streams: 0.95x the step time at 4-260 cached positions,
    /// 0.80x at 4-1004). bf16 is widened first and costs time.
    #[arg(long, default_value = "auto")]
    kv_cache_dtype: candle_tp::nn::KvCacheDtype,
}

/// A count of 1 or more.
fn at_least_one(v: &str) -> std::result::Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("'{v}' is not a whole number of at least 1")),
    }
}

/// Seconds (`30`, `1.5`) of 0 or more.
fn seconds_or_zero(v: &str) -> std::result::Result<Duration, String> {
    v.parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| format!("'{v}' is not a number of seconds"))
}

/// Seconds (`30`, `1.5`) above 0.
fn positive_seconds(v: &str) -> std::result::Result<Duration, String> {
    match seconds_or_zero(v)? {
        d if d.is_zero() => Err(format!("'{v}': the deadline must be above 0 seconds")),
        d => Ok(d),
    }
}

impl Args {
    /// The limits of each connection.
    fn conn_limits(&self) -> limits::ConnLimits {
        limits::ConnLimits {
            max_connections: self.max_connections,
            header_timeout: self.header_timeout,
            send_timeout: self.send_timeout,
        }
    }

    /// The limits of each request.
    fn request_limits(&self) -> limits::RequestLimits {
        limits::RequestLimits {
            body_timeout: self.body_timeout,
            text_jobs: limits::TextJobs::new(
                self.max_tokenize_jobs
                    .unwrap_or_else(limits::default_tokenize_jobs),
                self.tokenize_wait,
            ),
            sse_keep_alive: (!self.sse_keep_alive.is_zero()).then_some(self.sse_keep_alive),
        }
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    // Checked on every rank before anything loads: a bad key ends the job at once.
    let key = api_key(&args)?;
    // A request's tokens must not depend on what else is in its batch (and batches of 2-16
    // rows must read each weight once): the small-m kernel for f32 too.
    candle_tp::set_batch_invariant_matmul(true);
    // Freed op outputs stay in the process for the next forward (no page faults).
    candle_tp::retain_freed_memory();
    let device = candle_tp::device_from_arg(&args.device)?;
    let dtype = candle_tp::dtype_from_arg(&args.dtype)?;
    let pg = candle_tp::init_from_env(&device)?;
    if pg.rank() != 0 {
        defer_signals(pg.rank())?;
    }
    let path = match &args.model {
        Some(p) => p.clone(),
        None => candle_tp::models::models_dir()?.join("smollm2-135m-instruct"),
    };
    if is_bert(&path) {
        if args.pp > 1 || args.pp_layers.is_some() {
            bail!(
                "--pp {}: {} is a BERT encoder, served with tensor parallelism only (pipeline stages are for decoders)",
                args.pp,
                path.display()
            );
        }
        return serve_embeddings(&args, key, pg, &path, dtype, &device);
    }
    let t0 = Instant::now();
    let (stage, tp) = PipelineStage::from_option(&pg, args.pp, args.pp_layers.clone())?;
    let options = LoadOptions {
        pipeline: stage,
        expert_parallel: args.ep,
        ..LoadOptions::default()
    };
    let mut model =
        CausalLm::from_path_with(&path, dtype, &device, tp, options).with_context(|| {
            format!(
                "loading {} on rank {} of {}",
                path.display(),
                pg.rank(),
                pg.size()
            )
        })?;
    model.set_kv_cache_dtype(args.kv_cache_dtype.0);
    let max_seq_len = args.max_seq_len.min(model.config().max_position_embeddings);
    let mut dec = BatchDecoder::new(args.max_batch, max_seq_len, args.prefill_chunk)?;
    if pg.rank() != 0 {
        serve::run_follower(&mut model, &mut dec)?;
        return Ok(());
    }

    let text = ModelText::load(&path)?;
    let eos = text.eos_ids(&model.config().eos_token_ids);
    let vocab_size = model.config().vocab_size;
    // Rank 0 holds the grammars and the LM head's group shares its masks: no pipeline (also
    // not the one stage that `--pp 1 --pp-layers N` makes: the decoder refuses grammars on
    // any pipeline, which then failed every constrained request at every rank).
    let grammars = if model.pipeline().is_some() {
        Err(format!(
            "grammars need the model outside a pipeline (this server runs --pp {}{})",
            args.pp,
            if args.pp_layers.is_some() {
                " with --pp-layers"
            } else {
                ""
            }
        ))
    } else {
        serve::grammar::Grammars::new(&text, vocab_size, &eos).map_err(|e| {
            eprintln!("rank 0: structured outputs and forced tool calls are off: {e}");
            e.to_string()
        })
    };
    let tool_format = text
        .chat_template()
        .map_or(serve::tools::ToolFormat::Hermes, |t| {
            serve::tools::ToolFormat::of_template(t.source())
        });
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
        vocab_size,
        queue: queue.clone(),
        api_key: key,
        max_body_bytes: args.max_body_bytes,
        grammars,
        tool_format,
        limits: args.request_limits(),
    };
    let q = queue.clone();
    let rejected = queue.metrics().rejected.clone();
    let http = start_http(&args, serve::router(state), rejected, move || q.shutdown())?;
    println!(
        "{}",
        serde_json::json!({
            "listening": format!("http://{}", http.local), "model": name, "world_size": pg.size(), "pipeline_parallel_size": args.pp,
            "max_batch": args.max_batch, "max_seq_len": max_seq_len,
            "load_s": t0.elapsed().as_secs_f64(),
        })
    );
    let heartbeat = serve::idle_heartbeat(candle_tp::comm::default_timeout());
    let result = serve::run_leader(&mut model, &mut dec, inbox, heartbeat);
    http.stop();
    if let Err(e) = result {
        bail!("rank 0: the serving loop failed: {e}");
    }
    Ok(())
}

/// Rank 0's HTTP server, on a thread of its own (one tokio worker; tokenizing runs on tokio's
/// blocking threads).
struct Http {
    local: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Http {
    /// Stops accepting, and gives the open connections a moment to close (their handlers
    /// already got their answers or errors).
    fn stop(self) {
        let _ = self.stop.send(());
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Serves `app` on `--host:--port` within the connection limits (`--max-connections`,
/// `--header-timeout`, `--send-timeout`); on SIGTERM or Ctrl-C (or when the server fails)
/// calls `shutdown`, which makes the serving loop broadcast the end. What the limits refuse
/// and close is counted in `rejected`.
fn start_http(
    args: &Args,
    app: axum::Router,
    rejected: Arc<serve::metrics::Rejections>,
    shutdown: impl Fn() + Send + Sync + 'static,
) -> Result<Http> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let addr = format!("{}:{}", args.host, args.port);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(&addr))
        .with_context(|| format!("listening on {addr}"))?;
    let local: SocketAddr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let shutdown = Arc::new(shutdown);
    let conn_limits = args.conn_limits();
    room_for_connections(conn_limits.max_connections);
    let thread = std::thread::Builder::new()
        .name("http".into())
        .spawn(move || {
            rt.block_on(async move {
                let on_signal = shutdown.clone();
                tokio::spawn(async move {
                    wait_for_signal().await;
                    eprintln!("shutting down: ending in-flight requests");
                    (*on_signal)();
                });
                let r = limits::serve(listener, app, conn_limits, rejected, async move {
                    let _ = stopped.await;
                })
                .await;
                if let Err(e) = r {
                    eprintln!("http server: {e}");
                    (*shutdown)();
                }
            })
        })?;
    Ok(Http {
        local,
        stop,
        thread,
    })
}

/// Raises the process's open-file limit (its soft limit, up to the hard one) so that
/// `--max-connections` connections fit beside the files and sockets the job itself holds;
/// warns when they cannot (accepting then fails with EMFILE, retried every second).
fn room_for_connections(max_connections: usize) {
    let needed = max_connections as u64 + 256;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into a live local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 || lim.rlim_cur >= needed {
        return;
    }
    let raised = libc::rlimit {
        rlim_cur: needed.min(lim.rlim_max),
        rlim_max: lim.rlim_max,
    };
    // SAFETY: setrlimit reads one rlimit from a live local.
    let ok = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0;
    if !ok || raised.rlim_cur < needed {
        eprintln!(
            "rank 0: --max-connections {max_connections} needs about {needed} open files; this process may open {} (ulimit -n): connections past that wait",
            if ok { raised.rlim_cur } else { lim.rlim_cur }
        );
    }
}

/// Whether `path` is a BERT checkpoint directory (config.json's `model_type` "bert", or a
/// `Bert...` architecture): a sentence-embedding model, served on `/v1/embeddings`.
fn is_bert(path: &std::path::Path) -> bool {
    let Ok(text) = std::fs::read_to_string(path.join("config.json")) else {
        return false;
    };
    let Ok(cfg) = serde_json::from_str::<serde_json::Value>(&text) else {
        return false;
    };
    cfg["model_type"] == "bert"
        || cfg["architectures"].as_array().is_some_and(|a| {
            a.iter()
                .any(|x| x.as_str().is_some_and(|s| s.starts_with("Bert")))
        })
}

/// sentence-transformers' settings of the checkpoint: its `max_seq_length`
/// (sentence_bert_config.json; else `max_positions`), capped by `max_positions`, and whether
/// modules.json ends with a `Normalize` module.
fn sentence_settings(path: &std::path::Path, max_positions: usize) -> (usize, bool) {
    let read = |name: &str| -> serde_json::Value {
        std::fs::read_to_string(path.join(name))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default()
    };
    let max_len = read("sentence_bert_config.json")["max_seq_length"]
        .as_u64()
        .map_or(max_positions, |n| (n as usize).min(max_positions));
    let normalize = read("modules.json").as_array().is_some_and(|m| {
        m.iter().any(|x| {
            x["type"]
                .as_str()
                .is_some_and(|t| t.ends_with("models.Normalize"))
        })
    });
    (max_len, normalize)
}

/// The embedding server: the BERT encoder over the ranks, `POST /v1/embeddings` on rank 0.
fn serve_embeddings(
    args: &Args,
    key: Option<String>,
    pg: candle_tp::ProcessGroup,
    path: &std::path::Path,
    dtype: candle_core::DType,
    device: &candle_core::Device,
) -> Result<()> {
    let t0 = Instant::now();
    let model = BertModel::from_dir(path, dtype, device, pg.clone()).with_context(|| {
        format!(
            "loading the BERT model {} on rank {} of {}",
            path.display(),
            pg.rank(),
            pg.size()
        )
    })?;
    let cfg = model.config();
    let (max_tokens, normalize) = sentence_settings(path, cfg.max_position_embeddings);
    if pg.rank() != 0 {
        embeddings::run_embed_follower(&model, normalize)?;
        return Ok(());
    }
    let tok_path = path.join("tokenizer.json");
    let mut tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
        .map_err(|e| anyhow::anyhow!("loading {}: {e}", tok_path.display()))?;
    // The model pads each batch itself (with the attention mask); an input longer than
    // max_seq_length is refused, not cut.
    tokenizer.with_padding(None);
    tokenizer
        .with_truncation(None)
        .map_err(|e| anyhow::anyhow!("{}: {e}", tok_path.display()))?;
    let name = args
        .model_name
        .clone()
        .unwrap_or_else(|| serve::default_model_name(path));
    let (queue, rx) = embeddings::embed_queue(args.max_queue);
    let state = embeddings::EmbedState {
        model_name: name.clone(),
        tokenizer: Arc::new(tokenizer),
        max_tokens,
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden_size,
        queue: queue.clone(),
        api_key: key,
        max_body_bytes: args.max_body_bytes,
        limits: args.request_limits(),
        rejected: Arc::default(),
    };
    let q = queue.clone();
    // Shown on its /metrics.
    let rejected = state.rejected.clone();
    let http = start_http(args, embeddings::router(state), rejected, move || {
        q.shutdown()
    })?;
    println!(
        "{}",
        serde_json::json!({
            "listening": format!("http://{}", http.local), "model": name, "world_size": pg.size(),
            "embeddings": true, "max_tokens": max_tokens, "normalize": normalize,
            "load_s": t0.elapsed().as_secs_f64(),
        })
    );
    let result = embeddings::run_embed_leader(
        &model,
        normalize,
        rx,
        &queue,
        serve::idle_heartbeat(candle_tp::comm::default_timeout()),
    );
    http.stop();
    if let Err(e) = result {
        bail!("rank 0: the serving loop failed: {e}");
    }
    Ok(())
}

/// `--api-key`, else `$CANDLE_TP_API_KEY`, else none. A key that is set but empty (or only
/// blanks) is an error: it reads as "a key" but would let every client in.
fn api_key(args: &Args) -> Result<Option<String>> {
    let (key, from) = match &args.api_key {
        Some(k) => (Some(k.clone()), "--api-key"),
        None => (
            std::env::var("CANDLE_TP_API_KEY").ok(),
            "$CANDLE_TP_API_KEY",
        ),
    };
    match key {
        Some(k) if k.trim().is_empty() => bail!(
            "{from} is set but empty: that would turn authentication off; give a key, or leave \
             it unset to serve without one"
        ),
        Some(k) if k.trim() != k => {
            bail!("{from} starts or ends with blanks: clients cannot send those in a Bearer token")
        }
        k => Ok(k),
    }
}
