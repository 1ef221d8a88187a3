//! The `mpi` backend (cargo feature `mpi`): CPU ranks anywhere MPI reaches (Open MPI, MPICH,
//! Intel MPI; launched by `mpirun`, `mpiexec` or `srun`), through the `mpi` crate (rsmpi).
//!
//! - Every collective first exchanges its (kind, dtype, count, sizes) with every rank
//!   ([`exchange`]: recursive doubling of a small header), so ranks that disagree get an error
//!   naming the rank and both values instead of a hang or corrupt data. All-reduces up to
//!   64 KiB (decoding's) carry their data in the same exchange: one network round trip per
//!   step, as MPI's own small all-reduce, with the check included. `CANDLE_TP_MPI_CHECK=0`
//!   skips the separate agreement before larger collectives.
//! - f16 and bf16, which MPI has no type for, are reduced in f32 and rounded once (as the
//!   shared-memory engine does); gathers and broadcasts move their bits as u16.
//! - `Max` of floats propagates NaN as PyTorch and NCCL do (MPI's `MPI_MAX` on NaN is
//!   unspecified): a NaN flag per element is reduced beside the values.
//! - MPI has no deadline: a watchdog thread checks every in-flight collective and, past
//!   `CANDLE_TP_TIMEOUT`, prints the collective, the group and the rank and calls `MPI_Abort`,
//!   which ends the whole job (a stuck MPI call cannot be cancelled).
//! - `abort` marks the group failed on this rank (its later collectives return the reason);
//!   the launcher ends the job when a rank exits with an error.
//! - Sub-groups are `MPI_Comm_create_group` over the members alone.

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use ::mpi::topology::{Communicator, SimpleCommunicator};
use ::mpi::traits::*;
use ::mpi::Threading;

use super::backend::{erased_all_to_all, erased_collectives, Backend, Registration, World};
use super::context::{Context, GroupOptions};
use super::error::{CommError, CommResult};
use super::launcher::{Launch, Launcher};
use super::region::random_hex;
use super::stats::{CollectiveKind, SharedStats};
use super::store::MemStore;

mod bootstrap;
mod exchange;
mod size_check;
mod typed;
mod wire;
#[allow(unused_imports)] // used with the nccl feature
pub(crate) use bootstrap::store_over_mpi;
pub use size_check::CHECK_SIZES_VAR;
use size_check::{agree_on_check_sizes, check_sizes};

