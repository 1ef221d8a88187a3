//! Per-group counters of what each collective moved, for checking communication formulas and
//! for benchmarks that split time between compute and communication.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// The collectives a group counts separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    /// `all_reduce`.
    AllReduce,
    /// `all_gather` (equal or unequal sizes).
    AllGather,
    /// `reduce_scatter`.
    ReduceScatter,
    /// `broadcast`.
    Broadcast,
    /// `barrier`.
    Barrier,
    /// `all_to_all` (per-rank block sizes; its size agreement is counted as an all-gather).
    AllToAll,
}

impl CollectiveKind {
    /// Every kind, in a fixed order.
    pub const ALL: [CollectiveKind; 6] = [
        CollectiveKind::AllReduce,
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::Broadcast,
        CollectiveKind::Barrier,
        CollectiveKind::AllToAll,
    ];

    /// The collective's name as in PyTorch and NCCL (`all_reduce`, …).
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::AllToAll => "all_to_all",
        }
    }

    pub(crate) fn code(self) -> u32 {
        self as u32 + 1
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// Counters of one collective kind on one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpStats {
    /// Number of calls.
    pub calls: u64,
    /// Logical size: the buffer reduced or broadcast, the gathered output, the input that was
    /// reduce-scattered, the larger of what an all-to-all sends to and receives from other ranks.
    pub payload_bytes: u64,
    /// Bytes this rank made available to peers (written into its shared slots for them to
    /// read): what it sent. An all-to-all counts the blocks for other ranks (its own block
    /// is a local copy).
    pub sent_bytes: u64,
    /// Bytes this rank copied or reduced out of peers' slots: what it received.
    pub received_bytes: u64,
    /// Wall time spent inside the collective, waiting included. On NCCL groups a collective
    /// only enqueues work on the CUDA stream and returns, so this is the time to enqueue it
    /// (microseconds), not its transfer: time NCCL with CUDA events or a synchronised stream.
    pub time: Duration,
    /// Payload of the collectives this rank ran with members on other hosts (the MPI stage of
    /// a hierarchical collective, or a whole MPI collective whose group spans hosts), counted
    /// as `payload_bytes` is. What goes on the wire is this times the algorithm's factor
    /// (2(h−1)/h for an all-reduce over h hosts by a ring, (h−1)/h for the others). Zero on
    /// one host.
    pub cross_host_bytes: u64,
}

impl OpStats {
    fn minus(&self, earlier: &OpStats) -> OpStats {
        OpStats {
            calls: self.calls - earlier.calls,
            payload_bytes: self.payload_bytes - earlier.payload_bytes,
            sent_bytes: self.sent_bytes - earlier.sent_bytes,
            received_bytes: self.received_bytes - earlier.received_bytes,
            time: self.time.saturating_sub(earlier.time),
            cross_host_bytes: self.cross_host_bytes - earlier.cross_host_bytes,
        }
    }

    fn plus(&self, other: &OpStats) -> OpStats {
        OpStats {
            calls: self.calls + other.calls,
            payload_bytes: self.payload_bytes + other.payload_bytes,
            sent_bytes: self.sent_bytes + other.sent_bytes,
            received_bytes: self.received_bytes + other.received_bytes,
            time: self.time + other.time,
            cross_host_bytes: self.cross_host_bytes + other.cross_host_bytes,
        }
    }
}

/// Counters of every collective kind of one group on one rank.
///
/// ```
/// # use candle_tp::comm::{ProcessGroup, CollectiveKind};
/// let pg = ProcessGroup::single();
/// let before = pg.stats();
/// // … run collectives …
/// let moved = pg.stats().since(&before);
/// assert_eq!(moved.get(CollectiveKind::AllReduce).calls, 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommStats {
    ops: [OpStats; CollectiveKind::ALL.len()],
}

impl CommStats {
    /// The counters of one kind.
    pub fn get(&self, kind: CollectiveKind) -> OpStats {
        self.ops[kind.index()]
    }

    pub(crate) fn record(
        &mut self,
        kind: CollectiveKind,
        payload: usize,
        sent: usize,
        received: usize,
        time: Duration,
    ) {
        let s = &mut self.ops[kind.index()];
        s.calls += 1;
        s.payload_bytes += payload as u64;
        s.sent_bytes += sent as u64;
        s.received_bytes += received as u64;
        s.time += time;
    }

    /// Adds `bytes` of payload that crossed hosts to `kind` (the call itself is counted by
    /// [`record`](Self::record)).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // the MPI backends'
    pub(crate) fn record_cross_host(&mut self, kind: CollectiveKind, bytes: usize) {
        self.ops[kind.index()].cross_host_bytes += bytes as u64;
    }

    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let mut out = CommStats::default();
        for k in CollectiveKind::ALL {
            out.ops[k.index()] = self.get(k).minus(&earlier.get(k));
        }
        out
    }

    /// The sum over all kinds.
    pub fn total(&self) -> OpStats {
        self.ops.iter().fold(OpStats::default(), |a, b| a.plus(b))
    }

    /// Adds another group's counters (to sum over the sub-groups of a mesh).
    pub fn add(&mut self, other: &CommStats) {
        for k in CollectiveKind::ALL {
            self.ops[k.index()] = self.get(k).plus(&other.get(k));
        }
    }
}

/// A backend's counters behind a lock: its collectives record into it, [`SharedStats::get`]
/// reads them. A poisoned lock (a panic while recording) still gives the counters.
#[derive(Debug, Default)]
pub(crate) struct SharedStats(Mutex<CommStats>);

impl SharedStats {
    /// The counters, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, CommStats> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of the counters.
    pub(crate) fn get(&self) -> CommStats {
        *self.lock()
    }

    /// Zeroes the counters.
    pub(crate) fn reset(&self) {
        *self.lock() = CommStats::default();
    }
}
