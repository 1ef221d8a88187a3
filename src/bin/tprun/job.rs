//! Job identity (id, token, thread split) and the environment of each worker.
//!
//! The variables are those torchrun sets (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
//! `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `GROUP_WORLD_SIZE`, `ROLE_RANK`,
//! `ROLE_WORLD_SIZE`, `ROLE_NAME`, `MASTER_ADDR`, `MASTER_PORT`,
//! `TORCHELASTIC_RUN_ID`, ...) plus candle-tp's `CANDLE_TP_TOKEN`, so a
//! program runs the same under `tprun` or `torchrun`.

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

use crate::args::Config;

/// Environment variable holding the job's shared secret token.
pub const TOKEN_VAR: &str = "CANDLE_TP_TOKEN";

/// Environment variable with the job's shared-memory tag: rank 0 starts the job id, so every
/// segment name (`/dev/shm/candle-tp-<tag>...`), with it.
pub const SHM_TAG_VAR: &str = "CANDLE_TP_SHM_TAG";

/// Thread-count variables split between the workers unless the user set them.
pub const THREAD_VARS: [&str; 3] = ["RAYON_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"];

/// What is shared by every worker of one job on this node.
#[derive(Debug, Clone)]
pub struct Job {
    /// The job id (`TORCHELASTIC_RUN_ID`).
    pub run_id: String,
    /// The job token (`CANDLE_TP_TOKEN`): inherited, or 32 random hex characters.
    pub token: OsString,
    /// The tag of this job's shared-memory segments (`CANDLE_TP_SHM_TAG`): 16 random hex
    /// characters, not secret.
    pub shm_tag: String,
    /// Thread-count variables to set, with their value; user-set ones are absent.
    pub threads: Vec<(&'static str, String)>,
}

impl Job {
    /// Creates the job: the id from the config or random, the token from
    /// tprun's environment or `/dev/urandom`, the threads split over the cores.
    pub fn new(config: &Config) -> io::Result<Job> {
        let run_id = match &config.run_id {
            Some(id) => id.clone(),
            None => random_hex(8)?,
        };
        let token = match std::env::var_os(TOKEN_VAR) {
            Some(token) if !token.is_empty() => token,
            _ => OsString::from(random_hex(16)?),
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per_rank = threads_per_rank(cores, config.nproc_per_node).to_string();
        let threads = THREAD_VARS
            .iter()
            .filter(|var| std::env::var_os(var).is_none())
            .map(|var| (*var, per_rank.clone()))
            .collect();
        Ok(Job {
            run_id,
            token,
            shm_tag: random_hex(8)?,
            threads,
        })
    }

    /// The variables to add to tprun's own environment for the worker with
    /// local rank `local_rank`.
    pub fn worker_env(&self, config: &Config, local_rank: usize) -> Vec<(String, OsString)> {
        let rank = config.global_rank(local_rank);
        let world = config.world_size();
        let mut vars: Vec<(String, OsString)> = [
            ("RANK", rank.to_string()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("WORLD_SIZE", world.to_string()),
            ("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string()),
            ("GROUP_RANK", config.node_rank.to_string()),
            ("GROUP_WORLD_SIZE", config.nnodes.to_string()),
            ("ROLE_NAME", "default".to_string()),
            ("ROLE_RANK", rank.to_string()),
            ("ROLE_WORLD_SIZE", world.to_string()),
            ("MASTER_ADDR", config.master_addr.clone()),
            ("MASTER_PORT", config.master_port.to_string()),
            ("TORCHELASTIC_RUN_ID", self.run_id.clone()),
            ("TORCHELASTIC_RESTART_COUNT", "0".to_string()),
            ("TORCHELASTIC_MAX_RESTARTS", "0".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), OsString::from(v)))
        .collect();
        vars.push((TOKEN_VAR.to_string(), self.token.clone()));
        vars.push((SHM_TAG_VAR.to_string(), OsString::from(&self.shm_tag)));
        for (var, value) in &self.threads {
            vars.push((var.to_string(), OsString::from(value)));
        }
        vars
    }
}

impl Job {
    /// Removes the segments of this job still in `/dev/shm` (`candle-tp-<tag>*`), which a
    /// rank leaves behind only when it is killed between creating a group's segment and the
    /// moment every rank has mapped it; returns their names.
    pub fn remove_segments(&self) -> Vec<String> {
        remove_tagged(
            Path::new("/dev/shm"),
            &format!("candle-tp-{}", self.shm_tag),
        )
    }
}

/// Removes the entries of `dir` whose name starts with `prefix`; returns the removed names.
fn remove_tagged(dir: &Path, prefix: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(prefix))
        .filter(|name| std::fs::remove_file(dir.join(name)).is_ok())
        .collect()
}

/// Threads per worker: the cores split evenly, at least one.
pub fn threads_per_rank(cores: usize, nproc_per_node: usize) -> usize {
    (cores / nproc_per_node.max(1)).max(1)
}

/// `bytes` random bytes from `/dev/urandom`, as lowercase hex (2 chars a byte).
pub fn random_hex(bytes: usize) -> io::Result<String> {
    let mut buf = vec![0u8; bytes];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .map_err(|e| io::Error::new(e.kind(), format!("cannot read /dev/urandom: {e}")))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_split_the_cores_with_at_least_one_each() {
        assert_eq!(threads_per_rank(16, 4), 4);
        assert_eq!(threads_per_rank(16, 3), 5);
        assert_eq!(threads_per_rank(2, 3), 1);
        assert_eq!(threads_per_rank(1, 1), 1);
    }

    #[test]
    fn remove_tagged_removes_only_the_tagged_entries() -> io::Result<()> {
        let dir = std::env::temp_dir().join(format!("tprun-tag-{}", random_hex(8)?));
        std::fs::create_dir(&dir)?;
        for name in [
            "candle-tp-abc1-x",
            "candle-tp-abc1-y",
            "candle-tp-abc2-x",
            "other",
        ] {
            std::fs::write(dir.join(name), b"")?;
        }
        let mut removed = remove_tagged(&dir, "candle-tp-abc1");
        removed.sort();
        assert_eq!(removed, ["candle-tp-abc1-x", "candle-tp-abc1-y"]);
        let mut left: Vec<String> = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["candle-tp-abc2-x", "other"]);
        std::fs::remove_dir_all(&dir)
    }

    #[test]
    fn random_hex_has_two_chars_a_byte_and_differs() -> io::Result<()> {
        let (a, b) = (random_hex(16)?, random_hex(16)?);
        assert_eq!(a.len(), 32);
        assert!(a
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a, b);
        Ok(())
    }
}
