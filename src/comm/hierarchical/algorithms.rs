//! The stages of each hierarchical collective, typed (see the module docs of `hierarchical`).
//!
//! `cross` accumulates the payload this rank handed to the across-host stage.

use crate::comm::backend::{offsets, HostBuf, HostBufMut};
use crate::comm::element::{Element, ReduceOp};
use crate::comm::error::CommResult;

use super::Hierarchical;

/// Largest all-reduce (bytes) that goes through each host's first member even in an even
/// layout: below it the message count, not the bytes, sets the time (each host sends the
/// same bytes across either way: `l` shards of `B / l`, or `B` once), so one across-host
/// exchange per host beats `l` of them competing for the host's cores and link.
pub(crate) const LEADER_ALL_REDUCE_BYTES: usize = 16 << 10;

/// `n` elements cut into `parts` nearly equal blocks (the first `n % parts` one larger).
fn split_even(n: usize, parts: usize) -> Vec<usize> {
    (0..parts)
        .map(|p| n / parts + usize::from(p < n % parts))
        .collect()
}

impl Hierarchical {
    /// This rank's host (in the group's host order) and index on that host.
    fn here(&self) -> (usize, usize) {
        self.place[self.rank]
    }

    /// Members per host of an even layout.
    fn per_host(&self) -> usize {
        self.hosts[0].len()
    }

    /// Elements of every member of local index `j`, in host order, summed.
    fn column_total(&self, counts: &[usize], j: usize) -> usize {
        self.hosts.iter().map(|m| counts[m[j]]).sum()
    }

    pub(super) fn all_reduce_t<T: Element>(
        &self,
        src: Option<&[T]>,
        dst: &mut [T],
        op: ReduceOp,
        cross: &mut usize,
    ) -> CommResult<()> {
        let (_, j) = self.here();
        if self.even && std::mem::size_of_val(dst) > LEADER_ALL_REDUCE_BYTES {
            let counts = split_even(dst.len(), self.per_host());
            let mut shard = vec![T::default(); counts[j]];
            let input: &[T] = src.unwrap_or(dst);
            self.local.reduce_scatter_v(
                HostBuf::new(input),
                HostBufMut::new(&mut shard),
                &counts,
                op,
            )?;
            self.cross()?
                .all_reduce(None, HostBufMut::new(&mut shard), op)?;
            *cross += std::mem::size_of_val(&shard[..]);
            return self
                .local
                .all_gather_v(HostBuf::new(&shard), HostBufMut::new(dst), &counts);
        }
        self.local
            .all_reduce(src.map(HostBuf::new), HostBufMut::new(dst), op)?;
        if j == 0 {
            self.cross()?.all_reduce(None, HostBufMut::new(dst), op)?;
            *cross += std::mem::size_of_val(dst);
        }
        self.local.broadcast(HostBufMut::new(dst), 0)
    }

