//! The hierarchical backend (feature `mpi`): for a job across hosts, the shared-memory engine
//! among the ranks of each host and MPI between hosts.
//!
//! It knows its two transports only through the `Backend` trait: `comm/join.rs` hands it MPI's
//! world and the group of this host's ranks, and the shm engine's rendezvous, which builds the
//! in-host groups. The hosts are found with `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`. Ranks of one host meet
//! through a store that the host's first rank serves on its loopback (its port handed out over
//! MPI), so no address needs configuring. A group whose members all sit on one host is a plain
//! shm group, one whose members sit on different hosts one per host a plain MPI group; only a
//! group with several members on some host and several hosts is hierarchical. When every host
//! holds the same number `l` of the group's members (the usual layout):
//!
//! - all-reduce: reduce-scatter inside the host into `l` shards, an all-reduce of shard `j`
//!   across hosts among the members whose index on their host is `j` (one MPI communicator per
//!   local index), then an all-gather inside the host. Each host sends its data across once,
//!   split over `l` streams, against `l` times for a flat MPI all-reduce. Up to 16 KiB
//!   (`LEADER_ALL_REDUCE_BYTES`, what decoding sends) it goes through the hosts' first members
//!   instead, as uneven layouts do: the same bytes leave each host, in one message instead of
//!   `l`;
//! - all-gather: an all-gather across hosts among the members of local index `j`, then inside
//!   the host; reduce-scatter: inside the host, then across; broadcast: across hosts among the
//!   root's local index, then inside each host.
//!
//! - all-to-all (`all_to_all.rs`): an all-to-all inside the host, in which each member hands
//!   the member of local index `j'` its blocks for the ranks of local index `j'` on every
//!   host; an all-to-all across hosts among the members of each local index, which hands each
//!   host what it now holds for that host's member; and a reordering into the receive
//!   buffer's order. Every stage's block sizes follow from the agreed matrix that every rank
//!   holds, so the stages add no message. Each block crosses hosts once (a block between two
//!   members of one host never leaves it), in `l` streams per host, as a native all-to-all
//!   over MPI would move it; the all-gather form (`all_to_all_by_all_gather`), which uneven
//!   layouts keep, moves every send buffer to every rank, `p − 1` times the data, across
//!   hosts too. Sub-groups on one host (shm) or with one member per host (MPI) have their
//!   backend's own. `tests/hosts_collectives.rs` checks its results on the 2 × 2 and 2 + 1
//!   layouts.
//!
//! Uneven layouts (3 ranks: 2 on one host, 1 on another) go through each host's first member:
//! the collective inside the host, the same collective among those leaders, and a broadcast
//! inside the host.
//!
//! A stage that fails (ranks that disagree on sizes, a deadline, a dead peer) aborts the
//! group's shm part with the reason, so that the host's other members, which may already wait
//! in the next stage, fail too instead of waiting for the deadline; the group stays failed.

mod algorithms;
mod all_to_all;

use std::any::Any;
use std::sync::Arc;

use super::backend::{
    all_to_all_by_all_gather, check_counts, erased_all_to_all, erased_collectives, Backend,
    BlockSizes, HostBuf, HostBufMut, World,
};
use super::context::{Context, GroupOptions};
use super::element::{Element, ReduceOp};
use super::error::{CommError, CommResult};
use super::region::{random_hex, RegionKind};
use super::secret::random_token;
use super::single::Single;
use super::stats::{CollectiveKind, SharedStats};
use super::store::{Store, TcpStore, TcpStoreServer};

/// Where every world rank lives, and the world's two transports, shared by all groups.
struct HostMap {
    /// The world on the across-host transport (MPI): its sub-groups are the across-host stages.
    across: Arc<dyn Backend>,
    /// The shm engine over this host's world ranks: its sub-groups are the in-host stages.
    local: Arc<dyn Backend>,
    /// Host index of each world rank (hosts numbered in the order of their first rank).
    host_of: Vec<usize>,
    /// Index of each world rank among the world's ranks on its host (ordered by world rank).
    local_of: Vec<usize>,
}

