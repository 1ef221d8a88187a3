//! All-to-all on a [`ProcessGroup`] (`MPI_Alltoallv`): every rank sends one block to every
//! rank, blocks of any size (zero included), the sizes agreed by every rank before any data
//! moves. What expert parallelism dispatches tokens with, and brings them back with.
//!
//! It runs on every backend through the group's own collectives: an all-gather of the
//! `2·p` sizes of every rank (each rank then checks the whole matrix, so a disagreement is the
//! same error on every rank, naming the pair, and the group stays usable), then an
//! all-gather of each rank's whole send buffer, from which each rank keeps its blocks. The
//! data step moves every rank's send buffer to every rank, `p − 1` times what a native
//! all-to-all moves: right for decode's few tokens, and the first thing to replace with a
//! backend's own (`MPI_Alltoallv`, a pairwise exchange on the shm engine) where prompts make
//! it large.

use super::backend::offsets;
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
        } else if send_counts.iter().sum::<usize>() != src.len()
            || recv_counts.iter().sum::<usize>() != dst.len()
        {
            Err(CommError::invalid(
                who(),
                format!(
                    "send sizes {send_counts:?} for an input of {} elements, receive sizes \
                     {recv_counts:?} for an output of {}",
                    src.len(),
                    dst.len()
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
        // Every rank's whole send buffer, then this rank's block of each.
        let totals: Vec<usize> = (0..p).map(|s| (0..p).map(|d| sends(s, d)).sum()).collect();
        let mut gathered = vec![T::default(); totals.iter().sum()];
        self.all_gather_v_slice(src, &mut gathered, &totals)?;
        let (starts, out) = (offsets(&totals), offsets(recv_counts));
        for s in 0..p {
            let at = starts[s] + (0..me).map(|d| sends(s, d)).sum::<usize>();
            dst[out[s]..out[s] + recv_counts[s]]
                .copy_from_slice(&gathered[at..at + recv_counts[s]]);
        }
        Ok(())
    }
}
