//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod dense;
pub mod families;
pub mod hosts;
pub mod json_schema;
pub mod moe_gguf;
pub mod quantized;
#[cfg(feature = "server")]
pub mod serve;
pub mod train;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Result, Tensor, Var};

/// The converted SmolLM2-135M-Instruct directory (`scripts/fetch-models.sh`), checked to hold
/// its weights.
/// A test that cannot run on this machine (no root, no `mpirun`, no `ip netns`) calls this
/// and returns. Where every test must run (`CI` set, or `CANDLE_TP_NO_SKIPS`, which
/// `scripts/test.sh` sets when it runs as root and can install what the tests need) it fails
/// instead, naming why; elsewhere it prints `SKIPPED: why` and writes the line to
/// `$CANDLE_TP_SKIP_LOG`, so that `scripts/test.sh` counts and lists every skip in its
/// summary (a passing test's output is otherwise hidden by cargo).
#[allow(dead_code)]
pub fn skip(why: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("a test")
        .to_string();
    let strict = ["CI", "CANDLE_TP_NO_SKIPS"]
        .into_iter()
        .find(|v| std::env::var_os(v).is_some_and(|x| !x.is_empty()));
    if let Some(var) = strict {
        panic!("{test} must run here ({var} is set), but it would skip: {why}");
    }
    eprintln!("SKIPPED: {why}");
    if let Some(path) = std::env::var_os("CANDLE_TP_SKIP_LOG") {
        use std::io::Write;
        let exe = std::env::current_exe().ok();
        let bin = exe
            .as_deref()
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let bin = bin
            .rsplit_once('-')
            .map_or(&bin[..], |(b, _)| b)
            .to_string();
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "tests/{bin}.rs {test}: {why}");
        }
    }
}

pub fn smollm2_dir() -> std::path::PathBuf {
    let dir = candle_tp::models::models_dir()
        .expect("models directory")
        .join("smollm2-135m-instruct");
    assert!(
        dir.join("model.safetensors").is_file(),
        "{} is missing: run scripts/fetch-models.sh",
        dir.display()
    );
    dir
}

/// The path of SmolLM2's `dtype` GGUF in the model cache, written from the shipped Q4_1 file
/// by [`candle_tp::convert::requantize_gguf`] when missing (idempotent: an existing file is
/// kept).
pub fn smollm2_gguf(dtype: GgmlDType) -> Result<std::path::PathBuf> {
    let dir = candle_tp::models::models_dir()?;
    let shipped = dir.join("smollm2-135m-instruct.Q4_1.gguf");
    let name = format!("{dtype:?}").replace('K', "_K");
    let path = dir.join(format!("smollm2-135m-instruct.{name}.gguf"));
    // One writer per process (tests run in threads); processes write under their own names.
    static WRITING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = WRITING.lock().unwrap_or_else(|p| p.into_inner());
    if dtype == GgmlDType::Q4_1 || path.is_file() {
        return Ok(if dtype == GgmlDType::Q4_1 {
            shipped
        } else {
            path
        });
    }
    if !shipped.is_file() {
        candle_core::bail!(
            "{} is missing: run scripts/fetch-models.sh",
            shipped.display()
        );
    }
    candle_tp::convert::requantize_gguf(&shipped, dtype, &path)?;
    Ok(path)
}

/// A tensor of deterministic pseudo-random values in [-1, 1), the same on every rank and
/// every run.
pub fn seeded(shape: &[usize], seed: u64) -> Tensor {
    candle_tp::rng::seeded_uniform(shape, seed, 1.0, &Device::Cpu).expect("shape matches data")
}

/// Largest absolute difference of two tensors of the same shape, and an error if either holds
/// a non-finite value (NaN or ±Inf).
///
/// Finiteness is checked explicitly, on the host: Candle's CPU `max` skips NaN after the first
/// element, so `max(|a - b|) <= tol` alone passes on NaN output.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let host = |t: &Tensor, which: &str| -> Result<Vec<f32>> {
        let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        if let Some((i, x)) = v.iter().enumerate().find(|(_, x)| !x.is_finite()) {
            candle_core::bail!(
                "non-finite value {x} at flat index {i} of the {which} tensor (shape {:?})",
                t.dims()
            );
        }
        Ok(v)
    };
    let (a, b) = (host(a, "first")?, host(b, "second")?);
    Ok(a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max))
}

/// Errors if `t` holds a non-finite value (NaN or ±Inf), naming `what`.
pub fn assert_finite(what: &str, t: &Tensor) -> Result<()> {
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    match v.iter().position(|x| !x.is_finite()) {
        Some(i) => candle_core::bail!("{what}: non-finite value {} at flat index {i}", v[i]),
        None => Ok(()),
    }
}

/// A trainable copy of `t`.
pub fn var(t: &Tensor) -> Var {
    Var::from_tensor(t).expect("var")
}

/// Path of a built example binary next to this test binary
/// (`target/<profile>/deps/<test>-<hash>` → `target/<profile>/examples/<name>`).
/// `cargo test` builds the examples; a test run alone may need `cargo build --example NAME`.
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let path = exe
        .parent()
        .and_then(|p| p.parent())
        .expect("profile dir")
        .join("examples")
        .join(name);
    assert!(
        path.is_file(),
        "{} is not built: run `cargo test` (which builds the examples) or `cargo build --example {name}`",
        path.display()
    );
    path
}

/// The names of candle-tp's shared-memory segments in /dev/shm now (`candle-tp-*`).
pub fn ours_in_dev_shm() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("candle-tp-"))
                .collect()
        })
        .unwrap_or_default()
}

