//! Starting the workers, watching them, and stopping them all when one fails
//! or tprun is signalled.
//!
//! Each worker runs in its own process group (so a signal reaches its children
//! too, and a Ctrl-C at the terminal reaches only tprun) with
//! `PR_SET_PDEATHSIG(SIGKILL)`, so no worker outlives tprun. The workers are
//! spawned by the main thread, which lives until tprun exits: the death signal
//! follows the thread that forked, not the process.

use std::fs::{self, File};
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::args::Config;
use crate::input;
use crate::job::Job;
use crate::output::{self, Pump, Stream, Tail, TAIL_LINES};
use crate::signals;

/// How often the workers are polled.
const POLL: Duration = Duration::from_millis(10);

/// How long to wait for a worker to be reaped after SIGKILL before giving up on it.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// How long to wait, once every worker is reaped, for their output to drain.
const DRAIN_WAIT: Duration = Duration::from_secs(3);

/// How a worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// It exited with this code.
    Code(i32),
    /// It was killed by this signal.
    Signal(i32),
    /// Its status could not be read.
    Unknown,
}

impl End {
    /// Converts a wait status.
    pub fn from_status(status: ExitStatus) -> End {
        match (status.code(), status.signal()) {
            (Some(code), _) => End::Code(code),
            (None, Some(signal)) => End::Signal(signal),
            (None, None) => End::Unknown,
        }
    }

    /// Whether this is a clean exit (code 0).
    pub fn success(self) -> bool {
        self == End::Code(0)
    }

    /// Human-readable form: `exit code 3`, `killed by signal SIGKILL`.
    pub fn describe(self) -> String {
        match self {
            End::Code(code) => format!("exit code {code}"),
            End::Signal(signal) => format!("killed by signal {}", signals::name(signal)),
            End::Unknown => "unknown exit status".to_string(),
        }
    }

    /// tprun's exit code for a job whose first failure ended like this.
    pub fn exit_code(self) -> i32 {
        match self {
            End::Code(code) if (1..=255).contains(&code) => code,
            _ => 1,
        }
    }
}

/// One worker process.
#[derive(Debug)]
pub struct Worker {
    /// Global rank.
    pub rank: usize,
    /// Process id, which is also its process group id.
    pub pid: u32,
    /// The child handle, used to reap it.
    child: Child,
    /// When it was spawned.
    started: Instant,
    /// How it ended and after how long, once reaped.
    end: Option<(End, Duration)>,
    /// Its last stderr lines.
    tail: Arc<Mutex<Tail>>,
}

impl Worker {
    /// Sends `signal` to the worker's whole process group (ignoring a group
    /// that no longer exists).
    fn signal_group(&self, signal: libc::c_int) {
        if let Ok(pgid) = libc::pid_t::try_from(self.pid) {
            // SAFETY: kill has no memory-safety preconditions; a negative pid
            // addresses the process group the worker leads.
            unsafe {
                libc::kill(-pgid, signal);
            }
        }
    }

    /// Reaps the worker if it has ended; returns whether it ended just now.
    fn poll(&mut self) -> bool {
        if self.end.is_some() {
            return false;
        }
        let end = match self.child.try_wait() {
            Ok(Some(status)) => End::from_status(status),
            Ok(None) => return false,
            Err(e) => {
                say!(
                    "tprun: cannot wait for rank {} (pid {}): {e}\n",
                    self.rank,
                    self.pid
                );
                End::Unknown
            }
        };
        self.end = Some((end, self.started.elapsed()));
        true
    }
}

/// What the watch loop saw first.
enum Event {
    /// Every worker exited with code 0.
    AllSucceeded,
    /// The worker at this index failed first.
    Failed(usize),
    /// tprun received this signal.
    Signalled(libc::c_int),
}

/// Runs the job to completion and returns tprun's exit code.
pub fn run(config: &Config, job: &Job) -> i32 {
    if let Some(dir) = &config.log_dir {
        if let Err(e) = fs::create_dir_all(dir) {
            say!("tprun: cannot create --log-dir {}: {e}\n", dir.display());
            return 1;
        }
    }
    let (done_tx, done_rx) = mpsc::channel();
    let mut workers = Vec::with_capacity(config.nproc_per_node);
    for local_rank in 0..config.nproc_per_node {
        if let Some(signal) = signals::first() {
            return stop_on_signal(&mut workers, signal, config.grace_period, done_tx, &done_rx);
        }
        if let Err(message) = spawn_worker(config, job, local_rank, &done_tx, &mut workers) {
            say!("tprun: {message}\n");
            teardown(&mut workers, config.grace_period, signals::count());
            drain(done_tx, &done_rx);
            return 1;
        }
    }
    match watch(&mut workers) {
        Event::AllSucceeded => {
            drain(done_tx, &done_rx);
            0
        }
        Event::Signalled(signal) => {
            stop_on_signal(&mut workers, signal, config.grace_period, done_tx, &done_rx)
        }
        Event::Failed(index) => {
            let others = workers.iter().filter(|w| w.end.is_none()).count();
            teardown(&mut workers, config.grace_period, signals::count());
            drain(done_tx, &done_rx);
            report_failure(&workers[index], others)
        }
    }
}

