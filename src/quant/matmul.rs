//! `QuantMatMul`: `y = x · Wᵀ` with W a GGUF-quantized [`QTensor`], the crate's kernels where
//! it has one (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K on CPU) and candle's [`QMatMul`] everywhere
//! else.

use super::input_rows::input_rows;
use super::types::{CpuProduct, QuantType};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Module, Result, Shape, Tensor};
use candle_tp_kernels::f64_matmul::{check_matmul, fill_by_weight_rows};
use candle_tp_kernels::q4_0::BlockQ4_0;
use candle_tp_kernels::q4_0x4::RepackedQ4_0;
use candle_tp_kernels::q4_1::{self, BlockQ4_1, Kernel, QK4_1};
use candle_tp_kernels::q5_0::{self, BlockQ5_0, QK5_0};
use candle_tp_kernels::q5_1::{self, BlockQ5_1, QK5_1};
use candle_tp_kernels::q8_0::{quantize_row_q8_0, BlockQ8_0, QK8_0};
use candle_tp_kernels::q8_1::quantize_row_q8_1_into;
use candle_tp_kernels::repack::{PreparedActs, RepackedMatMul};
use std::sync::Arc;

/// `dst[m, n] = x[m, k] · W[n, k]ᵀ` for a Q4_1 weight given as its `n * k / 32` blocks (the
/// bytes of a GGUF tensor of shape `[n, k]`, rows of blocks) and f32 activations.
///
/// Each activation row is quantized to Q8_1 once; the weight rows are split over the current
/// rayon pool (`RAYON_NUM_THREADS`) in ranges of whole rows, four rows at a time sharing each
/// activation load, every activation row (`m > 1`, prefill) reusing the four rows while they
/// are in L1, four activation rows at a time against each unpacked weight block (the same
/// values bit for bit as one row at a time). `k` may be any multiple of 32 (odd block counts
/// included).
pub fn matmul_q4_1(
    kernel: Kernel,
    dims: (usize, usize, usize),
    x: &[f32],
    w: &[BlockQ4_1],
    dst: &mut [f32],
) -> Result<()> {
    matmul_rows(
        "Q4_1 matmul",
        kernel,
        dims,
        (x, w, dst),
        QK4_1,
        quantize_row_q8_1_into,
        q4_1::rows_dot,
    )
}

/// As [`matmul_q4_1`] for a Q4_0 weight (activations quantized to Q8_0, candle's rounding),
/// summed in f64 and rounded (`candle_tp_kernels::q4_0x4`). The weight is repacked four rows
/// at a time on every call: [`QuantMatMul`] repacks once, when it is built.
pub fn matmul_q4_0(
    kernel: Kernel,
    (m, k, n): (usize, usize, usize),
    x: &[f32],
    w: &[BlockQ4_0],
    dst: &mut [f32],
) -> Result<()> {
    RepackedQ4_0::new(w, n, k)?.matmul_f32(kernel, m, x, dst)
}

/// As [`matmul_q4_1`] for a Q5_0 weight (activations quantized to Q8_0, candle's rounding).
pub fn matmul_q5_0(
    kernel: Kernel,
    dims: (usize, usize, usize),
    x: &[f32],
    w: &[BlockQ5_0],
    dst: &mut [f32],
) -> Result<()> {
    matmul_rows(
        "Q5_0 matmul",
        kernel,
        dims,
        (x, w, dst),
        QK5_0,
        quantize_q8_0_into,
        q5_0::rows_dot,
    )
}

/// As [`matmul_q4_1`] for a Q5_1 weight (activations quantized to Q8_1, candle's rounding).
pub fn matmul_q5_1(
    kernel: Kernel,
    dims: (usize, usize, usize),
    x: &[f32],
    w: &[BlockQ5_1],
    dst: &mut [f32],
) -> Result<()> {
    matmul_rows(
        "Q5_1 matmul",
        kernel,
        dims,
        (x, w, dst),
        QK5_1,
        quantize_row_q8_1_into,
        q5_1::rows_dot,
    )
}

/// Quantizes rows of activations to Q8_0 into a reused buffer (the `k` of
/// [`quantize_row_q8_1_into`]'s signature is not needed: the blocks run on across rows).
fn quantize_q8_0_into(x: &[f32], _k: usize, xq: &mut Vec<BlockQ8_0>) {
    xq.clear();
    xq.resize(x.len() / QK8_0, BlockQ8_0::ZERO);
    quantize_row_q8_0(x, xq);
}

