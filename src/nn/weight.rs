//! [`ParallelWeight`]: the local weight of a parallel layer, dense or quantized.
//!
//! Every parallel layer (`ColumnParallelLinear`, `RowParallelLinear`,
//! `VocabParallelEmbedding`, `ParallelLmHead`) holds its shard as a `ParallelWeight`, chosen
//! by what the source holds: a dense `candle_nn::Linear` (candle-nn's matmul; for small CPU inference inputs
//! in bf16/f16, or in f32 after [`set_batch_invariant_matmul`], the crate's small-m kernel), or
//! GGUF blocks multiplied by [`QuantMatMul`] (the crate's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K kernels, Candle's
//! `QMatMul` for the other types; f64 sums for row-parallel layers). So each layer type and each model is written
//! once for both.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::Linear;

use crate::loader::WeightShard;
use crate::quant::QuantMatMul;

static TIMING: AtomicBool = AtomicBool::new(false);
static MATMUL_NS: AtomicU64 = AtomicU64::new(0);

/// Starts (or stops) adding the wall time of every [`ParallelWeight`] matmul in this process
/// to [`matmul_time`]: the profile of a decode step (matmuls against everything else). Off by
/// default; when off a matmul pays one relaxed atomic load.
pub fn set_matmul_timing(on: bool) {
    TIMING.store(on, Ordering::Relaxed);
}

static BATCH_INVARIANT_F32: AtomicBool = AtomicBool::new(false);

/// Sends dense f32 inference products of at most 16 rows on the CPU to the crate's
/// batch-invariant small-m kernel ([`crate::quant::matmul_small_m`]) instead of candle's
/// matmul, in this process (as PyTorch's `torch.backends` switches do). On, a sequence's
/// logits are the same bits alone or in a batch of 16, and a batch of 2-16 rows reads each
/// weight once (candle 0.11 packs the weight for every product of 2+ rows: 2-2.7× slower);
/// results differ from candle-nn's by f32 rounding. Off (the default), every f32 product is
/// candle-nn's, bit for bit. `candle-tp-serve`, `examples/generate` and the decode
/// benchmarks turn it on. bf16 and f16 products of at most 16 rows always take the small-m
/// kernel (candle widens the whole weight to f32 on every call); products that record
/// gradients never do.
pub fn set_batch_invariant_matmul(on: bool) {
    BATCH_INVARIANT_F32.store(on, Ordering::Relaxed);
}

/// The matmul time accumulated since timing was switched on (all threads of the process).
pub fn matmul_time() -> Duration {
    Duration::from_nanos(MATMUL_NS.load(Ordering::Relaxed))
}

/// A quantized weight `[out, in]` (GGUF blocks along `in`) and an optional dense bias.
#[derive(Debug, Clone)]
pub struct QuantizedWeight {
    /// The blocks as the source gave them; `None` where the matmul keeps the weight in a
    /// layout of its own ([`QuantMatMul::holds_weight`]: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and
    /// Q6_K on the CPU), so that it is in memory once.
    qtensor: Option<Arc<QTensor>>,
    dtype: GgmlDType,
    device: candle_core::Device,
    matmul: QuantMatMul,
    bias: Option<Tensor>,
}

impl QuantizedWeight {
    /// The blocks as the source gave them, unless the matmul keeps the weight in a layout of
    /// its own (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K on the CPU, repacked four rows at a time:
    /// `None`).
    pub fn qtensor(&self) -> Option<&Arc<QTensor>> {
        self.qtensor.as_ref()
    }

    /// `x Wᵀ`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K through the crate's SIMD kernels ([`QuantMatMul`]), every
    /// other type through Candle's `QMatMul` (x in f32; other dtypes are converted and back).
    fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        if dtype == DType::F32 {
            self.matmul.forward(&x.contiguous()?)
        } else {
            self.matmul
                .forward(&x.to_dtype(DType::F32)?.contiguous()?)?
                .to_dtype(dtype)
        }
    }
}

