//! A job token for ranks that an MPI launcher (`mpirun`, Hydra's `mpiexec`, `srun`) started
//! on one host without one (issue 44, defect 4).
//!
//! `tprun` gives every job a random `CANDLE_TP_TOKEN`, and a build with the `mpi` feature
//! sends one over MPI. A build without it, under an MPI launcher, had nothing to share a
//! secret with: its ranks met at a store whose port is derived from the launcher's job id and
//! took an empty token, so any local user could join the job, or listen on that port first and
//! answer as its store. Now rank 0 writes a random token to a file that only this user can
//! read, in a directory only this user can write ([`token_dir`]), and the other ranks read
//! it there; the store's handshake (`store::auth`) then proves the token on both sides without
//! sending it, so a program on the port that does not hold it is refused. Rank 0 removes the
//! file when the [`JobTokenFile`] drops, once the ranks have met.
//!
//! Ranks on several hosts share no such file: [`token_for_launch`] refuses that job (GPUs
//! under mpirun across hosts, in a build without `mpi`) with what gives every rank the same
//! token, instead of letting it meet with an empty one.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use super::error::{CommError, CommResult};
use super::launcher::Launch;
use super::secret;

/// How long before a rank started a token file may have been written and still be this job's:
/// the ranks of one launch start within seconds of each other, and a file from an earlier job
/// with the same key is older.
const FRESH: Duration = Duration::from_secs(60);

/// This job's token, read from (or, on rank 0, written to) its file; rank 0 removes the file
/// when this drops.
#[derive(Debug)]
pub struct JobTokenFile {
    /// The token.
    pub token: String,
    /// The file, for messages.
    pub path: PathBuf,
    owner: bool,
}

