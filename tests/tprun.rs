//! End-to-end tests of the `tprun` launcher: real processes (`sh -c` scripts as
//! workers), checked from the outside (exit codes, console lines, log files,
//! `/proc`). Every run is bounded in time.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

/// Upper bound for any single tprun run in these tests.
const LIMIT: Duration = Duration::from_secs(15);

/// What a finished tprun run left.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Result<TempDir> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .subsec_nanos();
        let dir =
            std::env::temp_dir().join(format!("tprun-test-{name}-{}-{nanos}", std::process::id()));
        fs::create_dir_all(&dir)?;
        Ok(TempDir(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn str(&self) -> Result<&str> {
        self.0.to_str().context("temp dir path is not UTF-8")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A tprun command with a clean, deterministic environment for the variables it sets.
fn tprun(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tprun"));
    command
        .args(args)
        .env_remove("CANDLE_TP_TOKEN")
        .env_remove("RAYON_NUM_THREADS")
        .env_remove("OMP_NUM_THREADS")
        .env_remove("MKL_NUM_THREADS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Waits for a spawned tprun (killing it past [`LIMIT`]) and collects its output.
fn finish(mut child: Child, started: Instant) -> Result<Run> {
    let mut out = child.stdout.take().context("stdout not piped")?;
    let mut err = child.stderr.take().context("stderr not piped")?;
    let out = thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = out.read_to_end(&mut buf);
        buf
    });
    let err = thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = err.read_to_end(&mut buf);
        buf
    });
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            bail!("tprun did not finish within {LIMIT:?}");
        }
        thread::sleep(Duration::from_millis(10));
    };
    let elapsed = started.elapsed();
    let stdout = String::from_utf8(out.join().map_err(|_| anyhow::anyhow!("reader panicked"))?)?;
    let stderr = String::from_utf8(err.join().map_err(|_| anyhow::anyhow!("reader panicked"))?)?;
    Ok(Run {
        code: status.code(),
        stdout,
        stderr,
        elapsed,
    })
}

/// Runs tprun to completion.
fn run(mut command: Command) -> Result<Run> {
    let started = Instant::now();
    finish(command.spawn()?, started)
}

/// The `KEY=VALUE` words of every stdout line, by the rank in its `[rank N] ` prefix.
fn env_by_rank(stdout: &str) -> Result<BTreeMap<usize, BTreeMap<String, String>>> {
    let mut ranks = BTreeMap::new();
    for line in stdout.lines() {
        let rest = line
            .strip_prefix("[rank ")
            .context(format!("no prefix: {line:?}"))?;
        let (rank, body) = rest
            .split_once("] ")
            .context(format!("bad prefix: {line:?}"))?;
        let vars: BTreeMap<String, String> = body
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ranks.insert(rank.parse()?, vars);
    }
    Ok(ranks)
}

/// Worker script printing the launcher's variables on one line.
const PRINT_ENV: &str = "echo RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE \
    LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK ROLE_RANK=$ROLE_RANK \
    ROLE_WORLD_SIZE=$ROLE_WORLD_SIZE MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT \
    RUN_ID=$TORCHELASTIC_RUN_ID TOKEN=$CANDLE_TP_TOKEN RAYON=$RAYON_NUM_THREADS \
    OMP=$OMP_NUM_THREADS MKL=$MKL_NUM_THREADS";

fn cores() -> usize {
    thread::available_parallelism().map_or(1, |n| n.get())
}

/// Live (not zombie) processes whose process group is `pgid`, from `/proc/<pid>/stat`.
fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            let Some((_, after)) = stat.rsplit_once(')') else {
                return false;
            };
            let fields: Vec<&str> = after.split_whitespace().collect();
            fields.len() > 2 && fields[0] != "Z" && fields[2].parse::<u32>() == Ok(pgid)
        })
        .collect()
}