/// An MPI communicator of one group on this rank.
pub(crate) struct MpiBackend {
    comm: Mutex<Comm>,
    name: String,
    rank: usize,
    size: usize,
    timeout: Duration,
    stats: SharedStats,
    aborted: Mutex<Option<String>>,
    /// The collective in progress and when it started, for the watchdog.
    in_flight: Mutex<Option<(Instant, &'static str)>>,
    /// Whether the members live on more than one host (then every byte a collective moves
    /// is counted as crossing hosts).
    spans_hosts: bool,
}

/// The group's communicator behind the backend's lock, and a duplicate of it for the
/// header exchanges of [`exchange`] (its own context: no other message can match them).
struct Comm {
    main: SimpleCommunicator,
    exchange: SimpleCommunicator,
}

// SAFETY: MPI was initialised with MPI_THREAD_MULTIPLE (checked in `init_mpi`), so a
// communicator may be used from any thread; the Mutex around it serialises this group's calls.
unsafe impl Send for Comm {}

/// The `mpi` backend in `init_from_env`'s table: every byte over MPI, on CPUs; only when asked
/// for (`auto` takes the hierarchical backend across hosts).
pub(crate) const REGISTRATION: Registration = Registration {
    name: "mpi",
    devices: "CPUs",
    serves: candle_core::Device::is_cpu,
    auto: |_, _| false,
    join: Ok(|_, launch, options| {
        let world = join(options)?;
        check_launch(&world, launch)?;
        Ok(world)
    }),
};

/// Checks that MPI's world is the job the launcher describes (a process started by hand with
/// a launcher's variables sees a world of one), naming the launcher's variable.
pub(crate) fn check_launch(world: &World, launch: &Launch) -> CommResult<()> {
    if launch.launcher != Launcher::Alone && world.members.len() != launch.world_size {
        return Err(CommError::env(
            launch.launcher.world_size_var(),
            format!(
                "{} says the job has {} processes, but MPI reports {} (was this process \
                 started by that launcher's MPI?)",
                launch.launcher.name(),
                launch.world_size,
                world.members.len()
            ),
        ));
    }
    Ok(())
}

/// Joins the MPI job this process was started in, every byte over MPI (what
/// [`init_mpi`](crate::comm::init_mpi) wraps).
pub(crate) fn join(options: GroupOptions) -> CommResult<World> {
    let world = mpi_world(options)?;
    let (rank, size) = (world.rank, world.size);
    let ctx = Context::new(
        Arc::new(MemStore::new()),
        super::region::RegionKind::InProcess,
        random_hex(),
        &options,
        size,
        Vec::new(),
    );
    Ok(World::new(rank, size, world, Some(ctx)))
}

/// Writes `line` and a newline to stderr in one write: under mpirun, whose output tags cut
/// a line at every write (and `eprintln!` writes its arguments piece by piece), the line then
/// reaches the log whole, so that the rank and the reason stand together.
fn say(line: String) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// MPI's universe, once initialised (taken, hence finalised, at a clean exit).
static UNIVERSE: OnceLock<Mutex<Option<::mpi::environment::Universe>>> = OnceLock::new();

/// What happens to MPI when the process exits (statics are never dropped, so something must
/// run then):
/// - status 0: `MPI_Finalize`, which mpirun needs to count the rank as done;
/// - any other status (`main` returned an error, a panic, `exit(1)`): `MPI_Abort`. Never
///   finalise there: Open MPI's `MPI_Finalize` waits for every rank, so a rank leaving on an
///   error would stay in it, mpirun would never see it fail, and its peers would wait in their
///   collectives until their deadline (or for ever, outside one). `MPI_Abort` makes mpirun
///   end the whole job within seconds.
///
/// The status is known at exit through glibc's `on_exit`; elsewhere (musl) only `atexit`
/// exists, and the rank finalises whatever its status.
fn register_exit_handler() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn on_exit(
                f: extern "C" fn(libc::c_int, *mut libc::c_void),
                arg: *mut libc::c_void,
            ) -> libc::c_int;
        }
        extern "C" fn at_exit(status: libc::c_int, _: *mut libc::c_void) {
            leave_mpi(status);
        }
        // SAFETY: registering a plain `extern "C"` function that ignores its pointer.
        if unsafe { on_exit(at_exit, std::ptr::null_mut()) } != 0 {
            say("candle-tp: could not register MPI's exit handler".into());
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        extern "C" fn at_exit() {
            leave_mpi(0);
        }
        // SAFETY: registering a plain `extern "C"` function with no arguments.
        if unsafe { libc::atexit(at_exit) } != 0 {
            say("candle-tp: could not register MPI_Finalize at exit".into());
        }
    }
}

/// Finalises MPI (`status` 0) or aborts the whole job with `status` (see
/// [`register_exit_handler`]).
fn leave_mpi(status: libc::c_int) {
    let Some(cell) = UNIVERSE.get() else { return };
    let mut u = cell.lock().unwrap_or_else(|e| e.into_inner());
    if status == 0 {
        drop(u.take());
        return;
    }
    if let Some(universe) = u.as_ref() {
        let world = universe.world();
        say(format!(
            "candle-tp: MPI rank {} of {} is exiting with status {status}: aborting the job \
             (MPI_Abort) so that no peer waits for it",
            world.rank(),
            world.size()
        ));
        world.abort(status);
    }
}

