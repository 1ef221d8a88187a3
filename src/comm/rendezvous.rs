//! [`Rendezvous`]: where and how the ranks of a job meet (rank, size, rank 0's store address,
//! the job token), read from the environment a launcher sets ([`rendezvous_from_env`]), and
//! whether torchrun's agent hosts the store instead.
//!
//! It sits below the store and every backend: the store connects with it, the backends join
//! with it, and only `env.rs` at the top chooses which backend joins.

use super::error::{CommError, CommResult};
use super::launcher::{launch_from_env, Launcher};

/// Where and how the ranks of a job meet.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Address rank 0 listens on (`MASTER_ADDR`; loopback for one host).
    pub master_addr: String,
    /// Port of the store (`MASTER_PORT`).
    pub master_port: u16,
    /// The job's secret; peers without it are refused (`CANDLE_TP_TOKEN`, set by `tprun`).
    pub token: String,
}

pub(super) fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> CommResult<T> {
    value
        .trim()
        .parse()
        .map_err(|_| CommError::env(name, format!("'{value}' is not a valid number")))
}

/// Reads the job's layout ([`launch_from_env`]: tprun/torchrun's `RANK` and `WORLD_SIZE`,
/// or those of `mpirun`, Hydra's `mpiexec` or `srun`), `MASTER_ADDR`, `MASTER_PORT` and
/// `CANDLE_TP_TOKEN`, and checks they agree.
///
/// Without any launcher's variables (a program started by hand) it describes a job of one
/// rank. A rank without a size (or the reverse), or values that contradict each other, is an
/// error naming the variable. Under an MPI launcher or `srun`, `MASTER_PORT` may be unset: the
/// store then listens at a port derived from the launcher's job id
/// ([`Launch::default_port`](super::launcher::Launch::default_port)), on `MASTER_ADDR`, the
/// first host of a Slurm allocation, or 127.0.0.1 for a job on one host.
pub fn rendezvous_from_env() -> CommResult<Rendezvous> {
    let launch = launch_from_env()?;
    let (rank, world) = (launch.rank, launch.world_size);
    let master_addr = var("MASTER_ADDR")
        .or_else(|| {
            launch
                .first_host
                .clone()
                .filter(|_| !launch.is_single_host())
        })
        .unwrap_or_else(|| "127.0.0.1".into());
    let master_port = match var("MASTER_PORT") {
        Some(p) => parse::<u16>("MASTER_PORT", &p)?,
        None if world == 1 => 0,
        None => match launch.default_port() {
            Some(p)
                if launch.is_single_host()
                    || var("MASTER_ADDR").is_some()
                    || launch.first_host.is_some() =>
            {
                p
            }
            _ => {
                return Err(CommError::env(
                    "MASTER_PORT",
                    format!(
                        "is not set (WORLD_SIZE={world}, RANK={rank}, started by {}){}",
                        launch.launcher.name(),
                        if launch.launcher == Launcher::Torchrun {
                            ""
                        } else {
                            "; set MASTER_ADDR (rank 0's host) and MASTER_PORT for every rank \
                             (mpirun -x MASTER_ADDR=HOST -x MASTER_PORT=PORT)"
                        }
                    ),
                ))
            }
        },
    };
    Ok(Rendezvous {
        rank,
        world_size: world,
        master_addr,
        master_port,
        token: var("CANDLE_TP_TOKEN").unwrap_or_default(),
    })
}

/// Whether this process runs under torchrun with its agent's store
/// (`TORCHELASTIC_USE_AGENT_STORE=True`, as torchrun sets it): then the agent hosts a PyTorch
/// `TCPStore` at `MASTER_ADDR:MASTER_PORT` and every rank must join it rather than start one.
/// Returns the prefix for this job's keys there, `candle-tp/<TORCHELASTIC_RUN_ID>/<TORCHELASTIC_RESTART_COUNT>/`,
/// so that a restarted job never reads the keys of the attempt before it.
pub(crate) fn torch_agent_store() -> CommResult<Option<String>> {
    const VAR: &str = "TORCHELASTIC_USE_AGENT_STORE";
    match var(VAR).as_deref().map(str::trim) {
        None => return Ok(None),
        Some(v) if v.eq_ignore_ascii_case("false") || v == "0" => return Ok(None),
        Some(v) if v.eq_ignore_ascii_case("true") || v == "1" => {}
        Some(v) => {
            return Err(CommError::env(
                VAR,
                format!("'{v}' is neither True nor False"),
            ))
        }
    }
    let run = var("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into());
    let restart = var("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into());
    Ok(Some(format!("candle-tp/{run}/{restart}/")))
}
