//! Joining a job on a named backend: the public `init_*` functions, each one backend's join
//! wrapped in its world [`ProcessGroup`], and [`BACKENDS`], the table `init_from_env` chooses
//! from. The backends sit below the group and return a [`World`]; this file, above both, is
//! where they meet, and where the backends made of others are put together (the hierarchical
//! backend over MPI and shm, NCCL meeting over MPI).

use candle_core::Device;

use super::backend::Registration;
#[cfg(any(feature = "mpi", feature = "nccl"))]
use super::backend::World;
use super::context::GroupOptions;
use super::error::CommResult;
use super::group::ProcessGroup;
#[cfg(feature = "nccl")]
use super::launcher::Launch;
use super::rendezvous::Rendezvous;
use super::shm;
#[cfg(feature = "mpi")]
use super::{hierarchical, mpi};

/// The backends [`init_from_env`](crate::init_from_env) chooses from, in the order `auto`
/// tries them: one line per backend, each registered by its own file (or below, for those
/// made of others); a backend this build lacks stays listed, with what builds it.
pub(crate) const BACKENDS: &[Registration] = &[
    HIERARCHICAL,
    #[cfg(feature = "mpi")]
    mpi::REGISTRATION,
    #[cfg(not(feature = "mpi"))]
    missing("mpi", "CPUs", Device::is_cpu, MPI_HINT),
    NCCL,
    #[cfg(feature = "mpi")]
    SHM_MEETING_OVER_MPI,
    #[cfg(not(feature = "mpi"))]
    shm::REGISTRATION,
];

/// The shm backend; under an MPI launcher (without `CANDLE_TP_TOKEN`) its ranks meet at a
/// store found through MPI (`store_over_mpi`: loopback, a port the kernel picks, a random token
/// sent by `MPI_Bcast`) instead of one at a port derived from the launcher's job id that takes
/// an empty token, which any local user could join (issue 44, defect 4).
#[cfg(feature = "mpi")]
const SHM_MEETING_OVER_MPI: Registration = Registration {
    join: Ok(shm_from_env),
    ..shm::REGISTRATION
};

#[cfg(feature = "mpi")]
fn shm_from_env(
    device: &Device,
    launch: &super::launcher::Launch,
    options: GroupOptions,
) -> CommResult<World> {
    let token_set = std::env::var("CANDLE_TP_TOKEN").is_ok_and(|t| !t.trim().is_empty());
    if launch.launcher.is_mpi() && launch.world_size > 1 && launch.is_single_host() && !token_set {
        let world = mpi::mpi_world(options)?;
        let (rank, size) = (world.rank(), world.size());
        mpi::check_launch(&World::new(rank, size, world.clone(), None), launch)?;
        let (store, keep) = mpi::store_over_mpi(&world, options.timeout)?;
        return shm::join_on(store, keep, rank, size, options);
    }
    match shm::REGISTRATION.join {
        Ok(join) => join(device, launch, options),
        Err(hint) => unreachable!("the shm backend is always built ({hint})"),
    }
}

/// What builds the MPI backends.
#[cfg(not(feature = "mpi"))]
const MPI_HINT: &str = "cargo build --features mpi; scripts/setup-mpi.sh installs what it needs";

/// The table line of a backend this build lacks: named, never taken by `auto`.
#[cfg(any(not(feature = "mpi"), not(feature = "nccl")))]
const fn missing(
    name: &'static str,
    devices: &'static str,
    serves: fn(&Device) -> bool,
    hint: &'static str,
) -> Registration {
    Registration {
        name,
        devices,
        serves,
        auto: |_, _| false,
        join: Err(hint),
    }
}

/// The hierarchical backend: shm inside each host, MPI between hosts; what `auto` takes for a
/// CPU job across hosts under an MPI launcher.
#[cfg(feature = "mpi")]
const HIERARCHICAL: Registration = Registration {
    name: "hierarchical",
    devices: "CPUs",
    serves: Device::is_cpu,
    auto: |device, launch| device.is_cpu() && launch.launcher.is_mpi() && !launch.is_single_host(),
    join: Ok(|_, launch, options| {
        let world = hierarchical_world(options)?;
        mpi::check_launch(&world, launch)?;
        Ok(world)
    }),
};
#[cfg(not(feature = "mpi"))]
const HIERARCHICAL: Registration = missing("hierarchical", "CPUs", Device::is_cpu, MPI_HINT);