/// Initialises MPI (once per process, with `MPI_THREAD_MULTIPLE`; finalised at a clean exit,
/// aborted at any other, see [`register_exit_handler`]) and returns the backend of
/// `MPI_COMM_WORLD`.
pub(crate) fn mpi_world(options: GroupOptions) -> CommResult<Arc<MpiBackend>> {
    let cell = UNIVERSE.get_or_init(|| Mutex::new(None));
    let mut u = cell.lock().unwrap_or_else(|e| e.into_inner());
    if u.is_none() {
        let (universe, threading) = ::mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| CommError::invalid("init_mpi", "MPI was already initialised"))?;
        if threading != Threading::Multiple {
            return Err(CommError::invalid(
                "init_mpi",
                format!(
                    "this MPI library provides {threading:?}, candle-tp needs \
                     MPI_THREAD_MULTIPLE (Open MPI and MPICH provide it)"
                ),
            ));
        }
        let world = universe.world();
        *u = Some(universe);
        register_exit_handler();
        agree_on_check_sizes(&world)?;
    }
    let world = u.as_ref().expect("initialised above").world();
    Ok(MpiBackend::new(world, "world".into(), options.timeout))
}

impl MpiBackend {
    /// Collective over `comm`'s members (it asks MPI which of them share a host).
    fn new(comm: SimpleCommunicator, name: String, timeout: Duration) -> Arc<Self> {
        let (spans_hosts, exchange) = watched(
            format!(
                "creating MPI group '{name}' (rank {} of {}: MPI_Comm_split_type, MPI_Comm_dup)",
                comm.rank(),
                comm.size()
            ),
            timeout,
            || {
                (
                    comm.split_shared(comm.rank()).size() < comm.size(),
                    comm.duplicate(),
                )
            },
        );
        let b = Arc::new(Self {
            spans_hosts,
            rank: comm.rank() as usize,
            size: comm.size() as usize,
            comm: Mutex::new(Comm {
                exchange,
                main: comm,
            }),
            name,
            timeout,
            stats: SharedStats::default(),
            aborted: Mutex::new(None),
            in_flight: Mutex::new(None),
        });
        watchdog()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::downgrade(&b));
        b
    }

    /// This rank's index in the group.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// The members on this rank's host (`MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`, ordered
    /// by their rank here), as a group of their own. Collective over the whole group.
    pub(crate) fn split_shared(&self, name: String) -> Arc<MpiBackend> {
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let local = watched(
            format!("{} (MPI_Comm_split_type)", self.who("split_shared")),
            self.timeout,
            || comm.main.split_shared(self.rank as i32),
        );
        drop(comm);
        MpiBackend::new(local, name, self.timeout)
    }

    fn who(&self, op: &str) -> String {
        format!(
            "{op} on MPI group '{}' (rank {} of {})",
            self.name, self.rank, self.size
        )
    }

    /// Runs `f` on the communicator: checks the abort state, agrees on `meta` with every rank
    /// (unless `CANDLE_TP_MPI_CHECK=0`), records the collective for the watchdog and the
    /// statistics.
    fn run<R>(
        &self,
        kind: CollectiveKind,
        meta: [u64; 4],
        bytes: (usize, usize),
        f: impl FnOnce(&SimpleCommunicator) -> CommResult<R>,
    ) -> CommResult<R> {
        self.run_with(kind, bytes, |comm| {
            if check_sizes() {
                exchange::agree(&comm.exchange, meta)
                    .map_err(|d| self.disagreement(kind, meta, d))?;
            }
            f(&comm.main)
        })
    }

    /// Runs `f` (which makes its own agreement) under the abort check, the watchdog and the
    /// statistics.
    fn run_with<R>(
        &self,
        kind: CollectiveKind,
        bytes: (usize, usize),
        f: impl FnOnce(&Comm) -> CommResult<R>,
    ) -> CommResult<R> {
        let op = kind.name();
        if let Some(reason) = self
            .aborted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Err(CommError::Aborted {
                group: self.name.clone(),
                op: op.into(),
                rank: self.rank,
                reason,
            });
        }
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let t0 = Instant::now();
        *self.in_flight.lock().unwrap_or_else(|e| e.into_inner()) = Some((t0, op));
        let out = f(&comm);
        *self.in_flight.lock().unwrap_or_else(|e| e.into_inner()) = None;
        drop(comm);
        if out.is_ok() {
            // The payload as `OpStats` defines it: the larger of input and output.
            let payload = bytes.0.max(bytes.1);
            let mut stats = self.stats.lock();
            stats.record(kind, payload, bytes.0, bytes.1, t0.elapsed());
            if self.spans_hosts {
                stats.record_cross_host(kind, payload);
            }
        }
        out
    }

    /// The error every rank returns when a rank passed other sizes than `meta`.
    fn disagreement(
        &self,
        kind: CollectiveKind,
        meta: [u64; 4],
        d: exchange::Disagreement,
    ) -> CommError {
        let show = |m: &[u64; 4]| {
            if *m == [u64::MAX; 4] {
                "a message that is not a collective's header (another collective)".to_string()
            } else {
                format!(
                    "(kind {}, dtype {}, count {}, sizes {:x})",
                    m[0], m[1], m[2], m[3]
                )
            }
        };
        CommError::Mismatch {
            group: self.name.clone(),
            op: kind.name().into(),
            detail: format!(
                "rank {} passed {} and rank {} passed {} (this rank, {} of {}, passed {})",
                d.first.0,
                show(&d.first.1),
                d.second.0,
                show(&d.second.1),
                self.rank,
                self.size,
                show(&meta)
            ),
        }
    }
}

