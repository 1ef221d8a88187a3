//! Building the world group from the environment that `tprun` (or PyTorch's `torchrun`) sets.

use candle_core::Device;

use super::error::{CommError, CommResult};
use super::group::{GroupOptions, ProcessGroup};
use super::shm::{init_shm, Rendezvous};

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> CommResult<T> {
    value
        .trim()
        .parse()
        .map_err(|_| CommError::env(name, format!("'{value}' is not a valid number")))
}

/// Reads `RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and
/// `CANDLE_TP_TOKEN`, and checks they agree.
///
/// Without `RANK` and `WORLD_SIZE` (a program started by hand) it describes a job of one
/// rank. One of the two without the other, or values that contradict each other, is an error
/// naming the variable.
pub fn rendezvous_from_env() -> CommResult<Rendezvous> {
    let (rank, world) = match (var("RANK"), var("WORLD_SIZE")) {
        (None, None) => (0usize, 1usize),
        (Some(_), None) => {
            return Err(CommError::env(
                "WORLD_SIZE",
                "is not set but RANK is (start the job with tprun or torchrun)",
            ))
        }
        (None, Some(_)) => {
            return Err(CommError::env(
                "RANK",
                "is not set but WORLD_SIZE is (start the job with tprun or torchrun)",
            ))
        }
        (Some(r), Some(w)) => (parse("RANK", &r)?, parse("WORLD_SIZE", &w)?),
    };
    if world == 0 {
        return Err(CommError::env("WORLD_SIZE", "must be at least 1"));
    }
    if rank >= world {
        return Err(CommError::env(
            "RANK",
            format!("RANK={rank} must be below WORLD_SIZE={world}"),
        ));
    }
    if let Some(l) = var("LOCAL_WORLD_SIZE") {
        let local: usize = parse("LOCAL_WORLD_SIZE", &l)?;
        if local > world {
            return Err(CommError::env(
                "LOCAL_WORLD_SIZE",
                format!("LOCAL_WORLD_SIZE={local} exceeds WORLD_SIZE={world}"),
            ));
        }
    }
    let master_addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
    let master_port = match var("MASTER_PORT") {
        Some(p) => parse::<u16>("MASTER_PORT", &p)?,
        None if world == 1 => 0,
        None => {
            return Err(CommError::env(
                "MASTER_PORT",
                format!("is not set (WORLD_SIZE={world}, RANK={rank})"),
            ))
        }
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

/// Joins the job this process was started in (by `tprun` or `torchrun`) and returns its world
/// group, on the backend that suits `device`. The ranks meet through rank 0's store, or under
/// torchrun through its agent's PyTorch `TCPStore` (`TORCHELASTIC_USE_AGENT_STORE=True`);
/// then they talk over shared memory between processes on CPU, NCCL
/// on a CUDA device (feature `nccl`; one GPU per rank, normally `cuda:LOCAL_RANK`, see
/// [`crate::device_from_arg`]). A job of one rank needs no backend and gets
/// [`ProcessGroup::single`].
///
/// ```no_run
/// # fn main() -> candle_core::Result<()> {
/// let device = candle_core::Device::Cpu;
/// let pg = candle_tp::init_from_env(&device)?;
/// println!("rank {} of {}", pg.rank(), pg.size());
/// # Ok(()) }
/// ```
pub fn init_from_env(device: &Device) -> candle_core::Result<ProcessGroup> {
    let rv = rendezvous_from_env()?;
    if rv.world_size == 1 {
        return Ok(ProcessGroup::single());
    }
    if let Some(l) = var("LOCAL_WORLD_SIZE") {
        if parse::<usize>("LOCAL_WORLD_SIZE", &l)? != rv.world_size && device.is_cpu() {
            return Err(CommError::env(
                "LOCAL_WORLD_SIZE",
                format!(
                    "the shm backend serves one host, but WORLD_SIZE={} spans {} processes per node; \
                     use GPUs with the nccl feature across nodes",
                    rv.world_size, l
                ),
            )
            .into());
        }
    }
    match device {
        Device::Cpu => Ok(init_shm(&rv, GroupOptions::default())?),
        #[cfg(feature = "nccl")]
        Device::Cuda(_) => Ok(super::nccl::init_nccl(&rv, device, GroupOptions::default())?),
        other => candle_core::bail!(
            "init_from_env: no backend for device {other:?} in this build (the CPU shm backend is built in; \
             GPUs need the `nccl` feature)"
        ),
    }
}
