//! candle-tp: tensor parallelism for Candle.
#![warn(missing_docs)]

pub mod comm;
pub mod convert;
pub mod loader;
pub mod partition;

pub use partition::{Partition, PartitionError};