    pub(super) fn all_gather_t<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
        cross: &mut usize,
    ) -> CommResult<()> {
        let (h, j) = self.here();
        let at = offsets(counts);
        if self.even {
            // Across hosts, the blocks of this local index; then inside the host, every index's.
            let across: Vec<usize> = self.hosts.iter().map(|m| counts[m[j]]).collect();
            let mut column = vec![T::default(); across.iter().sum()];
            self.cross()?
                .all_gather_v(HostBuf::new(src), HostBufMut::new(&mut column), &across)?;
            *cross += std::mem::size_of_val(&column[..]);
            let inside: Vec<usize> = (0..self.per_host())
                .map(|jj| self.column_total(counts, jj))
                .collect();
            let mut all = vec![T::default(); dst.len()];
            self.local
                .all_gather_v(HostBuf::new(&column), HostBufMut::new(&mut all), &inside)?;
            // `all` holds index 0 of every host, then index 1...: put each block in its place.
            let mut from = 0;
            for jj in 0..self.per_host() {
                for m in &self.hosts {
                    let g = m[jj];
                    dst[at[g]..at[g] + counts[g]].copy_from_slice(&all[from..from + counts[g]]);
                    from += counts[g];
                }
            }
            return Ok(());
        }
        // Uneven: inside the host, among the hosts' first members, then a broadcast inside.
        let inside: Vec<usize> = self.hosts[h].iter().map(|&g| counts[g]).collect();
        let mut host_block = vec![T::default(); inside.iter().sum()];
        self.local
            .all_gather_v(HostBuf::new(src), HostBufMut::new(&mut host_block), &inside)?;
        let mut full = vec![T::default(); dst.len()];
        if j == 0 {
            let per_host: Vec<usize> = self
                .hosts
                .iter()
                .map(|m| m.iter().map(|&g| counts[g]).sum())
                .collect();
            self.cross()?.all_gather_v(
                HostBuf::new(&host_block),
                HostBufMut::new(&mut full),
                &per_host,
            )?;
            *cross += std::mem::size_of_val(&full[..]);
        }
        self.local.broadcast(HostBufMut::new(&mut full), 0)?;
        // `full` holds host 0's members, then host 1's...
        let mut from = 0;
        for m in &self.hosts {
            for &g in m {
                dst[at[g]..at[g] + counts[g]].copy_from_slice(&full[from..from + counts[g]]);
                from += counts[g];
            }
        }
        Ok(())
    }

    pub(super) fn reduce_scatter_t<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
        op: ReduceOp,
        cross: &mut usize,
    ) -> CommResult<()> {
        let (_, j) = self.here();
        let at = offsets(counts);
        if self.even {
            // Inside the host, each local index gets the host's sum of the blocks of every
            // member of that index (all hosts); across hosts, each member its own block.
            let mut ordered = Vec::with_capacity(src.len());
            for jj in 0..self.per_host() {
                for m in &self.hosts {
                    let g = m[jj];
                    ordered.extend_from_slice(&src[at[g]..at[g] + counts[g]]);
                }
            }
            let inside: Vec<usize> = (0..self.per_host())
                .map(|jj| self.column_total(counts, jj))
                .collect();
            let mut column = vec![T::default(); inside[j]];
            self.local.reduce_scatter_v(
                HostBuf::new(&ordered),
                HostBufMut::new(&mut column),
                &inside,
                op,
            )?;
            let across: Vec<usize> = self.hosts.iter().map(|m| counts[m[j]]).collect();
            self.cross()?.reduce_scatter_v(
                HostBuf::new(&column),
                HostBufMut::new(dst),
                &across,
                op,
            )?;
            *cross += std::mem::size_of_val(&column[..]);
            return Ok(());
        }
        let mut sum = vec![T::default(); src.len()];
        self.local
            .all_reduce(Some(HostBuf::new(src)), HostBufMut::new(&mut sum), op)?;
        if j == 0 {
            self.cross()?
                .all_reduce(None, HostBufMut::new(&mut sum), op)?;
            *cross += std::mem::size_of_val(&sum[..]);
        }
        self.local.broadcast(HostBufMut::new(&mut sum), 0)?;
        dst.copy_from_slice(&sum[at[self.rank]..at[self.rank] + counts[self.rank]]);
        Ok(())
    }

    pub(super) fn broadcast_t<T: Element>(
        &self,
        buf: &mut [T],
        root: usize,
        cross: &mut usize,
    ) -> CommResult<()> {
        let (h, j) = self.here();
        let (root_host, root_index) = self.place[root];
        if self.even {
            if j == root_index {
                self.cross()?.broadcast(HostBufMut::new(buf), root_host)?;
                *cross += std::mem::size_of_val(buf);
            }
            return self.local.broadcast(HostBufMut::new(buf), root_index);
        }
        if h == root_host {
            self.local.broadcast(HostBufMut::new(buf), root_index)?;
        }
        if j == 0 {
            self.cross()?.broadcast(HostBufMut::new(buf), root_host)?;
            *cross += std::mem::size_of_val(buf);
        }
        if h != root_host {
            self.local.broadcast(HostBufMut::new(buf), 0)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{offsets, split_even};

    #[test]
    fn blocks() {
        assert_eq!(split_even(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(split_even(1, 2), vec![1, 0]);
        assert_eq!(split_even(0, 3), vec![0, 0, 0]);
        assert_eq!(offsets(&[3, 0, 2]), vec![0, 3, 3]);
    }
}
