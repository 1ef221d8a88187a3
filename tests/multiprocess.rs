//! Real processes: `tprun` launching ranks that meet over the shm backend.
//!
//! The worker is this very test binary, re-executed under `tprun` with `--ignored --exact
//! worker` and a scenario in `CANDLE_TP_SCENARIO`; the `worker` test does nothing when run
//! normally.

mod common;

use common::example;

use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_tp::comm::ReduceOp;

/// One multi-process job at a time: the machine has two cores and the checks of /dev/shm
/// must not see another test's segments.
static SERIAL: Mutex<()> = Mutex::new(());

fn tprun() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tprun"))
}

fn run_scenario(scenario: &str, nproc: usize, extra_env: &[(&str, &str)]) -> (Output, Duration) {
    let mut cmd = tprun();
    cmd.args([
        "--standalone",
        "--grace-period",
        "2",
        "--nproc-per-node",
        &nproc.to_string(),
    ])
    .arg(std::env::current_exe().expect("test binary"))
    .args([
        "--ignored",
        "--exact",
        "worker",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env("CANDLE_TP_SCENARIO", scenario);
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let t0 = Instant::now();
    let out = cmd.output().expect("run tprun");
    (out, t0.elapsed())
}

fn text(out: &Output) -> String {
    common::output_text(out)
}

/// The worker side of every scenario; a no-op unless started by one of the tests below.
#[test]
#[ignore]
fn worker() {
    let Ok(scenario) = std::env::var("CANDLE_TP_SCENARIO") else {
        return;
    };
    if let Err(e) = run_worker(&scenario) {
        eprintln!("worker error: {e}");
        std::process::exit(1);
    }
}

fn run_worker(scenario: &str) -> candle_core::Result<()> {
    let pg = candle_tp::init_from_env(&candle_core::Device::Cpu)?;
    let (rank, world) = (pg.rank(), pg.size());
    if let Ok(dir) = std::env::var("CANDLE_TP_PID_DIR") {
        std::fs::write(format!("{dir}/{rank}"), std::process::id().to_string())?;
    }
    match scenario {
        "collectives" => {
            // Exact sums over processes, large enough for the chunked path too.
            for n in [5usize, 100_000, 3_000_000] {
                let mut v: Vec<f32> = (0..n).map(|i| ((i + rank) % 13) as f32).collect();
                pg.all_reduce_slice(&mut v, ReduceOp::Sum)?;
                for (i, x) in v.iter().enumerate().step_by(997) {
                    let want: f32 = (0..world).map(|r| ((i + r) % 13) as f32).sum();
                    assert_eq!(*x, want, "all_reduce n={n} i={i}");
                }
            }
            let counts: Vec<usize> = (0..world).map(|r| 1000 + r).collect();
            let mine: Vec<i64> = (0..counts[rank])
                .map(|i| (rank * 10_000 + i) as i64)
                .collect();
            let mut all = vec![0i64; counts.iter().sum()];
            pg.all_gather_v_slice(&mine, &mut all, &counts)?;
            let mut off = 0;
            for (r, &c) in counts.iter().enumerate() {
                assert!(all[off..off + c]
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| x == (r * 10_000 + i) as i64));
                off += c;
            }
            let sub = pg.split(Some((rank % 2) as u32))?.expect("member");
            let mut s = [rank as f64];
            sub.all_reduce_slice(&mut s, ReduceOp::Sum)?;
            let want: f64 = (0..world)
                .filter(|r| r % 2 == rank % 2)
                .map(|r| r as f64)
                .sum();
            assert_eq!(s[0], want);
            // Point-to-point between processes: a ring, even ranks sending first, a message
            // of several slots.
            let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
            let mine: Vec<f32> = (0..1_500_000).map(|i| (rank * 7 + i % 11) as f32).collect();
            let mut got = vec![0f32; mine.len()];
            if rank % 2 == 0 {
                pg.send_slice(&mine, next)?;
                pg.recv_slice(&mut got, prev)?;
            } else {
                pg.recv_slice(&mut got, prev)?;
                pg.send_slice(&mine, next)?;
            }
            assert!(got
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (prev * 7 + i % 11) as f32));
            pg.barrier()?;
            println!("collectives ok on rank {rank}");
        }
        "fail" => {
            let mut v = [1f32; 8];
            pg.all_reduce_slice(&mut v, ReduceOp::Sum)?;
            if rank == 1 {
                eprintln!("rank 1 gives up: simulated failure");
                std::process::exit(3);
            }
            loop {
                pg.all_reduce_slice(&mut v, ReduceOp::Sum)?;
            }
        }
        "stall" => {
            if rank == 1 {
                std::thread::sleep(Duration::from_secs(60));
            }
            let mut v = [1f32; 8];
            pg.all_reduce_slice(&mut v, ReduceOp::Sum)?;
        }
        other => candle_core::bail!("unknown scenario {other}"),
    }
    Ok(())
}

