//! Command-line arguments of `tprun` and their validation into a [`Config`].
//!
//! Flag names follow torchrun (`torch/distributed/run.py`); like torchrun, each
//! dashed flag also accepts its underscore spelling (`--nproc_per_node`).
//! Every validation error is a [`clap::Error`], so it is printed with the usage
//! line and makes the process exit with code 2.

use std::ffi::OsString;
use std::net::TcpListener;
use std::path::PathBuf;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};

/// The raw command line, as parsed by clap.
#[derive(Debug, Parser)]
#[command(
    name = "tprun",
    version,
    override_usage = "tprun [OPTIONS] [--] PROGRAM [ARGS]...",
    about = "Launch one process per rank for candle-tp (a torchrun-style launcher)",
    long_about = "Launch one process per rank for candle-tp (a torchrun-style launcher).\n\n\
        Every worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, \
        MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID and CANDLE_TP_TOKEN in its environment. \
        Everything after PROGRAM is passed to it verbatim."
)]
pub struct Cli {
    /// Number of worker processes on this node.
    #[arg(
        long = "nproc-per-node",
        alias = "nproc_per_node",
        value_name = "N",
        default_value_t = 1,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub nproc_per_node: u32,

    /// Number of nodes taking part in the job.
    #[arg(
        long = "nnodes",
        value_name = "N",
        default_value_t = 1,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub nnodes: u32,

    /// Rank of this node, in 0..nnodes.
    #[arg(
        long = "node-rank",
        alias = "node_rank",
        value_name = "K",
        default_value_t = 0
    )]
    pub node_rank: u32,

    /// Address of the node that hosts rank 0's rendezvous store.
    #[arg(
        long = "master-addr",
        alias = "master_addr",
        value_name = "ADDR",
        default_value = "127.0.0.1"
    )]
    pub master_addr: String,

    /// Port of rank 0's rendezvous store on the master address.
    #[arg(
        long = "master-port",
        alias = "master_port",
        value_name = "PORT",
        default_value_t = 29500
    )]
    pub master_port: u16,

    /// Single-node job: use a free port on the master address instead of --master-port.
    #[arg(long = "standalone")]
    pub standalone: bool,

    /// Also write each rank's output to DIR/rankN.stdout and DIR/rankN.stderr (N: global rank).
    #[arg(long = "log-dir", alias = "log_dir", value_name = "DIR")]
    pub log_dir: Option<PathBuf>,

    /// Comma-separated local ranks whose output reaches the console (all are still logged).
    #[arg(
        long = "local-ranks-filter",
        alias = "local_ranks_filter",
        value_name = "RANKS"
    )]
    pub local_ranks_filter: Option<String>,

    /// Seconds between SIGTERM and SIGKILL when the workers are stopped.
    #[arg(
        long = "grace-period",
        alias = "grace_period",
        value_name = "SECS",
        default_value = "5",
        allow_hyphen_values = true,
        value_parser = parse_seconds
    )]
    pub grace_period: Duration,

    /// Global rank that receives tprun's standard input ('none': no rank); every other rank
    /// reads /dev/null, as with mpirun. End of file reaches the rank when tprun's input ends.
    #[arg(
        long = "stdin-rank",
        alias = "stdin_rank",
        value_name = "RANK|none",
        default_value = "0"
    )]
    pub stdin_rank: String,

    /// Job id given to the workers as TORCHELASTIC_RUN_ID (default: random).
    #[arg(long = "rdzv-id", alias = "rdzv_id", value_name = "ID")]
    pub rdzv_id: Option<String>,

    /// The program to run once per rank, then its arguments, passed verbatim.
    #[arg(
        value_name = "PROGRAM",
        required = true,
        num_args = 1..,
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    pub command: Vec<OsString>,
}

/// A validated launch configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Worker processes on this node (at least 1).
    pub nproc_per_node: usize,
    /// Nodes in the job (at least 1).
    pub nnodes: usize,
    /// This node's rank, below `nnodes`.
    pub node_rank: usize,
    /// Rendezvous address given to the workers.
    pub master_addr: String,
    /// Rendezvous port given to the workers (a free one under `--standalone`).
    pub master_port: u16,
    /// Directory for per-rank log files, if any.
    pub log_dir: Option<PathBuf>,
    /// Local ranks whose output is shown on the console; `None` shows all.
    pub console_ranks: Option<Vec<usize>>,
    /// Time between SIGTERM and SIGKILL on teardown.
    pub grace_period: Duration,
    /// Global rank whose standard input is tprun's (`None`: every rank reads /dev/null).
    pub stdin_rank: Option<usize>,
    /// Job id requested on the command line, if any.
    pub run_id: Option<String>,
    /// Program run by every worker.
    pub program: OsString,
    /// Arguments of the program.
    pub args: Vec<OsString>,
}

impl Config {
    /// Total number of ranks in the job (`nnodes * nproc_per_node`).
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// Global rank of the worker with local rank `local_rank` on this node.
    pub fn global_rank(&self, local_rank: usize) -> usize {
        self.node_rank * self.nproc_per_node + local_rank
    }

    /// Whether the output of `local_rank` is shown on the console.
    pub fn shows_on_console(&self, local_rank: usize) -> bool {
        self.console_ranks
            .as_ref()
            .is_none_or(|ranks| ranks.contains(&local_rank))
    }

