//! Meeting on NCCL: the world group of a job ([`join`]) and the communicator of each
//! group ([`rendezvous`]), the NCCL unique id exchanged through the rendezvous store.

use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::CudaDevice;
use candle_core::Device;
use cudarc::nccl::safe::{Comm, Id};

use super::{driver_err, nccl_err, ordinal, NcclComm, NcclGroup};
use crate::comm::backend::World;
use crate::comm::context::{Context, GroupOptions};
use crate::comm::error::{CommError, CommResult};
use crate::comm::region::{random_hex, RegionKind};
use crate::comm::rendezvous::Rendezvous;
use crate::comm::stats::SharedStats;
use crate::comm::store::connect_job_store;

/// Joins the job described by `rv` with one NCCL communicator per rank on `device` (what
/// [`init_nccl`](crate::comm::init_nccl) wraps): rank 0 hosts the rendezvous store, a job of
/// one rank still gets a real communicator.
pub(crate) fn join(rv: &Rendezvous, device: &Device, options: GroupOptions) -> CommResult<World> {
    let Device::Cuda(dev) = device else {
        return Err(CommError::invalid(
            "init_nccl",
            format!("the nccl backend needs a CUDA device, got {device:?}"),
        ));
    };
    let (store, keep) = connect_job_store(rv, options.timeout)?;
    join_on(Arc::from(store), keep, rv.rank, rv.world_size, dev, options)
}

/// The world on NCCL, the ranks meeting (NCCL unique ids) through `store`.
pub(crate) fn join_on(
    store: Arc<dyn crate::comm::store::Store>,
    keep: crate::comm::store::Keep,
    rank: usize,
    world_size: usize,
    dev: &CudaDevice,
    options: GroupOptions,
) -> CommResult<World> {
    if rank == 0 {
        store.set("job", random_hex().as_bytes())?;
    }
    let job = String::from_utf8_lossy(&store.get("job", options.timeout)?).into_owned();
    let ctx = Context::new(store, RegionKind::Shm, job, &options, world_size, keep);
    let group = rendezvous(&ctx, "world".into(), rank, world_size, dev)?;
    Ok(World::new(rank, world_size, Arc::new(group), Some(ctx)))
}

/// Creates the NCCL communicator of group `name` (this rank is `rank` of `members`).
pub(crate) fn rendezvous(
    ctx: &Arc<Context>,
    name: String,
    rank: usize,
    size: usize,
    device: &CudaDevice,
) -> CommResult<NcclGroup> {
    let gpu = ordinal(device);
    let who = |step: &str| format!("{step} for group '{name}' (rank {rank} of {size}, cuda:{gpu})");
    let stream = device.cuda_stream();
    stream
        .context()
        .bind_to_thread()
        .map_err(driver_err(who("making the CUDA context current")))?;
    let key = format!("{name}/nccl-id");
    let id = if rank == 0 {
        let id = Id::new().map_err(nccl_err(who("ncclGetUniqueId")))?;
        let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
        ctx.store.set(&key, &bytes)?;
        id
    } else {
        let bytes = ctx
            .store
            .get(&key, ctx.timeout)
            .map_err(|e| CommError::Timeout {
                group: name.clone(),
                op: format!("rendezvous (waiting for rank 0 to publish the NCCL id: {e})"),
                missing: vec![0],
                waited: ctx.timeout,
            })?;
        let mut internal = [0 as std::ffi::c_char; 128];
        if bytes.len() != internal.len() {
            return Err(CommError::Mismatch {
                group: name.clone(),
                op: "rendezvous".into(),
                detail: format!(
                    "the NCCL id under '{key}' has {} bytes, expected {}",
                    bytes.len(),
                    internal.len()
                ),
            });
        }
        for (d, s) in internal.iter_mut().zip(&bytes) {
            *d = *s as std::ffi::c_char;
        }
        Id::uninit(internal)
    };
    // ncclCommInitRank waits for every rank without a deadline: meet in the store first.
    ctx.store.set(&format!("{name}/nccl-ready/{rank}"), b"1")?;
    for r in 0..size {
        ctx.store
            .get(&format!("{name}/nccl-ready/{r}"), ctx.timeout)
            .map_err(|e| CommError::Timeout {
                group: name.clone(),
                op: format!("rendezvous (waiting for every rank to reach ncclCommInitRank: {e})"),
                missing: vec![r],
                waited: ctx.timeout,
            })?;
    }
    let comm = Comm::from_rank(stream, rank, size, id).map_err(|e| CommError::Io {
        context: who("ncclCommInitRank"),
        source: format!(
            "NCCL error {:?} (each rank needs its own GPU: use Device::new_cuda(LOCAL_RANK), \
             see candle_tp::device_from_arg; NCCL_DEBUG=INFO tells more)",
            e.0
        ),
    })?;
    Ok(NcclGroup {
        comm: Mutex::new(Some(NcclComm(comm))),
        abort_requested: std::sync::atomic::AtomicBool::new(false),
        device: device.clone(),
        stats: SharedStats::default(),
        name,
        rank,
        size,
    })
}
