//! The hierarchical all-to-all of an even layout (every host holds `l` of the group's
//! members), composed of the two transports' own all-to-alls, each block moved once per
//! stage and across hosts at most once:
//!
//! 1. inside the host (shm): the member of local index `j` sends the member of local index
//!    `j'` its blocks for every rank of local index `j'`, on any host (host order);
//! 2. across hosts, among the members of local index `j` (MPI): to host `h'` everything that
//!    now sits here for the member `(h', j)` (by source local index);
//! 3. the blocks that arrived (by source host, then source local index) put in the receive
//!    buffer's order (by source group rank).
//!
//! Every stage's block sizes follow from the agreed matrix ([`BlockSizes`]), which every rank
//! holds, so no stage needs a message of its own to agree on them. [`Plan`] is that
//! arithmetic, free of any transport (the unit tests run it through in-memory exchanges).

use crate::comm::backend::{offsets, BlockSizes, HostBuf, HostBufMut};
use crate::comm::element::Element;
use crate::comm::error::CommResult;

use super::Hierarchical;

/// The stages of one rank's composed all-to-all: the group's members on each host (`hosts`,
/// group ranks, every host the same number), this rank's host and local index, and the agreed
/// block sizes over the group's ranks.
pub(super) struct Plan<'a> {
    /// Group ranks on each host, in group order (hosts in the order of their first member).
    hosts: &'a [Vec<usize>],
    /// This rank's host.
    host: usize,
    /// This rank's index on its host.
    index: usize,
    /// The agreed block sizes, over group ranks.
    sizes: &'a BlockSizes<'a>,
}

impl<'a> Plan<'a> {
    /// The plan of the member at local index `index` of host `host`.
    pub(super) fn new(
        hosts: &'a [Vec<usize>],
        host: usize,
        index: usize,
        sizes: &'a BlockSizes<'a>,
    ) -> Self {
        Self {
            hosts,
            host,
            index,
            sizes,
        }
    }

    /// Elements the member `(a, i)` (host, local index) sends the member `(b, k)`.
    fn count(&self, (a, i): (usize, usize), (b, k): (usize, usize)) -> usize {
        self.sizes.count(self.hosts[a][i], self.hosts[b][k])
    }

    /// Members per host (`l`).
    fn per_host(&self) -> usize {
        self.hosts[0].len()
    }

    /// The in-host stage's matrix over this host's local indices (row-major, `l × l`): local
    /// index `i` sends `k` its blocks for local index `k` of every host.
    pub(super) fn in_host_sizes(&self) -> Vec<usize> {
        let l = self.per_host();
        let h = self.host;
        let row = |i: usize, k: usize| -> usize {
            (0..self.hosts.len())
                .map(|b| self.count((h, i), (b, k)))
                .sum()
        };
        (0..l)
            .flat_map(|i| (0..l).map(move |k| (i, k)))
            .map(|(i, k)| row(i, k))
            .collect()
    }

    /// The across-host stage's matrix over the hosts (row-major, `H × H`), among the members
    /// of this local index: host `a` sends host `b` what its members have for `(b, index)`.
    pub(super) fn across_sizes(&self) -> Vec<usize> {
        let (nh, l, j) = (self.hosts.len(), self.per_host(), self.index);
        let cell =
            |a: usize, b: usize| -> usize { (0..l).map(|i| self.count((a, i), (b, j))).sum() };
        (0..nh)
            .flat_map(|a| (0..nh).map(move |b| (a, b)))
            .map(|(a, b)| cell(a, b))
            .collect()
    }

    /// The in-host stage's send buffer: `src` (blocks by destination group rank) regrouped
    /// by destination local index, then destination host.
    pub(super) fn pack<T: Copy>(&self, src: &[T]) -> Vec<T> {
        let me = self.hosts[self.host][self.index];
        let at = offsets(self.sizes.sends(me));
        let mut out = Vec::with_capacity(src.len());
        for k in 0..self.per_host() {
            for m in self.hosts {
                let d = m[k];
                out.extend_from_slice(&src[at[d]..at[d] + self.sizes.count(me, d)]);
            }
        }
        out
    }

