//! Gradient synchronisation between backward and the optimizer step.
//!
//! - Sequence parallelism: parameters used on sequence-split activations (norm weights) get
//!   partial gradients on every TP rank; [`all_reduce_grads`] with `average = false` over the
//!   TP group sums them.
//! - Data parallelism: every gradient is averaged over the DP group ([`all_reduce_grads`] with
//!   `average = true`), so each DP replica takes the same optimizer step.
//!
//! Gradients are packed into one buffer per call (one collective, not one per tensor).

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};

use crate::comm::{ProcessGroup, ReduceOp};

/// All-reduces (sums, or averages) the gradients of `vars` in `grads` over `pg`, in place.
/// A variable without a gradient counts as zeros (it gets the others' gradient). Every rank of
/// `pg` must pass variables of the same shapes in the same order.
pub fn all_reduce_grads(
    grads: &mut GradStore,
    vars: &[Var],
    pg: &ProcessGroup,
    average: bool,
) -> Result<()> {
    if pg.size() == 1 || vars.is_empty() {
        return Ok(());
    }
    let mut flat: Vec<f32> = Vec::new();
    for v in vars {
        match grads.get(v.as_tensor()) {
            Some(g) => flat.extend(g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            None => flat.resize(flat.len() + v.elem_count(), 0.0),
        }
    }
    pg.all_reduce_slice(&mut flat, ReduceOp::Sum)?;
    let scale = if average { 1.0 / pg.size() as f32 } else { 1.0 };
    let mut at = 0;
    for v in vars {
        let n = v.elem_count();
        let part: Vec<f32> = flat[at..at + n].iter().map(|x| x * scale).collect();
        at += n;
        let g = Tensor::from_vec(part, v.shape(), v.device())?.to_dtype(v.dtype())?;
        grads.insert(v.as_tensor(), g);
    }
    Ok(())
}

/// Bytes of the activations the autograd graph of `loss` keeps for backward: every buffer of
/// the graph that is not a parameter's, counted once (measured from the graph itself, not
/// estimated). Views share their buffer: a transposed weight is the parameter's buffer (not
/// counted), a reshaped activation its input's (counted once, at its largest view).
pub fn activation_bytes(loss: &Tensor) -> usize {
    let nodes = loss.sorted_nodes();
    let buffer = |t: &Tensor| {
        let (storage, _) = t.storage_and_layout();
        &*storage as *const candle_core::Storage as usize
    };
    let params: std::collections::HashSet<usize> = nodes
        .iter()
        .filter(|t| t.is_variable())
        .map(|t| buffer(t))
        .collect();
    let mut bytes: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    for t in nodes.iter().filter(|t| !t.is_variable()) {
        let b = buffer(t);
        if !params.contains(&b) {
            let n = t.elem_count() * t.dtype().size_in_bytes();
            let e = bytes.entry(b).or_default();
            *e = (*e).max(n);
        }
    }
    bytes.values().sum()
}