/// Stops every worker after tprun received `signal`; returns 128 + signal.
fn stop_on_signal(
    workers: &mut [Worker],
    signal: libc::c_int,
    grace: Duration,
    done_tx: Sender<()>,
    done_rx: &Receiver<()>,
) -> i32 {
    let running = workers.iter().filter(|w| w.end.is_none()).count();
    say!(
        "tprun: received {}: stopping {running} rank(s) with SIGTERM, SIGKILL after {:.1} s \
         (send it again to kill them now)\n",
        signals::name(signal),
        grace.as_secs_f64()
    );
    // The first signal started this teardown; only a later one escalates.
    teardown(workers, grace, 1);
    drain(done_tx, done_rx);
    128 + signal
}

/// Spawns the worker with local rank `local_rank` and its output pumps, and
/// appends it to `workers` (also when its pumps fail to start, so that it is
/// stopped with the rest).
fn spawn_worker(
    config: &Config,
    job: &Job,
    local_rank: usize,
    done: &Sender<()>,
    workers: &mut Vec<Worker>,
) -> Result<(), String> {
    let rank = config.global_rank(local_rank);
    let logs = match &config.log_dir {
        Some(dir) => Some((
            open_log(dir, rank, Stream::Stdout)?,
            open_log(dir, rank, Stream::Stderr)?,
        )),
        None => None,
    };
    let reads_stdin = config.stdin_rank == Some(rank);
    let mut command = Command::new(&config.program);
    command
        .args(&config.args)
        .envs(job.worker_env(config, local_rank))
        .stdin(if reads_stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    set_parent_death_signal(&mut command);
    let mut child = command.spawn().map_err(|e| {
        format!(
            "cannot start rank {rank}: {}: {e}",
            Path::new(&config.program).display()
        )
    })?;
    let stdin = child.stdin.take();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let tail = Arc::new(Mutex::new(Tail::new(TAIL_LINES)));
    workers.push(Worker {
        rank,
        pid: child.id(),
        child,
        started: Instant::now(),
        end: None,
        tail: Arc::clone(&tail),
    });
    let console = config.shows_on_console(local_rank);
    let (log_out, log_err) = logs.map_or((None, None), |(o, e)| (Some(o), Some(e)));
    let started = |e: io::Error| format!("cannot start the output thread of rank {rank}: {e}");
    if let Some(stdin) = stdin {
        input::forward_stdin(rank, stdin).map_err(|e| {
            format!("cannot start the thread forwarding standard input to rank {rank}: {e}")
        })?;
    }
    if let Some(stdout) = stdout {
        let pump = Pump {
            rank,
            stream: Stream::Stdout,
            console,
            log: log_out,
            tail: None,
        };
        pump.spawn(stdout, done.clone()).map_err(started)?;
    }
    if let Some(stderr) = stderr {
        let pump = Pump {
            rank,
            stream: Stream::Stderr,
            console,
            log: log_err,
            tail: Some(tail),
        };
        pump.spawn(stderr, done.clone()).map_err(started)?;
    }
    Ok(())
}

/// Creates `DIR/rank<N>.<stream>`.
fn open_log(dir: &Path, rank: usize, stream: Stream) -> Result<File, String> {
    let path = dir.join(format!("rank{rank}.{}", stream.name()));
    File::create(&path).map_err(|e| format!("cannot create log file {}: {e}", path.display()))
}

/// Makes the kernel SIGKILL the worker when tprun's main thread dies.
#[cfg(target_os = "linux")]
fn set_parent_death_signal(command: &mut Command) {
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe calls (prctl, getppid) and builds errors without allocating.
    unsafe {
        command.pre_exec(move || {
            let signal = libc::SIGKILL as libc::c_ulong;
            if libc::prctl(libc::PR_SET_PDEATHSIG, signal, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // tprun may have died before prctl: then nobody would kill us.
            if u32::try_from(libc::getppid()) != Ok(parent) {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Without Linux's `PR_SET_PDEATHSIG`, workers rely on tprun's teardown alone.
#[cfg(not(target_os = "linux"))]
fn set_parent_death_signal(_command: &mut Command) {}

/// Polls the workers until all succeed, one fails, or tprun is signalled.
fn watch(workers: &mut [Worker]) -> Event {
    loop {
        if let Some(signal) = signals::first() {
            return Event::Signalled(signal);
        }
        let mut failed = None;
        for (index, worker) in workers.iter_mut().enumerate() {
            if worker.poll() && failed.is_none() && worker.end.is_some_and(|(e, _)| !e.success()) {
                failed = Some(index);
            }
        }
        if let Some(index) = failed {
            return Event::Failed(index);
        }
        if workers.iter().all(|w| w.end.is_some()) {
            return Event::AllSucceeded;
        }
        thread::sleep(POLL);
    }
}

/// Stops every worker: SIGTERM to each process group, SIGKILL to those still
/// running after `grace` (or at once when tprun receives more than
/// `signals_seen` signals), then reaps them. Finally SIGKILLs whatever is left
/// in the groups (children of workers that outlived them).
fn teardown(workers: &mut [Worker], grace: Duration, signals_seen: usize) {
    for worker in workers.iter() {
        worker.signal_group(libc::SIGTERM);
        // A stopped worker (SIGSTOP, a debugger) would hold SIGTERM pending until the
        // grace period ends: wake it so that it handles the signal now.
        worker.signal_group(libc::SIGCONT);
    }
    let deadline = Instant::now() + grace;
    let mut killed_at: Option<Instant> = None;
    loop {
        for worker in workers.iter_mut() {
            worker.poll();
        }
        let running: Vec<&Worker> = workers.iter().filter(|w| w.end.is_none()).collect();
        if running.is_empty() {
            break;
        }
        let now = Instant::now();
        match killed_at {
            None if now >= deadline || signals::count() > signals_seen => {
                let why = if now >= deadline {
                    format!("still running {:.1} s after SIGTERM", grace.as_secs_f64())
                } else {
                    "stopped at once on a second signal".to_string()
                };
                for worker in &running {
                    say!(
                        "tprun: rank {} (pid {}) {why}: sending SIGKILL\n",
                        worker.rank,
                        worker.pid
                    );
                    worker.signal_group(libc::SIGKILL);
                }
                killed_at = Some(now);
            }
            Some(at) if now >= at + KILL_WAIT => {
                for worker in &running {
                    say!(
                        "tprun: rank {} (pid {}) was not reaped {} s after SIGKILL; giving up on it\n",
                        worker.rank,
                        worker.pid,
                        KILL_WAIT.as_secs()
                    );
                }
                break;
            }
            _ => {}
        }
        thread::sleep(POLL);
    }
    for worker in workers.iter() {
        worker.signal_group(libc::SIGKILL);
    }
}

/// Waits (bounded by [`DRAIN_WAIT`]) for every output pump to reach end of file.
fn drain(done_tx: Sender<()>, done_rx: &Receiver<()>) {
    drop(done_tx);
    let deadline = Instant::now() + DRAIN_WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match done_rx.recv_timeout(left) {
            Ok(()) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
            Err(RecvTimeoutError::Timeout) => {
                say!(
                    "tprun: some worker output was still open {} s after the workers ended; not waiting for it\n",
                    DRAIN_WAIT.as_secs()
                );
                return;
            }
        }
    }
}

/// Prints which rank failed first with its last stderr lines; returns tprun's exit code.
fn report_failure(worker: &Worker, others: usize) -> i32 {
    let (end, elapsed) = worker.end.unwrap_or((End::Unknown, Duration::ZERO));
    let lines = output::tail_lines(&worker.tail);
    let mut text = format!(
        "tprun: rank {} (pid {}) failed first: {} after {:.2} s\n",
        worker.rank,
        worker.pid,
        end.describe(),
        elapsed.as_secs_f64()
    );
    if others > 0 {
        text.push_str(&format!(
            "tprun: stopped the {others} other running rank(s)\n"
        ));
    }
    if lines.is_empty() {
        text.push_str(&format!(
            "tprun: rank {} wrote nothing to stderr\n",
            worker.rank
        ));
    } else {
        text.push_str(&format!(
            "tprun: last {} stderr line(s) of rank {}:\n",
            lines.len(),
            worker.rank
        ));
        for line in lines {
            text.push_str(&format!("tprun:   {line}\n"));
        }
    }
    say!("{text}");
    end.exit_code()
}