/// One group's hierarchical collectives on this rank.
pub(crate) struct Hierarchical {
    name: String,
    /// This rank's index in the group.
    rank: usize,
    /// Group ranks on each of the group's hosts, in group order (hosts in the order of their
    /// first member).
    hosts: Vec<Vec<usize>>,
    /// Host and index on that host of each group rank.
    place: Vec<(usize, usize)>,
    /// Whether every host holds the same number of members.
    even: bool,
    /// The members on this rank's host.
    local: Arc<dyn Backend>,
    /// The members with this rank's local index, one per host (even layouts), or the hosts'
    /// first members (uneven layouts; `None` on the others).
    cross: Option<Arc<dyn Backend>>,
    map: Arc<HostMap>,
    stats: SharedStats,
    /// Held for a whole collective (its in-host, across-host and in-host stages): two
    /// threads of one rank would otherwise interleave their stages, in a different order on
    /// different ranks, and match one collective's stage with another's.
    serial: std::sync::Mutex<()>,
}

/// The in-host backend of a host's ranks: `(context, name, rank, members)`, `rank` numbered
/// among the host's ranks and `members` their world ranks in that order (the shm engine's
/// rendezvous, whose messages name both).
pub(crate) type LocalJoin<'a> =
    &'a dyn Fn(&Arc<Context>, String, usize, &[usize]) -> CommResult<Arc<dyn Backend>>;

/// The world of the hierarchical backend, over two backends it knows only through the trait
/// (what [`init_hierarchical`](crate::comm::init_hierarchical) wraps): `across`, the world on
/// the transport between hosts (MPI), whose sub-groups carry the across-host stages; `node`,
/// the ranks of this rank's host as a group of that transport (ordered by world rank); and
/// `local`, which builds the in-host backend (shared memory) of a host's ranks. On one host
/// the world is the in-host backend's, with one rank per host the transport's.
pub(crate) fn join(
    across: World,
    node: Arc<dyn Backend>,
    local: LocalJoin<'_>,
    options: GroupOptions,
) -> CommResult<World> {
    let (rank, size) = (across.rank, across.members.len());
    let mpi = across.backend;
    // The host of every rank, named by its host's first world rank.
    let mut first = [rank as i64];
    node.broadcast(HostBufMut::new(&mut first), 0)?;
    let mut firsts = vec![0i64; size];
    mpi.all_gather_v(
        HostBuf::new(&first),
        HostBufMut::new(&mut firsts),
        &vec![1; size],
    )?;
    let mut host_of = Vec::with_capacity(size);
    let mut local_of = Vec::with_capacity(size);
    let mut seen: Vec<(i64, usize)> = Vec::new();
    for &f in &firsts {
        match seen.iter_mut().position(|(id, _)| *id == f) {
            Some(h) => {
                host_of.push(h);
                local_of.push(seen[h].1);
                seen[h].1 += 1;
            }
            None => {
                host_of.push(seen.len());
                local_of.push(0);
                seen.push((f, 1));
            }
        }
    }
    let local_size = seen[host_of[rank]].1;
    // The job id names the shm segments (each host has its own /dev/shm, but one host may run
    // several jobs).
    let mut job = [0u8; 16];
    if rank == 0 {
        job.copy_from_slice(random_hex().as_bytes());
    }
    mpi.broadcast(HostBufMut::new(&mut job), 0)?;
    let job = String::from_utf8_lossy(&job).into_owned();
    let ctx = host_store(node.as_ref(), local_of[rank], local_size, job, &options)?;
    // The world ranks of this host, in local order (what its group's messages name them as).
    let local_members: Vec<usize> = (0..size).filter(|&r| host_of[r] == host_of[rank]).collect();
    debug_assert_eq!(local_members.len(), local_size);
    let local = local(&ctx, "world/host".into(), local_of[rank], &local_members)?;
    let map = Arc::new(HostMap {
        across: mpi,
        local,
        host_of,
        local_of,
    });
    let members: Vec<usize> = (0..size).collect();
    let backend = Hierarchical::group(&map, &ctx, "world".into(), rank, &members, true)?;
    Ok(World::new(rank, size, backend, Some(ctx)))
}