#[test]
fn collectives_across_two_and_three_processes() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for n in [2, 3] {
        let (out, _) = run_scenario("collectives", n, &[]);
        let t = text(&out);
        assert!(out.status.success(), "{t}");
        for r in 0..n {
            let prefix = format!("[rank {r}] ");
            let ok = format!("collectives ok on rank {r}");
            assert!(
                t.lines().any(|l| l.starts_with(&prefix) && l.contains(&ok)),
                "{t}"
            );
        }
    }
    assert!(
        common::ours_in_dev_shm().is_empty(),
        "leaked: {:?}",
        common::ours_in_dev_shm()
    );
}

#[test]
fn mlp_example_matches_dense_on_2_3_and_4_processes() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for n in [2, 3, 4] {
        let out = tprun()
            .args(["--standalone", "--nproc-per-node", &n.to_string()])
            .arg(example("mlp"))
            .args(["--d-model", "64", "--seq-len", "8"])
            .output()
            .expect("run tprun");
        let t = text(&out);
        assert!(out.status.success(), "{t}");
        let json = t
            .lines()
            .filter_map(|l| l.strip_prefix("[rank 0] "))
            .rfind(|l| l.starts_with('{'))
            .unwrap_or_else(|| panic!("no JSON line: {t}"));
        let v: serde_json::Value = serde_json::from_str(json).expect("JSON");
        assert_eq!(v["world_size"], n);
        for key in [
            "max_abs_err_out",
            "max_abs_err_grad_input",
            "max_abs_err_grad_weight",
            "max_abs_err_grad_bias",
        ] {
            let e = v[key].as_f64().expect(key);
            assert!(e <= 1e-5, "{key} = {e} with {n} ranks");
        }
    }
}

#[test]
fn a_rank_that_fails_stops_the_job_and_is_named() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("candle-tp-pids-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (out, took) = run_scenario("fail", 3, &[("CANDLE_TP_PID_DIR", dir.to_str().unwrap())]);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        took < Duration::from_secs(10),
        "teardown took {took:?}: {t}"
    );
    assert!(t.contains("rank 1") && t.contains("failed first"), "{t}");
    assert!(t.contains("simulated failure"), "{t}");
    for r in 0..3 {
        let pid = std::fs::read_to_string(dir.join(r.to_string())).unwrap_or_default();
        if !pid.is_empty() {
            assert!(
                !std::path::Path::new(&format!("/proc/{pid}")).exists(),
                "rank {r} (pid {pid}) survived"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        common::ours_in_dev_shm().is_empty(),
        "leaked: {:?}",
        common::ours_in_dev_shm()
    );
}

#[test]
fn a_rank_that_never_arrives_times_out_naming_it() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (out, took) = run_scenario("stall", 2, &[("CANDLE_TP_TIMEOUT", "2")]);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(t.contains("timeout in all_reduce on group 'world'"), "{t}");
    assert!(t.contains("rank(s) 1 that never arrived"), "{t}");
    assert!(took < Duration::from_secs(15), "took {took:?}");
    assert!(
        common::ours_in_dev_shm().is_empty(),
        "leaked: {:?}",
        common::ours_in_dev_shm()
    );
}

#[test]
fn bad_environment_and_busy_port_are_clear_errors() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let worker = |envs: &[(&str, &str)]| {
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.args(["--ignored", "--exact", "worker", "--nocapture"])
            .env("CANDLE_TP_SCENARIO", "collectives");
        for v in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ] {
            c.env_remove(v);
        }
        for (k, v) in envs {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        assert!(!out.status.success());
        text(&out)
    };
    let t = worker(&[("WORLD_SIZE", "2")]);
    assert!(
        t.contains("environment variable RANK: is not set but WORLD_SIZE is"),
        "{t}"
    );
    let t = worker(&[("RANK", "5"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]);
    assert!(t.contains("RANK=5 must be below WORLD_SIZE=2"), "{t}");
    let t = worker(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "http")]);
    assert!(
        t.contains("MASTER_PORT: 'http' is not a valid number"),
        "{t}"
    );
    // A port already taken by someone else.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let out = tprun()
        .args(["--nproc-per-node", "2", "--master-port", &port])
        .arg(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "worker", "--nocapture"])
        .env("CANDLE_TP_SCENARIO", "collectives")
        .env("CANDLE_TP_TIMEOUT", "5")
        .output()
        .unwrap();
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains(&format!("127.0.0.1:{port}")) && t.contains("already in use"),
        "{t}"
    );
}