impl Drop for JobTokenFile {
    fn drop(&mut self) {
        if self.owner {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// The directory of token files: `$XDG_RUNTIME_DIR/candle-tp` (a per-user tmpfs) where the
/// session has one, else `$CANDLE_TP_HOME/run` (`~/.cache/candle-tp/run`); see
/// [`private_dir`].
pub fn token_dir() -> CommResult<PathBuf> {
    let base = match std::env::var_os("XDG_RUNTIME_DIR").filter(|v| !v.is_empty()) {
        Some(run) => PathBuf::from(run).join("candle-tp"),
        None => {
            let home = std::env::var_os("CANDLE_TP_HOME")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/candle-tp"))
                })
                .ok_or_else(|| {
                    CommError::env("HOME", "is not set: no private directory for the job token")
                })?;
            home.join("run")
        }
    };
    private_dir(base)
}

/// `dir`, created mode 0700 if missing, and refused unless this user owns it and nobody else
/// can enter it: where a token file can be neither read nor planted by another user.
pub fn private_dir(dir: PathBuf) -> CommResult<PathBuf> {
    let io = |what: &str, e: std::io::Error| CommError::io(format!("{what} {}", dir.display()), e);
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|e| io("creating the job token directory", e))?;
    let meta = fs::symlink_metadata(&dir).map_err(|e| io("inspecting", e))?;
    let me = euid();
    if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o077 != 0 {
        return Err(CommError::invalid(
            format!("the job token directory {}", dir.display()),
            format!(
                "must be a directory of this user (uid {me}) that nobody else can enter; it is \
                 {} of uid {}, mode {:o} (chmod 700 it, or set CANDLE_TP_TOKEN on every rank)",
                if meta.is_dir() {
                    "a directory"
                } else {
                    "not a directory"
                },
                meta.uid(),
                meta.mode() & 0o7777
            ),
        ));
    }
    Ok(dir)
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// 32 hex characters from the kernel's random source (no predictable fallback: this is a
/// secret).
fn random_token() -> CommResult<String> {
    secret::random_token().map_err(|e| CommError::io("drawing a job token from getrandom", e))
}

/// The token of a job that an MPI launcher started without `CANDLE_TP_TOKEN`, for a build
/// without the `mpi` feature (the shm and NCCL joins): when `token` is empty and `launch` is
/// an MPI launcher's, rank `rank` takes the job's token file ([`job_token_file`] in
/// [`token_dir`]) and puts its token in `token`; the file is removed when the returned handle
/// of rank 0 drops (keep it until the ranks have met). A job across hosts has no file all its
/// ranks can read: an error that says how to give every rank the same token. Nothing to do
/// (`None`) when `token` is set or another launcher started the job.
pub(crate) fn token_for_launch(
    launch: &Launch,
    rank: usize,
    token: &mut String,
    timeout: Duration,
) -> CommResult<Option<JobTokenFile>> {
    if !token.is_empty() || !launch.launcher.is_mpi() {
        return Ok(None);
    }
    if !launch.is_single_host() {
        return Err(CommError::env(
            "CANDLE_TP_TOKEN",
            format!(
                "is not set, and the job spans hosts ({} processes, {} on this host, started \
                 by {}): a token file serves one host, and this build has no MPI to send a \
                 token with. Give every rank the same secret (export \
                 CANDLE_TP_TOKEN=$(openssl rand -hex 16), then mpirun -x CANDLE_TP_TOKEN ...), \
                 or build with --features mpi",
                launch.world_size,
                launch.local_world_size,
                launch.launcher.name()
            ),
        ));
    }
    let file = job_token_file(launch, rank, &token_dir()?, timeout)?;
    token.clone_from(&file.token);
    Ok(Some(file))
}

/// The token of the job `launch` describes, for rank `rank`: rank 0 writes a fresh random one
/// to `dir/job-<key>.token` (mode 0600, replacing any older file atomically), the others wait
/// for a file written less than a minute before they started and read it, until `timeout`.
/// An error names the file, the launcher and what to do instead.
pub fn job_token_file(
    launch: &Launch,
    rank: usize,
    dir: &Path,
    timeout: Duration,
) -> CommResult<JobTokenFile> {
    let key = launch.job_key.as_deref().ok_or_else(|| {
        CommError::env(
            "CANDLE_TP_TOKEN",
            format!(
                "is not set, and {} gave this job no id to name a token file after: set the same \
                 random CANDLE_TP_TOKEN for every rank (mpirun -x CANDLE_TP_TOKEN), or build \
                 with --features mpi",
                launch.launcher.name()
            ),
        )
    })?;
    let safe: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let path = dir.join(format!("job-{safe}.token"));
    if rank == 0 {
        let token = random_token()?;
        let tmp = dir.join(format!(".job-{safe}.{}.tmp", std::process::id()));
        let written = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(token.as_bytes()))
            .and_then(|_| fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(CommError::io(
                format!("writing the job token file {}", path.display()),
                e,
            ));
        }
        return Ok(JobTokenFile {
            token,
            path,
            owner: true,
        });
    }
    let started = SystemTime::now() - FRESH;
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(meta) = fs::metadata(&path) {
            let fresh = meta.modified().is_ok_and(|t| t >= started);
            if fresh && meta.uid() == euid() && meta.mode() & 0o077 == 0 {
                let token = fs::read_to_string(&path).map_err(|e| {
                    CommError::io(format!("reading the job token file {}", path.display()), e)
                })?;
                if !token.is_empty() {
                    return Ok(JobTokenFile {
                        token,
                        path,
                        owner: false,
                    });
                }
            }
        }
        if Instant::now() >= deadline {
            return Err(CommError::invalid(
                format!("rank {rank} of a job started by {}", launch.launcher.name()),
                format!(
                    "rank 0 wrote no job token to {} within {:.0} s (is rank 0 running on this \
                     host? ranks on several hosts need the same CANDLE_TP_TOKEN set for every \
                     rank, or a build with --features mpi)",
                    path.display(),
                    timeout.as_secs_f64()
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::launcher::Launcher;
    use std::os::unix::fs::PermissionsExt;

    fn launch(key: &str) -> Launch {
        Launch {
            launcher: Launcher::OpenMpi,
            rank: 0,
            world_size: 2,
            local_rank: 0,
            local_world_size: 2,
            job_key: Some(key.into()),
            first_host: None,
        }
    }

    /// Issue 44: ranks of an MPI job across hosts, in a build without MPI, cannot share a
    /// token file; they are refused with what to do instead of meeting with an empty token.
    /// A set token or another launcher leaves the token alone.
    #[test]
    fn an_mpi_job_across_hosts_without_a_token_is_refused() {
        let across = Launch {
            world_size: 4,
            ..launch("ompi/9.1")
        };
        let mut token = String::new();
        let e = token_for_launch(&across, 0, &mut token, Duration::from_secs(1))
            .unwrap_err()
            .to_string();
        assert!(!e.contains("  "), "runs of spaces in the message: {e}");
        for part in [
            "CANDLE_TP_TOKEN",
            "spans hosts",
            "4 processes, 2 on this host",
            "mpirun -x",
            "--features mpi",
        ] {
            assert!(e.contains(part), "{part}: {e}");
        }
        assert!(token.is_empty());
        let mut set = "secret".to_string();
        assert!(
            token_for_launch(&across, 0, &mut set, Duration::from_secs(1))
                .unwrap()
                .is_none()
        );
        assert_eq!(set, "secret");
        let torchrun = Launch {
            launcher: Launcher::Torchrun,
            ..across
        };
        assert!(
            token_for_launch(&torchrun, 0, &mut token, Duration::from_secs(1))
                .unwrap()
                .is_none()
        );
        assert!(token.is_empty());
    }

    /// A scratch directory of mode 0700, removed at the end.
    fn private_dir_for_test() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o700)).unwrap();
        dir
    }

    /// Rank 0's token reaches rank 1 through a file of mode 0600 whatever the umask, each job
    /// gets a different one, and the file goes when rank 0's handle drops.
    #[test]
    fn rank_0_writes_a_private_token_that_rank_1_reads() {
        let dir = private_dir_for_test();
        // SAFETY: umask only sets this process's file creation mask.
        let old = unsafe { libc::umask(0) };
        let zero = job_token_file(&launch("ompi/77.1"), 0, dir.path(), Duration::from_secs(5));
        unsafe { libc::umask(old) };
        let zero = zero.unwrap();
        assert_eq!(zero.token.len(), 32, "{}", zero.token);
        let mode = fs::metadata(&zero.path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let one =
            job_token_file(&launch("ompi/77.1"), 1, dir.path(), Duration::from_secs(5)).unwrap();
        assert_eq!(one.token, zero.token);
        let other =
            job_token_file(&launch("ompi/78.1"), 0, dir.path(), Duration::from_secs(5)).unwrap();
        assert_ne!(other.token, zero.token);
        let path = zero.path.clone();
        drop(one);
        assert!(path.exists(), "a reader removed the file");
        drop(zero);
        assert!(!path.exists(), "rank 0 left its token file");
    }

    /// A rank whose rank 0 never writes waits out its deadline and says where it looked; a
    /// file another mode could read is not taken.
    #[test]
    fn no_token_from_rank_0_is_a_timeout_naming_the_file() {
        let dir = private_dir_for_test();
        let path = dir.path().join("job-ompi_5.token");
        fs::write(&path, "readable-by-all").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let start = Instant::now();
        let err = job_token_file(&launch("ompi/5"), 1, dir.path(), Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(start.elapsed() >= Duration::from_millis(300));
        for part in ["rank 1", "mpirun", "job-ompi_5.token", "CANDLE_TP_TOKEN"] {
            assert!(err.contains(part), "{err:?} lacks {part:?}");
        }
    }

    /// A directory others can enter is refused, naming it and its mode; a missing one is made
    /// mode 0700.
    #[test]
    fn an_open_directory_is_refused() {
        let dir = private_dir_for_test();
        let open = dir.path().join("open");
        fs::create_dir(&open).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o755)).unwrap();
        let err = private_dir(open).unwrap_err().to_string();
        for part in ["open", "mode 755", "chmod 700"] {
            assert!(err.contains(part), "{err:?} lacks {part:?}");
        }
        let made = private_dir(dir.path().join("a/b")).unwrap();
        assert_eq!(
            fs::metadata(made).unwrap().permissions().mode() & 0o777,
            0o700
        );
    }
}
