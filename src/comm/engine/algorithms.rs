//! The collectives on top of the phase protocol: all-reduce (one-shot and
//! reduce-scatter + all-gather), all-gather and reduce-scatter with per-rank sizes,
//! broadcast, all-to-all.

use std::time::Instant;

use super::{CollectiveKind, Engine, MetaValue, MAX_RANKS, PORTION_ALIGN};
use crate::comm::block_sizes::BlockSizes;
use crate::comm::element::{reduce_into, Element, ReduceOp};
use crate::comm::error::{CommError, CommResult};

impl Engine {
    /// Element-wise reduction of `n` elements from `src` into `dst` across ranks.
    ///
    /// # Safety
    /// `src` and `dst` must be valid for `n` elements; they may be equal (in place) but must
    /// not otherwise overlap.
    pub(crate) unsafe fn all_reduce<T: Element>(
        &mut self,
        src: *const T,
        dst: *mut T,
        n: usize,
        op: ReduceOp,
    ) -> CommResult<()> {
        let name = "all_reduce";
        let t0 = Instant::now();
        self.check_abort(name)?;
        let esz = std::mem::size_of::<T>();
        let meta = MetaValue {
            kind: CollectiveKind::AllReduce.code(),
            dtype: T::CODE,
            count: n as u64,
            aux: op.code() as u64,
        };
        let aux = |a: u64| format!(" ({})", if a == 1 { "sum" } else { "max" });
        let (mut sent, mut recv) = (0usize, 0usize);
        let mut srcs = [std::ptr::null::<T>(); MAX_RANKS];
        let srcs = &mut srcs[..self.size];
        if n * esz <= self.one_shot_max {
            let (phase, parity) = self.next_phase();
            std::ptr::copy_nonoverlapping(src, self.slot::<T>(self.rank, parity), n);
            sent += n * esz;
            self.exchange(phase, parity, name, Some((meta, &aux)))?;
            for (r, s) in srcs.iter_mut().enumerate() {
                *s = if r == self.rank {
                    src
                } else {
                    self.slot::<T>(r, parity)
                };
            }
            reduce_into(op, srcs, dst, n);
            recv += (self.size - 1) * n * esz;
        } else {
            let chunk = self.slot_bytes / esz;
            let mut start = 0;
            let mut first = true;
            while start < n {
                let len = chunk.min(n - start);
                let base = len.div_ceil(self.size).div_ceil(PORTION_ALIGN) * PORTION_ALIGN;
                let portion = |r: usize| ((r * base).min(len), ((r + 1) * base).min(len));
                // Phase A: publish the parts of this chunk that peers reduce.
                let (pa, para) = self.next_phase();
                let slot_a = self.slot::<T>(self.rank, para);
                for r in (0..self.size).filter(|&r| r != self.rank) {
                    let (lo, hi) = portion(r);
                    std::ptr::copy_nonoverlapping(src.add(start + lo), slot_a.add(lo), hi - lo);
                    sent += (hi - lo) * esz;
                }
                let check: &dyn Fn(u64) -> String = &aux;
                self.exchange(pa, para, name, first.then_some((meta, check)))?;
                first = false;
                let (lo, hi) = portion(self.rank);
                for (r, s) in srcs.iter_mut().enumerate() {
                    *s = if r == self.rank {
                        src.add(start + lo)
                    } else {
                        self.slot::<T>(r, para).add(lo) as *const T
                    };
                }
                reduce_into(op, srcs, dst.add(start + lo), hi - lo);
                recv += (self.size - 1) * (hi - lo) * esz;
                // Phase B: publish the reduced portion, gather the others'.
                let (pb, parb) = self.next_phase();
                std::ptr::copy_nonoverlapping(
                    dst.add(start + lo),
                    self.slot::<T>(self.rank, parb).add(lo),
                    hi - lo,
                );
                sent += (hi - lo) * esz;
                self.exchange(pb, parb, name, None)?;
                for r in (0..self.size).filter(|&r| r != self.rank) {
                    let (lo, hi) = portion(r);
                    std::ptr::copy_nonoverlapping(
                        self.slot::<T>(r, parb).add(lo),
                        dst.add(start + lo),
                        hi - lo,
                    );
                    recv += (hi - lo) * esz;
                }
                start += len;
            }
        }
        self.stats
            .record(CollectiveKind::AllReduce, n * esz, sent, recv, t0.elapsed());
        Ok(())
    }

