//! A shortened `scripts/chaos.sh` inside `cargo test`: one run of each fault that needs no
//! checkpoint (SIGKILL during the rendezvous and inside an all-reduce, SIGSTOP inside an
//! all-reduce with a 2 s timeout, a rank exiting 0 early), on the debug binaries that
//! `cargo test` builds. The script checks each run (non-zero exit, time bound, the failing rank
//! named, no process and no segment left) and its last line sums them up as JSON.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// `target/<profile>/deps/chaos-<hash>` -> (`target`, `<profile>`).
fn target_and_profile() -> Option<(PathBuf, String)> {
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    let profile = profile_dir.file_name()?.to_string_lossy().into_owned();
    Some((profile_dir.parent()?.to_path_buf(), profile))
}

#[test]
fn chaos_quick_every_fault_is_torn_down_and_cleaned_up() {
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
