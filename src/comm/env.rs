//! Building the world group from the environment that `tprun` (or PyTorch's `torchrun`), an MPI
//! launcher or `srun` sets.

use candle_core::Device;

use super::context::GroupOptions;
use super::error::{CommError, CommResult};
use super::group::ProcessGroup;
use super::launcher::{launch_from_env, Launcher};
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

/// Chooses the backend: `auto` (the default: for a CPU job that spans hosts under an MPI
/// launcher or srun, when built with the `mpi` feature, `hierarchical`; shared memory on one
/// host; NCCL on GPUs), `shm`, `hierarchical` (shared memory inside each host, MPI between
/// hosts), `mpi` (MPI for every byte, also inside a host) or `nccl`.
pub const BACKEND_VAR: &str = "CANDLE_TP_BACKEND";

/// The variable that gives the number of processes of the whole job, for messages.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
fn world_size_var(launcher: Launcher) -> &'static str {
    match launcher {
        Launcher::OpenMpi => "OMPI_COMM_WORLD_SIZE",
        Launcher::Hydra => "PMI_SIZE",
        Launcher::Slurm if var("SLURM_STEP_NUM_TASKS").is_some() => "SLURM_STEP_NUM_TASKS",
        Launcher::Slurm => "SLURM_NTASKS",
        Launcher::Alone | Launcher::Torchrun => "WORLD_SIZE",
    }
}

/// The variable that gives the number of processes on this host, for messages.
fn launch_size_var(launcher: Launcher) -> &'static str {
    match launcher {
        Launcher::OpenMpi => "OMPI_COMM_WORLD_SIZE",
        Launcher::Hydra => "MPI_LOCALNRANKS",
        Launcher::Slurm => "SLURM_STEP_TASKS_PER_NODE",
        Launcher::Alone | Launcher::Torchrun => "LOCAL_WORLD_SIZE",
    }
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
    // A deadline nobody asked for (a typo read as the default) is worse than no job.
    super::wait::timeout_from_env().map_err(|e| CommError::env(super::wait::TIMEOUT_VAR, e))?;
    let launch = launch_from_env()?;
    let mpi_launched = matches!(
        launch.launcher,
        Launcher::OpenMpi | Launcher::Hydra | Launcher::Slurm
    );
    // Some(flat) when an MPI backend is chosen: flat MPI or hierarchical.
    let use_mpi = match var(BACKEND_VAR).as_deref().map(str::trim) {
        None | Some("auto") => {
            (cfg!(feature = "mpi") && mpi_launched && !launch.is_single_host()).then_some(false)
        }
        Some("hierarchical") => Some(false),
        Some("mpi") => Some(true),
        Some("shm") => None,
        Some("nccl") if !device.is_cuda() => {
            return Err(CommError::env(
                BACKEND_VAR,
                format!(
                    "'nccl' runs on CUDA devices, and this job's device is {:?} (use shm, \
                     hierarchical or mpi on CPUs, or auto)",
                    device.location()
                ),
            )
            .into())
        }
        Some("nccl") => None,
        Some(other) => {
            return Err(CommError::env(
                BACKEND_VAR,
                format!("'{other}' is not a backend (auto, shm, hierarchical, mpi or nccl)"),
            )
            .into())
        }
    };
    if let (Some(_flat), true) = (use_mpi, device.is_cpu()) {
        #[cfg(feature = "mpi")]
        {
            let pg = if _flat {
                super::mpi::init_mpi(GroupOptions::default())?
            } else {
                super::hierarchical::init_hierarchical(GroupOptions::default())?
            };
            if launch.launcher != Launcher::Alone && pg.size() != launch.world_size {
                return Err(CommError::env(
                    world_size_var(launch.launcher),
                    format!(
                        "{} says the job has {} processes, but MPI reports {} (was this \
                         process started by that launcher's MPI?)",
                        launch.launcher.name(),
                        launch.world_size,
                        pg.size()
                    ),
                )
                .into());
            }
            return Ok(pg);
        }
        #[cfg(not(feature = "mpi"))]
        return Err(CommError::env(
            BACKEND_VAR,
            "asks for an MPI backend, which this build lacks (cargo build --features mpi; \
             scripts/setup-mpi.sh installs what it needs)",
        )
        .into());
    }
    // GPUs under an MPI launcher: NCCL, meeting at a store found through MPI (no MASTER_ADDR).
    #[cfg(all(feature = "nccl", feature = "mpi"))]
    if let (true, Device::Cuda(dev), true) = (
        mpi_launched,
        device,
        launch.world_size > 1 && var(BACKEND_VAR).as_deref().map(str::trim) != Some("shm"),
    ) {
        let options = GroupOptions::default();
        let world = super::mpi::mpi_world(options)?;
        let (store, keep) = super::mpi::store_over_mpi(&world, options.timeout)?;
        return Ok(super::nccl::init_nccl_on(
            store,
            keep,
            world.rank(),
            world.size(),
            dev,
            options,
        )?);
    }
    let rv = rendezvous_from_env()?;
    if rv.world_size == 1 {
        return Ok(ProcessGroup::single());
    }
    if !launch.is_single_host() && device.is_cpu() {
        return Err(CommError::env(
            launch_size_var(launch.launcher),
            format!(
                "the job spans hosts ({} processes, {} on this host, started by {}), but \
                 the shared-memory backend serves one host. On CPUs, cross hosts with MPI: \
                 build with `--features mpi` (scripts/setup-mpi.sh installs Open MPI) and \
                 launch with `mpirun -np 4 --host a:2,b:2 PROGRAM` or `srun -N 2 \
                 --ntasks-per-node 2 PROGRAM` instead of tprun --nnodes (docs/MULTIHOST.md); \
                 tprun --nnodes serves GPU jobs (the nccl feature)",
                launch.world_size,
                launch.local_world_size,
                launch.launcher.name()
            ),
        )
        .into());
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
