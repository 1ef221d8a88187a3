//! Quantized activations shared by the weights that read the same input.
//!
//! A layer multiplies one input by several weights: q, k and v read the same normed hidden
//! state, gate and up the same one again. Each repacked product quantizes its input to 8-bit
//! blocks first, so the input was quantized five times per layer where two would do, and with
//! tensor parallelism every rank quantizes the whole input for its slice of the weights: on a
//! SmolLM2 prefill at world 2, quantizing took 6 % of a rank's time.
//!
//! [`share_activations`] runs a closure in which the crate's quantized matmuls on this thread
//! prepare each (input tensor, weight type, kernel) once and reuse it. The scope is explicit
//! (the layers open it around their projections) so that nothing is cached where an input
//! might change in place between two products.

use candle_core::{DType, Result, Storage, Tensor, TensorId};
use candle_tp_kernels::kernel::Kernel;
use candle_tp_kernels::repack::{PreparedActs, RepackedMatMul};
use std::cell::RefCell;
use std::sync::Arc;

/// Activations prepared inside the current scope, if one is open on this thread.
type Entries = Vec<(TensorId, &'static str, Kernel, Arc<PreparedActs>)>;

thread_local! {
    static SHARED: RefCell<Option<Entries>> = const { RefCell::new(None) };
}

/// Runs `f`, in which the crate's CPU quantized matmuls ([`super::QuantMatMul`] on the
/// repacked types) quantize each input tensor once per weight type and reuse it, as a
/// layer's projections of one input want (q, k, v; gate, up). Nested calls share the
/// outermost scope. Inside `f`, no input of those matmuls may change in place (`slice_set`
/// on it): the products would read its old values.
///
/// ```
/// use candle_core::{Device, Module, Tensor};
/// use candle_core::quantized::{GgmlDType, QTensor};
/// use candle_tp::quant::{share_activations, QuantMatMul};
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// let w = |seed: f64| -> candle_core::Result<QuantMatMul> {
///     let w = (Tensor::arange(0f32, 64.0 * 64.0, &dev)?.reshape((64, 64))? * seed)?.sin()?;
///     QuantMatMul::new(QTensor::quantize(&w, GgmlDType::Q4_0)?)
/// };
/// let (wq, wk) = (w(0.1)?, w(0.2)?);
/// let x = Tensor::ones((3, 64), candle_core::DType::F32, &dev)?;
/// let (q, k) = share_activations(|| -> candle_core::Result<_> {
///     Ok((wq.forward(&x)?, wk.forward(&x)?)) // x quantized once
/// })?;
/// assert_eq!(q.to_vec2::<f32>()?, wq.forward(&x)?.to_vec2::<f32>()?);
/// # let _ = k;
/// # Ok(())
/// # }
/// ```
pub fn share_activations<R>(f: impl FnOnce() -> R) -> R {
    if SHARED.with(|s| s.borrow().is_some()) {
        return f();
    }
    /// Closes the scope, also when `f` panics.
    struct Close;
    impl Drop for Close {
        fn drop(&mut self) {
            SHARED.with(|s| *s.borrow_mut() = None);
        }
    }
    SHARED.with(|s| *s.borrow_mut() = Some(Vec::new()));
    let _close = Close;
    f()
}

/// How many inputs the [`share_activations`] scope open on this thread has prepared (one per
/// input tensor, weight type and kernel); `None` outside a scope. For tests.
#[doc(hidden)]
pub fn prepared_in_scope() -> Option<usize> {
    SHARED.with(|s| s.borrow().as_ref().map(Vec::len))
}

/// Inside a [`share_activations`] scope: `xs` (contiguous f32 on the CPU) prepared for `w`'s
/// type and `kernel`, made now or earlier in the scope. `None` outside a scope.
pub(super) fn prepared(
    xs: &Tensor,
    w: &dyn RepackedMatMul,
    kernel: Kernel,
) -> Result<Option<Arc<PreparedActs>>> {
    let key = (xs.id(), w.type_name(), kernel);
    let found = SHARED.with(|s| {
        s.borrow().as_ref().map(|entries| {
            entries
                .iter()
                .find(|(id, ty, k, _)| (*id, *ty, *k) == key)
                .map(|e| e.3.clone())
        })
    });
    let Some(found) = found else {
        return Ok(None); // no scope
    };
    if let Some(p) = found {
        return Ok(Some(p));
    }
    if xs.dtype() != DType::F32 || !xs.is_contiguous() {
        return Ok(None);
    }
    let (n, k) = w.dims();
    let p = {
        let (storage, layout) = xs.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            return Ok(None);
        };
        let (x, m, _) = super::input_rows::input_rows(w.type_name(), (n, k), cpu, layout)?;
        Arc::new(w.prepare(kernel, m, x)?)
    };
    SHARED.with(|s| {
        if let Some(entries) = s.borrow_mut().as_mut() {
            entries.push((key.0, key.1, key.2, p.clone()));
        }
    });
    Ok(Some(p))
}
