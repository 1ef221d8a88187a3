//! Cross-entropy over vocabulary-parallel logits (Megatron's `vocab_parallel_cross_entropy`),
//! without ever gathering the vocabulary.
//!
//! Forward: an all-reduce (max) of the row maxima, then ONE all-reduce (sum) of three numbers
//! per row: this rank's sum of `exp(z - max)`, its target logit (zero where the target is
//! another rank's), and its sum of logits (for label smoothing). The op is composed of Candle
//! ops whose backward is local: the max is detached and the summing all-reduce is
//! [`reduce_from_tp`] (identity backward), so the gradient of the local logits,
//! `softmax(z) - (1 - ε)·onehot - ε / V`, is computed without communication.

use candle_core::{DType, Tensor, D};

use crate::comm::{ProcessGroup, ReduceOp};
use crate::ops::reduce_from_tp;
use crate::Partition;

/// Mean cross-entropy of `targets` under vocabulary-parallel logits.
///
/// - `local_logits`: `[n, part.size(rank)]`, this rank's slice of the vocabulary (the output
///   of `ParallelLmHead::forward`, flattened to rows).
/// - `targets`: `[n]` global token ids (`u32`), the same on every rank of `pg`.
/// - `label_smoothing` ε in `[0, 1)`: the target distribution is `(1 - ε)·onehot + ε / V`
///   (PyTorch's convention).
/// - `ignore_index`: rows whose target equals it contribute nothing; the mean is over the
///   other rows (0 when there are none).
///
/// Equal to `candle_nn::loss::cross_entropy` on the gathered logits (ε = 0, no ignored rows).
pub fn vocab_parallel_cross_entropy(
    local_logits: &Tensor,
    targets: &Tensor,
    part: &Partition,
    pg: &ProcessGroup,
    label_smoothing: f64,
    ignore_index: Option<u32>,
) -> candle_core::Result<Tensor> {
    let (n, local_v) = local_logits.dims2().map_err(|_| {
        candle_core::Error::msg(format!(
            "vocab_parallel_cross_entropy: logits must be [rows, local_vocab], got {:?}",
            local_logits.dims()
        ))
    })?;
    if part.parts() != pg.size() || local_v != part.size(pg.rank()) {
        candle_core::bail!(
            "vocab_parallel_cross_entropy on rank {} of group '{}': {local_v} local logits, but the vocabulary of {} over {} parts gives this rank {}",
            pg.rank(),
            pg.name(),
            part.total(),
            part.parts(),
            part.size(pg.rank().min(part.parts().saturating_sub(1)))
        );
    }
    if targets.dims() != [n] {
        candle_core::bail!(
            "vocab_parallel_cross_entropy: {n} rows of logits but targets of shape {:?}",
            targets.dims()
        );
    }
    if !(0.0..1.0).contains(&label_smoothing) {
        candle_core::bail!(
            "vocab_parallel_cross_entropy: label_smoothing {label_smoothing} is not in [0, 1)"
        );
    }
    let dev = local_logits.device();
    let dtype = local_logits.dtype();
    let vocab = part.total();
    let range = part.range(pg.rank());
    let tg: Vec<u32> = targets.to_dtype(DType::U32)?.to_vec1()?;
    let mut local_idx = Vec::with_capacity(n);
    let mut in_range = Vec::with_capacity(n);
    let mut valid = Vec::with_capacity(n);
    for (row, &t) in tg.iter().enumerate() {
        let ignored = Some(t) == ignore_index;
        if !ignored && t as usize >= vocab {
            candle_core::bail!(
                "vocab_parallel_cross_entropy: target {t} of row {row} is outside the vocabulary of {vocab}"
            );
        }
        let mine = !ignored && range.contains(&(t as usize));
        local_idx.push(if mine { t - range.start as u32 } else { 0 });
        in_range.push(if mine { 1f32 } else { 0. });
        valid.push(if ignored { 0f32 } else { 1. });
    }
    let count = valid.iter().filter(|&&v| v > 0.).count();
    let local_idx = Tensor::from_vec(local_idx, (n, 1), dev)?;
    let in_range = Tensor::from_vec(in_range, n, dev)?.to_dtype(dtype)?;
    let valid = Tensor::from_vec(valid, n, dev)?.to_dtype(dtype)?;

    // Global row maxima (no gradient: the loss does not depend on the shift).
    let local_max = local_logits.detach().max_keepdim(D::Minus1)?;
    let max = if pg.size() == 1 {
        local_max
    } else {
        pg.all_reduce(&local_max, ReduceOp::Max)?
    };
    let z = local_logits.broadcast_sub(&max)?;
    let sum_exp = z.exp()?.sum_keepdim(D::Minus1)?;
    let target = (z.gather(&local_idx, 1)?.squeeze(1)? * &in_range)?.unsqueeze(1)?;
    let mut parts = vec![sum_exp, target];
    if label_smoothing > 0.0 {
        parts.push(z.sum_keepdim(D::Minus1)?);
    }
    // One all-reduce for all per-row sums; identity backward.
    let sums = reduce_from_tp(&Tensor::cat(&parts, 1)?, pg)?;
    let log_z = sums.narrow(1, 0, 1)?.squeeze(1)?.log()?;
    let target = sums.narrow(1, 1, 1)?.squeeze(1)?;
    let nll = (&log_z - target)?;
    let per_row = if label_smoothing > 0.0 {
        let mean_z = (sums.narrow(1, 2, 1)?.squeeze(1)? / vocab as f64)?;
        let smooth = (log_z - mean_z)?;
        ((nll * (1.0 - label_smoothing))? + (smooth * label_smoothing)?)?
    } else {
        nll
    };
    (per_row * valid)?.sum_all()? / count.max(1) as f64
}
