//! Loading weights: tensor sources and the sharded var builder.
pub mod source;
pub use source::{slice_ranges, TensorMapSource, TensorSource, VarBuilderSource};
