//! Bad GGUF files (built from the shipped SmolLM2 Q4_1 file by truncating it or patching its
//! header bytes) give an error naming the file and the tensor or key on every rank, quickly,
//! whether the ranks are threads or `tprun` processes.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::Device;
use candle_tp::models::FromCheckpoint;
use candle_tp::models::Llama;
use candle_tp::run_threads;

fn shipped() -> Vec<u8> {
    let path = candle_tp::models::models_dir()
        .expect("models dir")
        .join("smollm2-135m-instruct.Q4_1.gguf");
    std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-models.sh)", path.display()))
}

/// Offset just after the length-prefixed string `s` where it appears as a GGUF string.
fn after_string(bytes: &[u8], s: &str) -> usize {
    let mut needle = (s.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(s.as_bytes());
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle.as_slice())
        .unwrap_or_else(|| panic!("{s} not found"));
    at + needle.len()
}

/// Every rank of 2 threads loads `path`; returns each rank's error message.
fn errors_on_every_rank(path: &Path) -> Vec<String> {
    let t0 = Instant::now();
    let errs = run_threads(2, |pg| {
        Ok(Llama::from_gguf(path, &Device::Cpu, pg)
            .err()
            .map(|e| e.to_string()))
    })
    .expect("threads");
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t0.elapsed()
    );
    errs.into_iter()
        .enumerate()
        .map(|(r, e)| e.unwrap_or_else(|| panic!("rank {r} accepted {}", path.display())))
        .collect()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).expect("write");
    p
}

#[test]
fn bad_gguf_files_are_refused_with_file_and_tensor_names() {
    let good = shipped();
    let tmp = tempfile::tempdir().expect("tmp");
    let q = "blk.0.attn_q.weight";
    // Tensor info after the name: n_dims u32, dims u64 (fastest first), type u32, offset u64.
    let info = after_string(&good, q);
    let cases: Vec<(&str, Vec<u8>, Vec<&str>)> = vec![
        (
            "truncated.gguf",
            good[..good.len() * 6 / 10].to_vec(),
            vec!["past the end of the file", "truncated", "blk."],
        ),
        (
            "header-cut.gguf",
            good[..200_000].to_vec(),
            vec!["truncated GGUF header"],
        ),
        (
            "size.gguf",
            {
                let mut b = good.clone();
                b[info + 4..info + 12].copy_from_slice(&1152u64.to_le_bytes());
                b
            },
            vec![q, "byte size disagrees"],
        ),
        (
            // Found by the checkpoint fuzzer: a shape whose element count fits in usize but
            // whose byte size does not (2^62 f32 elements are 2^64 bytes).
            "byte-overflow.gguf",
            {
                let mut b = good.clone();
                b[info + 4..info + 12].copy_from_slice(&(1u64 << 62).to_le_bytes());
                b[info + 12..info + 20].copy_from_slice(&1u64.to_le_bytes());
                b[info + 20..info + 24].copy_from_slice(&0u32.to_le_bytes()); // F32
                b
            },
            vec![q, "overflowing"],
        ),
        (
            "type.gguf",
            {
                let mut b = good.clone();
                b[info + 20..info + 24].copy_from_slice(&99u32.to_le_bytes());
                b
            },
            vec![q, "type id 99"],
        ),
        (
            "heads.gguf",
            {
                let mut b = good.clone();
                let k = after_string(&b, "llama.attention.head_count");
                b[k - 5] = b'C'; // llama.attention.head_Count: the key is gone
                b
            },
            vec!["llama.attention.head_count"],
        ),
    ];
    for (name, bytes, needles) in cases {
        let path = write(tmp.path(), name, &bytes);
        for (rank, e) in errors_on_every_rank(&path).iter().enumerate() {
            assert!(
                e.contains(&path.display().to_string()),
                "{name} rank {rank}: no file name in: {e}"
            );
            for n in &needles {
                assert!(e.contains(n), "{name} rank {rank}: {n:?} not in: {e}");
            }
            if rank == 0 {
                eprintln!("{name}: {e}");
            }
        }
    }
}

#[test]
fn tprun_processes_all_fail_on_a_truncated_file() {
    let good = shipped();
    let tmp = tempfile::tempdir().expect("tmp");
    let path = write(tmp.path(), "cut.gguf", &good[..good.len() / 2]);
    let t0 = Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tprun"))
        .args(["--standalone", "--nproc-per-node", "2"])
        .arg(common::example("generate"))
        .args([
            "--model",
            &path.display().to_string(),
            "--max-new-tokens",
            "2",
        ])
        .output()
        .expect("tprun");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t0.elapsed()
    );
    assert!(
        text.contains("cut.gguf") && text.contains("tensor blk."),
        "{text}"
    );
}
