//! The layout of a group's shared region: the header, one record per rank (sequence word,
//! pid, abort reason, the two declarations a collective compares), then two data slots per
//! rank; the sizes and their checked arithmetic.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};

use crate::comm::error::{CommError, CommResult};

pub(super) const MAGIC: u64 = 0x7074_656c_646e_6163; // "candletp", little endian
pub(super) const HEADER_BYTES: usize = 256;
pub(super) const RECORD_BYTES: usize = 512;
/// Room for an abort reason (an error message naming the layer, the sizes and the rank).
pub(super) const REASON_BYTES: usize = 432;
pub(super) const PAGE: usize = 4096;
/// Element alignment of the per-rank portions of a chunk (one cache line of f32).
pub(super) const PORTION_ALIGN: usize = 16;
/// Largest group the engine serves (per-call scratch lives on the stack).
pub(crate) const MAX_RANKS: usize = 64;

#[repr(C)]
pub(super) struct Header {
    pub(super) magic: AtomicU64,
    pub(super) size: AtomicU64,
    pub(super) slot_bytes: AtomicU64,
    pub(super) abort: AtomicU32,
    /// The creator's rank in the group, plus one (0: not written), for the errors of ranks
    /// that do not match its header.
    pub(super) creator: AtomicU32,
    /// Largest one-shot all-reduce in bytes: a protocol choice, so the creator's value (its
    /// `CANDLE_TP_ONESHOT_BYTES`) holds for every rank.
    pub(super) one_shot_bytes: AtomicU64,
}

#[repr(C)]
pub(super) struct Meta {
    pub(super) kind: AtomicU32,
    pub(super) dtype: AtomicU32,
    pub(super) count: AtomicU64,
    pub(super) aux: AtomicU64,
}

#[repr(C)]
pub(super) struct Record {
    pub(super) seq: AtomicU32,
    pub(super) waiters: AtomicU32,
    pub(super) pid: AtomicU32,
    /// Set (0 -> 1) by the first abort of this rank, which alone writes `reason`.
    pub(super) reason_claimed: AtomicU32,
    /// Non-zero while this rank sleeps on a futex waiting for a peer: its waiters then sleep
    /// too instead of yielding (see [`super::wait`]).
    pub(super) sleeping: AtomicU32,
    pub(super) meta: [Meta; 2],
    pub(super) reason: [AtomicU8; REASON_BYTES],
}

const _: () = assert!(std::mem::size_of::<Record>() <= RECORD_BYTES);
const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);

/// What a rank declares about a collective, compared across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MetaValue {
    pub(super) kind: u32,
    pub(super) dtype: u32,
    pub(super) count: u64,
    pub(super) aux: u64,
}

/// Checks the slot size (`CANDLE_TP_SLOT_BYTES`) of group `group`: every rank checks it before
/// it waits for its peers, so that a bad one fails every rank at once instead of the one that
/// creates the region while the others wait for it.
pub(crate) fn check_slot_bytes(group: &str, slot_bytes: usize) -> CommResult<()> {
    if slot_bytes < 1024 || !slot_bytes.is_multiple_of(64) {
        return Err(CommError::invalid(
            format!("group '{group}'"),
            format!("slot size {slot_bytes} bytes: it must be a multiple of 64 and at least 1024"),
        ));
    }
    Ok(())
}

/// The data offset and the bytes needed for a region of `size` ranks with `slot_bytes`
/// slots, in checked arithmetic (the slot size comes from `CANDLE_TP_SLOT_BYTES`).
pub(crate) fn region_layout(size: usize, slot_bytes: usize) -> CommResult<(usize, usize)> {
    let data = size
        .checked_mul(RECORD_BYTES)
        .and_then(|r| r.checked_add(HEADER_BYTES))
        .map(|b| b.div_ceil(PAGE))
        .and_then(|p| p.checked_mul(PAGE));
    let total = data.and_then(|d| {
        size.checked_mul(2)
            .and_then(|s| s.checked_mul(slot_bytes))
            .and_then(|s| s.checked_add(d))
    });
    match (data, total) {
        (Some(d), Some(t)) => Ok((d, t)),
        _ => Err(CommError::invalid(
            "shared memory",
            format!(
                "a region for {size} ranks with 2 slots of {slot_bytes} bytes each does not fit in the address space: lower CANDLE_TP_SLOT_BYTES"
            ),
        )),
    }
}

impl Record {
    /// The abort reason this rank wrote (empty if none).
    pub(super) fn reason(&self) -> String {
        let bytes: Vec<u8> = self
            .reason
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .take_while(|&b| b != 0)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}
