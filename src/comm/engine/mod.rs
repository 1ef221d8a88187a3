//! The shared-memory collective engine behind the `threads` and `shm` backends.
//!
//! # Layout of a group's region
//! A header (magic, size, slot size, abort word), one 256-byte record per rank (its sequence
//! word, a waiter count for the futex, its pid, the metadata of its last two phases, an abort
//! reason), then two data slots per rank (`parity` 0 and 1), each `slot_bytes` long.
//!
//! # The phase protocol
//! Every collective is a sequence of *phases*, numbered the same on every rank. In phase `t` a
//! rank writes only into its own slot `t % 2`, publishes `seq = t`, waits until every peer has
//! published `t`, then reads peers' slots `t % 2`. A slot is written again two phases later,
//! and by then the rank has seen every peer publish `t + 1`, which they only do after their
//! reads of phase `t`: double buffering makes one wait per phase enough.
//!
//! The first phase of each collective also carries its metadata (kind, dtype, element count,
//! reduce op / root / per-rank sizes), and every rank checks that all ranks agree, so a
//! mismatched call is a clear error on every rank instead of garbage.
//!
//! # Algorithms
//! - all-reduce, small: one shot, each rank reduces the whole vector from every slot (one
//!   phase). Large: reduce-scatter then all-gather through the slots, chunk by chunk (two
//!   phases per chunk), so the work and the memory traffic are split between ranks.
//! - all-gather (sizes may differ per rank), reduce-scatter (likewise), broadcast: one phase
//!   per chunk.
//!
//! Every rank reduces in rank order, so all ranks end with bit-identical values.
//!
//! # Aborts
//! A failing rank writes its reason into its record and sets the header's abort word; every
//! wait checks the word, the peers' processes and the parent group ([`abort`]).

mod abort;
mod algorithms;
mod layout;
mod stale;

pub(crate) use abort::AbortHandle;
use abort::{abort_region, process_alive, Parent};
pub(crate) use layout::{check_slot_bytes, region_layout, MAX_RANKS};
use layout::{Header, MetaValue, Record, HEADER_BYTES, MAGIC, PORTION_ALIGN, RECORD_BYTES};
pub(crate) use stale::sweep_dev_shm_once;
#[cfg(test)]
mod tests;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::error::{CommError, CommResult};
use super::region::Mapping;
use super::stats::{CollectiveKind, CommStats};
use super::wait::{
    futex_wait, futex_wake_all, reached, spin_then_yield, yield_while_running, Deadline, Spun,
    WaitPolicy,
};

/// One rank's view of a group's region.
pub(crate) struct Engine {
    map: Arc<Mapping>,
    group: String,
    rank: usize,
    size: usize,
    slot_bytes: usize,
    data_off: usize,
    phase: u32,
    policy: WaitPolicy,
    timeout: Duration,
    pid: u32,
    one_shot_max: usize,
    stats: CommStats,
    /// The group this one was made from: its abort stops this group's waits too (a peer
    /// that failed before it reached this group's rendezvous aborted only the parent).
    parent: Option<Arc<Parent>>,
}

fn dtype_name(code: u32) -> &'static str {
    match code {
        1 => "f32",
        2 => "f64",
        3 => "f16",
        4 => "bf16",
        5 => "u8",
        6 => "u32",
        7 => "i16",
        8 => "i32",
        9 => "i64",
        _ => "none",
    }
}

fn kind_name(code: u32) -> &'static str {
    CollectiveKind::ALL
        .iter()
        .find(|k| k.code() == code)
        .map(|k| k.name())
        .unwrap_or("nothing")
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// Default size of one data slot (`CANDLE_TP_SLOT_BYTES`, default 4 MiB).
pub(crate) fn default_slot_bytes() -> usize {
    env_usize("CANDLE_TP_SLOT_BYTES").unwrap_or(4 << 20)
}

