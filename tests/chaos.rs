//! A shortened `scripts/chaos.sh` inside `cargo test`: one run of each fault that needs no
//! checkpoint (SIGKILL during the rendezvous and inside an all-reduce, SIGSTOP inside an
//! all-reduce with a 2 s timeout, a rank exiting 0 early), on the debug binaries that
//! `cargo test` builds. The script checks each run (non-zero exit, time bound, the failing rank
//! named, no process and no segment left) and its last line sums them up as JSON.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// The tests of this file one at a time: chaos.sh counts the `candle-tp-*` files of
/// /dev/shm that a run leaves, and the other test puts one there on purpose.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `target/<profile>/deps/chaos-<hash>` -> (`target`, `<profile>`).
fn target_and_profile() -> Option<(PathBuf, String)> {
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    let profile = profile_dir.file_name()?.to_string_lossy().into_owned();
    Some((profile_dir.parent()?.to_path_buf(), profile))
}

#[test]
fn chaos_quick_every_fault_is_torn_down_and_cleaned_up() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (target, profile) = target_and_profile().expect("test binary under target/<profile>/deps");
    let tprun = PathBuf::from(env!("CARGO_BIN_EXE_tprun"));
    assert_eq!(
        tprun.parent(),
        Some(target.join(&profile).as_path()),
        "tprun and the examples must come from the same target dir"
    );
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/chaos.sh");
    let mut cmd = Command::new("bash");
    cmd.arg(&script)
        .args(["--no-build", "--runs", "1", "--cases"])
        .arg("rendezvous-kill,allreduce-kill,collective-stop,exit0-early")
        .env("CARGO_TARGET_DIR", &target);
    if profile == "debug" {
        cmd.arg("--debug");
    }
    let start = Instant::now();
    let out = cmd.output().expect("run scripts/chaos.sh");
    let took = start.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let context = format!("stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        out.status.success(),
        "chaos.sh failed ({})\n{context}",
        out.status
    );
    let last = stdout.lines().last().unwrap_or_default();
    let summary: serde_json::Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("last line is not JSON: {e}\n{context}"));
    assert_eq!(summary["cases"], 4, "{context}");
    assert_eq!(summary["runs"], 4, "{context}");
    assert_eq!(summary["passes"], 4, "{context}");
    assert_eq!(summary["leaked_segments"], 0, "{context}");
    assert_eq!(summary["leftover_processes"], 0, "{context}");
    // The slowest case is the stopped rank: 2 s of CANDLE_TP_TIMEOUT, then the teardown.
    let worst = summary["worst_teardown_s"].as_f64().unwrap_or(f64::NAN);
    assert!(
        worst > 0.0 && worst <= 12.0,
        "worst teardown {worst} s\n{context}"
    );
    assert!(took < Duration::from_secs(60), "took {took:?}\n{context}");
    for case in [
        "rendezvous-kill",
        "allreduce-kill",
        "collective-stop",
        "exit0-early",
    ] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(case) && l.split_whitespace().nth(2) == Some("1")),
            "no passing row for {case}\n{context}"
        );
    }
}

/// Issue 44: a host whose every rank was SIGKILLed keeps the region its ranks had made and not
/// all mapped (no survivor to remove it, no SIGTERM). The next job of the user on the host
/// removes such a segment: one of `/dev/shm` left untouched for ten minutes whose region names
/// no live process. Made here as such a job leaves it (the engine's magic, two ranks, a pid
/// that has exited) and aged an hour; a 2-rank job then runs, removes it and says so. Failed
/// before: the segment stayed.
#[test]
fn the_next_job_sweeps_a_segment_that_no_rank_survived() {
    use std::io::Write;
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // The region's on-disk layout (src/comm/engine/layout.rs): magic, rank count, ..., then
    // 512-byte records after a 256-byte header, each with its rank's pid at byte 8.
    const MAGIC: u64 = 0x7074_656c_646e_6163;
    let dead = {
        let mut child = Command::new("true").spawn().expect("spawn true");
        let pid = child.id();
        child.wait().expect("wait true");
        pid
    };
    let name = format!("candle-tp-sweeptest{}-0000000000000000", std::process::id());
    let path = PathBuf::from("/dev/shm").join(&name);
    let mut bytes = vec![0u8; 256 + 2 * 512];
    bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
    bytes[8..16].copy_from_slice(&2u64.to_le_bytes());
    bytes[256 + 8..256 + 12].copy_from_slice(&dead.to_le_bytes());
    let mut f = std::fs::File::create(&path).expect("create the segment");
    f.write_all(&bytes).expect("write the segment");
    f.set_modified(std::time::SystemTime::now() - Duration::from_secs(3600))
        .expect("age the segment");
    drop(f);
    let (target, profile) = target_and_profile().expect("test binary under target/<profile>/deps");
    let out = Command::new(env!("CARGO_BIN_EXE_tprun"))
        .args(["--standalone", "--nproc-per-node", "2"])
        .arg(target.join(&profile).join("examples/chaos_worker"))
        .args(["allreduce", "--seconds", "0.2"])
        .env_remove("CANDLE_TP_TOKEN")
        .output()
        .expect("run the job");
    let text = common::output_text(&out);
    let left = path.exists();
    let _ = std::fs::remove_file(&path);
    assert!(out.status.success(), "the job failed:\n{text}");
    assert!(
        !left,
        "the stale segment {name} is still in /dev/shm:\n{text}"
    );
    assert!(
        text.contains("removed") && text.contains(&name),
        "the job did not say what it removed:\n{text}"
    );
}
