//! The MPI backend's collectives on typed slices ([`erased_collectives!`] calls them): each
//! agrees on its kind, element type and sizes first ([`MpiBackend::run`]), and runs in pieces
//! where MPI's 32-bit counts would not hold it.

use std::sync::OnceLock;

use super::super::backend::{check_counts, BlockSizes};
use super::super::element::{Element, ReduceOp};
use super::super::error::{CommError, CommResult};
use super::super::stats::CollectiveKind;
use super::exchange;
use super::wire::Wire;
use super::{hash_counts, MpiBackend};

/// What every rank must agree on before a collective: its kind, the element type, the
/// length and one more value (`extra`: the op, the root, a hash of the sizes).
fn meta<T: Element>(kind: CollectiveKind, len: usize, extra: u64) -> [u64; 4] {
    [kind.code() as u64, T::CODE as u64, len as u64, extra]
}

fn displacements(counts: &[usize]) -> CommResult<(Vec<i32>, Vec<i32>)> {
    let mut displs = Vec::with_capacity(counts.len());
    let mut at = 0usize;
    for &c in counts {
        displs.push(i32::try_from(at).map_err(|_| too_large(at))?);
        at += c;
    }
    let counts = counts
        .iter()
        .map(|&c| i32::try_from(c).map_err(|_| too_large(c)))
        .collect::<CommResult<Vec<_>>>()?;
    Ok((counts, displs))
}

/// The most elements one MPI call carries: MPI's counts are 32-bit (rsmpi panics past
/// `i32::MAX`), so the element-wise collectives (all-reduce, broadcast, reduce-scatter) run in
/// pieces of at most this many. `CANDLE_TP_MPI_MAX_COUNT` lowers it (a test hook: the pieces
/// are then tested on buffers of ordinary size).
fn max_count() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("CANDLE_TP_MPI_MAX_COUNT")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .map_or(i32::MAX as usize, |n| n.min(i32::MAX as usize))
    })
}

fn too_large(n: usize) -> CommError {
    CommError::invalid(
        "mpi",
        format!("{n} elements: MPI counts are 32-bit (at most {})", i32::MAX),
    )
}

/// The collectives on typed slices ([`erased_collectives!`] calls them).
impl MpiBackend {
    /// [`check_counts`] for this group, the error naming `op`.
    fn check_counts(
        &self,
        op: &str,
        counts: &[usize],
        mine: usize,
        total: usize,
        gather: bool,
    ) -> CommResult<()> {
        let who = self.who(op);
        check_counts(&who, counts, self.size, self.rank, mine, total, gather)
    }

    pub(super) fn typed_all_reduce<T: Wire>(
        &self,
        src: Option<&[T]>,
        d: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        let kind = CollectiveKind::AllReduce;
        if let Some(s) = src.filter(|s| s.len() != d.len()) {
            return Err(CommError::invalid(
                self.who("all_reduce"),
                format!("input of {} elements, output of {}", s.len(), d.len()),
            ));
        }
        let bytes = std::mem::size_of_val(d);
        let meta = meta::<T>(kind, d.len(), op.code() as u64);
        if bytes <= exchange::SMALL_ALL_REDUCE_BYTES {
            if let Some(s) = src {
                d.copy_from_slice(s);
            }
            // Sizes and data in one exchange per step (the agreement costs nothing more).
            return self.run_with(kind, (bytes, bytes), |comm| {
                <T as Wire>::all_reduce_small(&comm.exchange, meta, d, op)
                    .map_err(|e| self.disagreement(kind, meta, e))
            });
        }
        self.run(kind, meta, (bytes, bytes), |c| {
            let max = max_count();
            match src {
                Some(s) => {
                    for (s, d) in s.chunks(max).zip(d.chunks_mut(max)) {
                        <T as Wire>::all_reduce(c, s, d, op)
                    }
                }
                // In place: MPI's send and receive buffers must differ (one piece at a time).
                None => {
                    for d in d.chunks_mut(max) {
                        let s = d.to_vec();
                        <T as Wire>::all_reduce(c, &s, d, op)
                    }
                }
            }
            Ok(())
        })
    }