    /// The across-host stage's send buffer from what the in-host stage delivered (by source
    /// local index, then destination host): by destination host, then source local index.
    pub(super) fn regroup<T: Copy>(&self, arrived: &[T]) -> Vec<T> {
        let (nh, l, (h, j)) = (self.hosts.len(), self.per_host(), (self.host, self.index));
        // Where source i's piece for host b starts in `arrived`, in arrival order.
        let pieces: Vec<usize> = (0..l)
            .flat_map(|i| (0..nh).map(move |b| (i, b)))
            .map(|(i, b)| self.count((h, i), (b, j)))
            .collect();
        let at = offsets(&pieces);
        let mut out = Vec::with_capacity(arrived.len());
        for b in 0..nh {
            for i in 0..l {
                let p = i * nh + b;
                out.extend_from_slice(&arrived[at[p]..at[p] + pieces[p]]);
            }
        }
        out
    }

    /// Puts what the across-host stage delivered (by source host, then source local index)
    /// into `dst`, by source group rank.
    pub(super) fn unpack<T: Copy>(&self, arrived: &[T], dst: &mut [T]) {
        let me = self.hosts[self.host][self.index];
        let out = offsets(&self.sizes.recv_counts());
        let mut from = 0;
        for m in self.hosts {
            for &s in m {
                let n = self.sizes.count(s, me);
                dst[out[s]..out[s] + n].copy_from_slice(&arrived[from..from + n]);
                from += n;
            }
        }
    }
}