/// Reads the pids the workers wrote to `dir/pid.<rank>`.
fn worker_pids(dir: &Path, ranks: usize) -> Result<Vec<u32>> {
    (0..ranks)
        .map(|rank| {
            let path = dir.join(format!("pid.{rank}"));
            let text = fs::read_to_string(&path).context(format!("{} missing", path.display()))?;
            Ok(text.trim().parse()?)
        })
        .collect()
}

/// Asserts that no worker process (nor anything in its process group) is left
/// running; processes killed a moment ago get 1 s to be reaped.
fn assert_all_gone(pids: &[u32]) -> Result<()> {
    for &pid in pids {
        ensure!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "worker pid {pid} survived tprun"
        );
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            let left = group_members(pid);
            if left.is_empty() {
                break;
            }
            ensure!(Instant::now() < deadline, "group {pid} still has {left:?}");
            thread::sleep(Duration::from_millis(10));
        }
    }
    Ok(())
}

/// Shell snippet: write `$$` to `$D/pid.$RANK` atomically.
const WRITE_PID: &str = "echo $$ > \"$D/tmp.$RANK\" && mv \"$D/tmp.$RANK\" \"$D/pid.$RANK\"";

/// Shell snippet: wait (at most 5 s) until `$N` pid files exist.
const WAIT_PIDS: &str = "i=0; while [ \"$(ls \"$D\" | grep -c '^pid')\" -lt \"$N\" ] \
    && [ $i -lt 500 ]; do sleep 0.01; i=$((i+1)); done";

#[test]
fn three_ranks_get_their_environment() -> Result<()> {
    let mut command = tprun(&["--nproc-per-node", "3", "sh", "-c", PRINT_ENV]);
    command.env("RAYON_NUM_THREADS", "7");
    let out = run(command)?;
    ensure!(out.code == Some(0), "exit {:?}: {}", out.code, out.stderr);
    let ranks = env_by_rank(&out.stdout)?;
    ensure!(ranks.len() == 3, "stdout: {}", out.stdout);
    let split = (cores() / 3).max(1).to_string();
    let token = &ranks[&0]["TOKEN"];
    ensure!(
        token.len() == 32 && token.chars().all(|c| c.is_ascii_hexdigit()),
        "token {token:?}"
    );
    for (&rank, vars) in &ranks {
        let r = rank.to_string();
        let expected = [
            ("RANK", r.as_str()),
            ("LOCAL_RANK", r.as_str()),
            ("ROLE_RANK", r.as_str()),
            ("WORLD_SIZE", "3"),
            ("ROLE_WORLD_SIZE", "3"),
            ("LOCAL_WORLD_SIZE", "3"),
            ("GROUP_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TOKEN", token.as_str()),
            ("RUN_ID", ranks[&0]["RUN_ID"].as_str()),
            ("RAYON", "7"),
            ("OMP", split.as_str()),
            ("MKL", split.as_str()),
        ];
        for (key, value) in expected {
            ensure!(
                vars.get(key).map(String::as_str) == Some(value),
                "rank {rank}: {key} = {:?}, expected {value:?}",
                vars.get(key)
            );
        }
    }
    ensure!(!ranks[&0]["RUN_ID"].is_empty(), "empty TORCHELASTIC_RUN_ID");
    Ok(())
}

#[test]
fn second_node_gets_global_ranks_and_inherited_token() -> Result<()> {
    let mut command = tprun(&[
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "10.1.2.3",
        "--master_port",
        "1234",
        "sh",
        "-c",
        PRINT_ENV,
    ]);
    command.env("CANDLE_TP_TOKEN", "sharedsecret");
    let out = run(command)?;
    ensure!(out.code == Some(0), "exit {:?}: {}", out.code, out.stderr);
    let ranks = env_by_rank(&out.stdout)?;
    ensure!(
        ranks.keys().copied().collect::<Vec<_>>() == [2, 3],
        "{}",
        out.stdout
    );
    for (rank, vars) in &ranks {
        ensure!(vars["RANK"] == rank.to_string());
        ensure!(vars["LOCAL_RANK"] == (rank - 2).to_string());
        ensure!(vars["WORLD_SIZE"] == "4" && vars["LOCAL_WORLD_SIZE"] == "2");
        ensure!(vars["GROUP_RANK"] == "1");
        ensure!(vars["MASTER_ADDR"] == "10.1.2.3" && vars["MASTER_PORT"] == "1234");
        ensure!(vars["TOKEN"] == "sharedsecret", "{vars:?}");
        let split = (cores() / 2).max(1).to_string();
        ensure!(vars["RAYON"] == split && vars["OMP"] == split);
    }
    Ok(())
}

