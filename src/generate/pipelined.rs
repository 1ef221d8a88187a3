//! Sampling on a pipeline: the last stage draws the token from its logits and hands it to
//! every other stage, so that every rank of every stage runs the same decode loop.

use candle_core::{Result, Tensor};

use super::DistributedSampler;
use crate::models::CausalLm;

impl DistributedSampler {
    /// The next token on every rank of every pipeline stage, from what
    /// [`CausalLm::forward_stage`] returned there: the last stage samples `logits` (this rank's
    /// slice, leading dimensions of size 1 accepted) and sends the token to the other stages,
    /// which pass `None`. Without a pipeline it is [`sample`](Self::sample).
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use candle_tp::generate::{DistributedSampler, SamplingParams};
    /// use candle_tp::models::CausalLm;
    /// # fn run(model: &mut CausalLm, prompt: &[u32]) -> candle_core::Result<Vec<u32>> {
    /// let mut sampler = DistributedSampler::new(SamplingParams::greedy());
    /// let x = Tensor::new(prompt, &Device::Cpu)?.unsqueeze(0)?;
    /// let logits = model.forward_stage(&x, 0)?; // Some on the last stage, None elsewhere
    /// let first = sampler.sample_stage(logits.as_ref(), model)?; // every rank: the same token
    /// # Ok(vec![first]) }
    /// ```
    pub fn sample_stage(&mut self, logits: Option<&Tensor>, model: &CausalLm) -> Result<u32> {
        let mut token = [0u32];
        match (logits, model.lm_head()) {
            (Some(l), Some(head)) => token[0] = self.sample(l, head)?,
            (None, None) => {}
            (Some(_), None) | (None, Some(_)) => {
                candle_core::bail!(
                "{}: sample_stage needs the logits exactly on the stage with the LM head (this \
                 rank holds layers {:?}, {} the head, and was given {} logits)",
                model.config().architecture,
                model.layer_range(),
                if model.has_logits() { "with" } else { "without" },
                if logits.is_some() { "some" } else { "no" },
            )
            }
        }
        if let Some(stage) = model.pipeline() {
            stage.share_from_last(&mut token)?;
        }
        Ok(token[0])
    }
}
