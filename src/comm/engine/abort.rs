//! Aborting a group: a rank's reason in its record, the group's abort word in the header, and
//! the checks every wait makes (the word, the peers' processes, the parent group's abort).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::layout::{Header, Record, HEADER_BYTES, REASON_BYTES, RECORD_BYTES};
use crate::comm::region::Mapping;
use crate::comm::wait::futex_wake_all;

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
    /// A link to the group `name`, aborted through `abort`.
    pub(super) fn new(name: String, abort: AbortHandle) -> Self {
        Self { name, abort }
    }

    /// The aborted ancestor's name, the rank that aborted it and its reason.
    pub(super) fn aborted(&self) -> Option<(String, usize, String)> {
        match self.abort.own_abort() {
            Some((rank, reason)) => Some((self.name.clone(), rank, reason)),
            None => self.abort.parent.as_deref().and_then(Parent::aborted),
        }
    }
}

impl AbortHandle {
    /// A handle on the region `map` of rank `rank` of `size`, its group made from `parent`.
    pub(super) fn new(
        map: Arc<Mapping>,
        rank: usize,
        size: usize,
        parent: Option<Arc<Parent>>,
    ) -> Self {
        Self {
            map,
            rank,
            size,
            parent,
        }
    }

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
pub(super) fn abort_region(map: &Mapping, rank: usize, size: usize, reason: &str) {
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
pub(super) fn process_alive(pid: u32) -> bool {
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