/// The driver of the f32 block kernels: checks, quantizes the activations once, fills the
/// output by ranges of weight rows over rayon.
#[allow(clippy::type_complexity)]
fn matmul_rows<W: Sync, X: Sync>(
    what: &str,
    kernel: Kernel,
    (m, k, n): (usize, usize, usize),
    (x, w, dst): (&[f32], &[W], &mut [f32]),
    block: usize,
    quantize: impl Fn(&[f32], usize, &mut Vec<X>),
    rows_dot: fn(Kernel, &[W], usize, &[X], usize, usize, &mut [f32]),
) -> Result<()> {
    let kb = check_matmul(
        what,
        kernel,
        (m, k, n),
        block,
        (x.len(), w.len(), dst.len()),
    )?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        dst.fill(0.0); // empty sums
        return Ok(());
    }
    let mut xq = Vec::new();
    quantize(x, k, &mut xq);
    let xq = &xq[..];
    let fill = |row0: usize, out: &mut [f32]| rows_dot(kernel, w, kb, xq, m, row0, out);
    fill_by_weight_rows(n, m, dst, fill);
    Ok(())
}

/// The product of a repacked weight as a candle op (CPU, f32 input, f32 or f64 output;
/// inference only).
#[derive(Clone)]
struct RepackedOp {
    w: Arc<dyn RepackedMatMul>,
    kernel: Kernel,
    /// The f64 sums (`forward_f64`: a row-parallel layer's partials) instead of f32.
    f64_out: bool,
    /// The input, already quantized for this weight's type and kernel
    /// ([`super::share_activations`]).
    prepared: Option<Arc<PreparedActs>>,
}

impl RepackedOp {
    /// This op, with `xs` as prepared in the [`super::share_activations`] scope open on this
    /// thread, if any.
    fn with_shared(&self, xs: &Tensor) -> Result<Self> {
        Ok(Self {
            prepared: super::shared::prepared(xs, self.w.as_ref(), self.kernel)?,
            ..self.clone()
        })
    }
}

impl CustomOp1 for RepackedOp {
    fn name(&self) -> &'static str {
        "quantized-matmul-repacked"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, k) = self.w.dims();
        let (x, m, out) = input_rows(self.w.type_name(), (n, k), storage, layout)?;
        let prepared = self
            .prepared
            .as_deref()
            .filter(|p| p.m() == m && p.k() == k);
        let storage = if self.f64_out {
            let mut dst = vec![0f64; m * n];
            match prepared {
                Some(p) => self.w.matmul_prepared_f64(p, &mut dst)?,
                None => self.w.matmul_f64(self.kernel, m, x, &mut dst)?,
            }
            CpuStorage::F64(dst)
        } else {
            let mut dst = vec![0f32; m * n];
            match prepared {
                Some(p) => self.w.matmul_prepared_f32(p, &mut dst)?,
                None => self.w.matmul_f32(self.kernel, m, x, &mut dst)?,
            }
            CpuStorage::F32(dst)
        };
        Ok((storage, out))
    }
}

#[derive(Clone)]
enum Inner {
    /// A weight repacked four rows at a time (CPU Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and
    /// Q6_K), summed in f64: the only copy of the weight this matmul keeps.
    Repacked(RepackedOp),
    /// Everything else: candle's own quantized matmul.
    Candle(QMatMul),
}

/// A linear map `y = x · Wᵀ` (no bias) with W a quantized `[n, k]` [`QTensor`], as candle's
/// [`QMatMul`] but with the crate's fast kernels where it has them:
///
/// | weight type | CPU | other devices |
/// |---|---|---|
/// | Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K | this crate: repacked four rows at a time when built, summed in f64 and rounded (AVX2 + FMA + F16C or scalar; any block count); the `QTensor` is not kept | `QMatMul` |
/// | anything else | `QMatMul` | `QMatMul` |
///
/// [`QuantMatMul::forward_f64`] returns the f64 sums instead (the same types, on the CPU):
/// what row-parallel layers use.
///
/// Input: any leading dims, last dim `k`; f32 (f16 / bf16 are converted to f32 and the result
/// back). Inference only: the output does not track gradients.
///
/// ```no_run
/// # use candle_core::{quantized::{GgmlDType, QTensor}, Device, Module, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let w = Tensor::randn(0f32, 1.0, (1536, 576), &Device::Cpu)?;
/// let mm = candle_tp::quant::QuantMatMul::new(QTensor::quantize(&w, GgmlDType::Q4_1)?)?;
/// let y = mm.forward(&Tensor::randn(0f32, 1.0, (1, 7, 576), &Device::Cpu)?)?; // [1, 7, 1536]
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct QuantMatMul {
    inner: Inner,
    /// The weight's `(n, k)`.
    dims: (usize, usize),
}