/// The store of this host's ranks: its first rank serves it on loopback and tells the others
/// the port and a fresh token over MPI.
fn host_store(
    node: &dyn Backend,
    local_rank: usize,
    local_size: usize,
    job: String,
    options: &GroupOptions,
) -> CommResult<Arc<Context>> {
    const ADDR: &str = "127.0.0.1";
    let mut keep: Vec<Box<dyn Any + Send + Sync>> = Vec::new();
    // Port (2 bytes) then the token (32 hex characters); port 0 says that the host's first
    // rank could not serve the store, so that the others fail at once instead of connecting.
    let mut msg = [0u8; 34];
    let mut failed = None;
    if local_rank == 0 {
        let served = random_token()
            .map_err(|e| CommError::io("drawing the host store's token from getrandom", e))
            .and_then(|token| Ok((TcpStoreServer::bind(ADDR, 0, &token)?, token)));
        match served {
            Ok((server, token)) => {
                msg[..2].copy_from_slice(&server.port().to_le_bytes());
                msg[2..].copy_from_slice(token.as_bytes());
                keep.push(Box::new(server));
            }
            Err(e) => failed = Some(e),
        }
    }
    node.broadcast(HostBufMut::new(&mut msg), 0)?;
    if let Some(e) = failed {
        return Err(e);
    }
    let port = u16::from_le_bytes([msg[0], msg[1]]);
    if port == 0 {
        return Err(CommError::invalid(
            format!("local rank {local_rank} joining its host's store"),
            "the host's first rank could not serve the store (its own error says why)",
        ));
    }
    let token = String::from_utf8_lossy(&msg[2..]).into_owned();
    let store: Arc<dyn Store> = Arc::new(TcpStore::connect(ADDR, port, &token, options.timeout)?);
    Ok(Context::new(
        store,
        RegionKind::Shm,
        job,
        options,
        local_size,
        keep,
    ))
}

impl Hierarchical {
    /// The backend of the group `members` (world ranks, group order; this rank is `rank` of
    /// them): shm, MPI or hierarchical, whichever the members' hosts call for.
    fn group(
        map: &Arc<HostMap>,
        ctx: &Arc<Context>,
        name: String,
        rank: usize,
        members: &[usize],
        world: bool,
    ) -> CommResult<Arc<dyn Backend>> {
        let mut hosts: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut place = Vec::with_capacity(members.len());
        for (g, &w) in members.iter().enumerate() {
            let h = map.host_of[w];
            let slot = match hosts.iter().position(|(id, _)| *id == h) {
                Some(s) => s,
                None => {
                    hosts.push((h, Vec::new()));
                    hosts.len() - 1
                }
            };
            place.push((slot, hosts[slot].1.len()));
            hosts[slot].1.push(g);
        }
        let hosts: Vec<Vec<usize>> = hosts.into_iter().map(|(_, m)| m).collect();
        let (my_host, my_index) = place[rank];
        let whole_host = hosts.len() == 1;
        let one_per_host = hosts.iter().all(|m| m.len() == 1);
        // The members on this host, as indices of the host's world ranks.
        let local_members: Vec<usize> = hosts[my_host]
            .iter()
            .map(|&g| map.local_of[members[g]])
            .collect();
        if one_per_host {
            return map.across.subgroup(ctx, name, rank, members);
        }
        if whole_host {
            return map.local.subgroup(ctx, name, my_index, &local_members);
        }
        // The world's in-host stage is the host's group itself; any other group gets its own
        // (its own shared memory and statistics).
        let local = if world {
            map.local.clone()
        } else {
            map.local
                .subgroup(ctx, format!("{name}/host"), my_index, &local_members)?
        };
        let even = hosts.iter().all(|m| m.len() == hosts[0].len());
        // Even: the members of this local index on every host; uneven: the hosts' first members.
        let cross = if even || my_index == 0 {
            let across: Vec<usize> = hosts.iter().map(|m| members[m[my_index]]).collect();
            Some(
                map.across
                    .subgroup(ctx, format!("{name}/across{my_index}"), my_host, &across)?,
            )
        } else {
            None
        };
        Ok(Arc::new(Hierarchical {
            name,
            rank,
            hosts,
            place,
            even,
            local,
            cross,
            map: map.clone(),
            stats: SharedStats::default(),
            serial: std::sync::Mutex::new(()),
        }))
    }

