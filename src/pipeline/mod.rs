//! Pipeline parallelism: stages of layers on different ranks, micro-batches flowing through
//! them. This module holds the training schedules (GPipe and 1F1B) as data and the replay that
//! checks them; the stages exchange activations and gradients with
//! [`ops::send`](crate::ops::send) / [`ops::recv`](crate::ops::recv).

mod replay;
mod schedule;

pub use replay::{check, replay, Replay};
pub use schedule::{peak_activations, schedule, Kind, Step};

#[cfg(test)]
mod tests;