/// NCCL on GPUs: the ranks meet at rank 0's store, or under an MPI launcher (built with `mpi`)
/// at a store found through MPI.
#[cfg(feature = "nccl")]
const NCCL: Registration = Registration {
    name: "nccl",
    devices: "CUDA devices",
    serves: Device::is_cuda,
    auto: |device, _| device.is_cuda(),
    join: Ok(nccl_from_env),
};
#[cfg(not(feature = "nccl"))]
const NCCL: Registration = missing(
    "nccl",
    "CUDA devices",
    Device::is_cuda,
    "cargo build --features nccl; docs/GPU.md",
);

#[cfg(feature = "nccl")]
fn nccl_from_env(device: &Device, launch: &Launch, options: GroupOptions) -> CommResult<World> {
    // GPUs under an MPI launcher: meeting at a store found through MPI (no MASTER_ADDR).
    #[cfg(feature = "mpi")]
    if let (true, Device::Cuda(dev), true) =
        (launch.launcher.is_mpi(), device, launch.world_size > 1)
    {
        let world = mpi::mpi_world(options)?;
        let (store, keep) = mpi::store_over_mpi(&world, options.timeout)?;
        return super::nccl::join_on(store, keep, world.rank(), world.size(), dev, options);
    }
    let mut rv = super::rendezvous::rendezvous_from_env()?;
    if rv.world_size == 1 {
        return Ok(super::single::Single::world());
    }
    // An MPI launcher gave no token, and (without `mpi`) nothing sends one: the job's token
    // file on one host, an error across hosts (issue 44, defect 4).
    let _token_file =
        super::job_token::token_for_launch(launch, rv.rank, &mut rv.token, options.timeout)?;
    super::nccl::join(&rv, device, options)
}

/// The hierarchical world: MPI's world and this host's ranks (`MPI_Comm_split_type`), and the
/// shm engine's rendezvous for the groups inside a host.
#[cfg(feature = "mpi")]
fn hierarchical_world(options: GroupOptions) -> CommResult<World> {
    let world = mpi::mpi_world(options)?;
    let node = world.split_shared("world/node".into());
    let (rank, size) = (world.rank(), world.size());
    let across = World::new(rank, size, world, None);
    let local =
        |ctx: &_, name, rank, members: &[usize]| shm::rendezvous(ctx, name, rank, members, None);
    hierarchical::join(across, node, &local, options)
}

/// Joins the job described by `rv` as one process of the `shm` backend, and returns its world
/// group.
pub fn init_shm(rv: &Rendezvous, options: GroupOptions) -> CommResult<ProcessGroup> {
    shm::join(rv, options).map(ProcessGroup::from_world)
}

/// Joins the MPI job this process was started in (by `mpirun`, `mpiexec` or `srun`) and
/// returns its world group on the `mpi` backend. Initialises MPI with `MPI_THREAD_MULTIPLE`;
/// MPI is finalised at a clean exit and aborted (the whole job ends) at an exit with an error.
#[cfg(feature = "mpi")]
pub fn init_mpi(options: GroupOptions) -> CommResult<ProcessGroup> {
    mpi::join(options).map(ProcessGroup::from_world)
}

/// Joins the MPI job this process was started in (`mpirun`, `mpiexec`, `srun`) and returns its
/// world group on the hierarchical backend: shared memory among the ranks of each host, MPI
/// between hosts. On one host it is the shm backend, with one rank per host plain MPI.
#[cfg(feature = "mpi")]
pub fn init_hierarchical(options: GroupOptions) -> CommResult<ProcessGroup> {
    hierarchical_world(options).map(ProcessGroup::from_world)
}

/// Joins the job described by `rv` with one NCCL communicator per rank on `device`, and returns
/// the world group. Unlike [`crate::init_from_env`], a job of one rank still gets a real NCCL
/// communicator (useful to test NCCL on one GPU).
///
/// Rank 0 hosts the rendezvous store at `rv.master_addr:rv.master_port` (port 0: any free
/// port, only for one rank). Each rank needs its own GPU: NCCL refuses two ranks on one device.
#[cfg(feature = "nccl")]
pub fn init_nccl(
    rv: &Rendezvous,
    device: &Device,
    options: GroupOptions,
) -> CommResult<ProcessGroup> {
    super::nccl::join(rv, device, options).map(ProcessGroup::from_world)
}
