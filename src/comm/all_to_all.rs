//! All-to-all on a [`ProcessGroup`] (`MPI_Alltoallv`): every rank sends one block to every
//! rank, blocks of any size (zero included), the sizes agreed by every rank before any data
//! moves. What expert parallelism dispatches tokens with, and brings them back with.
//!
//! Two steps. The size agreement, on every backend: an all-gather of the `2·p` sizes of every
//! rank, after which each rank checks the whole matrix, so a disagreement is the same error on
//! every rank, naming the pair, and the group stays usable. Then the data, through the
//! backend's own all-to-all ([`Backend::all_to_all_v`](super::backend::Backend), given the
//! agreed matrix), which moves each block once:
//!
//! - shm and threads (the shared-memory engine, `engine/algorithms.rs`): each rank writes its
//!   blocks for the other ranks into its slot, and after one wait each rank reads its block
//!   from every peer's slot; send buffers larger than a slot go in slot-sized phases;
//! - MPI: `MPI_Alltoallv` (counts are 32-bit: blocks and offsets up to 2^31 − 1 elements);
//! - NCCL: grouped `ncclSend` / `ncclRecv`, one pair per peer;
//! - hierarchical (shm inside hosts, MPI between them): with the same number of ranks on
//!   every host, an in-host all-to-all, then one across hosts among the ranks of each local
//!   index (each byte crosses hosts once; `hierarchical/all_to_all.rs`); other layouts the
//!   fallback below, over its hierarchical all-gather;
//! - one rank: a copy.
//!
//! The fallback, [`Backend::all_to_all_v`](super::backend::Backend)'s default, is an
//! all-gather of every rank's whole send buffer from which each rank keeps its blocks: it moves
//! `p − 1` times what a native all-to-all moves. It stays callable
//! ([`ProcessGroup::all_to_all_v_slice_via_all_gather`]) for the benchmark
//! (`examples/bench_collectives.rs`) and the tests that compare the two.

use super::backend::{all_to_all_by_all_gather, BlockSizes, HostBuf, HostBufMut};
use super::element::Element;
use super::error::{CommError, CommResult};
use super::group::ProcessGroup;

impl ProcessGroup {
    /// All-to-all with per-rank sizes (`MPI_Alltoallv`): `src` holds one block per rank in
    /// rank order, block `d` (`send_counts[d]` elements) going to rank `d`; `dst` receives one
    /// block per rank, block `s` (`recv_counts[s]` elements) coming from rank `s`. Sizes may
    /// differ and be zero. Rank `s`'s `send_counts[d]` must equal rank `d`'s
    /// `recv_counts[s]`: every rank checks every pair, so a disagreement is an error on every
    /// rank that names the pair and leaves the group usable.
    ///
    /// ```
    /// use candle_tp::comm::run_threads;
    /// let got = run_threads(2, |pg| {
    ///     // Rank 0 sends [0] to itself and [1, 2] to rank 1; rank 1 sends [10, 11] to
    ///     // rank 0 and nothing to itself.
    ///     let (src, send, recv) = if pg.rank() == 0 {
    ///         (vec![0.0f32, 1.0, 2.0], [1, 2], [1, 2])
    ///     } else {
    ///         (vec![10.0, 11.0], [2, 0], [2, 0])
    ///     };
    ///     let mut dst = vec![0.0; recv.iter().sum()];
    ///     pg.all_to_all_v_slice(&src, &send, &mut dst, &recv)?;
    ///     Ok(dst)
    /// })
    /// .unwrap();
    /// assert_eq!(got, vec![vec![0.0, 10.0, 11.0], vec![1.0, 2.0]]);
    /// ```
    pub fn all_to_all_v_slice<T: Element>(
        &self,
        src: &[T],
        send_counts: &[usize],
        dst: &mut [T],
        recv_counts: &[usize],
    ) -> CommResult<()> {
        self.all_to_all_v_by(src, send_counts, dst, recv_counts, true)
    }

