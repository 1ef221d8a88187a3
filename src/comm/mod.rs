//! Process groups, collectives and their backends.
//!
//! - [`ProcessGroup`]: a set of ranks; `all_reduce`, `all_gather`, `reduce_scatter`,
//!   `broadcast`, `barrier` on slices here and on Candle tensors in [`crate::ops`].
//! - Backends: `threads` ([`run_threads`]: ranks as threads of one process, for tests) and
//!   `shm` (processes on one host, [`crate::init_from_env`]), both on the same shared-memory
//!   engine; NCCL on GPUs behind the `nccl` feature.
//! - [`launcher`]: the job's layout from tprun/torchrun, `mpirun` (Open MPI, Hydra) or `srun`.
pub mod element;
mod engine;
mod env;
pub mod error;
mod group;
pub mod launcher;
pub mod mesh;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
mod region;
mod shm;
pub mod stats;
pub mod store;
mod threads;
mod wait;

pub use element::{Element, ReduceOp};
pub use env::{init_from_env, rendezvous_from_env};
pub use error::{CommError, CommResult};
pub use group::{GroupOptions, ProcessGroup};
pub use launcher::{detect_launch, launch_from_env, Launch, Launcher};
pub use mesh::DeviceMesh;
#[cfg(feature = "nccl")]
pub use nccl::init_nccl;
pub use shm::{init_shm, Rendezvous};
pub use stats::{CollectiveKind, CommStats, OpStats};
pub use threads::{run_threads, run_threads_with};
pub use wait::default_timeout;
