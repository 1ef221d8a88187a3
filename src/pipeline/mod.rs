//! Pipeline parallelism: stages of layers on different ranks, micro-batches flowing through
//! them. This module holds which layers each stage holds ([`stage_layers`]; a rank's stage,
//! [`PipelineStage`], is data the layers below read, defined beneath them and re-exported
//! here), the training schedules (GPipe and 1F1B) as data and the replay that checks them,
//! and the training step ([`train_step`]); the ranks are laid out by
//! [`DeviceMesh::pp_dp_tp`](crate::comm::DeviceMesh::pp_dp_tp); the stages exchange activations and gradients with
//! [`ops::send`](crate::ops::send) / [`ops::recv`](crate::ops::recv).

mod replay;
mod schedule;
mod train;

pub use crate::stage::{stage_layers, PipelineStage, StagePart};
pub use replay::{check, replay, Replay};
pub use schedule::{peak_activations, schedule, Kind, Step};
pub use train::{train_step, MicroBatch, StepReport};

#[cfg(test)]
mod tests;