    pub(super) fn typed_all_gather<T: Wire>(
        &self,
        s: &[T],
        out: &mut [T],
        counts: &[usize],
    ) -> CommResult<()> {
        self.check_counts("all_gather", counts, s.len(), out.len(), true)?;
        let (c, d) = displacements(counts)?;
        let meta = meta::<T>(CollectiveKind::AllGather, out.len(), hash_counts(counts));
        let bytes = (std::mem::size_of_val(s), std::mem::size_of_val(out));
        self.run(CollectiveKind::AllGather, meta, bytes, |comm| {
            <T as Wire>::all_gather_v(comm, s, out, &c, &d);
            Ok(())
        })
    }

    pub(super) fn typed_reduce_scatter<T: Wire>(
        &self,
        s: &[T],
        out: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> CommResult<()> {
        self.check_counts("reduce_scatter", counts, out.len(), s.len(), false)?;
        let start: usize = counts[..self.rank].iter().sum();
        let meta = meta::<T>(CollectiveKind::ReduceScatter, s.len(), hash_counts(counts));
        let bytes = (std::mem::size_of_val(s), std::mem::size_of_val(out));
        // MPI_Reduce_scatter with counts is not in rsmpi: reduce all, keep this block.
        self.run(CollectiveKind::ReduceScatter, meta, bytes, |comm| {
            let mut all = vec![T::default(); s.len()];
            let max = max_count();
            for (s, d) in s.chunks(max).zip(all.chunks_mut(max)) {
                <T as Wire>::all_reduce(comm, s, d, op);
            }
            out.copy_from_slice(&all[start..start + out.len()]);
            Ok(())
        })
    }

    pub(super) fn typed_broadcast<T: Wire>(&self, b: &mut [T], root: usize) -> CommResult<()> {
        if root >= self.size {
            return Err(CommError::invalid(
                self.who("broadcast"),
                format!("root {root} is not a rank of this group of {}", self.size),
            ));
        }
        let meta = meta::<T>(CollectiveKind::Broadcast, b.len(), root as u64);
        let bytes = std::mem::size_of_val(b);
        self.run(CollectiveKind::Broadcast, meta, (bytes, bytes), |comm| {
            for b in b.chunks_mut(max_count()) {
                <T as Wire>::broadcast(comm, b, root);
            }
            Ok(())
        })
    }
}

impl MpiBackend {
    /// `MPI_Alltoallv`, after the agreement on the element type and the block sizes (which
    /// every rank already checked; this also catches element types that differ). MPI's counts
    /// and offsets are 32-bit: a send or receive buffer past `i32::MAX` elements is an error
    /// naming the sizes (no piecewise form: a block's pieces would need their own offsets).
    /// Counted: the blocks for and from other ranks.
    pub(super) fn typed_all_to_all<T: Wire>(
        &self,
        src: &[T],
        dst: &mut [T],
        sizes: &BlockSizes<'_>,
    ) -> CommResult<()> {
        sizes.check_for(
            &self.who("all_to_all"),
            (self.rank, self.size),
            src.len(),
            dst.len(),
        )?;
        let (send, recv) = (sizes.sends(self.rank), sizes.recv_counts());
        let wide = |what: &str, counts: &[usize]| {
            CommError::invalid(
                self.who("all_to_all"),
                format!(
                    "{what} sizes {counts:?}: MPI's counts and offsets are 32-bit (at most {} \
                     elements)",
                    i32::MAX
                ),
            )
        };
        let (sc, sd) = displacements(send).map_err(|_| wide("send", send))?;
        let (rc, rd) = displacements(&recv).map_err(|_| wide("receive", &recv))?;
        let total: usize = sizes.counts().iter().sum();
        let meta = meta::<T>(CollectiveKind::AllToAll, total, hash_counts(sizes.counts()));
        let own = sizes.count(self.rank, self.rank);
        let esz = std::mem::size_of::<T>();
        let bytes = ((src.len() - own) * esz, (dst.len() - own) * esz);
        self.run(CollectiveKind::AllToAll, meta, bytes, |comm| {
            <T as Wire>::all_to_all_v(comm, (src, &sc, &sd), (dst, &rc, &rd));
            Ok(())
        })
    }
}
