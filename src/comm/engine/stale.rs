//! Segments that no process of their job can remove any more (issue 44).
//!
//! A job's ranks remove their segments on every path they live through: once every rank
//! mapped a region, on a failed rendezvous, and on SIGTERM (`region::sweep_on_sigterm`). A host
//! whose every rank was SIGKILLed (no survivor, no SIGTERM) keeps whatever region was made and
//! not yet mapped by all. The next job of this user on the host sweeps them: a
//! `candle-tp-*` file of `/dev/shm` that this user owns, untouched for
//! [`STALE_AFTER`], whose region names no process that is still alive (or that holds no
//! region at all) is unlinked. A region of a running job is never taken: its ranks wrote
//! their pids when they attached, and one of them is alive. A job of the same user in another
//! pid namespace sharing this `/dev/shm` would look dead; the age bound keeps its rendezvous
//! (which waits at most `CANDLE_TP_TIMEOUT`, 300 s by default) out of reach.

use std::fs::File;
use std::mem::offset_of;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::time::{Duration, SystemTime};

use super::abort::process_alive;
use super::layout::{Header, Record, HEADER_BYTES, MAGIC, MAX_RANKS, RECORD_BYTES};

/// How long a segment must have been left untouched before a sweep considers it.
pub(crate) const STALE_AFTER: Duration = Duration::from_secs(600);

/// The pids a region's records hold (rank order, 0 where a rank never attached), or `None`
/// where the file holds no region of this engine (too short, another magic, a size out of
/// range).
fn region_pids(file: &File) -> Option<Vec<u32>> {
    // The header's and the records' fields where `layout.rs` puts them (native byte order, as
    // the mapped atomics hold them).
    let read_u64 = |at: usize| {
        let mut b = [0u8; 8];
        file.read_exact_at(&mut b, at as u64)
            .ok()
            .map(|_| u64::from_ne_bytes(b))
    };
    let magic = read_u64(offset_of!(Header, magic))?;
    let size = read_u64(offset_of!(Header, size))? as usize;
    if magic != MAGIC || size == 0 || size > MAX_RANKS {
        return None;
    }
    (0..size)
        .map(|r| {
            let mut pid = [0u8; 4];
            let at = HEADER_BYTES + r * RECORD_BYTES + offset_of!(Record, pid);
            file.read_exact_at(&mut pid, at as u64).ok()?;
            Some(u32::from_ne_bytes(pid))
        })
        .collect()
}

/// Unlinks the stale `candle-tp-*` segments of `dir` (see the module's documentation): this
/// user's, untouched for `older_than`, naming no live process. Returns their names. Errors
/// (a file that vanished meanwhile, one that cannot be read) leave that file alone.
pub(crate) fn sweep_stale_segments(dir: &Path, older_than: Duration) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let now = SystemTime::now();
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("candle-tp-") {
            continue;
        }
        let path = entry.path();
        let Ok(file) = File::open(&path) else {
            continue;
        };
        let Ok(meta) = file.metadata() else { continue };
        let idle = meta
            .modified()
            .ok()
            .and_then(|t| now.duration_since(t).ok())
            .unwrap_or_default();
        if !meta.is_file() || meta.uid() != me || idle < older_than {
            continue;
        }
        let alive = region_pids(&file)
            .unwrap_or_default()
            .into_iter()
            .any(|pid| pid != 0 && process_alive(pid));
        if !alive && std::fs::remove_file(&path).is_ok() {
            removed.push(name);
        }
    }
    removed
}

/// [`sweep_stale_segments`] of `/dev/shm` with [`STALE_AFTER`], once per process (the first
/// shm rendezvous calls it), saying on stderr what it removed.
pub(crate) fn sweep_dev_shm_once() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        let removed = sweep_stale_segments(Path::new("/dev/shm"), STALE_AFTER);
        if !removed.is_empty() {
            eprintln!(
                "candle-tp: removed {} segment(s) of jobs that ended without a survivor from \
                 /dev/shm: {}",
                removed.len(),
                removed.join(", ")
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A file laid out as a region of `pids.len()` ranks whose records hold `pids`.
    fn region_file(path: &Path, pids: &[u32], magic: u64) {
        let mut bytes = vec![0u8; HEADER_BYTES + pids.len().max(1) * RECORD_BYTES];
        let (m, n) = (offset_of!(Header, magic), offset_of!(Header, size));
        bytes[m..m + 8].copy_from_slice(&magic.to_ne_bytes());
        bytes[n..n + 8].copy_from_slice(&(pids.len() as u64).to_ne_bytes());
        for (r, pid) in pids.iter().enumerate() {
            let at = HEADER_BYTES + r * RECORD_BYTES + offset_of!(Record, pid);
            bytes[at..at + 4].copy_from_slice(&pid.to_ne_bytes());
        }
        File::create(path).unwrap().write_all(&bytes).unwrap();
    }

    fn age(path: &Path, by: Duration) {
        let f = File::options().write(true).open(path).unwrap();
        f.set_modified(SystemTime::now() - by).unwrap();
    }

    /// A pid that no process holds now: a child that has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    /// Only this user's old `candle-tp-*` segments that name no live process go: a region
    /// whose ranks all died, one never initialised; not a region with one live rank, not a
    /// young one, not another program's file.
    #[test]
    fn a_sweep_takes_only_old_segments_of_dead_jobs() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path();
        let (dead, me) = (dead_pid(), std::process::id());
        let old = Duration::from_secs(3600);
        let cases = [
            ("candle-tp-job1-dead", vec![dead, 0], MAGIC, old, true),
            ("candle-tp-job2-garbage", vec![dead], 0xdead, old, true),
            ("candle-tp-job3-live", vec![dead, me], MAGIC, old, false),
            (
                "candle-tp-job4-young",
                vec![dead, dead],
                MAGIC,
                Duration::ZERO,
                false,
            ),
            ("other-program", vec![dead], MAGIC, old, false),
        ];
        for (name, pids, magic, by, _) in &cases {
            let p = dir.join(name);
            region_file(&p, pids, *magic);
            age(&p, *by);
        }
        let mut removed = sweep_stale_segments(dir, Duration::from_secs(600));
        removed.sort();
        let mut want: Vec<String> = cases
            .iter()
            .filter(|c| c.4)
            .map(|c| c.0.to_string())
            .collect();
        want.sort();
        assert_eq!(removed, want);
        for (name, _, _, _, gone) in &cases {
            assert_eq!(!dir.join(name).exists(), *gone, "{name}");
        }
    }
}