impl Engine {
    /// Attaches to a mapped region. The creator (`init = true`) writes the header, with the
    /// protocol's tunables; the others check it and adopt them. `local_ranks` is how many
    /// ranks of the job share this host (the wait policy's oversubscription test).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attach(
        map: Arc<Mapping>,
        group: String,
        rank: usize,
        size: usize,
        slot_bytes: usize,
        timeout: Duration,
        init: bool,
        local_ranks: usize,
    ) -> CommResult<Self> {
        check_slot_bytes(&group, slot_bytes)?;
        let (data_off, len) = region_layout(size, slot_bytes)?;
        if size == 0 || size > MAX_RANKS {
            return Err(CommError::invalid(
                format!("group '{group}'"),
                format!("{size} ranks: the shared-memory backends serve 1 to {MAX_RANKS} ranks per host"),
            ));
        }
        if map.len() < len {
            return Err(CommError::invalid(
                format!("group '{group}'"),
                format!("shared region has {} bytes, needs {len}", map.len()),
            ));
        }
        let pid = std::process::id();
        let one_shot_max = env_usize("CANDLE_TP_ONESHOT_BYTES")
            .unwrap_or(if size <= 2 { 64 << 10 } else { 128 << 10 })
            .min(slot_bytes);
        let mut engine = Self {
            map,
            group,
            rank,
            size,
            slot_bytes,
            data_off,
            phase: 0,
            policy: WaitPolicy::for_ranks(local_ranks.max(size)),
            timeout,
            pid,
            one_shot_max,
            stats: CommStats::default(),
            parent: None,
        };
        let h = engine.header();
        if init {
            h.size.store(size as u64, Ordering::Relaxed);
            h.slot_bytes.store(slot_bytes as u64, Ordering::Relaxed);
            h.one_shot_bytes
                .store(one_shot_max as u64, Ordering::Relaxed);
            h.creator.store(rank as u32 + 1, Ordering::Relaxed);
            h.magic.store(MAGIC, Ordering::Release);
        } else {
            let (m, s, b) = (
                h.magic.load(Ordering::Acquire),
                h.size.load(Ordering::Relaxed),
                h.slot_bytes.load(Ordering::Relaxed),
            );
            if m != MAGIC || s != size as u64 || b != slot_bytes as u64 {
                let creator = match h.creator.load(Ordering::Relaxed) {
                    0 => "its creator".to_string(),
                    c => format!("rank {}", c - 1),
                };
                return Err(CommError::invalid(
                    format!("group '{}' rank {rank}", engine.group),
                    format!(
                        "the shared region made by {creator} has {s} ranks and {b}-byte slots \
                         (magic {m:#x}); rank {rank} expects {size} ranks and {slot_bytes}-byte \
                         slots: CANDLE_TP_SLOT_BYTES or the world size differs between the two \
                         ranks, or the region is another job's or another version's"
                    ),
                ));
            }
            // The creator's threshold, whatever this rank's CANDLE_TP_ONESHOT_BYTES says.
            let adopted = h.one_shot_bytes.load(Ordering::Relaxed) as usize;
            engine.one_shot_max = adopted.min(slot_bytes);
        }
        engine.record(rank).pid.store(pid, Ordering::Release);
        Ok(engine)
    }

    pub(crate) fn stats(&self) -> CommStats {
        self.stats
    }

    pub(crate) fn reset_stats(&mut self) {
        self.stats = CommStats::default();
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is at least HEADER_BYTES long and page aligned; Header holds
        // only atomics, valid for any bit pattern.
        unsafe { &*(self.map.ptr() as *const Header) }
    }

    fn record(&self, r: usize) -> &Record {
        debug_assert!(r < self.size);
        // SAFETY: records lie within the mapping (checked in attach) and hold only atomics.
        unsafe { &*(self.map.ptr().add(HEADER_BYTES + r * RECORD_BYTES) as *const Record) }
    }

    fn slot<T>(&self, r: usize, parity: usize) -> *mut T {
        // SAFETY: the offset is within the mapping (checked in attach).
        unsafe {
            self.map
                .ptr()
                .add(self.data_off + (2 * r + parity) * self.slot_bytes)
                .cast()
        }
    }

    fn next_phase(&mut self) -> (u32, usize) {
        self.phase = self.phase.wrapping_add(1);
        (self.phase, (self.phase & 1) as usize)
    }

    fn publish(&self, phase: u32) {
        let rec = self.record(self.rank);
        rec.seq.store(phase, Ordering::SeqCst);
        if rec.waiters.load(Ordering::SeqCst) != 0 {
            futex_wake_all(&rec.seq);
        }
    }

    fn set_meta(&self, parity: usize, m: MetaValue) {
        let meta = &self.record(self.rank).meta[parity];
        meta.kind.store(m.kind, Ordering::Relaxed);
        meta.dtype.store(m.dtype, Ordering::Relaxed);
        meta.count.store(m.count, Ordering::Relaxed);
        meta.aux.store(m.aux, Ordering::Relaxed);
    }

    fn meta_of(&self, r: usize, parity: usize) -> MetaValue {
        let meta = &self.record(r).meta[parity];
        MetaValue {
            kind: meta.kind.load(Ordering::Relaxed),
            dtype: meta.dtype.load(Ordering::Relaxed),
            count: meta.count.load(Ordering::Relaxed),
            aux: meta.aux.load(Ordering::Relaxed),
        }
    }

    /// One phase of the protocol after this rank has written its slot: publish `phase`, wait
    /// for every peer to publish it. On the first phase of a collective, `first` carries its
    /// metadata, written before publishing and checked against every rank's after the wait.
    fn exchange(
        &self,
        phase: u32,
        parity: usize,
        op: &str,
        first: Option<(MetaValue, &dyn Fn(u64) -> String)>,
    ) -> CommResult<()> {
        if let Some((meta, _)) = &first {
            self.set_meta(parity, *meta);
        }
        self.publish(phase);
        self.wait_all(phase, op)?;
        match first {
            Some((_, describe_aux)) => self.check_meta(parity, op, describe_aux),
            None => Ok(()),
        }
    }

    /// After the first phase of a collective: do all ranks agree on what they are doing?
    fn check_meta(
        &self,
        parity: usize,
        op: &str,
        describe_aux: &dyn Fn(u64) -> String,
    ) -> CommResult<()> {
        let mine = self.meta_of(self.rank, parity);
        if (0..self.size).all(|r| self.meta_of(r, parity) == mine) {
            return Ok(());
        }
        let all: Vec<MetaValue> = (0..self.size).map(|r| self.meta_of(r, parity)).collect();
        let detail: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(r, m)| {
                format!(
                    "rank {r} called {} with {} {} elements{}",
                    kind_name(m.kind),
                    m.count,
                    dtype_name(m.dtype),
                    if m.kind == mine.kind {
                        describe_aux(m.aux)
                    } else {
                        String::new()
                    }
                )
            })
            .collect();
        Err(CommError::Mismatch {
            group: self.group.clone(),
            op: op.to_string(),
            detail: detail.join("; "),
        })
    }

    /// Waits until every peer has published `phase`.
    fn wait_all(&self, phase: u32, op: &str) -> CommResult<()> {
        let mut deadline: Option<Deadline> = None;
        for r in (0..self.size).filter(|&r| r != self.rank) {
            let rec = self.record(r);
            match spin_then_yield(&rec.seq, phase, &self.policy) {
                Spun::Reached => continue,
                Spun::Sleep => {}
                Spun::Poll { yielding } => {
                    let running = || rec.sleeping.load(Ordering::Acquire) == 0;
                    if yield_while_running(&rec.seq, phase, &self.policy, yielding, running) {
                        continue;
                    }
                }
            }
            let dl = *deadline.get_or_insert_with(|| Deadline::after(self.timeout));
            let me = self.record(self.rank);
            me.sleeping.store(1, Ordering::Release);
            let slept = self.sleep_until(r, rec, phase, op, dl);
            me.sleeping.store(0, Ordering::Release);
            slept?;
        }
        Ok(())
    }

    /// The futex part of [`Self::wait_all`]: sleeps on peer `r`'s word until it reaches
    /// `phase`, checking aborts, the peer's process and the deadline between slices.
    fn sleep_until(
        &self,
        r: usize,
        rec: &Record,
        phase: u32,
        op: &str,
        dl: Deadline,
    ) -> CommResult<()> {
        loop {
            // A peer that arrived and then aborted (an error in its next call) completed this
            // wait: the phase first, then the abort word.
            if reached(rec.seq.load(Ordering::Acquire), phase) {
                return Ok(());
            }
            self.check_abort(op)?;
            rec.waiters.fetch_add(1, Ordering::SeqCst);
            let seen = rec.seq.load(Ordering::SeqCst);
            if reached(seen, phase) {
                rec.waiters.fetch_sub(1, Ordering::SeqCst);
                return Ok(());
            }
            futex_wait(&rec.seq, seen, dl.remaining().min(self.policy.sleep_slice));
            rec.waiters.fetch_sub(1, Ordering::SeqCst);
            if reached(rec.seq.load(Ordering::Acquire), phase) {
                return Ok(());
            }
            self.check_abort(op)?;
            if let Err(e) = self.check_alive(r, op) {
                self.abort(&e.to_string());
                return Err(e);
            }
            if dl.expired() {
                let missing = (0..self.size)
                    .filter(|&q| {
                        q != self.rank
                            && !reached(self.record(q).seq.load(Ordering::Acquire), phase)
                    })
                    .collect();
                let e = CommError::Timeout {
                    group: self.group.clone(),
                    op: op.to_string(),
                    missing,
                    waited: dl.waited(),
                };
                self.abort(&e.to_string());
                return Err(e);
            }
        }
    }

    /// One synchronisation with no data (also used to finish a rendezvous).
    pub(crate) fn barrier(&mut self, op: &str) -> CommResult<()> {
        let t0 = Instant::now();
        self.check_abort(op)?;
        let (phase, parity) = self.next_phase();
        let meta = MetaValue {
            kind: CollectiveKind::Barrier.code(),
            dtype: 0,
            count: 0,
            aux: 0,
        };
        self.exchange(phase, parity, op, Some((meta, &|_| String::new())))?;
        self.stats
            .record(CollectiveKind::Barrier, 0, 0, 0, t0.elapsed());
        Ok(())
    }
}

/// Aborting (`abort.rs` holds the handle and the region's abort word).
impl Engine {
    /// Marks the group as failed, with a reason every peer will see, and wakes all waiters.
    pub(crate) fn abort(&self, reason: &str) {
        abort_region(&self.map, self.rank, self.size, reason);
    }

    /// A handle that aborts the group without this engine (nor its lock): what a watchdog
    /// thread uses while a collective of this rank is stuck holding the lock.
    pub(crate) fn abort_handle(&self) -> AbortHandle {
        AbortHandle::new(self.map.clone(), self.rank, self.size, self.parent.clone())
    }

    /// Links this group to the group it was made from (see [`Parent`]).
    pub(crate) fn set_parent(&mut self, name: String, abort: AbortHandle) {
        self.parent = Some(Arc::new(Parent::new(name, abort)));
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
