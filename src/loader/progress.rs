//! Progress of a model load, for a caller that wants to draw it (a progress bar in
//! `examples/generate.rs`). The library prints nothing itself.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Shape, Tensor};

use super::source::{RangeRequest, TensorSource, WeightShard};

/// Called after each tensor a rank reads: `(tensors read so far, tensors in the checkpoint,
/// name)`. The total is what the source holds (a model may read fewer: tied embeddings); when
/// the source cannot tell, it grows with the count.
pub type LoadProgress = Arc<dyn Fn(usize, usize, &str) + Send + Sync>;

/// A [`TensorSource`] that reports every tensor read through another one to a
/// [`LoadProgress`] callback. Reading a tensor twice (whole, then a slice) counts once.
pub struct ProgressSource {
    inner: Arc<dyn TensorSource>,
    total: usize,
    seen: Mutex<HashSet<String>>,
    progress: LoadProgress,
}

impl ProgressSource {
    /// Wraps `inner`; `total` is the count reported as the end (see [`LoadProgress`]).
    pub fn new(inner: Arc<dyn TensorSource>, total: usize, progress: LoadProgress) -> Self {
        Self {
            inner,
            total,
            seen: Mutex::new(HashSet::new()),
            progress,
        }
    }

    fn report<T>(&self, name: &str, result: Result<T>) -> Result<T> {
        if result.is_ok() {
            let done = {
                let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
                seen.insert(name.to_string());
                seen.len()
            };
            (self.progress)(done, self.total.max(done), name);
        }
        result
    }
}

impl TensorSource for ProgressSource {
    fn shape(&self, name: &str) -> Result<Option<Shape>> {
        self.inner.shape(name)
    }

    fn load(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        self.report(name, self.inner.load(name, dtype, device))
    }

    fn load_ranges(&self, req: &RangeRequest<'_>) -> Result<Tensor> {
        self.report(req.name, self.inner.load_ranges(req))
    }

    fn load_weight(&self, req: &RangeRequest<'_>) -> Result<WeightShard> {
        self.report(req.name, self.inner.load_weight(req))
    }

    fn split_unit(&self, name: &str, dim: usize) -> Result<usize> {
        self.inner.split_unit(name, dim)
    }

    fn num_tensors(&self) -> Option<usize> {
        self.inner.num_tensors()
    }
}
