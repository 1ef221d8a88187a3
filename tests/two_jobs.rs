//! Two jobs on one host at the same time (different ports) never share segments or ranks,
//! and a process with another job's address but not its token cannot join it.
//!
//! The workers are `examples/chaos_worker` with `--check`: every rank checks each all-reduce
//! result against the sum of its own job's contributions, so a rank (or a segment) shared
//! between the jobs would give a wrong sum, a wrong world size or a hang.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One test at a time: the machine has two cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(|p| p.parent())
        .expect("profile dir")
        .join("examples")
        .join(name)
}

/// A tprun job of `nproc` chaos workers in the all-reduce loop for `seconds`.
fn job(nproc: usize, port: Option<u16>, seconds: f64) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tprun"));
    match port {
        Some(p) => cmd.args(["--master-port", &p.to_string()]),
        None => cmd.arg("--standalone"),
    };
    cmd.args([
        "--grace-period",
        "1",
        "--nproc-per-node",
        &nproc.to_string(),
    ])
    .arg(example("chaos_worker"))
    .args([
        "allreduce",
        "--check",
        "--elems",
        "4096",
        "--seconds",
        &seconds.to_string(),
    ])
    .env("CANDLE_TP_TIMEOUT", "20")
    .env_remove("CANDLE_TP_TOKEN")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("start tprun")
}

/// Waits for `child` at most `limit`, killing it past that.
fn finish(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if child.try_wait().ok().flatten().is_none() {
        let _ = child.kill();
    }
    child.wait_with_output().expect("collect tprun output")
}

/// Rank 0's JSON line: (iterations, world_size, start, end).
fn summary(out: &Output) -> (u64, u64, f64, f64) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("[rank 0] "))
        .unwrap_or_else(|| panic!("no line from rank 0 in {stdout}"));
    let v: serde_json::Value = serde_json::from_str(line).expect("rank 0 prints JSON");
    (
        v["iterations"].as_u64().unwrap_or(0),
        v["world_size"].as_u64().unwrap_or(0),
        v["start"].as_f64().unwrap_or(f64::NAN),
        v["end"].as_f64().unwrap_or(f64::NAN),
    )
}

fn describe(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn two_concurrent_jobs_keep_their_own_ranks_and_results() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Different world sizes, so a rank joining the wrong job would show in the sums.
    let a = job(2, None, 2.0);
    let b = job(3, None, 2.0);
    let (a, b) = (
        finish(a, Duration::from_secs(60)),
        finish(b, Duration::from_secs(60)),
    );
    assert!(a.status.success(), "job A failed\n{}", describe(&a));
    assert!(b.status.success(), "job B failed\n{}", describe(&b));
    let (ia, wa, sa, ea) = summary(&a);
    let (ib, wb, sb, eb) = summary(&b);
    assert_eq!((wa, wb), (2, 3), "world sizes");
    assert!(ia > 0 && ib > 0, "iterations {ia} and {ib}");
    // They really ran at the same time: their all-reduce loops overlap.
    assert!(
        sa < eb && sb < ea,
        "loops [{sa}, {ea}] and [{sb}, {eb}] do not overlap"
    );
    for (out, world) in [(&a, 2), (&b, 3)] {
        let text = String::from_utf8_lossy(&out.stderr);
        for r in 0..world {
            assert!(
                text.contains(&format!("[rank {r}] chaos: rank {r} done after")),
                "rank {r} did not finish\n{}",
                describe(out)
            );
        }
        assert!(
            !text.contains(&format!("[rank {world}]")),
            "an extra rank\n{}",
            describe(out)
        );
    }
}

#[test]
fn a_process_without_the_job_token_cannot_join_a_running_job() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let victim_job = job(2, Some(port), 3.0);
    // Give rank 0 time to listen, then knock with another token, as rank 1 of a 2-rank job.
    std::thread::sleep(Duration::from_millis(500));
    let intruder = Command::new(example("chaos_worker"))
        .args(["allreduce", "--seconds", "1"])
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("CANDLE_TP_TOKEN", "not-the-token-of-that-job")
        .env("CANDLE_TP_TIMEOUT", "3")
        .output()
        .expect("run the intruder");
    let job_out = finish(victim_job, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&intruder.stderr);
    assert!(!intruder.status.success(), "the intruder joined\n{err}");
    assert!(err.contains("different job tokens"), "{err}");
    assert!(
        job_out.status.success(),
        "the job was disturbed\n{}",
        describe(&job_out)
    );
    let (iterations, world, _, _) = summary(&job_out);
    assert_eq!(world, 2);
    assert!(iterations > 0);
}
