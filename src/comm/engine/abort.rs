//! Aborting a group: a rank's reason in its record, the group's abort word in the header, and
//! the checks every wait makes (the word, the peers' processes, the parent group's abort).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Engine, Header, Record, HEADER_BYTES, REASON_BYTES, RECORD_BYTES};
use crate::comm::error::{CommError, CommResult};
use crate::comm::region::Mapping;
use crate::comm::wait::futex_wake_all;

impl Record {
    /// The abort reason this rank wrote (empty if none).
    fn reason(&self) -> String {
        let bytes: Vec<u8> = self
            .reason
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .take_while(|&b| b != 0)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl Engine {
    /// Marks the group as failed, with a reason every peer will see, and wakes all waiters.
    pub(crate) fn abort(&self, reason: &str) {
        abort_region(&self.map, self.rank, self.size, reason);
    }

    /// A handle that aborts the group without this engine (nor its lock): what a watchdog
    /// thread uses while a collective of this rank is stuck holding the lock.
    pub(crate) fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            map: self.map.clone(),
            rank: self.rank,
            size: self.size,
            parent: self.parent.clone(),
        }
    }

    /// Links this group to the group it was made from (see [`Parent`]).
    pub(crate) fn set_parent(&mut self, name: String, abort: AbortHandle) {
        self.parent = Some(Arc::new(Parent { name, abort }));
    }

    pub(super) fn check_abort(&self, op: &str) -> CommResult<()> {
        let a = self.header().abort.load(Ordering::Acquire);
        if a == 0 {
            return match self.parent.as_deref().and_then(Parent::aborted) {
                None => Ok(()),
                Some((group, rank, reason)) => Err(CommError::Aborted {
                    group,
                    op: op.to_string(),
                    rank,
                    reason,
                }),
            };
        }
        let by = a as usize - 1;
        Err(CommError::Aborted {
            group: self.group.clone(),
            op: op.to_string(),
            rank: by,
            reason: self.record(by).reason(),
        })
    }

    /// Errors if peer `r` is a process that no longer runs.
    pub(super) fn check_alive(&self, r: usize, op: &str) -> CommResult<()> {
        let pid = self.record(r).pid.load(Ordering::Acquire);
        if pid == 0 || pid == self.pid || process_alive(pid) {
            return Ok(());
        }
        Err(CommError::PeerDied {
            group: self.group.clone(),
            op: op.to_string(),
            rank: r,
            pid,
        })
    }
}

/// A parent group's name and abort state.
pub(super) struct Parent {
    name: String,
    abort: AbortHandle,
}

/// Aborts a group through its shared region alone: everything it touches is atomic, so any
/// thread may call it at any time, also while a collective of the same rank runs.
#[derive(Clone)]
pub(crate) struct AbortHandle {
    map: Arc<Mapping>,
    rank: usize,
    size: usize,
    parent: Option<Arc<Parent>>,
}

impl Parent {
    /// The aborted ancestor's name, the rank that aborted it and its reason.
    fn aborted(&self) -> Option<(String, usize, String)> {
        match self.abort.own_abort() {
            Some((rank, reason)) => Some((self.name.clone(), rank, reason)),
            None => self.abort.parent.as_deref().and_then(Parent::aborted),
        }
    }
}

impl AbortHandle {
    /// Marks the group as failed with `reason` and wakes every waiter.
    pub(crate) fn abort(&self, reason: &str) {
        abort_region(&self.map, self.rank, self.size, reason);
    }

    /// The group (this one or an ancestor) that was aborted, the rank that aborted it and its
    /// reason.
    pub(crate) fn aborted(&self, name: &str) -> Option<(String, usize, String)> {
        match self.own_abort() {
            Some((rank, reason)) => Some((name.to_string(), rank, reason)),
            None => self.parent.as_deref().and_then(Parent::aborted),
        }
    }

    /// The rank that aborted this group and its reason, if it was aborted.
    fn own_abort(&self) -> Option<(usize, String)> {
        // SAFETY: as in `abort_region`: the header and records hold only atomics.
        let header = unsafe { &*(self.map.ptr() as *const Header) };
        let by = header.abort.load(Ordering::Acquire).checked_sub(1)? as usize;
        if by >= self.size {
            return Some((by, String::new()));
        }
        // SAFETY: `by` < size: its record lies within the mapping.
        let rec =
            unsafe { &*(self.map.ptr().add(HEADER_BYTES + by * RECORD_BYTES) as *const Record) };
        Some((by, rec.reason()))
    }
}

/// Writes this rank's abort reason (the first abort of the rank wins), sets the group's abort
/// word (the first rank wins) and wakes all waiters. The reason is written before the word, so
/// a peer that sees the word reads a complete reason.
fn abort_region(map: &Mapping, rank: usize, size: usize, reason: &str) {
    let record = |r: usize| {
        // SAFETY: attach checked that the mapping holds the header and `size` records; they
        // hold only atomics.
        unsafe { &*(map.ptr().add(HEADER_BYTES + r * RECORD_BYTES) as *const Record) }
    };
    // SAFETY: as above, for the header.
    let header = unsafe { &*(map.ptr() as *const Header) };
    let rec = record(rank);
    if rec
        .reason_claimed
        .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        let bytes = reason.as_bytes();
        for (i, cell) in rec.reason.iter().enumerate() {
            let b = if i + 1 < REASON_BYTES {
                bytes.get(i).copied().unwrap_or(0)
            } else {
                0
            };
            cell.store(b, Ordering::Relaxed);
        }
    }
    let _ = header
        .abort
        .compare_exchange(0, rank as u32 + 1, Ordering::AcqRel, Ordering::Acquire);
    for r in 0..size {
        futex_wake_all(&record(r).seq);
    }
}

/// Whether process `pid` exists and is not a zombie.
fn process_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if r != 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !matches!(
            s.rsplit(')').next().map(|t| t.trim_start().chars().next()),
            Some(Some('Z' | 'X'))
        ),
        Err(_) => true,
    }
}
