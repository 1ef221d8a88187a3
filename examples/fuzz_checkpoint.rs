//! A bounded-time mutation fuzzer for the safetensors header and index parsers
//! (`SafetensorsSource::from_files` / `from_dir`), the GGUF header and tensor-info parser
//! (`gguf::header::scan`, then Candle's metadata reader as `GgufSource` calls it) and
//! the tensor loads behind them (quantized shards by rows and by blocks).
//!
//! ```text
//! cargo run --release --example fuzz_checkpoint -- --seconds 60
//! ```
//!
//! It starts from valid single files and sharded checkpoints (an index and two shards), mutates
//! them (bit flips, byte writes, truncation, extension, the header length field, and edits of
//! the JSON: offsets, shapes, dtypes, names, shard paths; for the GGUF seed, edge values written
//! over its counts, lengths, dims, type ids and offsets), writes them to a scratch directory,
//! opens them and loads every tensor they claim to hold (whole and a slice). A case fails when
//! it panics (caught with `catch_unwind`), runs longer than `--case-limit-ms` (the process
//! stops), or asks for one allocation over `--max-alloc-mb` (the process aborts). Each failure
//! saves the input under `--out` (`panic-N/`, `hang/`, `alloc/`). It prints the cases per second
//! and the counts of accepted and refused inputs, and exits non-zero on any failure.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_tp::gguf::header as gguf_header;
use candle_tp::loader::quant_shard::{self, Named, RowOrder};
use candle_tp::loader::{RangeRequest, SafetensorsSource, TensorSource};
use clap::Parser;
use serde_json::{json, Value};

/// Refuses (and reports) any single allocation above `LIMIT` once `ARMED`.
struct BoundedAlloc;

static LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);
static ARMED: AtomicBool = AtomicBool::new(false);
static OVER: AtomicBool = AtomicBool::new(false);

