//! [`CausalLm`] on a pipeline stage: where a stage's activations come from (the embedding on
//! the first stage, the previous stage otherwise) and where they go (the next stage, or the
//! final norm on the last).

use std::ops::Range;

use candle_core::{Module, Result, Tensor};

use super::{CausalLm, DecoderLayer};
use crate::nn::ParallelLmHead;
use crate::stage::PipelineStage;

impl CausalLm {
    /// The pipeline stage this model was loaded for (`None`: the whole model).
    pub fn pipeline(&self) -> Option<&PipelineStage> {
        self.stage.as_ref()
    }

    /// Every rank that runs this model: the pipeline's ranks, or [`pg`](Self::pg) without a
    /// pipeline (what a serving loop broadcasts its steps over).
    pub fn world(&self) -> &crate::comm::ProcessGroup {
        self.stage.as_ref().map_or(&self.pg, |s| s.world())
    }

    /// What this rank's communication for the model moved so far: the tensor-parallel group's
    /// collectives and, on a pipeline, the stages' group's transfers (activations handed on,
    /// tokens handed back) and the world's (a serving loop's step plans).
    pub fn comm_stats(&self) -> crate::comm::CommStats {
        let mut all = self.pg.stats();
        if let Some(s) = &self.stage {
            all.add(&s.group().stats());
            all.add(&s.world().stats());
        }
        all
    }

    /// The decoder layers this rank holds, in the model's numbering (all of them without a
    /// pipeline).
    pub fn layer_range(&self) -> Range<usize> {
        self.layer_range.clone()
    }

    /// Whether this rank computes logits: the last pipeline stage, or no pipeline.
    pub fn has_logits(&self) -> bool {
        self.lm_head.is_some()
    }

    /// The layer `i` of the model, if this rank holds it.
    pub(super) fn local_layer(&self, i: usize) -> Option<&DecoderLayer> {
        if !self.layer_range.contains(&i) {
            return None;
        }
        self.layers.get(i - self.layer_range.start)
    }

    /// A stage's input activations `shape` (`[batch, seq, hidden]`): `ids` embedded on the
    /// first stage, the previous stage's output otherwise.
    pub(super) fn stage_input(&self, ids: &Tensor, shape: &[usize]) -> Result<Tensor> {
        match (&self.embed_tokens, &self.stage) {
            (Some(embed), _) => {
                let x = embed.forward(ids)?;
                match self.config.embedding_multiplier {
                    Some(m) => x * m,
                    None => Ok(x),
                }
            }
            (None, Some(stage)) => stage.recv_prev(shape, self.dtype, ids.device()),
            (None, None) => candle_core::bail!(
                "{}: the model has no embedding and no pipeline stage before it",
                self.config.architecture
            ),
        }
    }

    /// A stage's output: the hidden states after the final norm on the last stage; on the
    /// others `None`, after handing `x` to the next stage.
    pub(super) fn stage_output(&self, x: Tensor) -> Result<Option<Tensor>> {
        match (&self.norm, &self.stage) {
            (Some(norm), _) => Ok(Some(norm.forward(&x)?)),
            (None, Some(stage)) => {
                stage.send_next(&x)?;
                Ok(None)
            }
            (None, None) => candle_core::bail!(
                "{}: the model has no final norm and no pipeline stage after it",
                self.config.architecture
            ),
        }
    }

    /// What `what` needs from the last stage: `h`, or an error on the other stages.
    pub(super) fn on_last_stage(&self, h: Option<Tensor>, what: &str) -> Result<Tensor> {
        h.ok_or_else(|| self.not_last(what))
    }

    /// The LM head, or an error naming the stage for `what`.
    pub(crate) fn head(&self, what: &str) -> Result<&ParallelLmHead> {
        self.lm_head.as_ref().ok_or_else(|| self.not_last(what))
    }

    fn not_last(&self, what: &str) -> candle_core::Error {
        let (index, count) = self
            .stage
            .as_ref()
            .map_or((0, 1), |s| (s.index(), s.count()));
        candle_core::Error::msg(format!(
            "{}: {what} on pipeline stage {index} of {count} (layers {:?}), which has no final \
             norm or LM head: call forward_stage / forward_batch_stage on every stage and read \
             the logits on the last",
            self.config.architecture, self.layer_range
        ))
    }
}
