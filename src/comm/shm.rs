//! The `shm` backend: ranks are processes on one host.
//!
//! Rank 0 hosts the rendezvous store at `MASTER_ADDR:MASTER_PORT`; every rank connects to it
//! with the job token (under torchrun, every rank joins the agent's store there instead). Rank 0 draws a random job id that names the job's shared-memory
//! segments (`/dev/shm/candle-tp-<job>-<group>`), created with `O_EXCL` and mode 0600 and
//! unlinked as soon as every rank has mapped them. Tensors never go through the socket.

use std::sync::Arc;

use super::error::{CommError, CommResult};
use super::group::{rendezvous, Context, GroupOptions, ProcessGroup};
use super::region::{random_hex, RegionKind};
use super::store::connect_job_store;

/// Environment variable with a tag that `tprun` puts at the start of the job id (so of every
/// segment name, `/dev/shm/candle-tp-<tag>…`): after the job, tprun removes what a rank killed
/// in the middle of a rendezvous could not.
pub const SHM_TAG_VAR: &str = "CANDLE_TP_SHM_TAG";

/// The job id drawn by rank 0: `CANDLE_TP_SHM_TAG` (1 to 32 lowercase ASCII letters or digits)
/// followed by 16 random hex characters, or the random part alone when the tag is unset.
fn job_id() -> CommResult<String> {
    match std::env::var(SHM_TAG_VAR) {
        Err(std::env::VarError::NotPresent) => Ok(random_hex()),
        Ok(tag)
            if (1..=32).contains(&tag.len())
                && tag
                    .bytes()
                    .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase()) =>
        {
            Ok(format!("{tag}{}", random_hex()))
        }
        _ => Err(CommError::env(
            SHM_TAG_VAR,
            "must be 1 to 32 lowercase ASCII letters or digits",
        )),
    }
}

/// Where and how the ranks of a job meet.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Address rank 0 listens on (`MASTER_ADDR`; loopback for one host).
    pub master_addr: String,
    /// Port of the store (`MASTER_PORT`).
    pub master_port: u16,
    /// The job's secret; peers without it are refused (`CANDLE_TP_TOKEN`, set by `tprun`).
    pub token: String,
}

/// Joins the job described by `rv` as one process of the `shm` backend, and returns its world
/// group.
pub fn init_shm(rv: &Rendezvous, options: GroupOptions) -> CommResult<ProcessGroup> {
    if rv.world_size == 1 {
        return Ok(ProcessGroup::single());
    }
    let (store, keep) = connect_job_store(rv, options.timeout)?;
    if rv.rank == 0 {
        store.set("job", job_id()?.as_bytes())?;
    }
    let job = String::from_utf8_lossy(&store.get("job", options.timeout)?).into_owned();
    let ctx = Context::new(
        Arc::from(store),
        RegionKind::Shm,
        job,
        &options,
        rv.world_size,
        keep,
    );
    rendezvous(&ctx, "world".into(), rv.rank, (0..rv.world_size).collect())
}
