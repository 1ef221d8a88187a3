//! A rank's place in a pipeline, as data the layers below the pipeline read: its stage
//! ([`PipelineStage`]), the parts of a model a stage holds ([`StagePart`]) and the layers of
//! each stage ([`stage_layers`]). The loader, the decoders and the training model load only
//! their stage's layers from it; [`crate::pipeline`] (the schedules and the training step)
//! sits above them and re-exports it, the public path.

mod layers;
mod placement;

pub use layers::stage_layers;
pub use placement::{PipelineStage, StagePart};
