//! Emulated hosts (`scripts/hosts.sh`) for the tests that run jobs across them: made for one
//! test at a time on the machine (a lock in the process and a file lock across processes: the
//! hosts are global, and two test runs in two checkouts would take each other's down), removed
//! when the guard drops, also when the test fails.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, MutexGuard};

/// The script.
pub fn hosts_sh() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/hosts.sh")
}

/// The emulated hosts for the test's duration: `down` when dropped, also on a failure. One
/// test at a time holds them.
pub struct Hosts {
    _one_at_a_time: MutexGuard<'static, ()>,
    /// Holds `flock(LOCK_EX)` on [`LOCK_FILE`] until dropped (after `down`).
    _machine: std::fs::File,
}

/// The file whose lock one test run on the machine holds while it has the hosts.
const LOCK_FILE: &str = "/tmp/candle-tp-hosts.lock";

impl Hosts {
    /// `hosts.sh up n`, or `None` after printing `SKIPPED: why` where the machine cannot make
    /// them (outside CI, which must be able to).
    pub fn up(n: usize) -> Option<Self> {
        static ONE: Mutex<()> = Mutex::new(());
        let guard = ONE.lock().unwrap_or_else(|e| e.into_inner());
        let check = Command::new(hosts_sh())
            .arg("check")
            .output()
            .expect("hosts.sh");
        if !check.status.success() {
            let why = String::from_utf8_lossy(&check.stdout).trim().to_string();
            super::skip(&format!("no emulated hosts: {why}"));
            return None;
        }
        let machine = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(LOCK_FILE)
            .expect("open the hosts lock file");
        // SAFETY: flock(2) on a descriptor this File owns; it blocks until the lock is ours.
        let rc = unsafe {
            libc::flock(
                std::os::unix::io::AsRawFd::as_raw_fd(&machine),
                libc::LOCK_EX,
            )
        };
        assert_eq!(
            rc,
            0,
            "flock {LOCK_FILE}: {}",
            std::io::Error::last_os_error()
        );
        let out = Command::new(hosts_sh())
            .args(["up", &n.to_string()])
            .output()
            .expect("hosts.sh up");
        assert!(
            out.status.success(),
            "hosts.sh up {n}: {}",
            super::output_text(&out)
        );
        Some(Hosts {
            _one_at_a_time: guard,
            _machine: machine,
        })
    }

    /// `mpirun -np N --map-by node` on the hosts.
    pub fn mpirun(&self, np: usize) -> Command {
        let mut c = Command::new(hosts_sh());
        c.args([
            "mpirun",
            "-np",
            &np.to_string(),
            "--map-by",
            "node",
            "--tag-output",
        ])
        .args(["-x", "RAYON_NUM_THREADS=1"]);
        c
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = Command::new(hosts_sh()).arg("down").output();
    }
}

/// The processes running in namespace `ns`, space-separated.
pub fn netns_pids(ns: &str) -> String {
    let out = Command::new("ip")
        .args(["netns", "pids", ns])
        .output()
        .expect("ip netns pids");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The files in host `ns`'s /dev/shm (`hosts.sh shm`: the host's kept mount namespace),
/// space-separated.
pub fn netns_shm(ns: &str) -> String {
    let out = Command::new(hosts_sh())
        .args(["shm", ns])
        .output()
        .expect("hosts.sh shm");
    assert!(
        out.status.success(),
        "hosts.sh shm {ns}: {}",
        super::output_text(&out)
    );
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}
