//! Collectives as Candle ops with autograd (Megatron's mappings), the all-to-all of expert
//! parallelism with autograd, point-to-point `send` / `recv` with autograd (pipeline stages),
//! tensor collectives, the gated MLP's fused `silu(gate) · up`, and causal attention in one op.
mod all_to_all;
pub(crate) mod attention;
pub(crate) mod collective;
mod cpu_slice;
#[cfg(feature = "cuda")]
mod cuda;
mod kind;
mod mappings;
mod p2p;
mod rms_norm;
mod swiglu;
mod tensor;

pub use all_to_all::all_to_all;
pub use mappings::{
    copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp, scatter_to_tp,
};
pub use p2p::{recv, recv_tagged, send, send_tagged};
pub use rms_norm::rms_norm;
pub use swiglu::silu_mul;