#[test]
fn output_is_prefixed_whole_lines_and_args_are_verbatim() -> Result<()> {
    let script = "printf '%s|' \"$@\"; printf '\\377x\\n'; echo err$RANK >&2; \
        seq 1 2000 | sed \"s/.*/rank $RANK line & xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx/\"; printf tail";
    let out = run(tprun(&[
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        script,
        "sh",
        "--",
        "--flag",
        "a b",
    ]))?;
    ensure!(out.code == Some(0), "exit {:?}: {}", out.code, out.stderr);
    for rank in 0..2 {
        let first = format!("[rank {rank}] --|--flag|a b|\u{FFFD}x");
        ensure!(out.stdout.lines().any(|l| l == first), "no {first:?}");
        let last = format!("[rank {rank}] tail");
        ensure!(out.stdout.lines().any(|l| l == last), "no {last:?}");
        let err = format!("[rank {rank}] err{rank}");
        ensure!(
            out.stderr.lines().any(|l| l == err),
            "stderr: {}",
            out.stderr
        );
    }
    let mut counts = [0usize; 2];
    for line in out.stdout.lines().filter(|l| l.contains(" line ")) {
        let rank: usize = line[6..7].parse()?;
        let expected_start = format!("[rank {rank}] rank {rank} line ");
        ensure!(
            line.starts_with(&expected_start) && line.ends_with(" xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"),
            "mangled line {line:?}"
        );
        counts[rank] += 1;
    }
    ensure!(counts == [2000, 2000], "line counts {counts:?}");
    ensure!(out.stdout.ends_with('\n'));
    Ok(())
}

#[test]
fn failing_rank_stops_the_others() -> Result<()> {
    let dir = TempDir::new("fail")?;
    let script = format!(
        "{WRITE_PID}; if [ \"$RANK\" = 1 ]; then {WAIT_PIDS}; echo boom >&2; exit 3; fi; exec sleep 60"
    );
    let mut command = tprun(&["--nproc-per-node", "3", "sh", "-c", &script]);
    command.env("D", dir.str()?).env("N", "3");
    let out = run(command)?;
    ensure!(out.code == Some(3), "exit {:?}: {}", out.code, out.stderr);
    ensure!(
        out.elapsed < Duration::from_secs(10),
        "took {:?}",
        out.elapsed
    );
    ensure!(
        out.stderr.contains("rank 1 (pid") && out.stderr.contains("failed first: exit code 3"),
        "stderr: {}",
        out.stderr
    );
    let report = out.stderr.split("failed first").nth(1).unwrap_or("");
    ensure!(
        report.contains("boom"),
        "report lacks the stderr tail: {}",
        out.stderr
    );
    assert_all_gone(&worker_pids(dir.path(), 3)?)
}

#[test]
fn rank_killed_by_a_signal_is_reported() -> Result<()> {
    let out = run(tprun(&[
        "--nproc-per-node",
        "2",
        "sh",
        "-c",
        "if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; exec sleep 60",
    ]))?;
    ensure!(out.code == Some(1), "exit {:?}: {}", out.code, out.stderr);
    ensure!(
        out.stderr.contains("rank 0 (pid") && out.stderr.contains("killed by signal SIGKILL"),
        "stderr: {}",
        out.stderr
    );
    Ok(())
}

