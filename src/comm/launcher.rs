//! Which launcher started this process, and the job layout it describes: `tprun` or PyTorch's
//! `torchrun` (`RANK`, `WORLD_SIZE`, ...), Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`),
//! MPICH / Intel MPI's Hydra `mpiexec` (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, ...) or
//! Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, ...).
//!
//! torchrun's variables win when both are present (`mpirun -x RANK=...`, or torchrun inside a
//! Slurm allocation). Under an MPI launcher or `srun` the ranks still meet through rank 0's
//! store at `MASTER_ADDR:MASTER_PORT`; when the job runs on one host and those are unset, the
//! store listens on 127.0.0.1 at a port derived from the launcher's job id, the same on every
//! rank ([`Launch::default_port`]), so `mpirun -np 4 PROGRAM` needs nothing else.

use super::error::{CommError, CommResult};

/// The program that started this process's job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher: a job of one rank.
    Alone,
    /// `tprun` or PyTorch's `torchrun` (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, ...).
    Torchrun,
    /// Open MPI's `mpirun` / `mpiexec` (`OMPI_COMM_WORLD_RANK`, ...).
    OpenMpi,
    /// MPICH's or Intel MPI's Hydra `mpiexec` (`PMI_RANK`, `PMI_SIZE`, ...).
    Hydra,
    /// Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, ...).
    Slurm,
}

impl Launcher {
    /// The launcher's usual name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Alone => "no launcher",
            Self::Torchrun => "tprun/torchrun",
            Self::OpenMpi => "Open MPI's mpirun",
            Self::Hydra => "Hydra's mpiexec (MPICH, Intel MPI)",
            Self::Slurm => "Slurm's srun",
        }
    }

    /// Whether an MPI launcher (`mpirun`, Hydra's `mpiexec`) or `srun` started the job.
    pub fn is_mpi(self) -> bool {
        matches!(self, Self::OpenMpi | Self::Hydra | Self::Slurm)
    }

    /// The variable that gives the number of processes of the whole job, for messages.
    pub fn world_size_var(self) -> &'static str {
        let step = std::env::var("SLURM_STEP_NUM_TASKS").is_ok_and(|v| !v.trim().is_empty());
        match self {
            Self::OpenMpi => "OMPI_COMM_WORLD_SIZE",
            Self::Hydra => "PMI_SIZE",
            Self::Slurm if step => "SLURM_STEP_NUM_TASKS",
            Self::Slurm => "SLURM_NTASKS",
            Self::Alone | Self::Torchrun => "WORLD_SIZE",
        }
    }

    /// The variable that gives the number of processes on this host, for messages.
    pub fn local_size_var(self) -> &'static str {
        match self {
            Self::OpenMpi => "OMPI_COMM_WORLD_SIZE",
            Self::Hydra => "MPI_LOCALNRANKS",
            Self::Slurm => "SLURM_STEP_TASKS_PER_NODE",
            Self::Alone | Self::Torchrun => "LOCAL_WORLD_SIZE",
        }
    }
}

/// This process's place in its job, as its launcher describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Who started the job.
    pub launcher: Launcher,
    /// This process's rank in the job, `0..world_size`.
    pub rank: usize,
    /// Processes in the job.
    pub world_size: usize,
    /// This process's index among the processes on its host (it picks the GPU).
    pub local_rank: usize,
    /// Processes of the job on this host.
    pub local_world_size: usize,
    /// An id of the job that every rank sees alike (MPI / Slurm), for a default port.
    pub job_key: Option<String>,
    /// The first host of a Slurm allocation (`SLURM_JOB_NODELIST`), a default `MASTER_ADDR`.
    pub first_host: Option<String>,
}

impl Launch {
    /// Whether every rank runs on this host.
    pub fn is_single_host(&self) -> bool {
        self.local_world_size == self.world_size
    }

    /// The store's port when `MASTER_PORT` is unset under an MPI launcher or srun: 20000 +
    /// a hash of the job id modulo 12768 (ports 20000-32767, below Linux's ephemeral range
    /// 32768-60999, where the kernel picks ports for other programs' sockets), the same on
    /// every rank.
    pub fn default_port(&self) -> Option<u16> {
        let key = self.job_key.as_deref()?;
        let h = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        Some(20_000 + (h % 12_768) as u16)
    }
}

fn parse(name: &str, value: &str) -> CommResult<usize> {
    value
        .trim()
        .parse()
        .map_err(|_| CommError::env(name, format!("'{value}' is not a valid number")))
}

