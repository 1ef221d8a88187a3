//! Key/value caches held outside the layers, one per sequence, so that one model can decode
//! many sequences at once (continuous batching): a [`KvCache`] is a sequence's keys and
//! values of every decoder layer, a [`LayerKvCache`] those of one attention layer.
//!
//! The caches hold this rank's KV heads only (`[1, local_kv_heads, positions, head_dim]`), so a
//! sequence's cache lives on every rank, each with its share.

use candle_core::{DType, Result, Tensor};
use std::sync::Arc;

/// Positions a cache's buffer holds at least, and the multiple its capacity is rounded to.
const CAPACITY_STEP: usize = 64;

/// One attention layer's cached keys and values for one sequence.
///
/// The keys and values live in buffers `[batch, kv_heads, capacity, head_dim]` that grow by
/// half when full (one copy), and each step's positions are written in place after the ones
/// held: appending costs the new positions, not the whole cache again (a concatenation per
/// step copied every cached position of every layer per token: 16 % of a 300-token SmolLM2
/// decode). Clones share the buffers until one of them appends, which then copies them first.
#[derive(Debug, Clone, Default)]
pub struct LayerKvCache {
    kv: Option<Buffers>,
    /// The precision the keys and values are kept in (`None`: the keys' own).
    dtype: Option<DType>,
}

/// The buffers, the positions they hold, and a token whose count says whether a clone shares
/// them.
#[derive(Debug, Clone)]
struct Buffers {
    k: Tensor,
    v: Tensor,
    len: usize,
    owners: Arc<()>,
}

impl LayerKvCache {
    /// An empty cache (a sequence at position 0).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty cache that keeps keys and values in `dtype` (`Some(DType::F16)`: half the
    /// memory, llama.cpp's default; `None`: as they come). The attention widens them back to
    /// its own precision (the CPU's fused attention as it reads them).
    pub fn with_dtype(dtype: Option<DType>) -> Self {
        Self { kv: None, dtype }
    }