#[test]
fn worker_ignoring_sigterm_is_killed_after_the_grace_period() -> Result<()> {
    let dir = TempDir::new("grace")?;
    let script = format!(
        "if [ \"$RANK\" = 1 ]; then {WAIT_PIDS}; exit 4; fi; \
         trap '' TERM; {WRITE_PID}; while :; do sleep 0.05; done"
    );
    let mut command = tprun(&[
        "--nproc-per-node",
        "2",
        "--grace-period",
        "1",
        "sh",
        "-c",
        &script,
    ]);
    command.env("D", dir.str()?).env("N", "1");
    let out = run(command)?;
    ensure!(out.code == Some(4), "exit {:?}: {}", out.code, out.stderr);
    ensure!(
        out.elapsed >= Duration::from_secs(1) && out.elapsed < Duration::from_secs(8),
        "took {:?}, expected the 1 s grace period then a kill",
        out.elapsed
    );
    ensure!(
        out.stderr.contains("rank 0 (pid") && out.stderr.contains("SIGKILL"),
        "stderr: {}",
        out.stderr
    );
    assert_all_gone(&worker_pids(dir.path(), 1)?)
}

/// Starts two sleeping workers, sends `signal` to tprun, checks its exit code.
fn stop_with_signal(signal: libc::c_int, expected: i32) -> Result<()> {
    let dir = TempDir::new("signal")?;
    let script = format!("{WRITE_PID}; exec sleep 60");
    let mut command = tprun(&["--nproc-per-node", "2", "sh", "-c", &script]);
    command.env("D", dir.str()?);
    let started = Instant::now();
    let child = command.spawn()?;
    let pid = libc::pid_t::try_from(child.id())?;
    while worker_pids(dir.path(), 2).is_err() {
        ensure!(
            started.elapsed() < Duration::from_secs(5),
            "workers did not start"
        );
        thread::sleep(Duration::from_millis(10));
    }
    let pids = worker_pids(dir.path(), 2)?;
    // SAFETY: plain kill(2) of the tprun child we spawned and have not reaped.
    ensure!(unsafe { libc::kill(pid, signal) } == 0, "kill failed");
    let out = finish(child, started)?;
    ensure!(
        out.code == Some(expected),
        "exit {:?}: {}",
        out.code,
        out.stderr
    );
    ensure!(
        out.elapsed < Duration::from_secs(10),
        "took {:?}",
        out.elapsed
    );
    assert_all_gone(&pids)
}

#[test]
fn workers_die_with_a_killed_tprun() -> Result<()> {
    let dir = TempDir::new("pdeathsig")?;
    let script = format!("{WRITE_PID}; exec sleep 60");
    let mut command = tprun(&["--nproc-per-node", "2", "sh", "-c", &script]);
    command.env("D", dir.str()?);
    let started = Instant::now();
    let mut child = command.spawn()?;
    while worker_pids(dir.path(), 2).is_err() {
        if started.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            let _ = child.wait();
            bail!("workers did not start");
        }
        thread::sleep(Duration::from_millis(10));
    }
    let pids = worker_pids(dir.path(), 2)?;
    // SIGKILL: tprun gets no chance to stop its workers; the kernel must.
    child.kill()?;
    child.wait()?;
    // Orphans are reparented and may stay zombies here: only live ones count.
    for pid in pids {
        let deadline = Instant::now() + Duration::from_secs(2);
        while !group_members(pid).is_empty() {
            ensure!(Instant::now() < deadline, "worker {pid} outlived tprun");
            thread::sleep(Duration::from_millis(10));
        }
    }
    Ok(())
}

#[test]
fn sigint_stops_all_workers_with_130() -> Result<()> {
    stop_with_signal(libc::SIGINT, 130)
}

#[test]
fn sigterm_stops_all_workers_with_143() -> Result<()> {
    stop_with_signal(libc::SIGTERM, 143)
}