impl Hierarchical {
    /// The composed all-to-all of an even layout (see the module docs); `cross` gets what this
    /// rank's across-host stage sent to or received from other hosts, the larger of the two,
    /// in bytes (its block for its own host is a local copy).
    pub(super) fn all_to_all_t<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        sizes: &BlockSizes<'_>,
        cross: &mut usize,
    ) -> CommResult<()> {
        let who = || self.who("all_to_all");
        let (h, j) = self.place[self.rank];
        let plan = Plan::new(&self.hosts, h, j, sizes);
        let (l, nh) = (self.hosts[0].len(), self.hosts.len());
        // 1. Inside the host: to local index k everything for local index k of any host.
        let inside = plan.in_host_sizes();
        let inside = BlockSizes::new(&who(), j, l, &inside)?;
        let mut column = vec![T::default(); inside.recv_counts().iter().sum()];
        self.local.all_to_all_v(
            HostBuf::new(&plan.pack(src)),
            HostBufMut::new(&mut column),
            &inside,
        )?;
        // 2. Across hosts, among this local index: to host b everything for (b, j).
        let across = plan.across_sizes();
        let across = BlockSizes::new(&who(), h, nh, &across)?;
        let mut arrived = vec![T::default(); dst.len()];
        self.cross()?.all_to_all_v(
            HostBuf::new(&plan.regroup(&column)),
            HostBufMut::new(&mut arrived),
            &across,
        )?;
        let own = across.count(h, h);
        let sent: usize = across.sends(h).iter().sum::<usize>() - own;
        let received: usize = across.recv_counts().iter().sum::<usize>() - own;
        *cross += sent.max(received) * std::mem::size_of::<T>();
        // 3. By source group rank.
        plan.unpack(&arrived, dst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{offsets, BlockSizes, Plan};

    /// An in-memory all-to-all among `bufs` (one send buffer per rank) with the row-major
    /// matrix `m`: what each rank receives, by source rank.
    fn exchange<T: Copy>(bufs: &[Vec<T>], m: &[usize]) -> Vec<Vec<T>> {
        let q = bufs.len();
        let row = |s: usize| &m[s * q..(s + 1) * q];
        (0..q)
            .map(|d| {
                let mut out = Vec::new();
                for (s, buf) in bufs.iter().enumerate() {
                    let at = offsets(row(s))[d];
                    out.extend_from_slice(&buf[at..at + m[s * q + d]]);
                }
                out
            })
            .collect()
    }

    /// Runs the composed exchange of every rank through in-memory stages and checks it
    /// against the direct one, with values `tag(s, d, k)` (element `k` of `s`'s block for `d`).
    fn composed<T: Copy + PartialEq + std::fmt::Debug>(
        hosts: &[Vec<usize>],
        count: impl Fn(usize, usize) -> usize,
        tag: impl Fn(usize, usize, usize) -> T,
    ) {
        let p: usize = hosts.iter().map(Vec::len).sum();
        let (nh, l) = (hosts.len(), hosts[0].len());
        let matrix: Vec<usize> = (0..p * p).map(|x| count(x / p, x % p)).collect();
        let src: Vec<Vec<T>> = (0..p)
            .map(|s| {
                (0..p)
                    .flat_map(|d| (0..count(s, d)).map(move |k| (d, k)))
                    .map(|(d, k)| tag(s, d, k))
                    .collect()
            })
            .collect();
        let sizes: Vec<BlockSizes> = (0..p)
            .map(|g| BlockSizes::new("test", g, p, &matrix).unwrap())
            .collect();
        let place = |g: usize| {
            (0..nh)
                .find_map(|h| hosts[h].iter().position(|&x| x == g).map(|j| (h, j)))
                .unwrap()
        };
        let plans: Vec<Plan> = (0..p)
            .map(|g| Plan::new(hosts, place(g).0, place(g).1, &sizes[g]))
            .collect();
        // Stage 1 on each host; stage 2 per local index.
        let mut column: Vec<Vec<T>> = vec![Vec::new(); p];
        for m in hosts {
            let bufs: Vec<Vec<T>> = m.iter().map(|&g| plans[g].pack(&src[g])).collect();
            let inside = plans[m[0]].in_host_sizes();
            for (k, &g) in m.iter().enumerate() {
                assert_eq!(plans[g].in_host_sizes(), inside, "in-host sizes agree");
                column[g] = exchange(&bufs, &inside)[k].clone();
            }
        }
        let mut arrived: Vec<Vec<T>> = vec![Vec::new(); p];
        for j in 0..l {
            let members: Vec<usize> = hosts.iter().map(|m| m[j]).collect();
            let bufs: Vec<Vec<T>> = members
                .iter()
                .map(|&g| plans[g].regroup(&column[g]))
                .collect();
            let across = plans[members[0]].across_sizes();
            for (b, &g) in members.iter().enumerate() {
                assert_eq!(plans[g].across_sizes(), across, "across sizes agree");
                arrived[g] = exchange(&bufs, &across)[b].clone();
            }
        }
        let direct = exchange(&src, &matrix);
        for g in 0..p {
            let mut dst = vec![tag(p, p, 0); direct[g].len()];
            assert_eq!(arrived[g].len(), dst.len(), "rank {g} receives its column");
            plans[g].unpack(&arrived[g], &mut dst);
            assert_eq!(dst, direct[g], "rank {g} of {hosts:?}");
        }
    }

    /// Layouts (interleaved as `--map-by node` places ranks, consecutive, three hosts), with
    /// uneven blocks, empty ones, an all-empty exchange and one block far larger than the rest.
    #[test]
    fn composed_matches_direct() {
        let layouts: [Vec<Vec<usize>>; 5] = [
            vec![vec![0, 2], vec![1, 3]],
            vec![vec![0, 1], vec![2, 3]],
            vec![vec![0, 3], vec![1, 4], vec![2, 5]],
            vec![vec![5, 0, 3], vec![1, 4, 2]],
            vec![vec![0], vec![1]],
        ];
        let uneven = |s: usize, d: usize| if (s + d) % 3 == 2 { 0 } else { 1 + s + 2 * d };
        for hosts in &layouts {
            composed(hosts, uneven, |s, d, k| (s * 1000 + d * 100 + k) as u32);
            composed(hosts, |_, _| 0, |_, _, _| 0u8);
            composed(hosts, |s, d| usize::from(s == d), |s, _, _| s as i64);
            composed(
                hosts,
                |s, d| if (s, d) == (1, 0) { 5000 } else { d },
                |s, d, k| (s * 7 + d * 3 + k) as f32,
            );
            composed(hosts, uneven, |s, d, k| {
                half::bf16::from_f32((s * 64 + d * 8 + k % 8) as f32)
            });
            composed(hosts, uneven, |s, d, k| (s * 1000 + d * 100 + k) as f64);
        }
    }
}