/// FNV-1a of the block sizes: a collective's sizes in one number, for the agreement.
fn hash_counts(counts: &[usize]) -> u64 {
    counts.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &c| {
        (h ^ c as u64).wrapping_mul(0x100_0000_01b3)
    })
}

impl Backend for MpiBackend {
    erased_collectives!();
    erased_all_to_all!();

    fn barrier(&self) -> CommResult<()> {
        let meta = [CollectiveKind::Barrier.code() as u64, 0, 0, 0];
        self.run(CollectiveKind::Barrier, meta, (0, 0), |comm| {
            comm.barrier();
            Ok(())
        })
    }

    /// Marks the group failed and ends the whole MPI job (`MPI_Abort`), printing `reason`.
    ///
    /// Peers blocked in an MPI collective cannot be woken with an error (MPI cancels no
    /// collective), and a flag here reaches no other process: they would wait for the
    /// watchdog's deadline and report a misleading "a peer did not arrive". A rank that
    /// aborts its group has failed (an argument error on this rank alone, a dead peer on this
    /// host), so the job ends now, with the reason on this rank's stderr.
    fn abort(&self, reason: &str) {
        let mut a = self.aborted.lock().unwrap_or_else(|e| e.into_inner());
        if a.is_some() {
            return;
        }
        *a = Some(reason.to_string());
        drop(a);
        say(format!(
            "candle-tp: MPI group '{}' aborted on rank {} of {}: {reason}; aborting the MPI job",
            self.name, self.rank, self.size
        ));
        SimpleCommunicator::world().abort(4);
    }

    fn shared_stats(&self) -> Option<&SharedStats> {
        Some(&self.stats)
    }

    fn subgroup(
        &self,
        _ctx: &Arc<Context>,
        name: String,
        _rank: usize,
        members: &[usize],
    ) -> CommResult<Arc<dyn Backend>> {
        // `members` are world ranks; this communicator's ranks are this group's indices,
        // which the caller numbered: look them up through the world group of each.
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let world = SimpleCommunicator::world();
        let world_group = world.group();
        let mine = comm.main.group();
        let as_world: Vec<i32> = members.iter().map(|&m| m as i32).collect();
        let ranks: Vec<i32> = world_group
            .translate_ranks(&as_world, &mine)
            .into_iter()
            .map(|r| r.unwrap_or(-1))
            .collect();
        if ranks.iter().any(|&r| r < 0) {
            return Err(CommError::invalid(
                self.who("new_group"),
                format!("members {members:?} are not all in this group"),
            ));
        }
        let sub = mine.include(&ranks[..]);
        let tag = (hash_counts(members) % 30_000) as i32;
        let new = watched(
            format!(
                "{} of members {members:?} (MPI_Comm_create_group)",
                self.who("new_group")
            ),
            self.timeout,
            || comm.main.split_by_subgroup_with_tag(&sub, tag),
        )
        .ok_or_else(|| {
            CommError::invalid(
                self.who("new_group"),
                "MPI_Comm_create_group gave no communicator",
            )
        })?;
        drop(comm);
        Ok(MpiBackend::new(new, name, self.timeout))
    }