#[test]
fn log_dir_keeps_everything_and_filter_limits_the_console() -> Result<()> {
    let dir = TempDir::new("logs")?;
    let logs = dir.path().join("logs");
    let logs_str = logs.to_str().context("non-UTF-8 path")?;
    let out = run(tprun(&[
        "--nproc-per-node",
        "2",
        "--log-dir",
        logs_str,
        "--local-ranks-filter",
        "1",
        "sh",
        "-c",
        "echo out$RANK; echo err$RANK >&2; printf 'last'",
    ]))?;
    ensure!(out.code == Some(0), "exit {:?}: {}", out.code, out.stderr);
    ensure!(
        out.stdout == "[rank 1] out1\n[rank 1] last\n",
        "stdout: {:?}",
        out.stdout
    );
    ensure!(out.stderr == "[rank 1] err1\n", "stderr: {:?}", out.stderr);
    for rank in 0..2 {
        let stdout = fs::read_to_string(logs.join(format!("rank{rank}.stdout")))?;
        let stderr = fs::read_to_string(logs.join(format!("rank{rank}.stderr")))?;
        ensure!(
            stdout == format!("out{rank}\nlast"),
            "rank {rank} log {stdout:?}"
        );
        ensure!(
            stderr == format!("err{rank}\n"),
            "rank {rank} log {stderr:?}"
        );
    }
    Ok(())
}

#[test]
fn filtered_rank_failure_is_still_reported() -> Result<()> {
    let out = run(tprun(&[
        "--nproc-per-node",
        "2",
        "--local-ranks-filter",
        "1",
        "sh",
        "-c",
        "if [ \"$RANK\" = 0 ]; then echo hidden boom >&2; exit 5; fi; exec sleep 60",
    ]))?;
    ensure!(out.code == Some(5), "exit {:?}: {}", out.code, out.stderr);
    ensure!(
        !out.stderr.contains("[rank 0] hidden boom"),
        "{}",
        out.stderr
    );
    ensure!(out.stderr.contains("hidden boom"), "stderr: {}", out.stderr);
    Ok(())
}

#[test]
fn standalone_picks_a_free_port() -> Result<()> {
    let out = run(tprun(&[
        "--standalone",
        "sh",
        "-c",
        "echo MASTER_PORT=$MASTER_PORT",
    ]))?;
    ensure!(out.code == Some(0), "exit {:?}: {}", out.code, out.stderr);
    let port: u16 = env_by_rank(&out.stdout)?[&0]["MASTER_PORT"].parse()?;
    ensure!(port != 29500 && port != 0, "port {port}");
    Ok(())
}

#[test]
fn bad_arguments_exit_2_naming_the_flag() -> Result<()> {
    let cases: [(&[&str], &str); 11] = [
        (&["--nproc-per-node", "0", "true"], "--nproc-per-node"),
        (&["--nnodes", "0", "true"], "--nnodes"),
        (
            &["--nnodes", "2", "--node-rank", "2", "true"],
            "--node-rank",
        ),
        (&[], "PROGRAM"),
        (&["--nproc-per-node", "2"], "PROGRAM"),
        (&["--standalone", "--nnodes", "2", "true"], "--standalone"),
        (
            &[
                "--nproc-per-node",
                "2",
                "--local-ranks-filter",
                "0,2",
                "true",
            ],
            "--local-ranks-filter",
        ),
        (&["--grace-period", "-1", "true"], "--grace-period"),
        (&["--no-such-flag", "true"], "--no-such-flag"),
        (
            &["--nproc-per-node", "2", "--stdin-rank", "2", "true"],
            "--stdin-rank",
        ),
        (&["--stdin-rank", "first", "true"], "--stdin-rank"),
    ];
    for (args, flag) in cases {
        let out = run(tprun(args))?;
        ensure!(
            out.code == Some(2),
            "{args:?}: exit {:?}: {}",
            out.code,
            out.stderr
        );
        ensure!(
            out.stderr.contains(flag),
            "{args:?}: stderr lacks {flag}: {}",
            out.stderr
        );
        ensure!(!out.stderr.contains("panicked"), "{args:?}: {}", out.stderr);
    }
    Ok(())
}

