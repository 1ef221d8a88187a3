//! Loading weights: tensor sources and the sharded var builder.
pub mod safetensors;
pub mod source;
pub use safetensors::SafetensorsSource;
pub use source::{slice_ranges, TensorMapSource, TensorSource, VarBuilderSource};
pub mod var_builder;
pub use var_builder::ShardedVarBuilder;