    /// Concatenates every rank's `src` (of `counts[r]` elements) into `dst`, in rank order.
    pub(crate) fn all_gather<T: Element>(
        &mut self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
    ) -> CommResult<()> {
        let name = "all_gather";
        let t0 = Instant::now();
        let esz = std::mem::size_of::<T>();
        let cap = self.slot_bytes / esz;
        let (offsets, total, chunks) =
            self.begin_sized(name, counts, (src.len(), dst.len()), true, cap)?;
        dst[offsets[self.rank]..offsets[self.rank] + src.len()].copy_from_slice(src);
        let meta = MetaValue {
            kind: CollectiveKind::AllGather.code(),
            dtype: T::CODE,
            count: total as u64,
            aux: hash_sizes(counts, 0),
        };
        let (mut sent, mut recv) = (0usize, 0usize);
        for k in 0..chunks {
            let lo = k * cap;
            let (phase, parity) = self.next_phase();
            let mine = piece(lo, cap, src.len());
            // SAFETY: the slot holds cap elements; mine <= cap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr().add(lo.min(src.len())),
                    self.slot::<T>(self.rank, parity),
                    mine,
                )
            };
            sent += mine * esz;
            let describe: &dyn Fn(u64) -> String =
                &|_| " (per-rank sizes differ between ranks)".into();
            self.exchange(phase, parity, name, (k == 0).then_some((meta, describe)))?;
            for r in (0..self.size).filter(|&r| r != self.rank) {
                let len = piece(lo, cap, counts[r]);
                if len > 0 {
                    let out = &mut dst[offsets[r] + lo..offsets[r] + lo + len];
                    // SAFETY: the peer wrote len <= cap elements into its slot this phase.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.slot::<T>(r, parity),
                            out.as_mut_ptr(),
                            len,
                        )
                    };
                    recv += len * esz;
                }
            }
        }
        self.stats.record(
            CollectiveKind::AllGather,
            total * esz,
            sent,
            recv,
            t0.elapsed(),
        );
        Ok(())
    }

    /// Reduces every rank's `src` (the concatenation of `counts[r]`-element blocks) and leaves
    /// block `rank` of the result in `dst`.
    pub(crate) fn reduce_scatter<T: Element>(
        &mut self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> CommResult<()> {
        let name = "reduce_scatter";
        let t0 = Instant::now();
        let esz = std::mem::size_of::<T>();
        let cap = (self.slot_bytes / esz / self.size).max(1);
        let (offsets, total, chunks) =
            self.begin_sized(name, counts, (dst.len(), src.len()), false, cap)?;
        let meta = MetaValue {
            kind: CollectiveKind::ReduceScatter.code(),
            dtype: T::CODE,
            count: total as u64,
            aux: hash_sizes(counts, op.code() as u64),
        };
        let mut srcs = [std::ptr::null::<T>(); MAX_RANKS];
        let srcs = &mut srcs[..self.size];
        let (mut sent, mut recv) = (0usize, 0usize);
        for k in 0..chunks {
            let lo = k * cap;
            let (phase, parity) = self.next_phase();
            let slot = self.slot::<T>(self.rank, parity);
            for r in (0..self.size).filter(|&r| r != self.rank) {
                let len = piece(lo, cap, counts[r]);
                // SAFETY: block r of the slot holds cap elements; len <= cap.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.as_ptr().add(offsets[r] + lo.min(counts[r])),
                        slot.add(r * cap),
                        len,
                    )
                };
                sent += len * esz;
            }
            let describe: &dyn Fn(u64) -> String =
                &|_| " (per-rank sizes or reduce op differ between ranks)".into();
            self.exchange(phase, parity, name, (k == 0).then_some((meta, describe)))?;
            let len = piece(lo, cap, counts[self.rank]);
            if len > 0 {
                for (r, s) in srcs.iter_mut().enumerate() {
                    *s = if r == self.rank {
                        // SAFETY: within src (offset + lo + len <= offset + count).
                        unsafe { src.as_ptr().add(offsets[r] + lo) }
                    } else {
                        // SAFETY: block `rank` of the peer's slot.
                        unsafe { self.slot::<T>(r, parity).add(self.rank * cap) as *const T }
                    };
                }
                // SAFETY: all sources hold len elements; dst[lo..lo+len] is in bounds.
                unsafe { reduce_into(op, srcs, dst.as_mut_ptr().add(lo), len) };
                recv += (self.size - 1) * len * esz;
            }
        }
        self.stats.record(
            CollectiveKind::ReduceScatter,
            total * esz,
            sent,
            recv,
            t0.elapsed(),
        );
        Ok(())
    }

    /// Copies `root`'s `buf` into every other rank's `buf`.
    pub(crate) fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> CommResult<()> {
        let name = "broadcast";
        let t0 = Instant::now();
        self.check_abort(name)?;
        if root >= self.size {
            return Err(CommError::invalid(
                format!("broadcast on group '{}'", self.group),
                format!(
                    "root {root} is not a rank of this group of {} ranks",
                    self.size
                ),
            ));
        }
        let esz = std::mem::size_of::<T>();
        let n = buf.len();
        let cap = self.slot_bytes / esz;
        let chunks = n.div_ceil(cap).max(1);
        let meta = MetaValue {
            kind: CollectiveKind::Broadcast.code(),
            dtype: T::CODE,
            count: n as u64,
            aux: root as u64,
        };
        let (mut sent, mut recv) = (0usize, 0usize);
        for k in 0..chunks {
            let lo = k * cap;
            let len = piece(lo, cap, n);
            let (phase, parity) = self.next_phase();
            if self.rank == root {
                // SAFETY: len <= cap elements fit the slot.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        buf.as_ptr().add(lo.min(n)),
                        self.slot::<T>(root, parity),
                        len,
                    )
                };
                sent += len * esz;
            }
            let describe: &dyn Fn(u64) -> String = &|a| format!(" from root {a}");
            self.exchange(phase, parity, name, (k == 0).then_some((meta, describe)))?;
            if self.rank != root && len > 0 {
                // SAFETY: the root wrote len elements this phase.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.slot::<T>(root, parity),
                        buf.as_mut_ptr().add(lo),
                        len,
                    )
                };
                recv += len * esz;
            }
        }
        self.stats.record(
            CollectiveKind::Broadcast,
            std::mem::size_of_val(buf),
            sent,
            recv,
            t0.elapsed(),
        );
        Ok(())
    }

    /// All-to-all with the agreed block sizes `sizes`: `src` holds this rank's block for
    /// every rank in rank order, `dst` receives every rank's block for this one.
    ///
    /// Each block crosses once. A rank's blocks for the other ranks, in rank order, form its
    /// *stream*; phase `k` carries elements `[k·cap, (k+1)·cap)` of every rank's stream (`cap`
    /// a slot's elements): each rank writes that window of its stream into its slot, waits for
    /// every peer, and copies out of each peer's slot the part of the window that is its
    /// block. Every rank runs the same number of phases (the longest stream's, at least one,
    /// which carries the element type for the agreement check), known from the matrix alone;
    /// most exchanges fit one slot and take one phase. Its own block is a local copy.
    pub(crate) fn all_to_all<T: Element>(
        &mut self,
        src: &[T],
        dst: &mut [T],
        sizes: &BlockSizes<'_>,
    ) -> CommResult<()> {
        let name = "all_to_all";
        let t0 = Instant::now();
        self.check_abort(name)?;
        let (p, me) = (self.size, self.rank);
        let who = || format!("{name} on group '{}' (rank {me} of {p})", self.group);
        if sizes.size() != p || sizes.rank() != me {
            return Err(CommError::invalid(
                who(),
                format!(
                    "block sizes for rank {} of {} ranks",
                    sizes.rank(),
                    sizes.size()
                ),
            ));
        }
        sizes.check(&who(), src.len(), dst.len())?;
        let esz = std::mem::size_of::<T>();
        let cap = self.slot_bytes / esz;
        // Where rank s's block for rank d starts in s's stream (its own block left out).
        let stream_at = |s: usize, d: usize| -> usize {
            (0..d).filter(|&q| q != s).map(|q| sizes.count(s, q)).sum()
        };
        // Per peer, on the stack: where this rank's block for it lies in this rank's stream
        // and send buffer, where its block for this rank lies in its stream, and where that
        // block goes in `dst`.
        let (mut mine_at, mut theirs_at) = ([0usize; MAX_RANKS], [0usize; MAX_RANKS]);
        let (mut src_at, mut dst_at) = ([0usize; MAX_RANKS], [0usize; MAX_RANKS]);
        let mut longest = 0;
        for r in 0..p {
            mine_at[r] = stream_at(me, r);
            theirs_at[r] = stream_at(r, me);
            src_at[r] = sizes.offset(me, r);
            dst_at[r] = (0..r).map(|q| sizes.count(q, me)).sum();
            longest = longest.max(stream_at(r, p));
        }
        let own = sizes.count(me, me);
        dst[dst_at[me]..dst_at[me] + own].copy_from_slice(&src[src_at[me]..src_at[me] + own]);
        let meta = MetaValue {
            kind: CollectiveKind::AllToAll.code(),
            dtype: T::CODE,
            count: sizes.counts().iter().sum::<usize>() as u64,
            aux: hash_sizes(sizes.counts(), 0),
        };
        let (mut sent, mut recv) = (0usize, 0usize);
        let phases = longest.div_ceil(cap).max(1);
        for k in 0..phases {
            let window = (k * cap, (k + 1) * cap);
            let (phase, parity) = self.next_phase();
            let slot = self.slot::<T>(me, parity);
            for d in (0..p).filter(|&d| d != me) {
                let (a, b) = overlap(mine_at[d], sizes.count(me, d), window);
                if a < b {
                    // SAFETY: [a, b) lies in this rank's block for d (so in src) and in the
                    // window, whose cap elements the slot holds.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            src.as_ptr().add(src_at[d] + (a - mine_at[d])),
                            slot.add(a - window.0),
                            b - a,
                        )
                    };
                    sent += (b - a) * esz;
                }
            }
            let describe: &dyn Fn(u64) -> String =
                &|_| " (block sizes differ between ranks)".into();
            self.exchange(phase, parity, name, (k == 0).then_some((meta, describe)))?;
            for s in (0..p).filter(|&s| s != me) {
                let (a, b) = overlap(theirs_at[s], sizes.count(s, me), window);
                if a < b {
                    let at = dst_at[s] + (a - theirs_at[s]);
                    let out = &mut dst[at..at + (b - a)];
                    // SAFETY: peer s wrote its stream's window this phase, [a, b) included.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.slot::<T>(s, parity).add(a - window.0),
                            out.as_mut_ptr(),
                            b - a,
                        )
                    };
                    recv += (b - a) * esz;
                }
            }
        }
        self.stats.record(
            CollectiveKind::AllToAll,
            sent.max(recv),
            sent,
            recv,
            t0.elapsed(),
        );
        Ok(())
    }

    /// The start of a collective with per-rank sizes `counts`: the abort checked, and the
    /// sizes (`mine` this rank's buffer, `whole` the concatenated one: [`Engine::check_counts`]);
    /// gives the blocks' offsets, their total and the number of phases of at most `cap`
    /// elements a block that the largest needs.
    fn begin_sized(
        &self,
        name: &str,
        counts: &[usize],
        (mine, whole): (usize, usize),
        gather: bool,
        cap: usize,
    ) -> CommResult<([usize; MAX_RANKS], usize, usize)> {
        self.check_abort(name)?;
        self.check_counts(name, counts, mine, whole, gather)?;
        let largest = counts.iter().max().copied().unwrap_or(0);
        Ok((
            prefix_sums(counts),
            counts.iter().sum(),
            largest.div_ceil(cap).max(1),
        ))
    }

    fn check_counts(
        &self,
        op: &str,
        counts: &[usize],
        mine: usize,
        whole: usize,
        gather: bool,
    ) -> CommResult<()> {
        let ctx = || format!("{op} on group '{}' (rank {})", self.group, self.rank);
        if counts.len() != self.size {
            return Err(CommError::invalid(
                ctx(),
                format!(
                    "{} per-rank sizes given for {} ranks",
                    counts.len(),
                    self.size
                ),
            ));
        }
        let total: usize = counts.iter().sum();
        if mine != counts[self.rank] {
            let what = if gather { "input" } else { "output" };
            return Err(CommError::invalid(
                ctx(),
                format!(
                    "{what} has {mine} elements but this rank's size is {}",
                    counts[self.rank]
                ),
            ));
        }
        if whole != total {
            let what = if gather { "output" } else { "input" };
            return Err(CommError::invalid(
                ctx(),
                format!("{what} has {whole} elements but the sizes {counts:?} add up to {total}"),
            ));
        }
        Ok(())
    }
}

fn hash_sizes(sizes: &[usize], salt: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ salt;
    for &s in sizes {
        for b in (s as u64).to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

/// The part of a block of `len` elements at `at` of a stream that falls in `window`, as
/// stream positions `(start, end)` (`start >= end`: none).
fn overlap(at: usize, len: usize, window: (usize, usize)) -> (usize, usize) {
    (at.max(window.0), (at + len).min(window.1))
}

/// Elements of a buffer of `count` that fall in chunk `[lo, lo + cap)`.
fn piece(lo: usize, cap: usize, count: usize) -> usize {
    count.saturating_sub(lo).min(cap)
}

/// Start of each rank's block (no allocation: collectives run on the data path).
fn prefix_sums(counts: &[usize]) -> [usize; MAX_RANKS] {
    let mut out = [0; MAX_RANKS];
    let mut acc = 0;
    for (o, &c) in out.iter_mut().zip(counts) {
        *o = acc;
        acc += c;
    }
    out
}