    /// Validates parsed arguments; under `--standalone` this binds port 0 on the
    /// master address to pick a free port.
    pub fn from_cli(cli: Cli) -> Result<Config, clap::Error> {
        let nproc_per_node = cli.nproc_per_node as usize;
        let nnodes = cli.nnodes as usize;
        let node_rank = cli.node_rank as usize;
        if node_rank >= nnodes {
            return Err(usage_error(
                ErrorKind::ValueValidation,
                format!(
                    "--node-rank {node_rank} is out of range: --nnodes is {nnodes}, \
                     so the node rank must be in 0..{nnodes}"
                ),
            ));
        }
        if nnodes
            .checked_mul(nproc_per_node)
            .is_none_or(|w| w > i32::MAX as usize)
        {
            return Err(usage_error(
                ErrorKind::ValueValidation,
                format!("--nnodes {nnodes} times --nproc-per-node {nproc_per_node} is too large"),
            ));
        }
        let master_port = if cli.standalone {
            if nnodes > 1 {
                return Err(usage_error(
                    ErrorKind::ArgumentConflict,
                    format!("--standalone is for a single node, but --nnodes is {nnodes}"),
                ));
            }
            free_port(&cli.master_addr)?
        } else {
            cli.master_port
        };
        let console_ranks = match &cli.local_ranks_filter {
            None => None,
            Some(text) => Some(parse_filter(text, nproc_per_node)?),
        };
        let stdin_rank = parse_stdin_rank(&cli.stdin_rank, nnodes * nproc_per_node)?;
        if let Some(id) = &cli.rdzv_id {
            if id.is_empty() || id.chars().any(|c| c.is_control() || c == '/') {
                return Err(usage_error(
                    ErrorKind::ValueValidation,
                    format!(
                        "--rdzv-id {id:?} must be non-empty, without '/' or control characters"
                    ),
                ));
            }
        }
        let mut command = cli.command.into_iter();
        let program = match command.next() {
            Some(program) if !program.to_string_lossy().starts_with('-') => program,
            Some(flag) => {
                let flag = flag.to_string_lossy();
                return Err(usage_error(
                    ErrorKind::UnknownArgument,
                    format!(
                        "unknown option '{flag}' (tprun's options come before PROGRAM; \
                         to run a program whose name starts with '-', write ./{flag})"
                    ),
                ));
            }
            None => {
                return Err(usage_error(
                    ErrorKind::MissingRequiredArgument,
                    "PROGRAM is missing: tprun [OPTIONS] PROGRAM [ARGS...]".to_string(),
                ))
            }
        };
        Ok(Config {
            nproc_per_node,
            nnodes,
            node_rank,
            master_addr: cli.master_addr,
            master_port,
            log_dir: cli.log_dir,
            console_ranks,
            grace_period: cli.grace_period,
            stdin_rank,
            run_id: cli.rdzv_id,
            program,
            args: command.collect(),
        })
    }
}

/// Builds a clap error carrying the usage line of `tprun` (exit code 2).
fn usage_error(kind: ErrorKind, message: String) -> clap::Error {
    Cli::command().error(kind, message)
}

/// Parses `--grace-period`: a finite, non-negative number of seconds.
fn parse_seconds(text: &str) -> Result<Duration, String> {
    let secs: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("{text:?} must be a finite number of seconds >= 0"));
    }
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{text:?}: {e}"))
}

/// Parses `--stdin-rank`: `none`, or a global rank below the world size.
fn parse_stdin_rank(text: &str, world: usize) -> Result<Option<usize>, clap::Error> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    let rank: usize = text.parse().map_err(|_| {
        usage_error(
            ErrorKind::ValueValidation,
            format!("--stdin-rank {text:?} is neither a global rank number nor 'none'"),
        )
    })?;
    if rank >= world {
        return Err(usage_error(
            ErrorKind::ValueValidation,
            format!(
                "--stdin-rank {rank} does not exist: the world size is {world} \
                 (global ranks are 0..{world})"
            ),
        ));
    }
    Ok(Some(rank))
}

/// Parses `--local-ranks-filter` ("0,2"): each entry a local rank below `nproc_per_node`.
fn parse_filter(text: &str, nproc_per_node: usize) -> Result<Vec<usize>, clap::Error> {
    let mut ranks = Vec::new();
    for item in text.split(',') {
        let item = item.trim();
        let rank: usize = item.parse().map_err(|_| {
            usage_error(
                ErrorKind::ValueValidation,
                format!("--local-ranks-filter {text:?}: {item:?} is not a local rank number"),
            )
        })?;
        if rank >= nproc_per_node {
            return Err(usage_error(
                ErrorKind::ValueValidation,
                format!(
                    "--local-ranks-filter {text:?}: local rank {rank} does not exist \
                     (--nproc-per-node is {nproc_per_node}, local ranks are 0..{nproc_per_node})"
                ),
            ));
        }
        if !ranks.contains(&rank) {
            ranks.push(rank);
        }
    }
    Ok(ranks)
}

/// Picks a free TCP port by binding port 0 on `addr` (for `--standalone`).
fn free_port(addr: &str) -> Result<u16, clap::Error> {
    let bound = TcpListener::bind((addr, 0)).and_then(|listener| listener.local_addr());
    match bound {
        Ok(local) => Ok(local.port()),
        Err(e) => Err(usage_error(
            ErrorKind::ValueValidation,
            format!("--standalone: cannot bind a free port on --master-addr {addr:?}: {e}"),
        )),
    }
}