    /// The precision keys and values are kept in, when it is set (`None`: as they come).
    pub fn storage_dtype(&self) -> Option<DType> {
        self.dtype
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.kv.as_ref().map_or(0, |b| b.len)
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions the buffers hold before they grow again.
    pub fn capacity(&self) -> usize {
        self.kv.as_ref().map_or(0, |b| b.k.dims()[2])
    }

    /// Forgets every position.
    pub fn clear(&mut self) {
        self.kv = None;
    }

    /// Appends this step's keys and values (`[batch, kv_heads, new, head_dim]`) and returns
    /// the whole cache (`[batch, kv_heads, positions, head_dim]`: views of the buffers, whose
    /// head stride is the capacity, so not contiguous when there are several heads; Candle's
    /// matmul takes them as they are).
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = match self.dtype {
            Some(dtype) if k.dtype() != dtype => (k.to_dtype(dtype)?, v.to_dtype(dtype)?),
            _ => (k.clone(), v.clone()),
        };
        let (k, v) = (&k, &v);
        let (b, h, new, d) = k.dims4()?;
        if v.dims() != k.dims() {
            candle_core::bail!(
                "KV cache: keys {:?} and values {:?} differ in shape",
                k.dims(),
                v.dims()
            )
        }
        let len = self.len();
        if let Some(buf) = &self.kv {
            let dims = buf.k.dims();
            if dims[0] != b || dims[1] != h || dims[3] != d || buf.k.dtype() != k.dtype() {
                candle_core::bail!(
                    "KV cache: appending keys of shape {:?} ({:?}) to a cache of shape {:?} \
                     ({:?}, {len} positions held; a cache belongs to one sequence of one layer)",
                    k.dims(),
                    k.dtype(),
                    [dims[0], dims[1], len, dims[3]],
                    buf.k.dtype()
                );
            }
        }
        let needed = len + new;
        let shared = self
            .kv
            .as_ref()
            .is_some_and(|buf| Arc::strong_count(&buf.owners) > 1);
        if shared || needed > self.capacity() {
            // New buffers (larger, or this clone's own), the held positions copied over.
            let capacity = needed
                .max(self.capacity() * 3 / 2)
                .next_multiple_of(CAPACITY_STEP);
            let zeros = || Tensor::zeros((b, h, capacity, d), k.dtype(), k.device());
            let (nk, nv) = (zeros()?, zeros()?);
            if let Some(buf) = &self.kv {
                nk.slice_set(&buf.k.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
                nv.slice_set(&buf.v.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
            }
            self.kv = Some(Buffers {
                k: nk,
                v: nv,
                len,
                owners: Arc::new(()),
            });
        }
        let buf = self.kv.as_mut().expect("buffers allocated above");
        buf.k.slice_set(&k.contiguous()?, 2, len)?;
        buf.v.slice_set(&v.contiguous()?, 2, len)?;
        buf.len = needed;
        Ok((buf.k.narrow(2, 0, needed)?, buf.v.narrow(2, 0, needed)?))
    }
}

/// The value of a `--kv-cache-dtype` flag (vLLM's name): `auto` (the activations'
/// precision, `KvCacheDtype(None)`), `f32`, `f16` or `bf16`; anything else is an error naming
/// the choices. What [`CausalLm::set_kv_cache_dtype`](crate::models::CausalLm::set_kv_cache_dtype)
/// takes is its `.0`.
///
/// ```
/// use candle_tp::nn::KvCacheDtype;
/// assert_eq!("f16".parse::<KvCacheDtype>().unwrap().0, Some(candle_core::DType::F16));
/// assert_eq!("auto".parse::<KvCacheDtype>().unwrap().0, None);
/// assert!("fp8".parse::<KvCacheDtype>().unwrap_err().contains("auto, f32, f16 or bf16"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvCacheDtype(pub Option<DType>);

impl std::str::FromStr for KvCacheDtype {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(Self(match s {
            "auto" => None,
            "f32" => Some(DType::F32),
            "f16" => Some(DType::F16),
            "bf16" => Some(DType::BF16),
            _ => {
                return Err(format!(
                    "unknown KV cache dtype '{s}': expected auto, f32, f16 or bf16"
                ))
            }
        }))
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
        Self::with_dtype(num_layers, None)
    }

    /// An empty cache for `num_layers` decoder layers that keeps keys and values in `dtype`
    /// ([`LayerKvCache::with_dtype`]).
    pub fn with_dtype(num_layers: usize, dtype: Option<DType>) -> Self {
        Self {
            layers: vec![LayerKvCache::with_dtype(dtype); num_layers],
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn step(seed: u64, new: usize) -> Result<(Tensor, Tensor)> {
        let k = crate::rng::seeded_uniform(&[1, 3, new, 4], seed, 1.0, &Device::Cpu)?;
        let v = crate::rng::seeded_uniform(&[1, 3, new, 4], seed + 1, 1.0, &Device::Cpu)?;
        Ok((k, v))
    }

    fn same(a: &Tensor, b: &Tensor) -> Result<()> {
        let (a, b): (Vec<f32>, Vec<f32>) =
            (a.flatten_all()?.to_vec1()?, b.flatten_all()?.to_vec1()?);
        assert_eq!(a, b);
        Ok(())
    }

    /// Appends through several growths give what concatenating every step gives, and a clone
    /// keeps its own positions when both it and the original append.
    #[test]
    fn appends_equal_the_concatenation_and_clones_do_not_share_writes() -> Result<()> {
        let mut cache = LayerKvCache::new();
        let (mut all_k, mut all_v) = step(0, 5)?;
        cache.append(&all_k, &all_v)?;
        let mut fork = None;
        for i in 1..90u64 {
            let (k, v) = step(2 * i, 1 + (i as usize % 3))?;
            all_k = Tensor::cat(&[&all_k, &k], 2)?;
            all_v = Tensor::cat(&[&all_v, &v], 2)?;
            let (ck, cv) = cache.append(&k, &v)?;
            same(&ck, &all_k)?;
            same(&cv, &all_v)?;
            assert!(
                cache.capacity() >= cache.len() && cache.capacity().is_multiple_of(CAPACITY_STEP)
            );
            if i == 40 {
                fork = Some((cache.clone(), all_k.clone(), all_v.clone()));
            }
        }
        assert!(cache.capacity() > CAPACITY_STEP, "the buffers grew");
        // The clone, taken at step 40, appends its own positions after the original went on.
        let (mut fork, fk, fv) = fork.expect("forked");
        let (k, v) = step(999, 2)?;
        let (ck, cv) = fork.append(&k, &v)?;
        same(&ck, &Tensor::cat(&[&fk, &k], 2)?)?;
        same(&cv, &Tensor::cat(&[&fv, &v], 2)?)?;
        // A clone and its original both appending at the same position, with room left in
        // the buffers (no growth to hide a shared write): each keeps its own.
        while cache.capacity() < cache.len() + 2 {
            let (k, v) = step(777, 1)?;
            all_k = Tensor::cat(&[&all_k, &k], 2)?;
            cache.append(&k, &v)?;
        }
        let mut twin = cache.clone();
        let (k1, v1) = step(1001, 1)?;
        let (ck, _) = cache.append(&k1, &v1)?;
        let (k2, v2) = step(1003, 1)?;
        let (tk, _) = twin.append(&k2, &v2)?;
        same(&ck, &Tensor::cat(&[&all_k, &k1], 2)?)?;
        same(&tk, &Tensor::cat(&[&all_k, &k2], 2)?)?;
        Ok(())
    }

    #[test]
    fn a_cache_refuses_other_shapes_and_dtypes() -> Result<()> {
        let mut cache = LayerKvCache::new();
        let (k, v) = step(0, 2)?;
        cache.append(&k, &v)?;
        let other = Tensor::zeros((1, 2, 1, 4), DType::F32, &Device::Cpu)?;
        let e = cache.append(&other, &other).unwrap_err().to_string();
        assert!(
            e.contains("[1, 2, 1, 4]") && e.contains("[1, 3, 2, 4]"),
            "{e}"
        );
        let half = k.to_dtype(DType::F16)?;
        assert!(cache.append(&half, &half).is_err());
        let e = cache.append(&k, &other).unwrap_err().to_string();
        assert!(e.contains("differ in shape"), "{e}");
        cache.clear();
        assert_eq!((cache.len(), cache.capacity()), (0, 0));
        Ok(())
    }
}