    fn who(&self, op: &str) -> String {
        format!(
            "{op} on group '{}' (rank {} of {}, hierarchical over {} hosts)",
            self.name,
            self.rank,
            self.place.len(),
            self.hosts.len()
        )
    }

    /// The across-host stage's group (present wherever a stage runs on this rank).
    fn cross(&self) -> CommResult<&Arc<dyn Backend>> {
        self.cross.as_ref().ok_or_else(|| {
            CommError::invalid(
                self.who("hierarchical collective"),
                "this rank has no across-host stage (internal error)",
            )
        })
    }

    /// Runs one collective's stages: statistics on success (payload, the stages' sent and
    /// received bytes, the across-host stage's payload), and on failure the in-host group
    /// aborted with the error, so that this host's other members fail too.
    fn run(
        &self,
        kind: CollectiveKind,
        payload: usize,
        f: impl FnOnce(&mut usize) -> CommResult<()>,
    ) -> CommResult<()> {
        let _whole = self.serial.lock().unwrap_or_else(|e| e.into_inner());
        let t0 = std::time::Instant::now();
        let before = self.stage_totals();
        let mut cross_bytes = 0usize;
        match f(&mut cross_bytes) {
            Ok(()) => {
                let after = self.stage_totals();
                let mut s = self.stats.lock();
                s.record(
                    kind,
                    payload,
                    (after.0 - before.0) as usize,
                    (after.1 - before.1) as usize,
                    t0.elapsed(),
                );
                s.record_cross_host(kind, cross_bytes);
                Ok(())
            }
            Err(e) => {
                let e = self.in_group_terms(e);
                let reason = format!("{} failed: {e}", self.who(kind.name()));
                self.local.abort(&reason);
                if let Some(c) = &self.cross {
                    c.abort(&reason);
                }
                Err(e)
            }
        }
    }

    /// A deadline or a dead peer of the in-host stage (the only stage that reports them: MPI's
    /// watchdog and launcher end the job) names the members by their rank in this group.
    fn in_group_terms(&self, e: CommError) -> CommError {
        let (h, _) = self.place[self.rank];
        let on_host = &self.hosts[h];
        let stage = |op: String, group: String| {
            format!("{op}, the in-host stage (group '{group}') of a hierarchical collective")
        };
        match e {
            CommError::PeerDied {
                group,
                op,
                rank,
                pid,
            } => CommError::PeerDied {
                group: self.name.clone(),
                op: stage(op, group),
                rank: on_host.get(rank).copied().unwrap_or(rank),
                pid,
            },
            CommError::Timeout {
                group,
                op,
                missing,
                waited,
            } => {
                let (h, _) = self.place[self.rank];
                let on_host = &self.hosts[h];
                CommError::Timeout {
                    group: self.name.clone(),
                    op: format!(
                        "{op}, the in-host stage (group '{group}') of a hierarchical collective"
                    ),
                    missing: missing
                        .into_iter()
                        .map(|m| on_host.get(m).copied().unwrap_or(m))
                        .collect(),
                    waited,
                }
            }
            e => e,
        }
    }

    /// Bytes sent and received so far by the stages' groups.
    fn stage_totals(&self) -> (u64, u64) {
        let mut t = self.local.stats().total();
        if let Some(c) = &self.cross {
            let c = c.stats().total();
            t.sent_bytes += c.sent_bytes;
            t.received_bytes += c.received_bytes;
        }
        (t.sent_bytes, t.received_bytes)
    }
}

