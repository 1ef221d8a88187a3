//! Tensor-parallel Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2): the shared
//! [`CausalLm`] with Llama's settings ([`LlamaConfig::decoder`]), keeping the typed
//! [`LlamaConfig`] at hand.

use candle_core::{Result, Tensor};

use crate::comm::ProcessGroup;
use crate::loader::ShardedVarBuilder;
use crate::models::checkpoint::FromCheckpoint;
use crate::models::{CausalLm, LlamaConfig};
use crate::nn::{ParallelAttention, ParallelLmHead};

/// A Llama-family causal LM whose weights are split across the ranks of a group. It loads
/// through [`FromCheckpoint`] (`Llama::from_dir`, `from_gguf`, `from_path`).
///
/// Every rank of the group calls [`Llama::forward`] with the same ids; each gets its slice of
/// the vocabulary's logits (or, with [`Llama::forward_gathered`], the full logits).
#[derive(Debug, Clone)]
pub struct Llama {
    inner: CausalLm,
    config: LlamaConfig,
}

impl Llama {
    /// Builds the model from `vb` (the checkpoint root: `model.embed_tokens`, `model.layers.N`,
    /// `model.norm`, `lm_head`), splitting over `vb.pg()`.
    pub fn load(cfg: &LlamaConfig, vb: ShardedVarBuilder) -> Result<Self> {
        Ok(Self {
            inner: CausalLm::load(&cfg.decoder(), vb)?,
            config: cfg.clone(),
        })
    }

    /// The hidden state after the final norm at the last position, `[batch, hidden]`,
    /// running `ids` `[batch, seq]` at positions `index_pos..` and extending the KV caches.
    pub fn forward_hidden(&mut self, ids: &Tensor, index_pos: usize) -> Result<Tensor> {
        self.inner.forward_hidden(ids, index_pos)
    }

    /// This rank's slice of the last position's logits, `[batch, vocab_part]`, in f32.
    pub fn forward(&mut self, ids: &Tensor, index_pos: usize) -> Result<Tensor> {
        self.inner.forward(ids, index_pos)
    }

    /// The last position's full logits `[batch, vocab]` (all-gathered), in f32.
    pub fn forward_gathered(&mut self, ids: &Tensor, index_pos: usize) -> Result<Tensor> {
        self.inner.forward_gathered(ids, index_pos)
    }

    /// Empties every layer's KV cache (a new sequence starts at position 0).
    pub fn clear_kv_cache(&mut self) {
        self.inner.clear_kv_cache()
    }

    /// The LM head (its vocabulary partition is the one of [`Llama::forward`]'s output);
    /// `None` on a pipeline stage other than the last.
    pub fn lm_head(&self) -> Option<&ParallelLmHead> {
        self.inner.lm_head()
    }

    /// The attention layer of decoder layer `i`, if it exists.
    pub fn attention(&self, i: usize) -> Option<&ParallelAttention> {
        self.inner.attention(i)
    }

    /// The model's configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The group the model is split over.
    pub fn pg(&self) -> &ProcessGroup {
        self.inner.pg()
    }

    /// The shared decoder underneath.
    pub fn decoder(&self) -> &CausalLm {
        &self.inner
    }
}

impl FromCheckpoint for Llama {
    fn from_config_json(text: &str, origin: &str, vb: ShardedVarBuilder) -> Result<Self> {
        Self::load(&LlamaConfig::from_json(text, origin)?, vb)
    }
}