    fn kind(&self) -> &'static str {
        "mpi"
    }
}

/// The groups the watchdog looks at, and the thread itself (started with the first group).
/// Communicator creations in progress (`MPI_Comm_split_type`, `MPI_Comm_dup`,
/// `MPI_Comm_create_group`): collective calls outside any group's collectives, which a peer
/// that never comes (it failed before, or it creates another communicator) would block for
/// ever. The watchdog ends the job when one runs past its deadline: (id, start, what,
/// deadline).
type Creation = (u64, Instant, String, Duration);

fn creations() -> &'static Mutex<Vec<Creation>> {
    static CREATING: OnceLock<Mutex<Vec<Creation>>> = OnceLock::new();
    CREATING.get_or_init(|| Mutex::new(Vec::new()))
}

/// Runs the communicator creation `f` under the watchdog: past `timeout` the job is aborted
/// with `what` named, instead of waiting for ever.
fn watched<R>(what: impl Into<String>, timeout: Duration, f: impl FnOnce() -> R) -> R {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let _ = watchdog(); // started, if it is not yet
    creations().lock().unwrap_or_else(|e| e.into_inner()).push((
        id,
        Instant::now(),
        what.into(),
        timeout,
    ));
    let out = f();
    creations()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|c| c.0 != id);
    out
}

fn watchdog() -> &'static Mutex<Vec<Weak<MpiBackend>>> {
    static GROUPS: OnceLock<Mutex<Vec<Weak<MpiBackend>>>> = OnceLock::new();
    GROUPS.get_or_init(|| {
        std::thread::Builder::new()
            .name("candle-tp-mpi-watchdog".into())
            .spawn(|| loop {
                std::thread::sleep(Duration::from_millis(500));
                let groups = {
                    let mut all = watchdog().lock().unwrap_or_else(|e| e.into_inner());
                    // Groups dropped since: their entries go (the list grew for ever).
                    all.retain(|g| g.strong_count() > 0);
                    all.clone()
                };
                let late = creations()
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .find(|c| c.1.elapsed() > c.3)
                    .map(|c| (c.1.elapsed(), c.2.clone(), c.3));
                if let Some((waited, what, limit)) = late {
                    say(format!(
                        "candle-tp: {what} has waited {:.0} s (CANDLE_TP_TIMEOUT is {:.0} s): a \
                         peer did not take part (MPI does not say which); aborting the MPI job",
                        waited.as_secs_f64(),
                        limit.as_secs_f64()
                    ));
                    SimpleCommunicator::world().abort(3);
                }
                for g in groups.iter().filter_map(Weak::upgrade) {
                    let late = g
                        .in_flight
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .filter(|(t0, _)| t0.elapsed() > g.timeout);
                    if let Some((t0, op)) = late {
                        say(format!(
                            "candle-tp: {} has waited {:.0} s (CANDLE_TP_TIMEOUT is {:.0} s): a peer \
                             did not arrive (MPI does not say which); aborting the MPI job",
                            g.who(op),
                            t0.elapsed().as_secs_f64(),
                            g.timeout.as_secs_f64()
                        ));
                        SimpleCommunicator::world().abort(3);
                    }
                }
            })
            .expect("spawn the MPI watchdog");
        Mutex::new(Vec::new())
    })
}