    /// [`all_to_all_v_slice`](Self::all_to_all_v_slice) through the all-gather fallback
    /// (every rank's whole send buffer to every rank, `p − 1` times the data of the native
    /// all-to-all), whatever the backend: what backends without their own all-to-all run, kept
    /// for the benchmark that compares the two. Same arguments, checks and result.
    #[doc(hidden)]
    pub fn all_to_all_v_slice_via_all_gather<T: Element>(
        &self,
        src: &[T],
        send_counts: &[usize],
        dst: &mut [T],
        recv_counts: &[usize],
    ) -> CommResult<()> {
        self.all_to_all_v_by(src, send_counts, dst, recv_counts, false)
    }

    /// The size agreement, then the backend's own all-to-all (`native`) or the fallback.
    fn all_to_all_v_by<T: Element>(
        &self,
        src: &[T],
        send_counts: &[usize],
        dst: &mut [T],
        recv_counts: &[usize],
        native: bool,
    ) -> CommResult<()> {
        let matrix = self.agree_all_to_all(send_counts, recv_counts, src.len(), dst.len())?;
        let who = || format!("all_to_all on group '{}'", self.name());
        let sizes = BlockSizes::new(&who(), self.rank(), self.size(), &matrix)?;
        let backend = self.host_backend();
        let (src, dst) = (HostBuf::new(src), HostBufMut::new(dst));
        let r = if native {
            backend.all_to_all_v(src, dst, &sizes)
        } else {
            all_to_all_by_all_gather(backend, src, dst, &sizes)
        };
        self.abort_if_invalid(r)
    }

    /// The size agreement of an all-to-all whose input has `src_len` elements and output
    /// `dst_len`: this rank's sizes checked against its buffers (an error here aborts the
    /// group, so that the peers stop at once), then every rank's gathered and the whole matrix
    /// checked on every rank (a pair that disagrees is the same error on every rank, and the
    /// group stays usable). Gives the matrix, row-major: row `s` is what rank `s` sends each
    /// rank (for [`BlockSizes`]). What every backend's all-to-all runs first, on the host or
    /// on the device (`ops/cuda.rs`).
    pub(crate) fn agree_all_to_all(
        &self,
        send_counts: &[usize],
        recv_counts: &[usize],
        src_len: usize,
        dst_len: usize,
    ) -> CommResult<Vec<usize>> {
        let (p, me) = (self.size(), self.rank());
        let who = || format!("all_to_all on group '{}' (rank {me} of {p})", self.name());
        let local = if send_counts.len() != p || recv_counts.len() != p {
            Err(CommError::invalid(
                who(),
                format!(
                    "{} send and {} receive sizes for {p} ranks",
                    send_counts.len(),
                    recv_counts.len()
                ),
            ))
        } else if send_counts.iter().sum::<usize>() != src_len
            || recv_counts.iter().sum::<usize>() != dst_len
        {
            Err(CommError::invalid(
                who(),
                format!(
                    "send sizes {send_counts:?} for an input of {src_len} elements, receive \
                     sizes {recv_counts:?} for an output of {dst_len}"
                ),
            ))
        } else {
            Ok(())
        };
        self.abort_if_invalid(local)?;
        // Every rank's sizes: its p send sizes, then its p receive sizes.
        let mine: Vec<i64> = send_counts
            .iter()
            .chain(recv_counts)
            .map(|&c| c as i64)
            .collect();
        let mut all = vec![0i64; 2 * p * p];
        self.all_gather_slice(&mine, &mut all)?;
        let sends = |s: usize, d: usize| all[s * 2 * p + d] as usize;
        let expects = |d: usize, s: usize| all[d * 2 * p + p + s] as usize;
        for s in 0..p {
            for d in 0..p {
                if sends(s, d) != expects(d, s) {
                    return Err(CommError::Mismatch {
                        group: self.name().to_string(),
                        op: "all_to_all".into(),
                        detail: format!(
                            "rank {s} sends {} elements to rank {d}, which expects {} from it",
                            sends(s, d),
                            expects(d, s)
                        ),
                    });
                }
            }
        }
        // The agreed matrix, row s what rank s sends each rank: the same on every rank.
        Ok((0..p)
            .flat_map(|s| (0..p).map(move |d| (s, d)))
            .map(|(s, d)| sends(s, d))
            .collect())
    }
}