impl Hierarchical {
    fn check_counts(
        &self,
        who: &str,
        counts: &[usize],
        mine: usize,
        total: usize,
        gather: bool,
    ) -> CommResult<()> {
        check_counts(
            who,
            counts,
            self.place.len(),
            self.rank,
            mine,
            total,
            gather,
        )
    }
}

/// The collectives on typed slices ([`erased_collectives!`] calls them).
impl Hierarchical {
    fn typed_all_reduce<T: Element>(
        &self,
        src: Option<&[T]>,
        dst: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        let payload = std::mem::size_of_val(dst);
        self.run(CollectiveKind::AllReduce, payload, |x| {
            self.all_reduce_t(src, dst, op, x)
        })
    }

    fn typed_all_gather<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
    ) -> CommResult<()> {
        let who = self.who("all_gather");
        self.check_counts(&who, counts, src.len(), dst.len(), true)?;
        let payload = std::mem::size_of_val(dst);
        self.run(CollectiveKind::AllGather, payload, |x| {
            self.all_gather_t(src, dst, counts, x)
        })
    }

    fn typed_reduce_scatter<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> CommResult<()> {
        let who = self.who("reduce_scatter");
        self.check_counts(&who, counts, dst.len(), src.len(), false)?;
        let payload = std::mem::size_of_val(src);
        self.run(CollectiveKind::ReduceScatter, payload, |x| {
            self.reduce_scatter_t(src, dst, counts, op, x)
        })
    }

    fn typed_broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> CommResult<()> {
        if root >= self.place.len() {
            return Err(CommError::invalid(
                self.who("broadcast"),
                format!(
                    "root {root} is not a rank of this group of {}",
                    self.place.len()
                ),
            ));
        }
        let payload = std::mem::size_of_val(buf);
        self.run(CollectiveKind::Broadcast, payload, |x| {
            self.broadcast_t(buf, root, x)
        })
    }

    /// The composed all-to-all on an even layout, the all-gather form on an uneven one (which
    /// runs this backend's all-gather, a collective of its own). Counted as the engine counts
    /// it: the payload is the larger of what goes to and comes from other ranks.
    fn typed_all_to_all<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        sizes: &BlockSizes<'_>,
    ) -> CommResult<()> {
        sizes.check_for(
            &self.who("all_to_all"),
            (self.rank, self.place.len()),
            src.len(),
            dst.len(),
        )?;
        if !self.even {
            return all_to_all_by_all_gather(self, HostBuf::new(src), HostBufMut::new(dst), sizes);
        }
        let own = sizes.count(self.rank, self.rank);
        let payload = (src.len() - own).max(dst.len() - own) * std::mem::size_of::<T>();
        self.run(CollectiveKind::AllToAll, payload, |x| {
            self.all_to_all_t(src, dst, sizes, x)
        })
    }
}

impl Backend for Hierarchical {
    erased_collectives!();
    erased_all_to_all!();

    fn barrier(&self) -> CommResult<()> {
        self.run(CollectiveKind::Barrier, 0, |_| {
            self.local.barrier()?;
            if let Some(c) = &self.cross {
                c.barrier()?;
            }
            self.local.barrier()
        })
    }

    fn abort(&self, reason: &str) {
        self.local.abort(reason);
        if let Some(c) = &self.cross {
            c.abort(reason);
        }
    }

    fn shared_stats(&self) -> Option<&SharedStats> {
        Some(&self.stats)
    }

    fn subgroup(
        &self,
        ctx: &Arc<Context>,
        name: String,
        rank: usize,
        members: &[usize],
    ) -> CommResult<Arc<dyn Backend>> {
        if members.len() == 1 {
            return Ok(Arc::new(Single::new(name)));
        }
        Hierarchical::group(&self.map, ctx, name, rank, members, false)
    }

    fn kind(&self) -> &'static str {
        "hierarchical"
    }
}