impl QuantMatMul {
    /// Wraps a quantized weight of shape `[n, k]` (GGUF layout: out features, in features).
    pub fn new(w: QTensor) -> Result<Self> {
        Self::from_arc(Arc::new(w))
    }

    /// As [`QuantMatMul::new`], sharing the tensor. Errors where `CANDLE_TP_KERNEL=amx` asks
    /// for AMX tiles this host cannot run ([`Kernel::check_forced`]).
    ///
    /// Candle's switches `CANDLE_DEQUANTIZE_ALL` / `CANDLE_DEQUANTIZE_ALL_F16` (any value but
    /// empty or `0`) keep their meaning: with either set, every weight, Q4_1 included, goes to
    /// candle's `QMatMul`, which then multiplies the dequantized weight in f32 (f16).
    pub fn from_arc(w: Arc<QTensor>) -> Result<Self> {
        if candle_dequantizes_all() {
            let (n, k) = w.shape().dims2()?;
            return Ok(Self {
                inner: Inner::Candle(QMatMul::from_arc(w)?),
                dims: (n, k),
            });
        }
        Kernel::check_forced().map_err(|e| candle_core::Error::Msg(format!("QuantMatMul: {e}")))?;
        Self::build(w, Kernel::detect())
    }

    /// As [`QuantMatMul::from_arc`] with a given kernel for the types the crate accelerates
    /// (to test or benchmark one path); errors if this CPU cannot run it.
    pub fn with_kernel(w: Arc<QTensor>, kernel: Kernel) -> Result<Self> {
        if !kernel.is_available() {
            candle_core::bail!("QuantMatMul: kernel {kernel:?} is not supported by this CPU")
        }
        Self::build(w, kernel)
    }

    fn build(w: Arc<QTensor>, kernel: Kernel) -> Result<Self> {
        let (n, k) = w.shape().dims2().map_err(|_| {
            candle_core::Error::Msg(format!(
                "QuantMatMul: weight of shape {:?} ({:?}) is not a matrix [n, k]",
                w.shape(),
                w.dtype()
            ))
        })?;
        let cpu = w.device().is_cpu();
        let qtype = QuantType::of(w.dtype());
        let product = if cpu {
            qtype.cpu_product
        } else {
            CpuProduct::Candle
        };
        match product {
            CpuProduct::Candle => Ok(Self {
                inner: Inner::Candle(QMatMul::from_arc(w)?),
                dims: (n, k),
            }),
            CpuProduct::Repacked => {
                let Some(repack) = qtype.repack else {
                    candle_core::bail!("QuantMatMul: no repacking for {:?}", w.dtype())
                };
                // Repacked, and `w` dropped: the caller's copy is the only other one.
                let repacked = repack(&w.data()?, n, k)
                    .map_err(|e| candle_core::Error::Msg(format!("QuantMatMul: {e}")))?;
                Ok(Self {
                    inner: Inner::Repacked(RepackedOp {
                        w: repacked,
                        kernel,
                        f64_out: false,
                        prepared: None,
                    }),
                    dims: (n, k),
                })
            }
        }
    }

    /// The weight's `(n, k)`: output and input features.
    pub fn dims(&self) -> (usize, usize) {
        self.dims
    }

    /// `x · Wᵀ` with the blocks' products summed in f64, as an f64 tensor `[.., n]`, for the
    /// weight types with an f64 kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) on the CPU;
    /// `None` for the others (and when candle's `CANDLE_DEQUANTIZE_ALL` is set).
    ///
    /// A row-parallel layer all-reduces these partials in f64 and rounds the total to f32
    /// once, so its output does not depend on how many ranks share the row
    /// (`candle_tp_kernels::f64_dot` says why that matters for quantized models). The input
    /// is quantized as for [`Module::forward`]; the result equals candle's `QMatMul` up to
    /// the precision and order of the sum.
    pub fn forward_f64(&self, xs: &Tensor) -> Result<Option<Tensor>> {
        if let Inner::Repacked(op) = &self.inner {
            let op = RepackedOp {
                f64_out: true,
                ..op.with_shared(xs)?
            };
            return crate_op_raw(xs, &op, op.w.type_name(), self.dims).map(Some);
        }
        Ok(None)
    }

