//! Parallel layers that are drop-in replacements for candle-nn's.
pub mod attention;
pub mod embedding;
mod expert_parallel;
pub mod kv_cache;
pub mod linear;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod parallel_2d;
pub mod parallel_3d;
mod parallel_parts;
pub mod rotary;
mod routing;
pub mod weight;

pub use attention::{AttentionConfig, HeadAssignment, Llama3RopeScaling, ParallelAttention};
pub use embedding::{ParallelLmHead, VocabParallelEmbedding};
pub use kv_cache::{KvCache, KvCacheDtype, LayerKvCache};
pub use linear::{
    column_linear, column_linear_no_bias, replicated_linear, replicated_linear_no_bias, row_linear,
    row_linear_no_bias, ColumnParallelLinear, ReplicatedLinear, RowParallelLinear,
};
pub use mlp::{gated_mlp, mlp, GatedMlp, Mlp, TwoLayerMlp};
pub use moe::{MoeConfig, SparseMoe};
pub use norm::{load_rms_norm, RmsNorm, RmsNormSpec};
pub use parallel_2d::{LayerNorm2d, Linear2d, Mlp2d};
pub use parallel_3d::{LayerNorm3d, Layout3d, Linear3d, Mlp3d};
pub use rotary::RotaryEmbedding;
pub use weight::{
    matmul_time, set_batch_invariant_matmul, set_matmul_timing, ParallelWeight, QuantizedWeight,
};