/// Runs `examples/generate` with `args` on `nproc` ranks (a plain process for 1, else under
/// `tprun --standalone`) and returns rank 0's final JSON line (`token_ids`, `rss_bytes`, ...);
/// panics with the whole output when it fails or prints no JSON.
pub fn run_generate(nproc: usize, args: &[String]) -> serde_json::Value {
    use std::process::Command;
    let out = if nproc == 1 {
        Command::new(example("generate")).args(args).output()
    } else {
        Command::new(env!("CARGO_BIN_EXE_tprun"))
            .args(["--standalone", "--nproc-per-node", &nproc.to_string()])
            .arg(example("generate"))
            .args(args)
            .output()
    }
    .expect("start examples/generate");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let all = format!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "examples/generate on {nproc} ranks ({args:?}) failed:\n{all}"
    );
    let json = stdout
        .lines()
        .map(|l| l.strip_prefix("[rank 0] ").unwrap_or(l))
        .rfind(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("examples/generate printed no JSON line:\n{all}"));
    serde_json::from_str(json).unwrap_or_else(|e| panic!("bad JSON {json}: {e}"))
}

/// Every rank's `RssAnon` after loading (bytes), from [`run_generate`]'s report.
pub fn rss_of(nproc: usize, args: &[&str]) -> Vec<f64> {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    run_generate(nproc, &args)["rss_bytes"]
        .as_array()
        .expect("rss_bytes")
        .iter()
        .map(|b| b.as_f64().expect("number"))
        .collect()
}

/// A `ShardedVarBuilder` over in-memory f32 CPU tensors `(name, tensor)`.
pub fn builder_from(
    tensors: &[(&str, &Tensor)],
    pg: &candle_tp::ProcessGroup,
) -> candle_tp::ShardedVarBuilder {
    let map = tensors
        .iter()
        .map(|(n, t)| (n.to_string(), (*t).clone()))
        .collect();
    candle_tp::ShardedVarBuilder::from_tensors(map, DType::F32, &Device::Cpu, pg.clone())
}

/// The dense parameters of an MLP and a LayerNorm, as the 2D/3D load tests use them:
/// `mlp.fc1.*` `[h, d]`, `mlp.fc2.*` `[d, h]`, `norm.*` `[d]`.
pub struct DenseMlpNorm {
    pub w1: Tensor,
    pub b1: Tensor,
    pub w2: Tensor,
    pub b2: Tensor,
    pub g: Tensor,
    pub beta: Tensor,
}

impl DenseMlpNorm {
    pub fn new(d: usize, h: usize) -> Self {
        let scaled = |shape: &[usize], seed: u64, s: f64| (seeded(shape, seed) * s).expect("scale");
        DenseMlpNorm {
            w1: scaled(&[h, d], 10, 1.0 / (d as f64).sqrt()),
            b1: scaled(&[h], 11, 0.1),
            w2: scaled(&[d, h], 20, 1.0 / (h as f64).sqrt()),
            b2: scaled(&[d], 21, 0.1),
            g: seeded(&[d], 30),
            beta: seeded(&[d], 31),
        }
    }

    /// The builder holding these tensors under their dense names.
    pub fn builder(&self, pg: &candle_tp::ProcessGroup) -> candle_tp::ShardedVarBuilder {
        builder_from(
            &[
                ("mlp.fc1.weight", &self.w1),
                ("mlp.fc1.bias", &self.b1),
                ("mlp.fc2.weight", &self.w2),
                ("mlp.fc2.bias", &self.b2),
                ("norm.weight", &self.g),
                ("norm.bias", &self.beta),
            ],
            pg,
        )
    }

    /// The dense MLP `fc2(gelu(fc1(x)))`.
    pub fn mlp(&self, x: &Tensor) -> Result<Tensor> {
        use candle_core::Module;
        let fc1 = candle_nn::Linear::new(self.w1.clone(), Some(self.b1.clone()));
        let fc2 = candle_nn::Linear::new(self.w2.clone(), Some(self.b2.clone()));
        fc2.forward(&candle_nn::Activation::Gelu.forward(&fc1.forward(x)?)?)
    }
}

/// Checks the per-rank results of a load test: `(largest difference between the loaded
/// blocks and the test's slices, largest forward error)`; the blocks must be exact.
pub fn assert_loaded(errs: Vec<(f32, f32)>, tol: f32) {
    for (rank, (slices, forward)) in errs.into_iter().enumerate() {
        assert_eq!(
            slices, 0.0,
            "rank {rank}: loaded blocks differ from the slices"
        );
        assert!(forward < tol, "rank {rank}: forward differs by {forward}");
    }
}

/// A finished process's stdout then stderr, as text (for assertions and failure messages).
/// `text` without mpirun's `--tag-output` tags (`[1,3]<stderr>:`), wherever they stand: a
/// rank's line that reached mpirun in several writes is cut by a tag at each, and reads whole
/// again here.
pub fn untagged(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("[1,") {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        let tag_end = tail.find(']').and_then(|close| {
            let after = &tail[close + 1..];
            ["<stdout>:", "<stderr>:"]
                .iter()
                .find(|t| after.starts_with(*t))
                .map(|t| close + 1 + t.len())
        });
        let digits = tail[3..]
            .find(']')
            .is_some_and(|n| n > 0 && tail[3..3 + n].bytes().all(|b| b.is_ascii_digit()));
        match tag_end {
            Some(end) if digits => rest = &tail[end..],
            _ => {
                out.push_str("[1,");
                rest = &tail[3..];
            }
        }
    }
    out.push_str(rest);
    out
}

pub fn output_text(out: &std::process::Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
