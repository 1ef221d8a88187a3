//! What loading a quantized model leaves in memory besides the model.
//!
//! - A rank's shard of a quantized tensor is copied out of the GGUF mapping once, into the
//!   buffer its `QTensor` keeps. Candle's `QStorage::from_data` copies whatever it is given,
//!   so a shard first gathered into a buffer of the loader's own stood in memory twice at the
//!   peak. A global allocator here counts the bytes live at the peak of each cut, above what
//!   was live before it: at most the shard's bytes and a little bookkeeping.
//! - The loader gives its freed copies back to the kernel. Each quantized weight's blocks are
//!   replaced by the kernels' repacked layout as it loads; the inference binaries ask glibc
//!   to keep freed buffers below 32 MiB (`retain_freed_memory`), so the freed blocks of the
//!   last such weight stayed resident when nothing loaded after them reused the memory: the
//!   LM head's half, 26 MiB per rank of the Mixtral GGUF at ep 2 (0.63x world 1, where issue
//!   45 asks 0.6x; 0.50x since).

use std::alloc::{GlobalAlloc, Layout, System};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Result, Tensor};
use candle_tp::loader::quant_shard::{shard, Named, RowOrder};
use candle_tp::loader::WeightShard;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// One measurement at a time (the test harness runs tests on several threads).
static ONE: Mutex<()> = Mutex::new(());

// SAFETY: every call is passed on to the system allocator unchanged; the counters only watch.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::SeqCst) + l.size();
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::SeqCst) + l.size();
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::SeqCst);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            if new >= l.size() {
                let now = LIVE.fetch_add(new - l.size(), Ordering::SeqCst) + new - l.size();
                PEAK.fetch_max(now, Ordering::SeqCst);
            } else {
                LIVE.fetch_sub(l.size() - new, Ordering::SeqCst);
            }
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The shard of `ranges` along `dim`, and the most bytes that were live during the cut above
/// those live before it.
fn cut_and_peak(
    bytes: &[u8],
    dtype: GgmlDType,
    shape: (usize, usize),
    dim: usize,
    ranges: &[Range<usize>],
) -> Result<(QTensor, usize)> {
    let named = Named {
        file: Path::new("peak.gguf"),
        tensor: "output.weight",
        hf: "lm_head.weight",
    };
    let before = LIVE.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let s = shard(
        &named,
        bytes,
        dtype,
        shape,
        &RowOrder::Identity,
        dim,
        ranges,
        &Device::Cpu,
    )?;
    let peak = PEAK.load(Ordering::SeqCst) - before;
    match s {
        WeightShard::Quantized(q) => Ok((q, peak)),
        WeightShard::Dense(_) => candle_core::bail!("a whole-block shard came back dense"),
    }
}

#[test]
fn a_shard_is_copied_once() -> Result<()> {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    // 2048 x 1024 (2.2 MB as Q8_0, 1.2 MB as Q4_K): large enough that the slack is small.
    let (rows, cols) = (2048, 1024);
    let w = Tensor::arange(0f32, (rows * cols) as f32, &Device::Cpu)?
        .affine(0.013, -1.0)?
        .sin()?
        .reshape((rows, cols))?;
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4K] {
        let q = QTensor::quantize(&w, dtype)?;
        let full = q.dequantize(&Device::Cpu)?;
        let bytes = q.data()?;
        let row_bytes = bytes.len() / rows;
        // One range in a Vec is meant: a shard of one range (clippy's lint guards against
        // `vec![a..b]` written for the range's elements).
        #[allow(clippy::single_range_in_vec_init)]
        let cases: [(usize, Vec<Range<usize>>); 3] = [
            // A column-parallel (or vocabulary) shard: the second half of the rows.
            (0, vec![rows / 2..rows]),
            // A fused shard: two row ranges.
            (0, vec![0..rows / 4, rows / 2..3 * rows / 4]),
            // A row-parallel shard: the second half of every row's blocks.
            (1, vec![cols / 2..cols]),
        ];
        for (dim, ranges) in cases {
            let (s, peak) = cut_and_peak(&bytes, dtype, (rows, cols), dim, &ranges)?;
            let want = Tensor::cat(
                &ranges
                    .iter()
                    .map(|r| full.narrow(dim, r.start, r.len()))
                    .collect::<Result<Vec<_>>>()?,
                dim,
            )?;
            let got = s.dequantize(&Device::Cpu)?;
            let diff = (got - &want)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(
                diff.is_finite() && diff == 0.0,
                "{dtype:?} dim {dim} {ranges:?}: shard differs from the dense slice by {diff}"
            );
            let shard_bytes = match dim {
                0 => ranges.iter().map(|r| r.len()).sum::<usize>() * row_bytes,
                _ => rows * row_bytes / 2,
            };
            // The shard's blocks, plus the row list and Candle's small structs.
            let allowed = shard_bytes + shard_bytes / 8 + (64 << 10);
            assert!(
                peak <= allowed,
                "{dtype:?} dim {dim} {ranges:?}: {peak} bytes live at the peak of the cut for a \
                 shard of {shard_bytes} bytes (allowed {allowed}): a second copy"
            );
        }
    }
    Ok(())
}

/// This process's anonymous resident memory (`RssAnon`), in bytes.
fn rss_anon() -> usize {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: usize = s
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("an RssAnon line");
    kb << 10
}

/// The loader gives its transients back: a quantized weight's blocks are replaced by the
/// kernels' repacked layout as it loads, and with glibc keeping freed buffers below 32 MiB
/// (`retain_freed_memory`, which the binaries call before loading) the freed blocks of the
/// last such weight stayed resident when nothing loaded after them reused the memory.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn a_loaded_model_holds_its_weights_and_no_freed_copies() -> anyhow::Result<()> {
    use candle_tp::models::CausalLm;
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let file = candle_tp::models::models_dir()?.join("smollm2-135m-instruct.Q4_1.gguf");
    let bytes = std::fs::metadata(&file)?.len() as usize;
    assert!(candle_tp::retain_freed_memory());
    let before = rss_anon();
    let live_before = LIVE.load(Ordering::SeqCst);
    let model = CausalLm::from_path(
        &file,
        candle_core::DType::F32,
        &Device::Cpu,
        candle_tp::comm::ProcessGroup::single(),
    )?;
    let grown = rss_anon() - before;
    let live = LIVE.load(Ordering::SeqCst) - live_before;
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    eprintln!(
        "file {:.1} MiB; the model's live allocations {:.1} MiB; RssAnon grew {:.1} MiB",
        mib(bytes),
        mib(live),
        mib(grown)
    );
    // What the model holds (its blocks, repacked, and the rotary tables) plus 4 MiB of
    // pages that malloc's bookkeeping and partly used pages may keep.
    assert!(
        grown <= live + (4 << 20),
        "RssAnon grew by {:.1} MiB while loading, for {:.1} MiB live: freed copies stayed",
        mib(grown),
        mib(live)
    );
    drop(model);
    Ok(())
}
