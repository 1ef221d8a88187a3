//! Pipeline parallelism: stages of layers on different ranks, micro-batches flowing through
//! them. This module holds which layers each stage holds ([`stage_layers`]), the training
//! schedules (GPipe and 1F1B) as data and the replay that checks them; the ranks are laid out by
//! [`DeviceMesh::pp_dp_tp`](crate::comm::DeviceMesh::pp_dp_tp); the stages exchange activations and gradients with
//! [`ops::send`](crate::ops::send) / [`ops::recv`](crate::ops::recv).

mod placement;
mod replay;
mod schedule;
mod stages;
mod train;

pub use placement::{PipelineStage, StagePart};
pub use replay::{check, replay, Replay};
pub use schedule::{peak_activations, schedule, Kind, Step};
pub use stages::stage_layers;
pub use train::{train_step, MicroBatch, StepReport};

#[cfg(test)]
mod tests;