/// A layer's local weight: dense or quantized.
#[derive(Debug, Clone)]
pub enum ParallelWeight {
    /// A dense weight and bias: exactly `candle_nn::Linear`.
    Dense(Linear),
    /// GGUF blocks through [`QuantMatMul`].
    Quantized(QuantizedWeight),
}

impl ParallelWeight {
    /// A dense weight `[out, in]` and bias `[out]`.
    pub fn dense(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self::Dense(Linear::new(weight, bias))
    }

    /// A quantized weight `[out, in]` and dense bias `[out]`.
    pub fn quantized(qtensor: QTensor, bias: Option<Tensor>) -> Result<Self> {
        let qtensor = Arc::new(qtensor);
        let matmul = QuantMatMul::from_arc(qtensor.clone())?;
        Ok(Self::Quantized(QuantizedWeight {
            dtype: qtensor.dtype(),
            device: qtensor.device(),
            qtensor: (!matmul.holds_weight()).then_some(qtensor),
            matmul,
            bias,
        }))
    }

    /// The weight as the source gave it, with `bias`.
    pub fn from_shard(shard: WeightShard, bias: Option<Tensor>) -> Result<Self> {
        match shard {
            WeightShard::Dense(w) => Ok(Self::dense(w, bias)),
            WeightShard::Quantized(q) => Self::quantized(q, bias),
        }
    }

    /// Whether a product's rows do not depend on how many rows it has: the crate's quantized
    /// kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K on the CPU) sum every row
    /// exactly in f64 whatever the row count, while dense products and candle's `QMatMul`
    /// change kernels with it (the small-m kernel up to 16 rows, a GEMM beyond).
    pub fn rows_invariant(&self) -> bool {
        matches!(self, Self::Quantized(q) if q.matmul.holds_weight())
    }

    /// The same weight without its bias (a tied LM head shares the embedding's blocks).
    pub fn without_bias(&self) -> Self {
        match self {
            Self::Dense(l) => Self::dense(l.weight().clone(), None),
            Self::Quantized(q) => Self::Quantized(QuantizedWeight {
                bias: None,
                ..q.clone()
            }),
        }
    }

    /// `(out, in)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match self {
            Self::Dense(l) => l.weight().dims2(),
            Self::Quantized(q) => Ok(q.matmul.dims()),
        }
    }

    /// The dense weight, or an error naming the quantized type for quantized weights.
    pub fn dense_weight(&self) -> Result<&Tensor> {
        match self {
            Self::Dense(l) => Ok(l.weight()),
            Self::Quantized(q) => candle_core::bail!(
                "the layer holds a quantized {:?} weight of shape {:?}, not a dense tensor",
                q.dtype,
                q.matmul.dims()
            ),
        }
    }

    /// The bias.
    pub fn bias(&self) -> Option<&Tensor> {
        match self {
            Self::Dense(l) => l.bias(),
            Self::Quantized(q) => q.bias.as_ref(),
        }
    }

    /// The device the weight lives on.
    pub fn device(&self) -> candle_core::Device {
        match self {
            Self::Dense(l) => l.weight().device().clone(),
            Self::Quantized(q) => q.device.clone(),
        }
    }

    /// The ggml type of a quantized weight, `None` when dense.
    pub fn ggml_dtype(&self) -> Option<GgmlDType> {
        match self {
            Self::Dense(_) => None,
            Self::Quantized(q) => Some(q.dtype),
        }
    }

    /// Rows `ids` (flat, local row indices) of the weight as dense rows `[n, in]` in `dtype`:
    /// an embedding lookup that dequantizes only the rows it reads.
    pub fn rows(&self, ids: &Tensor, dtype: DType) -> Result<Tensor> {
        match self {
            Self::Dense(l) => l.weight().index_select(ids, 0),
            Self::Quantized(q) => match &q.qtensor {
                Some(t) => t.embedding(ids)?.to_dtype(dtype),
                None => q.matmul.dequantize_rows(ids)?.to_dtype(dtype),
            },
        }
    }
}