// SAFETY: every call is forwarded to the system allocator; an over-limit request returns null,
// which the caller turns into `handle_alloc_error` (an abort).
unsafe impl GlobalAlloc for BoundedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) && layout.size() > LIMIT.load(Ordering::Relaxed) {
            OVER.store(true, Ordering::SeqCst);
            let msg = b"fuzz_checkpoint: an allocation over --max-alloc-mb; the input is in the out dir as current/\n";
            // SAFETY: writing a static buffer to stderr; no allocation.
            unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) && new_size > LIMIT.load(Ordering::Relaxed) {
            OVER.store(true, Ordering::SeqCst);
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's arguments.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: BoundedAlloc = BoundedAlloc;

#[derive(Parser, Debug)]
#[command(about = "Mutation fuzzer for the safetensors header and index parsers")]
struct Args {
    /// How long to fuzz.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// Seed of the mutations (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Where failing inputs are saved (and the scratch files written).
    #[arg(long, default_value = "target/fuzz-checkpoint")]
    out: PathBuf,
    /// A case running longer than this is a hang.
    #[arg(long, default_value_t = 1000)]
    case_limit_ms: u64,
    /// A single allocation larger than this many MiB is a failure.
    #[arg(long, default_value_t = 256)]
    max_alloc_mb: usize,
}

/// xorshift64*: small, seedable, good enough for mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// One input: file names and their bytes, written into a fresh directory.
type Input = Vec<(String, Vec<u8>)>;

const SHARDS: [&str; 2] = [
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
];
const INDEX: &str = "model.safetensors.index.json";

fn safetensors_bytes(tensors: &[(&str, Tensor)], scratch: &Path) -> Result<Vec<u8>> {
    let path = scratch.join("seed.safetensors");
    let map: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    candle_core::safetensors::save(&map, &path)?;
    std::fs::read(&path).with_context(|| format!("reading {}", path.display()))
}

/// Valid inputs: a single file with several dtypes and ranks, and a sharded checkpoint.
fn seeds(scratch: &Path) -> Result<Vec<Input>> {
    let cpu = Device::Cpu;
    let f = Tensor::arange(0f32, 24.0, &cpu)?;
    let single = safetensors_bytes(
        &[
            ("a.weight", f.reshape((4, 6))?),
            ("b.bias", f.narrow(0, 0, 5)?),
            ("c.half", f.reshape((2, 3, 4))?.to_dtype(DType::F16)?),
            ("d.bf", f.reshape((6, 4))?.to_dtype(DType::BF16)?),
            ("e.bytes", f.to_dtype(DType::U8)?),
            ("f.ids", f.narrow(0, 0, 3)?.to_dtype(DType::I64)?),
            ("g.empty", Tensor::zeros((0, 3), DType::F32, &cpu)?),
        ],
        scratch,
    )?;
    let shard0 = safetensors_bytes(&[("x.weight", f.reshape((3, 8))?)], scratch)?;
    let shard1 = safetensors_bytes(
        &[
            ("y.weight", f.reshape((8, 3))?.to_dtype(DType::F16)?),
            ("z.bias", f.narrow(0, 0, 4)?),
        ],
        scratch,
    )?;
    let index = json!({
        "metadata": {"total_size": 176},
        "weight_map": {"x.weight": SHARDS[0], "y.weight": SHARDS[1], "z.bias": SHARDS[1]}
    });
    let gguf = {
        let path = scratch.join("seed.gguf");
        // A tensor of its own for each: Candle's quantize reads a view's whole storage.
        let w = Tensor::arange(0f32, 256.0, &cpu)?.affine(0.01, -1.0)?;
        let q8 = QTensor::quantize(&w.reshape((4, 64))?, GgmlDType::Q8_0)?;
        let q41 = QTensor::quantize(
            &Tensor::arange(0f32, 128.0, &cpu)?
                .affine(0.02, -1.0)?
                .reshape((2, 64))?,
            GgmlDType::Q4_1,
        )?;
        let qk = QTensor::quantize(&w.reshape((1, 256))?, GgmlDType::Q4K)?;
        let norm = QTensor::quantize(
            &Tensor::arange(0f32, 8.0, &cpu)?.affine(0.5, 0.0)?,
            GgmlDType::F32,
        )?;
        let (arch, heads) = (
            gguf_file::Value::String("llama".into()),
            gguf_file::Value::U32(2),
        );
        let toks = gguf_file::Value::Array(vec![
            gguf_file::Value::String("a".into()),
            gguf_file::Value::String("b".into()),
        ]);
        let mut f = std::fs::File::create(&path)?;
        gguf_file::write(
            &mut f,
            &[
                ("general.architecture", &arch),
                ("llama.attention.head_count", &heads),
                ("tokenizer.ggml.tokens", &toks),
            ],
            &[
                ("blk.0.attn_q.weight", &q8),
                ("blk.0.ffn_up.weight", &q41),
                ("blk.0.ffn_down.weight", &qk),
                ("output_norm.weight", &norm),
            ],
        )?;
        drop(f);
        std::fs::read(&path)?
    };
    Ok(vec![
        vec![("model.gguf".into(), gguf)],
        vec![("model.safetensors".into(), single)],
        vec![
            (INDEX.into(), serde_json::to_vec_pretty(&index)?),
            (SHARDS[0].into(), shard0),
            (SHARDS[1].into(), shard1),
        ],
    ])
}

/// Values that sit on the edges of what a parser must handle.
fn interesting(rng: &mut Rng, len: usize) -> u64 {
    let l = len as u64;
    let random = rng.next() % (l + 16);
    *rng.pick(&[
        0,
        1,
        2,
        7,
        8,
        l.saturating_sub(8),
        l.saturating_sub(1),
        l,
        l + 1,
        255,
        65_536,
        1 << 31,
        1 << 32,
        (1 << 32) - 1,
        1 << 40,
        1 << 62,
        i64::MAX as u64,
        u64::MAX,
        random,
    ])
}

/// Edits one JSON value somewhere inside `v` (a header or an index).
fn mutate_json(v: &mut Value, rng: &mut Rng, len: usize) {
    let paths = [
        "../outside.safetensors",
        "/etc/passwd",
        "",
        ".",
        "sub/../../x.safetensors",
        "model-00001-of-00002.safetensors/..",
        SHARDS[0],
        SHARDS[1],
        "model.safetensors.index.json",
    ];
    let dtypes = [
        "F32", "F16", "BF16", "F64", "I64", "U32", "U8", "I32", "I8", "BOOL", "F4", "F6_E2M3",
        "F8_E4M3", "U64", "C64", "Q9", "",
    ];
    let interesting_v = json!(interesting(rng, len));
    match v {
        Value::Object(map) => {
            if map.is_empty() || rng.below(8) == 0 {
                let key = rng.pick(&["w", "__metadata__", "weight_map", "x.weight", ""]);
                map.insert(
                    key.to_string(),
                    json!({"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}),
                );
                return;
            }
            let keys: Vec<String> = map.keys().cloned().collect();
            let key = rng.pick(&keys).clone();
            match rng.below(10) {
                0 => {
                    map.remove(&key);
                }
                1 => {
                    if let Some(val) = map.remove(&key) {
                        map.insert(format!("{key}{}", rng.below(3)), val);
                    }
                }
                2 if key == "dtype" => {
                    map.insert(key, json!(rng.pick(&dtypes)));
                }
                3 => {
                    map.insert(key, json!(rng.pick(&paths)));
                }
                4 => {
                    map.insert(key, interesting_v);
                }
                _ => {
                    if let Some(child) = map.get_mut(&key) {
                        mutate_json(child, rng, len);
                    }
                }
            }
        }
        Value::Array(items) => match rng.below(6) {
            0 => items.push(interesting_v),
            1 => {
                items.pop();
            }
            2 => items.reverse(),
            _ if !items.is_empty() => {
                let i = rng.below(items.len());
                if items[i].is_number() || rng.below(2) == 0 {
                    items[i] = interesting_v;
                } else {
                    mutate_json(&mut items[i], rng, len);
                }
            }
            _ => items.push(json!(0)),
        },
        Value::String(s) => {
            *s = if rng.below(2) == 0 {
                rng.pick(&dtypes).to_string()
            } else {
                rng.pick(&paths).to_string()
            };
        }
        other => *other = interesting_v,
    }
}

/// Splits a safetensors file into its JSON header and the data after it.
fn split_header(bytes: &[u8]) -> Option<(Value, Vec<u8>)> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header = bytes.get(8..8usize.checked_add(n)?)?;
    Some((
        serde_json::from_slice(header).ok()?,
        bytes[8 + n..].to_vec(),
    ))
}

fn join_header(header: &Value, data: &[u8]) -> Vec<u8> {
    let text = serde_json::to_vec(header).unwrap_or_default();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(data);
    out
}

/// Applies 1 to 4 mutations to one file of the input.
fn mutate(input: &mut Input, rng: &mut Rng) {
    for _ in 0..1 + rng.below(4) {
        let i = rng.below(input.len());
        let (name, bytes) = &mut input[i];
        let len = bytes.len();
        match rng.below(9) {
            0 if len > 0 => {
                let at = rng.below(len);
                bytes[at] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let at = rng.below(len);
                bytes[at] = rng.next() as u8;
            }
            2 => bytes.truncate(rng.below(len + 1)),
            3 => bytes.extend((0..1 + rng.below(64)).map(|_| rng.next() as u8)),
            4 | 5 if len >= 8 && name.ends_with(".gguf") => {
                // Counts, lengths, dims, type ids and offsets live in the header.
                let at = rng.below(len.min(512) - 7);
                let v = interesting(rng, len);
                if rng.below(2) == 0 {
                    bytes[at..at + 4].copy_from_slice(&(v as u32).to_le_bytes());
                } else {
                    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
                }
            }
            4 if len >= 8 && name.ends_with(".safetensors") => {
                let v = interesting(rng, len);
                bytes[..8].copy_from_slice(&v.to_le_bytes());
            }
            _ if name.ends_with(".safetensors") => {
                if let Some((mut header, data)) = split_header(bytes) {
                    mutate_json(&mut header, rng, data.len());
                    *bytes = join_header(&header, &data);
                }
            }
            _ => {
                if let Ok(mut v) = serde_json::from_slice::<Value>(bytes) {
                    mutate_json(&mut v, rng, len);
                    *bytes = serde_json::to_vec(&v).unwrap_or_default();
                } else if len > 0 {
                    let at = rng.below(len);
                    bytes[at] = rng.next() as u8;
                }
            }
        }
    }
}

/// Writes the input into `dir` (emptied first).
fn write_input(dir: &Path, input: &Input) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::create_dir_all(dir)?;
    for (name, bytes) in input {
        std::fs::write(dir.join(name), bytes)?;
    }
    Ok(())
}

/// Opens the input and loads everything it claims to hold; `Ok(true)` if it was accepted.
fn exercise(dir: &Path, input: &Input) -> candle_core::Result<bool> {
    if let Some((name, bytes)) = input.iter().find(|(n, _)| n.ends_with(".gguf")) {
        return exercise_gguf(dir, name, bytes);
    }
    let src = if input.iter().any(|(n, _)| n == INDEX) {
        SafetensorsSource::from_dir(dir)?
    } else {
        SafetensorsSource::from_files(&[dir.join("model.safetensors")])?
    };
    let cpu = Device::Cpu;
    for name in src.names() {
        let _ = src.dtype(&name);
        let Ok(Some(shape)) = src.shape(&name) else {
            continue;
        };
        let _ = src.load(&name, DType::F32, &cpu);
        if let Some(&rows) = shape.dims().first() {
            for ranges in [
                &[0..rows.min(1), rows / 2..rows][..],
                std::slice::from_ref(&(rows..rows + 1)),
            ] {
                let _ = src.load_ranges(&RangeRequest {
                    name: &name,
                    dim: 0,
                    ranges,
                    dtype: DType::F32,
                    device: &cpu,
                });
            }
        }
    }
    Ok(true)
}

/// The GGUF path of `GgufSource::open` (header walk, then Candle's metadata reader) and
/// the shard cuts of every tensor it accepts: rows (plain and rotary order) and block ranges.
fn exercise_gguf(dir: &Path, name: &str, bytes: &[u8]) -> candle_core::Result<bool> {
    let path = dir.join(name);
    let header = gguf_header::scan(bytes, name)?;
    gguf_file::Content::read(&mut std::io::Cursor::new(bytes))?;
    let cpu = Device::Cpu;
    for t in &header.tensors {
        let (rows, cols) = match t.dims.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => continue,
        };
        let what = Named {
            file: &path,
            tensor: &t.name,
            hf: &t.name,
        };
        let data = &bytes[t.start..t.start + t.len];
        let orders = [
            RowOrder::Identity,
            RowOrder::rotary(rows, 1).unwrap_or(RowOrder::Identity),
        ];
        for order in &orders {
            let _ = quant_shard::shard(
                &what,
                data,
                t.dtype,
                (rows, cols),
                order,
                0,
                std::slice::from_ref(&(0..rows.div_ceil(2))),
                &cpu,
            );
        }
        let half = cols / 2;
        for r in [0..half.max(1), half..cols, 1..cols, cols..cols + 1] {
            let _ = quant_shard::shard(
                &what,
                data,
                t.dtype,
                (rows, cols),
                &RowOrder::Identity,
                1,
                std::slice::from_ref(&r),
                &cpu,
            );
        }
    }
    Ok(true)
}

