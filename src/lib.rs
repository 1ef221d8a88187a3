//! candle-tp: tensor parallelism for Candle.
#![warn(missing_docs)]

pub mod comm;
pub mod loader;
pub mod models;
pub mod nn;
pub mod ops;
pub mod partition;

pub use comm::{init_from_env, run_threads, ProcessGroup, ReduceOp};
pub use loader::ShardedVarBuilder;
pub use nn::*;
pub use partition::{Partition, PartitionError};