impl Module for ParallelWeight {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if TIMING.load(Ordering::Relaxed) {
            let t0 = Instant::now();
            let y = self.forward_untimed(x);
            MATMUL_NS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            return y;
        }
        self.forward_untimed(x)
    }
}

impl ParallelWeight {
    /// The product summed in f64, as an f64 tensor: for a quantized weight without bias whose
    /// type has an f64 kernel ([`QuantMatMul::forward_f64`]), on the CPU; `None` otherwise
    /// (use `forward`). Row-parallel layers all-reduce this in f64, so their output is the
    /// same at every world size.
    pub fn forward_f64(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let Self::Quantized(q) = self else {
            return Ok(None);
        };
        if q.bias.is_some() || !x.device().is_cpu() {
            return Ok(None);
        }
        if TIMING.load(Ordering::Relaxed) {
            let t0 = Instant::now();
            let y = q.matmul.forward_f64(x);
            MATMUL_NS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            return y;
        }
        q.matmul.forward_f64(x)
    }

    fn forward_untimed(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(l) if use_small_m(l.weight(), x) => {
                let y = crate::quant::matmul_small_m(x, l.weight())?;
                match l.bias() {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
            Self::Dense(l) => l.forward(x),
            Self::Quantized(q) => {
                let y = q.matmul(x)?;
                match &q.bias {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
        }
    }
}

/// Whether a dense product goes to the crate's small-m kernel (`crate::quant::matmul_small_m`):
/// bf16 or f16 (f32 too after [`set_batch_invariant_matmul`]) weight and input of one dtype
/// on the CPU, at most
/// [`crate::quant::SMALL_M_MAX_ROWS`] input rows (a decode step), and no gradient to record
/// (the kernel is not differentiable: training keeps candle's matmul).
fn use_small_m(w: &Tensor, x: &Tensor) -> bool {
    let f32_too = BATCH_INVARIANT_F32.load(Ordering::Relaxed);
    (matches!(w.dtype(), DType::BF16 | DType::F16) || (f32_too && w.dtype() == DType::F32))
        && x.dtype() == w.dtype()
        && w.device().is_cpu()
        && x.device().is_cpu()
        && !w.track_op()
        && !x.track_op()
        && x.elem_count() <= crate::quant::SMALL_M_MAX_ROWS * w.dim(1).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// A decode-sized product with a trainable weight or input must still record its
    /// gradient (the small-m kernel does not): dW and dx equal candle's own matmul's.
    #[test]
    fn small_products_keep_their_gradients() -> Result<()> {
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::BF16] {
            let w0 = Tensor::randn(0f32, 1.0, (6, 8), &dev)?.to_dtype(dtype)?;
            let x0 = Tensor::randn(0f32, 1.0, (2, 8), &dev)?.to_dtype(dtype)?;
            let (w, x) = (Var::from_tensor(&w0)?, Var::from_tensor(&x0)?);
            let y = ParallelWeight::dense(w.as_tensor().clone(), None).forward(x.as_tensor())?;
            let grads = y.sqr()?.sum_all()?.backward()?;
            let (w2, x2) = (Var::from_tensor(&w0)?, Var::from_tensor(&x0)?);
            let y2 = x2.as_tensor().matmul(&w2.as_tensor().t()?)?;
            let want = y2.sqr()?.sum_all()?.backward()?;
            for (name, got, reference) in [
                ("dW", grads.get(&w), want.get(&w2)),
                ("dx", grads.get(&x), want.get(&x2)),
            ] {
                let got = got.unwrap_or_else(|| panic!("{dtype:?}: no {name} recorded"));
                let d = (got.to_dtype(DType::F32)? - reference.unwrap().to_dtype(DType::F32)?)?
                    .abs()?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                assert!(
                    d.iter().all(|v| v.is_finite() && *v <= 0.05),
                    "{dtype:?} {name}: {d:?}"
                );
            }
        }
        Ok(())
    }
}