fn save(out: &Path, what: &str, input: &Input) -> PathBuf {
    let dir = out.join(what);
    if let Err(e) = write_input(&dir, input) {
        eprintln!(
            "fuzz_checkpoint: cannot save the failing input to {}: {e}",
            dir.display()
        );
    }
    dir
}

fn main() -> Result<()> {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    }) | 1;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let scratch = args.out.join("scratch");
    std::fs::create_dir_all(&scratch)?;
    let seeds = seeds(&scratch)?;
    let mut rng = Rng(seed);

    // Panics are expected to be caught: keep their message, print nothing.
    let last_panic: Arc<Mutex<String>> = Arc::default();
    let sink = Arc::clone(&last_panic);
    std::panic::set_hook(Box::new(move |info| {
        if let Ok(mut s) = sink.lock() {
            *s = info.to_string();
        }
    }));

    // The watchdog: a case over the limit saves its input and stops the process.
    let current: Arc<Mutex<Input>> = Arc::default();
    let case_started = Arc::new(AtomicU64::new(0));
    let epoch = Instant::now();
    {
        let (current, case_started, out) = (
            Arc::clone(&current),
            Arc::clone(&case_started),
            args.out.clone(),
        );
        let limit = Duration::from_millis(args.case_limit_ms);
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(50));
            let started = case_started.load(Ordering::SeqCst);
            if started != 0 && epoch.elapsed() > Duration::from_nanos(started) + limit {
                let input = current.lock().map(|i| i.clone()).unwrap_or_default();
                let dir = save(&out, "hang", &input);
                eprintln!(
                    "fuzz_checkpoint: a case ran over {} ms; input saved in {}",
                    limit.as_millis(),
                    dir.display()
                );
                std::process::exit(3);
            }
        });
    }

    let deadline = Duration::try_from_secs_f64(args.seconds).context("--seconds")?;
    LIMIT.store(args.max_alloc_mb << 20, Ordering::SeqCst);
    let work = scratch.join("case");
    let (mut cases, mut accepted, mut refused, mut panics) = (0u64, 0u64, 0u64, 0u64);
    let start = Instant::now();
    while start.elapsed() < deadline {
        let mut input = rng.pick(&seeds).clone();
        mutate(&mut input, &mut rng);
        write_input(&work, &input)?;
        if let Ok(mut c) = current.lock() {
            c.clone_from(&input);
        }
        // Saved up front, so that an abort on an over-limit allocation leaves it behind.
        if cases % 64 == 0 || OVER.load(Ordering::SeqCst) {
            let _ = write_input(&args.out.join("current"), &input);
        }
        case_started.store(epoch.elapsed().as_nanos() as u64, Ordering::SeqCst);
        ARMED.store(true, Ordering::SeqCst);
        let result = catch_unwind(AssertUnwindSafe(|| exercise(&work, &input)));
        ARMED.store(false, Ordering::SeqCst);
        case_started.store(0, Ordering::SeqCst);
        cases += 1;
        match result {
            Ok(Ok(_)) => accepted += 1,
            Ok(Err(_)) => refused += 1,
            Err(_) => {
                panics += 1;
                let dir = save(&args.out, &format!("panic-{panics}"), &input);
                let msg = last_panic.lock().map(|s| s.clone()).unwrap_or_default();
                eprintln!(
                    "fuzz_checkpoint: PANIC ({msg}); input saved in {}",
                    dir.display()
                );
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&scratch);
    let _ = std::fs::remove_dir_all(args.out.join("current"));
    println!(
        "{{\"seed\": {seed}, \"seconds\": {secs:.1}, \"cases\": {cases}, \"cases_per_s\": {:.0}, \
         \"accepted\": {accepted}, \"refused\": {refused}, \"panics\": {panics}, \"hangs\": 0, \
         \"over_alloc\": 0}}",
        cases as f64 / secs
    );
    std::io::stdout().flush()?;
    if panics > 0 {
        std::process::exit(1);
    }
    Ok(())
}
