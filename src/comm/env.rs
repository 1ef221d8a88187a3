//! Building the world group from the environment that `tprun` (or PyTorch's `torchrun`), an MPI
//! launcher or `srun` sets: `CANDLE_TP_BACKEND` picks a line of the backends' table
//! (`comm/join.rs`), or `auto` the first that suits the device and the job. No backend is
//! named here.

use candle_core::Device;

use super::backend::Registration;
use super::context::GroupOptions;
use super::error::CommError;
use super::group::ProcessGroup;
use super::join::BACKENDS;
use super::launcher::{launch_from_env, Launch};
use super::rendezvous::var;

/// Chooses the backend: `auto` (the default: for a CPU job that spans hosts under an MPI
/// launcher or srun, when built with the `mpi` feature, `hierarchical`; shared memory on one
/// host; NCCL on GPUs), `shm`, `hierarchical` (shared memory inside each host, MPI between
/// hosts), `mpi` (MPI for every byte, also inside a host) or `nccl`.
pub const BACKEND_VAR: &str = "CANDLE_TP_BACKEND";

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
    let backend = choose(var(BACKEND_VAR).as_deref(), device, &launch)?;
    let join = backend.join.map_err(|hint| {
        CommError::env(
            BACKEND_VAR,
            format!(
                "asks for the '{}' backend, which this build lacks ({hint})",
                backend.name
            ),
        )
    })?;
    Ok(ProcessGroup::from_world(join(
        device,
        &launch,
        GroupOptions::default(),
    )?))
}

/// The table's line that `wanted` (`CANDLE_TP_BACKEND`) names, or for `auto` (or nothing)
/// the first that serves `device` and takes this job.
fn choose(
    wanted: Option<&str>,
    device: &Device,
    launch: &Launch,
) -> Result<&'static Registration, CommError> {
    let names = || {
        let mut names: Vec<&str> = vec!["auto"];
        names.extend(BACKENDS.iter().map(|b| b.name));
        let last = names.pop().unwrap_or_default();
        format!("{} or {last}", names.join(", "))
    };
    let serving = |device: &Device| {
        let names: Vec<&str> = BACKENDS
            .iter()
            .filter(|b| (b.serves)(device))
            .map(|b| b.name)
            .collect();
        names.join(", ")
    };
    match wanted.map(str::trim) {
        None | Some("auto") => BACKENDS
            .iter()
            .find(|b| b.join.is_ok() && (b.serves)(device) && (b.auto)(device, launch))
            .ok_or_else(|| {
                let missing: Vec<String> = BACKENDS
                    .iter()
                    .filter(|b| (b.serves)(device))
                    .filter_map(|b| b.join.err().map(|hint| format!("{}: {hint}", b.name)))
                    .collect();
                CommError::env(
                    BACKEND_VAR,
                    format!(
                        "auto finds no backend for device {:?} in this build ({})",
                        device.location(),
                        missing.join("; ")
                    ),
                )
            }),
        Some(name) => {
            let Some(b) = BACKENDS.iter().find(|b| b.name == name) else {
                return Err(CommError::env(
                    BACKEND_VAR,
                    format!("'{name}' is not a backend ({})", names()),
                ));
            };
            if !(b.serves)(device) {
                return Err(CommError::env(
                    BACKEND_VAR,
                    format!(
                        "'{name}' runs on {}, and this job's device is {:?} (use {} there, or \
                         auto)",
                        b.devices,
                        device.location(),
                        serving(device)
                    ),
                ));
            }
            Ok(b)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::launcher::detect_launch;

    fn launch(vars: &[(&str, &str)]) -> Launch {
        detect_launch(&|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
        .expect("launch")
    }

    fn chosen(wanted: Option<&str>, launch: &Launch) -> String {
        match choose(wanted, &Device::Cpu, launch) {
            Ok(b) => b.name.to_string(),
            Err(e) => format!("error: {e}"),
        }
    }

    #[test]
    fn auto_takes_shm_on_one_host_and_hierarchical_across_hosts_when_built() {
        let alone = launch(&[]);
        assert_eq!(chosen(None, &alone), "shm");
        assert_eq!(chosen(Some(" auto "), &alone), "shm");
        // Open MPI, 4 ranks, 2 on this host: across hosts.
        let across = launch(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]);
        let want = if cfg!(feature = "mpi") {
            "hierarchical"
        } else {
            "shm"
        };
        assert_eq!(chosen(None, &across), want);
    }

    #[test]
    fn a_named_backend_is_taken_refused_for_the_device_or_unknown() {
        let alone = launch(&[]);
        assert_eq!(chosen(Some("shm"), &alone), "shm");
        let nccl = chosen(Some("nccl"), &alone);
        assert!(
            nccl.contains("'nccl' runs on CUDA devices")
                && nccl.contains("use hierarchical, mpi, shm"),
            "{nccl}"
        );
        let bogus = chosen(Some("tcp"), &alone);
        assert!(
            bogus.contains("'tcp' is not a backend (auto, hierarchical, mpi, nccl or shm)"),
            "{bogus}"
        );
        // A backend this build lacks is still known, and its join says what builds it.
        let mpi = choose(Some("mpi"), &Device::Cpu, &alone).expect("mpi is in the table");
        assert_eq!(mpi.join.is_ok(), cfg!(feature = "mpi"));
        if let Err(hint) = mpi.join {
            assert!(hint.contains("--features mpi"), "{hint}");
        }
    }
}
