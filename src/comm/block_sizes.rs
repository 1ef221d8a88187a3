//! The block sizes of an all-to-all that every rank agreed on ([`BlockSizes`]): what the
//! group checks before any data moves and every backend's exchange reads. A type below the
//! engines and the backends, so that both use it.

use super::error::{CommError, CommResult};

/// The block sizes of an all-to-all that every rank of the group agreed on: `count(s, d)`
/// elements go from rank `s` to rank `d`, for every pair (what each rank checked before any
/// data moves, so a backend may rely on every rank holding the same matrix), and this rank's
/// place in it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockSizes<'a> {
    rank: usize,
    size: usize,
    /// Row-major `size × size`: row `s` is what rank `s` sends each rank.
    counts: &'a [usize],
}

impl<'a> BlockSizes<'a> {
    /// The matrix `counts` (row-major, `size × size`) seen from rank `rank`; an error naming
    /// `who` when it is not square for `size` ranks or `rank` is not one of them.
    pub(crate) fn new(
        who: &str,
        rank: usize,
        size: usize,
        counts: &'a [usize],
    ) -> CommResult<Self> {
        if rank >= size || size.checked_mul(size) != Some(counts.len()) {
            return Err(CommError::invalid(
                who,
                format!(
                    "{} block sizes for rank {rank} of {size} ranks ({size} x {size} expected)",
                    counts.len()
                ),
            ));
        }
        Ok(Self { rank, size, counts })
    }

    /// This rank's index.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// Elements rank `s` sends rank `d`.
    pub(crate) fn count(&self, s: usize, d: usize) -> usize {
        self.counts[s * self.size + d]
    }

    /// What rank `s` sends each rank, in rank order (its send buffer's blocks).
    pub(crate) fn sends(&self, s: usize) -> &'a [usize] {
        &self.counts[s * self.size..(s + 1) * self.size]
    }

    /// What this rank receives from each rank, in rank order (its receive buffer's blocks).
    pub(crate) fn recv_counts(&self) -> Vec<usize> {
        (0..self.size).map(|s| self.count(s, self.rank)).collect()
    }

    /// Where rank `s`'s block for rank `d` starts in its send buffer.
    pub(crate) fn offset(&self, s: usize, d: usize) -> usize {
        self.sends(s)[..d].iter().sum()
    }

    /// The whole matrix, row-major.
    pub(crate) fn counts(&self) -> &'a [usize] {
        self.counts
    }

    /// Checks this rank's buffers against the matrix: `src` of `src_len` elements holds its
    /// row, `dst` of `dst_len` its column. The error names `who`.
    pub(crate) fn check(&self, who: &str, src_len: usize, dst_len: usize) -> CommResult<()> {
        let send = self.sends(self.rank);
        let recv: usize = (0..self.size).map(|s| self.count(s, self.rank)).sum();
        if send.iter().sum::<usize>() != src_len || recv != dst_len {
            return Err(CommError::invalid(
                who,
                format!(
                    "send sizes {send:?} for an input of {src_len} elements, receive sizes \
                     {:?} for an output of {dst_len}",
                    self.recv_counts()
                ),
            ));
        }
        Ok(())
    }

    /// [`BlockSizes::check`] for a backend whose group has `size` ranks, this one `rank`:
    /// also an error when the matrix was made for another rank or group size. (The MPI and
    /// hierarchical backends', which build their own exchange from the matrix.)
    #[cfg(feature = "mpi")]
    pub(crate) fn check_for(
        &self,
        who: &str,
        (rank, size): (usize, usize),
        src_len: usize,
        dst_len: usize,
    ) -> CommResult<()> {
        if self.size != size || self.rank != rank {
            return Err(CommError::invalid(
                who,
                format!(
                    "block sizes for rank {} of {} ranks, given to rank {rank} of {size}",
                    self.rank, self.size
                ),
            ));
        }
        self.check(who, src_len, dst_len)
    }
}
