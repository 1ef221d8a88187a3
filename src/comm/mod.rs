//! Process groups, collectives and their backends.
//!
//! - [`ProcessGroup`]: a set of ranks; `all_reduce`, `all_gather`, `reduce_scatter`,
//!   `broadcast`, `barrier` on slices here and on Candle tensors in [`crate::ops`].
//! - Backends behind one trait (`backend.rs`; `ProcessGroup` never branches on them): the
//!   shared-memory engine (`shm.rs`: processes of one host, [`crate::init_from_env`], or
//!   threads of one process, [`run_threads`], for tests), NCCL on GPUs (`nccl.rs`, feature
//!   `nccl`), MPI (`mpi/`, feature `mpi`), MPI between hosts with shm inside each
//!   (`hierarchical/`, feature `mpi`) and the one-rank group (`single.rs`).
//! - [`launcher`]: the job's layout from tprun/torchrun, `mpirun` (Open MPI, Hydra) or `srun`.
//!
//! The files stand in layers, each importing only its own and those below (checked by
//! `tests/structure`): types (errors, elements, counters, the launcher's layout, the
//! rendezvous) → the store → engines (waits, regions, the shm engine) → the `Backend` trait
//! and the context a job's groups share → the backends → `ProcessGroup`, point-to-point and
//! meshes → joining (`join.rs`: the `init_*` functions and the backends' table), the threads
//! runner and `init_from_env` (`env.rs`). This file only declares and re-exports.
mod all_to_all;
mod backend;
mod block_sizes;
mod context;
pub mod element;
mod engine;
mod env;
pub mod error;
mod group;
#[cfg(feature = "mpi")]
mod hierarchical;
mod job_token;
mod join;
pub mod launcher;
pub mod mesh;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
mod p2p;
mod region;
mod rendezvous;
mod secret;
mod shm;
mod single;
pub mod stats;
pub mod store;
mod threads;
mod wait;

#[cfg(feature = "mpi")]
pub use self::join::{init_hierarchical, init_mpi};
#[cfg(feature = "mpi")]
pub use self::mpi::CHECK_SIZES_VAR;
#[cfg(feature = "nccl")]
pub(crate) use backend::{BlockSizes, DeviceCollectives, DeviceSrc};
pub use context::GroupOptions;
pub use element::{Element, ReduceOp};
pub use env::init_from_env;
pub use error::{CommError, CommResult};
pub use group::ProcessGroup;
#[cfg(feature = "nccl")]
pub use join::init_nccl;
pub use join::init_shm;
pub use launcher::{detect_launch, launch_from_env, Launch, Launcher};
pub use mesh::DeviceMesh;
pub use rendezvous::{rendezvous_from_env, Rendezvous};
pub use stats::{CollectiveKind, CommStats, OpStats};
pub use store::FAULT_WRONG_TOKEN_VAR;
pub use threads::{run_threads, run_threads_with};
pub use wait::{default_timeout, parse_timeout, timeout_from_env, DEFAULT_TIMEOUT, TIMEOUT_VAR};
