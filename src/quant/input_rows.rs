//! The f32 rows of a quantized matmul's input, checked against the weight's shape: what the
//! matmul (`matmul.rs`) multiplies and what a shared-activations scope (`shared.rs`)
//! prepares once for several weights.

use candle_core::{CpuStorage, Layout, Result, Shape};

/// The f32 rows of a quantized matmul's input (`[.., k]`, contiguous), their count and the
/// output's shape `[.., n]`; errors name the weight `[n, k]` of type `dtype`.
pub(super) fn input_rows<'a>(
    dtype: &str,
    (n, k): (usize, usize),
    storage: &'a CpuStorage,
    layout: &Layout,
) -> Result<(&'a [f32], usize, Shape)> {
    let shape = layout.shape();
    let Some(&last) = shape.dims().last() else {
        candle_core::bail!("QuantMatMul: input is a scalar, expected [.., {k}]")
    };
    if last != k {
        candle_core::bail!(
            "QuantMatMul: input {shape:?} has last dim {last}, the {dtype} weight [n, k] = [{n}, {k}] needs k = {k}"
        )
    }
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("QuantMatMul: input {shape:?} is not contiguous")
    };
    let x = &storage.as_slice::<f32>()?[start..end];
    let mut out = shape.dims().to_vec();
    *out.last_mut().expect("rank checked above") = n;
    Ok((x, shape.elem_count() / k.max(1), Shape::from(out)))
}
