//! Key/value caches held outside the layers, one per sequence, so that one model can decode
//! many sequences at once (continuous batching): a [`KvCache`] is a sequence's keys and
//! values of every decoder layer, a [`LayerKvCache`] those of one attention layer.
//!
//! The caches hold this rank's KV heads only (`[1, local_kv_heads, positions, head_dim]`), so a
//! sequence's cache lives on every rank, each with its share.

use candle_core::{Result, Tensor};

/// One attention layer's cached keys and values for one sequence.
#[derive(Debug, Clone, Default)]
pub struct LayerKvCache {
    kv: Option<(Tensor, Tensor)>,
}

impl LayerKvCache {
    /// An empty cache (a sequence at position 0).
    pub fn new() -> Self {
        Self::default()
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, _)| k.dims()[2])
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.kv.is_none()
    }

    /// Forgets every position.
    pub fn clear(&mut self) {
        self.kv = None;
    }

    /// Appends this step's keys and values (`[batch, kv_heads, new, head_dim]`) and returns
    /// the whole cache, contiguous.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = match &self.kv {
            None => (k.contiguous()?, v.contiguous()?),
            Some((ck, cv)) => {
                if ck.dims()[..2] != k.dims()[..2] || ck.dims()[3] != k.dims()[3] {
                    candle_core::bail!(
                        "KV cache: appending keys of shape {:?} to a cache of shape {:?} (a cache belongs to one sequence of one layer)",
                        k.dims(),
                        ck.dims()
                    );
                }
                (
                    Tensor::cat(&[ck, k], 2)?.contiguous()?,
                    Tensor::cat(&[cv, v], 2)?.contiguous()?,
                )
            }
        };
        self.kv = Some((k.clone(), v.clone()));
        Ok((k, v))
    }
}

/// One sequence's KV caches, one per decoder layer (what
/// [`CausalLm::forward_batch`](crate::models::CausalLm::forward_batch) extends).
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<LayerKvCache>,
}

impl KvCache {
    /// An empty cache for a model of `num_layers` decoder layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![LayerKvCache::new(); num_layers],
        }
    }

    /// Positions held (the position of the sequence's next token).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerKvCache::len)
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Decoder layers covered.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Forgets every position of every layer.
    pub fn clear(&mut self) {
        self.layers.iter_mut().for_each(LayerKvCache::clear);
    }

    /// Layer `i`'s cache.
    pub fn layer_mut(&mut self, i: usize) -> Option<&mut LayerKvCache> {
        self.layers.get_mut(i)
    }
}
