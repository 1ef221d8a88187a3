//! `tprun`: a torchrun-style launcher for candle-tp.
//!
//! It starts one process per rank on this node, gives each the environment
//! that torchrun gives (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`,
//! `GROUP_RANK`, `ROLE_RANK`, `ROLE_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`,
//! `TORCHELASTIC_RUN_ID`), plus `CANDLE_TP_TOKEN` (a random 32-hex-char job
//! token, or the one already in tprun's environment), `CANDLE_TP_SHM_TAG` (the
//! prefix of the job's shared-memory segment names: whatever a killed rank
//! left in `/dev/shm` under it is removed when the job ends) and a per-rank thread
//! count (`RAYON_NUM_THREADS`, `OMP_NUM_THREADS`, `MKL_NUM_THREADS`: the cores
//! split between the ranks, unless the user set the variable).
//!
//! ```text
//! # two ranks on this machine
//! tprun --nproc-per-node 2 target/release/examples/mlp
//! # arguments after the program are its own, passed verbatim
//! tprun --nproc-per-node 2 target/release/examples/generate --model DIR
//! # a free rendezvous port, logs per rank, only rank 0 on the console
//! tprun --standalone --nproc-per-node 4 --log-dir logs --local-ranks-filter 0 ./prog
//! # second node of a two-node job (set the same CANDLE_TP_TOKEN on both nodes)
//! tprun --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --nproc-per-node 8 ./prog
//! ```
//!
//! tprun's standard input goes to global rank 0 (`--stdin-rank N` for another, `none` for
//! no rank), the other ranks read /dev/null, as with `mpirun`:
//! `echo "The cat sat on the mat." | tprun --nproc-per-node 2 target/release/examples/embed`.
//!
//! Each output line of a worker is printed as `[rank N] line` (stdout to
//! stdout, stderr to stderr). When a worker exits non-zero or is killed, the
//! others get SIGTERM (and SIGCONT, so a stopped one handles it), then SIGKILL
//! after `--grace-period` seconds; tprun
//! names the rank that failed first, shows its last stderr lines and exits
//! with its exit code (1 when it was killed by a signal). Ctrl-C (or SIGTERM,
//! SIGHUP, SIGQUIT) stops every worker the same way and exits with 128 +
//! the signal number; a second Ctrl-C kills them at once. Bad arguments exit 2.

/// Writes a formatted message to tprun's stderr without panicking.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::output::say(format_args!($($arg)*))
    };
}

mod args;
mod input;
mod job;
mod output;
mod signals;
mod supervise;

use clap::Parser;

use crate::args::{Cli, Config};
use crate::job::Job;

/// Parses the arguments (exit 2 when they are bad), runs the job and exits
/// with its code.
fn main() {
    let config = match Config::from_cli(Cli::parse()) {
        Ok(config) => config,
        Err(error) => error.exit(),
    };
    std::process::exit(run(&config));
}

/// Installs the signal handlers, creates the job and supervises it; returns
/// tprun's exit code.
fn run(config: &Config) -> i32 {
    if let Err(e) = signals::install() {
        say!("tprun: cannot install the signal handlers: {e}\n");
        return 1;
    }
    let job = match Job::new(config) {
        Ok(job) => job,
        Err(e) => {
            say!("tprun: cannot create the job: {e}\n");
            return 1;
        }
    };
    if config.nnodes > 1 {
        if std::env::var_os(job::TOKEN_VAR).is_none() {
            say!(
                "tprun: warning: --nnodes is {} but {} is not set, so this node made up its own \
                 token; set the same {1} on every node\n",
                config.nnodes,
                job::TOKEN_VAR
            );
        }
        if config.run_id.is_none() {
            say!(
                "tprun: warning: --nnodes is {} but --rdzv-id is not given, so this node made up \
                 its own job id ({}); give the same --rdzv-id on every node\n",
                config.nnodes,
                job.run_id
            );
        }
    }
    let code = supervise::run(config, &job);
    let removed = job.remove_segments();
    if !removed.is_empty() {
        say!(
            "tprun: removed {} shared-memory segment(s) a killed rank left in /dev/shm: {}\n",
            removed.len(),
            removed.join(", ")
        );
    }
    code
}