    /// The crate's kernel this matmul runs, or `None` where it defers to candle's `QMatMul`.
    pub fn kernel(&self) -> Option<Kernel> {
        match &self.inner {
            Inner::Repacked(op) => Some(op.kernel),
            Inner::Candle(_) => None,
        }
    }

    /// Whether this matmul keeps the weight in a layout of its own (Q4_0, Q4_1, Q5_0, Q5_1,
    /// Q8_0, Q4_K, Q5_K and Q6_K on the CPU, repacked four rows at a time) rather than sharing the `QTensor` it was built from: its owner
    /// may then drop that tensor and read rows with [`QuantMatMul::dequantize_rows`].
    pub fn holds_weight(&self) -> bool {
        matches!(self.inner, Inner::Repacked(_))
    }

    /// Rows `ids` of the weight, dequantized: `[ids.., k]` in f32, as candle's
    /// `QTensor::embedding` gives them, for a matmul that [holds its
    /// weight](QuantMatMul::holds_weight); an error otherwise (read the `QTensor`).
    pub fn dequantize_rows(&self, ids: &Tensor) -> Result<Tensor> {
        let Inner::Repacked(op) = &self.inner else {
            candle_core::bail!(
                "QuantMatMul::dequantize_rows: {self:?} shares its QTensor: read rows from it"
            )
        };
        let (n, k) = self.dims;
        let mut shape = ids.dims().to_vec();
        shape.push(k);
        let ids = ids.to_dtype(DType::U32)?.flatten_all()?.to_vec1::<u32>()?;
        let mut out = vec![0f32; ids.len() * k];
        for (&id, row) in ids.iter().zip(out.chunks_exact_mut(k.max(1))) {
            if id as usize >= n {
                candle_core::bail!(
                    "QuantMatMul: row {id} of the {} weight [{n}, {k}] does not exist",
                    op.w.type_name()
                )
            }
            op.w.dequantize_row(id as usize, row);
        }
        Tensor::from_vec(out, shape, &candle_core::Device::Cpu)
    }
}

impl Module for QuantMatMul {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        match &self.inner {
            Inner::Candle(mm) => mm.forward(xs),
            Inner::Repacked(op) => crate_op(xs, &op.with_shared(xs)?, op.w.type_name(), self.dims),
        }
    }
}

/// Runs one of the crate's CPU ops on `xs` (converted to contiguous f32, the result back to
/// `xs`'s dtype).
fn crate_op(xs: &Tensor, op: &impl CustomOp1, dtype: &str, dims: (usize, usize)) -> Result<Tensor> {
    crate_op_raw(xs, op, dtype, dims)?.to_dtype(xs.dtype())
}

/// As [`crate_op`], the op's output as it gives it (f32 or f64).
fn crate_op_raw(
    xs: &Tensor,
    op: &impl CustomOp1,
    dtype: &str,
    (n, k): (usize, usize),
) -> Result<Tensor> {
    if !xs.device().is_cpu() {
        candle_core::bail!(
            "QuantMatMul: input {:?} is on {:?}, the {dtype} weight [{n}, {k}] on the CPU",
            xs.shape(),
            xs.device().location(),
        )
    }
    xs.to_dtype(DType::F32)?.contiguous()?.apply_op1_no_bwd(op)
}

impl std::fmt::Debug for QuantMatMul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Repacked(op) => write!(
                f,
                "QuantMatMul({} {:?} repacked x4, summed in f64, {:?})",
                op.w.type_name(),
                op.w.dims(),
                op.kernel
            ),
            Inner::Candle(mm) => write!(f, "QuantMatMul({mm:?})"),
        }
    }
}

/// Whether candle's `CANDLE_DEQUANTIZE_ALL` or `CANDLE_DEQUANTIZE_ALL_F16` is set the way
/// candle reads it (present, not empty, not `0`).
fn candle_dequantizes_all() -> bool {
    ["CANDLE_DEQUANTIZE_ALL", "CANDLE_DEQUANTIZE_ALL_F16"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.is_empty() && s != "0"))
}
