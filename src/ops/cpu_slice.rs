//! The CPU ops' view of an input: its f32 values as one contiguous slice, or an error naming
//! the op, the input and what it was.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Result};

/// `s` under `l` as a contiguous f32 slice; an error naming `op` and `what` (the input's
/// role) otherwise.
pub(crate) fn contiguous_f32<'a>(
    op: &str,
    what: &str,
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("{op}: {what} must be f32, got {:?}", s.dtype())
    };
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("{op}: {what} of shape {:?} must be contiguous", l.dims())
    };
    Ok(&v[a..b])
}
