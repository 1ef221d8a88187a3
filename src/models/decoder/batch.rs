//! Many sequences through one [`CausalLm`] pass (continuous batching): every sequence brings
//! its own [`KvCache`] and its new tokens (a prefill chunk or one decoded token); the
//! embedding, norms, projections, MLPs and LM head run once over all the rows, and only the
//! rotary embedding, cache append and attention run per sequence, each at its own position.

use candle_core::{IndexOp, Result, Tensor};

use super::CausalLm;
use crate::nn::{KvCache, LayerKvCache};

/// One sequence's share of a batched step: its new tokens and its cache (which continues at
/// position `cache.len()` and grows by `tokens.len()`).
#[derive(Debug)]
pub struct SeqStep<'a> {
    /// The new tokens (at least one).
    pub tokens: &'a [u32],
    /// The sequence's KV cache (from [`CausalLm::new_kv_cache`]).
    pub cache: &'a mut KvCache,
}

impl CausalLm {
    /// An empty KV cache for one sequence of this model, in the precision
    /// [`CausalLm::set_kv_cache_dtype`] chose.
    pub fn new_kv_cache(&self) -> KvCache {
        KvCache::with_dtype(self.layers.len(), self.kv_cache_dtype)
    }

    /// Keeps the keys and values of the caches [`CausalLm::new_kv_cache`] makes from now on
    /// in `dtype` (`Some(DType::F16)`: half the memory per sequence, as llama.cpp's default
    /// `-ctk f16 -ctv f16` and vLLM's `--kv-cache-dtype`; `None`: the activations' precision,
    /// the default). Attention widens them back (exactly), so only the stored keys and values
    /// are rounded. On the CPU the fused attention reads an f16 cache as it is (AVX2's
    /// `vcvtph2ps`), half the bytes of f32: SmolLM2 at 16 streams, 4-1004 cached positions,
    /// 20.6-21.0 against 25.9-26.0 ms per step; bf16 takes the general path, slower. Every
    /// rank must choose the same. The single-sequence API ([`CausalLm::forward`]) keeps its
    /// own caches as they are.
    ///
    /// ```no_run
    /// # fn f(model: &mut candle_tp::models::CausalLm) {
    /// model.set_kv_cache_dtype(Some(candle_core::DType::F16));
    /// let cache = model.new_kv_cache();
    /// # }
    /// ```
    pub fn set_kv_cache_dtype(&mut self, dtype: Option<candle_core::DType>) {
        self.kv_cache_dtype = dtype;
    }

    /// The precision [`CausalLm::new_kv_cache`] keeps keys and values in (`None`: the
    /// activations').
    pub fn kv_cache_dtype(&self) -> Option<candle_core::DType> {
        self.kv_cache_dtype
    }

    /// Runs every sequence's new tokens in one pass and returns, for each sequence, this
    /// rank's slice of the logits at its last new token: `[seqs.len(), vocab_part]`, f32
    /// (sample each row with a [`DistributedSampler`](crate::generate::DistributedSampler)).
    ///
    /// Every rank must call it with the same tokens in the same order. A sequence alone gives
    /// what [`CausalLm::forward`] gives for it. On a pipeline stage other than the last, an
    /// error after the activations went on (use [`forward_batch_stage`](Self::forward_batch_stage)).
    pub fn forward_batch(&mut self, seqs: &mut [SeqStep<'_>]) -> Result<Tensor> {
        let logits = self.forward_batch_stage(seqs)?;
        self.on_last_stage(logits, "forward_batch")
    }

    /// [`forward_batch`](Self::forward_batch) on every stage of a pipeline: the logits on the
    /// last stage, `None` on the others (which hand their activations on). Every rank of every
    /// stage calls it with the same tokens; each stage's caches hold its own layers.
    pub fn forward_batch_stage(&mut self, seqs: &mut [SeqStep<'_>]) -> Result<Option<Tensor>> {
        let arch = &self.config.architecture;
        if seqs.is_empty() {
            candle_core::bail!("{arch}: forward_batch with no sequence");
        }
        let max_pos = self.config.max_position_embeddings;
        for (i, s) in seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                candle_core::bail!("{arch}: sequence {i} of the batch has no new token");
            }
            if s.cache.num_layers() != self.layers.len() {
                candle_core::bail!(
                    "{arch}: sequence {i}'s KV cache has {} layers, the model {}",
                    s.cache.num_layers(),
                    self.layers.len()
                );
            }
            if s.cache.len() + s.tokens.len() > max_pos {
                candle_core::bail!(
                    "{arch}: sequence {i} would reach {} positions ({} cached + {} new), the model holds at most {max_pos}",
                    s.cache.len() + s.tokens.len(),
                    s.cache.len(),
                    s.tokens.len()
                );
            }
        }
        let ids: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let device = self.ropes[0].device().clone();
        let rows = ids.len();
        let ids = Tensor::new(ids.as_slice(), &device)?.unsqueeze(0)?;
        // One hand-off to rayon's pool for the whole pass (see `crate::pool`).
        crate::pool::on_worker(|| {
            let mut x = self.stage_input(&ids, &[1, rows, self.config.hidden_size])?;
            for (i, layer) in self.layers.iter_mut().enumerate() {
                let mut caches: Vec<(usize, &mut LayerKvCache)> = seqs
                    .iter_mut()
                    .map(|s| {
                        let n = s.tokens.len();
                        (
                            n,
                            s.cache.layer_mut(i).expect("checked: one cache per layer"),
                        )
                    })
                    .collect();
                x = layer.forward_with(&x, &self.ropes, |a, h, rope| {
                    a.forward_batch(h, rope, &mut caches)
                })?;
            }
            let Some(h) = self.stage_output(x)? else {
                return Ok(None);
            };
            let h = h.i(0)?;
            let mut last = Vec::with_capacity(seqs.len());
            let mut end = 0u32;
            for s in seqs.iter() {
                end += s.tokens.len() as u32;
                last.push(end - 1);
            }
            let rows = Tensor::new(last.as_slice(), &device)?;
            let h = h.index_select(&rows, 0)?.contiguous()?;
            self.logits(&h, false).map(Some)
        })
    }
}