/// Reads the job layout from `get` (a variable's value, `None` when unset or blank): the
/// launcher's own variables, checked for consistency, each error naming the variable.
///
/// ```
/// use candle_tp::comm::{detect_launch, Launcher};
/// let env = [("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "4"),
///            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "2")];
/// let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
/// let l = detect_launch(&get).unwrap();
/// assert_eq!((l.launcher, l.rank, l.world_size, l.local_world_size), (Launcher::OpenMpi, 1, 4, 2));
/// assert!(!l.is_single_host());
/// ```
pub fn detect_launch(get: &dyn Fn(&str) -> Option<String>) -> CommResult<Launch> {
    let num = |name: &str| -> CommResult<Option<usize>> {
        get(name).map(|v| parse(name, &v)).transpose()
    };
    // (launcher, rank var, size var, local rank var, local size var)
    let layouts: [(Launcher, &str, &str, &str, &str); 4] = [
        (
            Launcher::Torchrun,
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
        ),
        (
            Launcher::OpenMpi,
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        (
            Launcher::Hydra,
            "PMI_RANK",
            "PMI_SIZE",
            "MPI_LOCALRANKID",
            "MPI_LOCALNRANKS",
        ),
        (
            Launcher::Slurm,
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            "",
        ),
    ];
    for (launcher, rank_var, size_var, local_var, local_size_var) in layouts {
        let size_var = if launcher == Launcher::Slurm && get("SLURM_STEP_NUM_TASKS").is_some() {
            // Inside a job step (srun): the step's tasks, not the allocation's.
            "SLURM_STEP_NUM_TASKS"
        } else {
            size_var
        };
        let (rank, world) = match (num(rank_var)?, num(size_var)?) {
            (None, None) => continue,
            (Some(_), None) => {
                return Err(CommError::env(
                    size_var,
                    format!(
                        "is not set but {rank_var} is (start the job with tprun, torchrun, \
                         mpirun or srun)"
                    ),
                ))
            }
            (None, Some(_)) if launcher == Launcher::Slurm => continue, // sbatch, no srun
            (None, Some(_)) => {
                return Err(CommError::env(
                    rank_var,
                    format!(
                        "is not set but {size_var} is (start the job with tprun, torchrun, \
                         mpirun or srun)"
                    ),
                ))
            }
            (Some(r), Some(w)) => (r, w),
        };
        if world == 0 {
            return Err(CommError::env(size_var, "must be at least 1"));
        }
        if rank >= world {
            return Err(CommError::env(
                rank_var,
                format!("{rank_var}={rank} must be below {size_var}={world}"),
            ));
        }
        let local_world_size = if launcher == Launcher::Slurm {
            slurm_local_tasks(get)?
        } else {
            num(local_size_var)?
        };
        let local_rank = num(local_var)?;
        let (local_rank, local_world_size) = match (local_rank, local_world_size) {
            (Some(l), Some(s)) => (l, s),
            // torchrun-style variables without the local ones: a job on one host.
            (None, None) => (rank, world),
            (Some(l), None) => (l, world),
            (None, Some(s)) if s == world => (rank, s),
            // As before launchers other than torchrun were read: LOCAL_RANK defaults to 0.
            (None, Some(s)) if launcher == Launcher::Torchrun => (0, s),
            (None, Some(_)) => {
                return Err(CommError::env(
                    local_var,
                    format!("is not set but the job spans hosts ({size_var}={world})"),
                ))
            }
        };
        if local_world_size == 0 || local_world_size > world {
            return Err(CommError::env(
                if local_size_var.is_empty() {
                    "SLURM_STEP_TASKS_PER_NODE"
                } else {
                    local_size_var
                },
                format!("{local_world_size} processes on this host in a job of {world}"),
            ));
        }
        if local_rank >= local_world_size {
            return Err(CommError::env(
                local_var,
                format!(
                    "{local_var}={local_rank} must be below the {local_world_size} processes \
                     on this host"
                ),
            ));
        }
        return Ok(Launch {
            launcher,
            rank,
            world_size: world,
            local_rank,
            local_world_size,
            job_key: job_key(launcher, local_world_size == world, get),
            first_host: get("SLURM_JOB_NODELIST")
                .or_else(|| get("SLURM_NODELIST"))
                .and_then(|l| first_host(&l)),
        });
    }
    Ok(Launch {
        launcher: Launcher::Alone,
        rank: 0,
        world_size: 1,
        local_rank: 0,
        local_world_size: 1,
        job_key: None,
        first_host: None,
    })
}

/// Reads the layout from this process's environment ([`detect_launch`]).
pub fn launch_from_env() -> CommResult<Launch> {
    detect_launch(&|k| std::env::var(k).ok().filter(|v| !v.trim().is_empty()))
}

/// An id every rank of the job sees alike (`single_host`: whether every rank runs on this
/// host), or `None` where the environment holds none.
fn job_key(
    launcher: Launcher,
    single_host: bool,
    get: &dyn Fn(&str) -> Option<String>,
) -> Option<String> {
    let pmix = || get("PMIX_NAMESPACE");
    match launcher {
        Launcher::Alone | Launcher::Torchrun => None,
        Launcher::OpenMpi => get("OMPI_MCA_ess_base_jobid")
            .or_else(pmix)
            .map(|k| format!("ompi/{k}")),
        // Hydra may put no job id in the environment; the ranks of one host share their
        // parent (its proxy), which is what a one-host default needs. Across hosts each host
        // has its own proxy, so there is no key (MASTER_PORT is then asked for by name).
        Launcher::Hydra => pmix()
            .or_else(|| get("PMI_KVSNAME"))
            .or_else(|| single_host.then(|| format!("ppid{}", parent_pid())))
            .map(|k| format!("hydra/{k}")),
        Launcher::Slurm => get("SLURM_JOB_ID").map(|j| {
            format!(
                "slurm/{j}.{}",
                get("SLURM_STEP_ID").unwrap_or_else(|| "0".into())
            )
        }),
    }
}

#[cfg(unix)]
fn parent_pid() -> u32 {
    std::os::unix::process::parent_id()
}

#[cfg(not(unix))]
fn parent_pid() -> u32 {
    0
}

/// Tasks of this Slurm step on this node: `SLURM_STEP_TASKS_PER_NODE` (or
/// `SLURM_TASKS_PER_NODE`), a compressed list such as `2(x3),1`, at index `SLURM_NODEID`.
fn slurm_local_tasks(get: &dyn Fn(&str) -> Option<String>) -> CommResult<Option<usize>> {
    let (var, list) = match get("SLURM_STEP_TASKS_PER_NODE") {
        Some(l) => ("SLURM_STEP_TASKS_PER_NODE", l),
        None => match get("SLURM_TASKS_PER_NODE") {
            Some(l) => ("SLURM_TASKS_PER_NODE", l),
            None => return Ok(None),
        },
    };
    let node = match get("SLURM_NODEID") {
        Some(v) => parse("SLURM_NODEID", &v)?,
        None => 0,
    };
    let counts = expand_tasks_per_node(&list)
        .ok_or_else(|| CommError::env(var, format!("'{list}' is not a list like 2(x3),1")))?;
    counts.get(node).copied().map(Some).ok_or_else(|| {
        CommError::env(
            var,
            format!(
                "'{list}' has {} nodes, SLURM_NODEID is {node}",
                counts.len()
            ),
        )
    })
}

/// `2(x3),1` → `[2, 2, 2, 1]`; `None` when malformed.
fn expand_tasks_per_node(list: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in list.split(',') {
        let part = part.trim();
        let (count, times) = match part.split_once("(x") {
            Some((c, rest)) => (c, rest.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (part, 1),
        };
        let count = count.parse::<usize>().ok()?;
        if times > 1 << 20 {
            return None;
        }
        out.extend(std::iter::repeat_n(count, times));
    }
    Some(out)
}

/// The first host of a Slurm host list: `node[01-04,07],gpu5` → `node01`.
fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list.find(',').unwrap_or(list.len());
    let bracket = list.find('[');
    match bracket {
        Some(b) if b < end => {
            let close = list[b..].find(']')? + b;
            let first = list[b + 1..close].split([',', '-']).next()?;
            Some(format!("{}{}", &list[..b], first))
        }
        _ => Some(list[..end].to_string()).filter(|h| !h.is_empty()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(vars: &[(&str, &str)]) -> CommResult<Launch> {
        let get = |k: &str| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        detect_launch(&get)
    }

    #[test]
    fn nothing_set_is_a_job_of_one() {
        let l = launch(&[]).unwrap();
        assert_eq!((l.launcher, l.rank, l.world_size), (Launcher::Alone, 0, 1));
    }

    #[test]
    fn torchrun_variables() {
        let l = launch(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!(l.launcher, Launcher::Torchrun);
        assert_eq!(
            (l.rank, l.world_size, l.local_rank, l.local_world_size),
            (3, 4, 1, 2)
        );
        assert_eq!(l.default_port(), None);
        // Without the local variables: one host.
        let l = launch(&[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap();
        assert!(l.is_single_host());
        assert_eq!(l.local_rank, 1);
    }

    #[test]
    fn torchrun_wins_over_an_mpi_launcher() {
        let l = launch(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!((l.launcher, l.rank), (Launcher::Torchrun, 0));
    }

    #[test]
    fn open_mpi_variables() {
        let vars = [
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("OMPI_MCA_ess_base_jobid", "3421569025"),
        ];
        let l = launch(&vars).unwrap();
        assert_eq!(l.launcher, Launcher::OpenMpi);
        assert_eq!(
            (l.rank, l.world_size, l.local_rank, l.local_world_size),
            (2, 4, 0, 2)
        );
        assert!(!l.is_single_host());
        let p = l.default_port().unwrap();
        assert!((20_000..32_768).contains(&p));
        // Another rank of the same job derives the same port.
        let mut other = vars;
        other[0].1 = "1";
        other[2].1 = "1";
        assert_eq!(launch(&other).unwrap().default_port(), Some(p));
    }

    #[test]
    fn default_ports_stay_below_the_ephemeral_range() {
        // Linux hands out 32768-60999 to sockets bound to port 0 (a test's listener, an
        // outgoing connection): a store port there collided with one in CI.
        for job in 0..5000u32 {
            let l = Launch {
                launcher: Launcher::OpenMpi,
                rank: 0,
                world_size: 2,
                local_rank: 0,
                local_world_size: 2,
                job_key: Some(job.to_string()),
                first_host: None,
            };
            let p = l.default_port().unwrap();
            assert!((20_000..32_768).contains(&p), "job {job}: port {p}");
        }
    }

    #[test]
    fn hydra_variables() {
        let l = launch(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ])
        .unwrap();
        assert_eq!(l.launcher, Launcher::Hydra);
        assert_eq!(
            (l.rank, l.world_size, l.local_rank, l.local_world_size),
            (1, 2, 1, 2)
        );
        assert!(l.is_single_host() && l.default_port().is_some());
    }

    /// Under Hydra across hosts without a job id in the environment (no PMIX_NAMESPACE or
    /// PMI_KVSNAME), the parent pid (each host's proxy) differs per host, so it cannot pick
    /// a port that every rank agrees on: no default port, so that MASTER_PORT is asked for by
    /// name instead of ranks meeting at different ports until the deadline.
    #[test]
    fn hydra_across_hosts_has_no_default_port_without_a_job_id() {
        let across = [
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ];
        let l = launch(&across).unwrap();
        assert!(!l.is_single_host());
        assert_eq!((l.job_key.as_deref(), l.default_port()), (None, None));
        let mut named = across.to_vec();
        named.push(("PMI_KVSNAME", "kvs_4242_0"));
        let l = launch(&named).unwrap();
        assert_eq!(l.job_key.as_deref(), Some("hydra/kvs_4242_0"));
        assert!(l.default_port().is_some());
    }

    #[test]
    fn slurm_variables() {
        // srun -N 2 --ntasks-per-node 2: task 3 is the second task of node 1.
        let l = launch(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_JOB_ID", "1234"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_NODELIST", "cn[07-08]"),
        ])
        .unwrap();
        assert_eq!(l.launcher, Launcher::Slurm);
        assert_eq!(
            (l.rank, l.world_size, l.local_rank, l.local_world_size),
            (3, 4, 1, 2)
        );
        assert_eq!(l.first_host.as_deref(), Some("cn07"));
        assert_eq!(l.job_key.as_deref(), Some("slurm/1234.0"));
        // Uneven: 3 tasks on 2 nodes, node 1 has one.
        let l = launch(&[
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "3"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "2,1"),
        ])
        .unwrap();
        assert_eq!((l.local_rank, l.local_world_size), (0, 1));
    }

    #[test]
    fn an_sbatch_script_outside_srun_is_alone() {
        // The batch script sees SLURM_NTASKS but no SLURM_PROCID of a step.
        let l = launch(&[("SLURM_NTASKS", "4"), ("SLURM_JOB_ID", "9")]).unwrap();
        assert_eq!(l.launcher, Launcher::Alone);
    }

    #[test]
    fn contradictions_name_the_variable() {
        let e = launch(&[("OMPI_COMM_WORLD_RANK", "4"), ("OMPI_COMM_WORLD_SIZE", "4")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("OMPI_COMM_WORLD_RANK=4") && e.contains("SIZE=4"),
            "{e}"
        );
        let e = launch(&[("PMI_RANK", "0")]).unwrap_err().to_string();
        assert!(e.contains("PMI_SIZE"), "{e}");
        let e = launch(&[("RANK", "x"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("RANK") && e.contains("'x'"), "{e}");
        let e = launch(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("OMPI_COMM_WORLD_LOCAL_RANK=2"), "{e}");
        let e = launch(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "3"),
            ("SLURM_TASKS_PER_NODE", "1(x2)"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("SLURM_TASKS_PER_NODE") && e.contains("SLURM_NODEID is 3"),
            "{e}"
        );
    }

    #[test]
    fn slurm_lists() {
        assert_eq!(expand_tasks_per_node("2(x3),1"), Some(vec![2, 2, 2, 1]));
        assert_eq!(expand_tasks_per_node("4"), Some(vec![4]));
        assert_eq!(expand_tasks_per_node("2(x"), None);
        assert_eq!(first_host("node[01-04,07],gpu5").as_deref(), Some("node01"));
        assert_eq!(first_host("a1,b[2-3]").as_deref(), Some("a1"));
        assert_eq!(first_host("solo").as_deref(), Some("solo"));
    }
}
