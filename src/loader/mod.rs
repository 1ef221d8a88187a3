//! Loading weights: tensor sources and the sharded var builder.
pub mod gguf;
pub mod progress;
pub use progress::{LoadProgress, ProgressSource};
pub mod quant_shard;
pub mod safetensors;
pub use gguf::GgufSource;
pub mod source;
pub use safetensors::SafetensorsSource;
pub use source::{
    slice_ranges, RangeRequest, TensorMapSource, TensorSource, VarBuilderSource, WeightShard,
};
pub mod var_builder;
pub use var_builder::ShardedVarBuilder;
