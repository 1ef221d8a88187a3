//! Where parallel layers get their weights from.
//!
//! A [`TensorSource`] hands out whole tensors or slices of them along one dimension. The
//! sharded var builder asks each source only for the rank's slice, so a source that can read
//! part of a tensor (the memory-mapped safetensors source) never materialises the whole model
//! on any rank.

use std::ops::Range;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Result, Shape, Tensor};

/// A weight as a source holds it: dense (a `Tensor` in the model dtype) or quantized (GGUF
/// blocks in a `QTensor`, multiplied with `quant::QuantMatMul`).
#[derive(Debug)]
pub enum WeightShard {
    /// A dense tensor.
    Dense(Tensor),
    /// GGUF blocks, `[rows, cols]` with whole blocks along the columns.
    Quantized(QTensor),
}

impl WeightShard {
    /// The shape of the weight.
    pub fn dims(&self) -> &[usize] {
        match self {
            Self::Dense(t) => t.dims(),
            Self::Quantized(q) => q.shape().dims(),
        }
    }
}

/// What to read of one tensor: the elements of `name` whose index along `dim` lies in
/// `ranges` (concatenated in the order given), converted to `dtype`, on `device`.
///
/// One range is a plain shard; several are the pieces of a fused tensor (for example the
/// rank's q, k and v rows of a `qkv_proj`).
#[derive(Debug, Clone, Copy)]
pub struct RangeRequest<'a> {
    /// The tensor's full name in the source.
    pub name: &'a str,
    /// The dimension the ranges index.
    pub dim: usize,
    /// The ranges along `dim`, in the order they are concatenated.
    pub ranges: &'a [Range<usize>],
    /// The element type of the result.
    pub dtype: DType,
    /// Where the result lives.
    pub device: &'a Device,
}

impl RangeRequest<'_> {
    /// Narrows `full` (the whole tensor) to the request's ranges: [`slice_ranges`].
    pub fn slice(&self, full: &Tensor) -> Result<Tensor> {
        slice_ranges(full, self.name, self.dim, self.ranges)
    }
}

/// A named collection of tensors that can be read whole or by slices along one dimension.
///
/// Implementations: [`TensorMapSource`] (tensors already in memory, e.g. a dense model's
/// weights in tests), [`VarBuilderSource`] (any `candle_nn::VarBuilder`), and the
/// memory-mapped safetensors source of the loader.
pub trait TensorSource: Send + Sync {
    /// The full (unsharded) shape of `name`, or `None` when the source has no such tensor.
    fn shape(&self, name: &str) -> Result<Option<Shape>>;

    /// Loads the whole tensor `name`, converted to `dtype`, on `device`.
    fn load(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor>;

    /// Loads what `req` asks for (see [`RangeRequest`]). A source that can read byte ranges
    /// reads only those; this default loads the whole tensor and narrows it.
    fn load_ranges(&self, req: &RangeRequest<'_>) -> Result<Tensor> {
        req.slice(&self.load(req.name, req.dtype, req.device)?)
    }

    /// Loads what `req` asks for of a 2-D weight as the source stores it: quantized blocks
    /// where the source holds a quantized tensor (a GGUF file), otherwise a dense tensor as
    /// [`TensorSource::load_ranges`] gives it.
    fn load_weight(&self, req: &RangeRequest<'_>) -> Result<WeightShard> {
        Ok(WeightShard::Dense(self.load_ranges(req)?))
    }

    /// The number of columns that a split of `name` along `dim` should keep together so that
    /// it falls on whole quantization blocks (1 for dense tensors).
    fn split_unit(&self, name: &str, dim: usize) -> Result<usize> {
        let _ = (name, dim);
        Ok(1)
    }

    /// How many tensors the source holds, when it knows (for progress reports).
    fn num_tensors(&self) -> Option<usize> {
        None
    }
}

/// Narrows `full` to `ranges` along `dim` and concatenates them, with errors that name the
/// tensor and the sizes.
pub fn slice_ranges(
    full: &Tensor,
    name: &str,
    dim: usize,
    ranges: &[Range<usize>],
) -> Result<Tensor> {
    let dims = full.dims();
    if dim >= dims.len() {
        candle_core::bail!(
            "tensor '{name}' of shape {:?} has no dimension {dim} to shard",
            dims
        );
    }
    if ranges.is_empty() {
        candle_core::bail!("tensor '{name}': asked for an empty list of ranges along dim {dim}");
    }
    let mut parts = Vec::with_capacity(ranges.len());
    for r in ranges {
        if r.start > r.end || r.end > dims[dim] {
            candle_core::bail!(
                "tensor '{name}' of shape {:?}: range {}..{} along dim {dim} is out of bounds (size {})",
                dims,
                r.start,
                r.end,
                dims[dim]
            );
        }
        parts.push(full.narrow(dim, r.start, r.end - r.start)?);
    }
    if parts.len() == 1 {
        // A copy of the slice, not a view: the rank keeps its share, not the whole tensor.
        return parts.pop().expect("one part").contiguous();
    }
    Tensor::cat(&parts, dim)
}

/// Tensors held in memory, keyed by name: the dense model's weights in tests, or weights built
/// by hand.
#[derive(Debug, Clone, Default)]
pub struct TensorMapSource {
    tensors: std::collections::HashMap<String, Tensor>,
}

impl TensorMapSource {
    /// Wraps a map of full tensors.
    pub fn new(tensors: std::collections::HashMap<String, Tensor>) -> Self {
        Self { tensors }
    }

    /// Adds or replaces one tensor.
    pub fn insert(&mut self, name: impl Into<String>, tensor: Tensor) {
        self.tensors.insert(name.into(), tensor);
    }
}

impl TensorSource for TensorMapSource {
    fn shape(&self, name: &str) -> Result<Option<Shape>> {
        Ok(self.tensors.get(name).map(|t| t.shape().clone()))
    }

    fn num_tensors(&self) -> Option<usize> {
        Some(self.tensors.len())
    }

    fn load(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        match self.tensors.get(name) {
            Some(t) => t.to_dtype(dtype)?.to_device(device),
            None => candle_core::bail!("tensor '{name}' is not in the tensor map"),
        }
    }

    fn load_ranges(&self, req: &RangeRequest<'_>) -> Result<Tensor> {
        // Slice before converting, so only the rank's part is converted and copied.
        match self.tensors.get(req.name) {
            Some(t) => req.slice(t)?.to_dtype(req.dtype)?.to_device(req.device),
            None => candle_core::bail!("tensor '{}' is not in the tensor map", req.name),
        }
    }
}

/// Any `candle_nn::VarBuilder` as a source (whole tensors, sliced after loading). Its shape
/// queries need the tensor itself, so prefer a specialised source for large checkpoints.
#[derive(Clone)]
pub struct VarBuilderSource {
    vb: candle_nn::VarBuilder<'static>,
}

impl VarBuilderSource {
    /// Wraps a var builder; its prefix is ignored, names are full paths.
    pub fn new(vb: candle_nn::VarBuilder<'static>) -> Self {
        Self { vb: vb.root() }
    }
}

impl TensorSource for VarBuilderSource {
    fn shape(&self, name: &str) -> Result<Option<Shape>> {
        if !self.vb.contains_tensor(name) {
            return Ok(None);
        }
        Ok(Some(self.vb.get_unchecked(name)?.shape().clone()))
    }

    fn load(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        self.vb.get_unchecked_dtype(name, dtype)?.to_device(device)
    }
}