#[test]
fn missing_program_fails_cleanly() -> Result<()> {
    let out = run(tprun(&[
        "--nproc-per-node",
        "2",
        "/nonexistent/tprun-test-program",
    ]))?;
    ensure!(out.code == Some(1), "exit {:?}: {}", out.code, out.stderr);
    ensure!(
        out.stderr.contains("cannot start rank 0")
            && out.stderr.contains("/nonexistent/tprun-test-program"),
        "stderr: {}",
        out.stderr
    );
    Ok(())
}

/// What each rank prints of its standard input: the lines joined by spaces. `cat` ends only
/// at end of file, so a rank whose input never ends would hang (bounded by LIMIT).
const ECHO_STDIN: &str = "printf 'read=%s|\\n' \"$(cat | tr '\\n' ' ')\"";

/// Runs a 3-rank job of `sh -c script`, whose ranks each print `read=...|` from standard
/// input, feeding tprun `input` on a pipe that is then closed; returns what each rank
/// printed, by rank.
fn stdin_by_rank(extra: &[&str], script: &str, input: &str) -> Result<BTreeMap<usize, String>> {
    let mut args = vec!["--nproc-per-node", "3"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["sh", "-c", script]);
    let mut command = tprun(&args);
    command.stdin(Stdio::piped());
    let started = Instant::now();
    let mut child = command.spawn()?;
    {
        let mut stdin = child.stdin.take().context("stdin not piped")?;
        std::io::Write::write_all(&mut stdin, input.as_bytes())?;
    }
    let out = finish(child, started)?;
    ensure!(out.code == Some(0), "exit {:?}: {}", out.code, out.stderr);
    let mut read = BTreeMap::new();
    for line in out.stdout.lines() {
        let rest = line.strip_prefix("[rank ").context("unprefixed line")?;
        let (rank, text) = rest.split_once("] read=").context("no read=")?;
        read.insert(rank.parse()?, text.trim_end_matches('|').to_string());
    }
    ensure!(read.len() == 3, "not every rank reported: {}", out.stdout);
    Ok(read)
}

#[test]
fn stdin_goes_to_rank_0_and_the_others_read_dev_null() -> Result<()> {
    let read = stdin_by_rank(&[], ECHO_STDIN, "one\ntwo\n")?;
    assert_eq!(read[&0], "one two ");
    assert_eq!(read[&1], "");
    assert_eq!(read[&2], "");
    Ok(())
}

#[test]
fn stdin_rank_picks_another_rank_or_none() -> Result<()> {
    let read = stdin_by_rank(&["--stdin-rank", "2"], ECHO_STDIN, "hello\n")?;
    assert_eq!(
        (read[&0].as_str(), read[&1].as_str(), read[&2].as_str()),
        ("", "", "hello ")
    );
    let read = stdin_by_rank(&["--stdin-rank", "none"], ECHO_STDIN, "hello\n")?;
    assert!(read.values().all(|r| r.is_empty()), "{read:?}");
    Ok(())
}

#[test]
fn large_stdin_arrives_whole() -> Result<()> {
    // More than a pipe buffer (64 KiB), so the forwarding must stream, not buffer once.
    let line = "0123456789abcdef".repeat(8);
    let input: String = (0..2000).map(|_| format!("{line}\n")).collect();
    let script = "printf 'read=%s|\\n' \"$(cksum)\"";
    let read = stdin_by_rank(&[], script, &input)?;
    // The reference: the same bytes through `cksum` directly.
    let mut direct = Command::new("cksum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    std::io::Write::write_all(&mut direct.stdin.take().context("stdin")?, input.as_bytes())?;
    let want = String::from_utf8(direct.wait_with_output()?.stdout)?;
    let want = want.trim();
    ensure!(
        want.ends_with(&format!(" {}", input.len())),
        "cksum: {want}"
    );
    assert_eq!(read[&0], want);
    assert_eq!(read[&1], "4294967295 0", "cksum of nothing");
    Ok(())
}
