//! Megatron's mappings between parallel regions, with autograd.
//!
//! | function | forward | backward |
//! |---|---|---|
//! | [`copy_to_tp`] | identity | all-reduce |
//! | [`reduce_from_tp`] | all-reduce | identity |
//! | [`gather_from_tp`] | all-gather, last dim | split, last dim |
//! | [`scatter_to_tp`] | split, last dim | all-gather, last dim |
//! | [`gather_from_sp`] | all-gather, sequence dim | reduce-scatter, sequence dim |
//! | [`reduce_scatter_to_sp`] | reduce-scatter, sequence dim | all-gather, sequence dim |
//!
//! (Megatron-LM `core/tensor_parallel/mappings.py`.) Inputs that do not track gradients skip
//! identity-forward work: `copy_to_tp` returns its input, `scatter_to_tp` a view.
//! With a group of one rank every mapping is the identity.

use candle_core::{Result, Tensor};

use super::collective::CollectiveOp;
use super::kind::Kind;
use crate::comm::{ProcessGroup, ReduceOp};
use crate::Partition;

fn check_partition(
    x: &Tensor,
    pg: &ProcessGroup,
    part: &Partition,
    dim: usize,
    what: &str,
    local: bool,
) -> Result<()> {
    // Errors abort the group (`refuse`): peers would otherwise wait for this rank until the
    // deadline.
    if part.parts() != pg.size() {
        return Err(pg.refuse(format!(
            "{what}: the partition has {} parts but group '{}' has {} ranks",
            part.parts(),
            pg.name(),
            pg.size()
        )));
    }
    let have = x.dims().get(dim).copied();
    let want = if local {
        part.size(pg.rank())
    } else {
        part.total()
    };
    if have != Some(want) {
        return Err(pg.refuse(format!(
            "{what} on rank {} of group '{}': expected {} {want} along dim {dim}, got a tensor of shape {:?}",
            pg.rank(),
            pg.name(),
            if local { "this rank's share of" } else { "the full size" },
            x.dims()
        )));
    }
    Ok(())
}

fn last_dim(x: &Tensor, pg: &ProcessGroup, what: &str) -> Result<usize> {
    match x.rank() {
        0 => Err(pg.refuse(format!(
            "{what}: a scalar has no dimension to split or gather"
        ))),
        r => Ok(r - 1),
    }
}

/// Enters a tensor-parallel region: identity forward, all-reduce of the gradient backward.
/// Put before a column-parallel layer whose input is replicated.
pub fn copy_to_tp(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    if pg.size() == 1 || !x.track_op() {
        return Ok(x.clone());
    }
    CollectiveOp::apply(pg, x, Kind::Identity, Some(Kind::AllReduce(ReduceOp::Sum)))
}

/// Leaves a tensor-parallel region by summing partial results: all-reduce forward, identity
/// backward. Put after a row-parallel layer.
pub fn reduce_from_tp(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    if pg.size() == 1 {
        return Ok(x.clone());
    }
    CollectiveOp::apply(pg, x, Kind::AllReduce(ReduceOp::Sum), Some(Kind::Identity))
}

/// Gathers the last dimension, split as `part` across the group: all-gather forward, this
/// rank's slice of the gradient backward.
pub fn gather_from_tp(x: &Tensor, pg: &ProcessGroup, part: &Partition) -> Result<Tensor> {
    let dim = last_dim(x, pg, "gather_from_tp")?;
    check_partition(x, pg, part, dim, "gather_from_tp", true)?;
    if pg.size() == 1 {
        return Ok(x.clone());
    }
    let sizes = part.sizes();
    CollectiveOp::apply(
        pg,
        x,
        Kind::AllGather {
            dim,
            sizes: sizes.clone(),
        },
        Some(Kind::Split { dim, sizes }),
    )
}

/// Keeps this rank's slice of the last dimension (split as `part`): split forward, all-gather
/// of the gradient backward.
pub fn scatter_to_tp(x: &Tensor, pg: &ProcessGroup, part: &Partition) -> Result<Tensor> {
    let dim = last_dim(x, pg, "scatter_to_tp")?;
    check_partition(x, pg, part, dim, "scatter_to_tp", false)?;
    if pg.size() == 1 {
        return Ok(x.clone());
    }
    if !x.track_op() {
        // A copy, not the strided `narrow` view: Candle's CUDA and MKL matmuls reject that
        // stride for more than one row, and the split feeds a matmul (RowParallelLinear).
        let r = part.range(pg.rank());
        return x.narrow(dim, r.start, r.len())?.contiguous();
    }
    let sizes = part.sizes();
    CollectiveOp::apply(
        pg,
        x,
        Kind::Split {
            dim,
            sizes: sizes.clone(),
        },
        Some(Kind::AllGather { dim, sizes }),
    )
}

/// Leaves a sequence-parallel region: all-gather along the sequence dimension `dim` (split as
/// `part`) forward, reduce-scatter of the gradient backward. Put before a column-parallel
/// layer (Megatron-SP).
pub fn gather_from_sp(
    x: &Tensor,
    pg: &ProcessGroup,
    part: &Partition,
    dim: usize,
) -> Result<Tensor> {
    sp_mapping(x, pg, part, dim, "gather_from_sp", true)
}

/// Enters a sequence-parallel region: reduce-scatter along the sequence dimension `dim`
/// (split as `part`) forward, all-gather of the gradient backward. Put after a row-parallel
/// layer instead of its all-reduce (Megatron-SP).
pub fn reduce_scatter_to_sp(
    x: &Tensor,
    pg: &ProcessGroup,
    part: &Partition,
    dim: usize,
) -> Result<Tensor> {
    sp_mapping(x, pg, part, dim, "reduce_scatter_to_sp", false)
}

/// The two sequence-parallel mappings along `dim` split as `part`: all-gather forward and
/// reduce-scatter backward (`gather`), or reduce-scatter forward and all-gather backward.
fn sp_mapping(
    x: &Tensor,
    pg: &ProcessGroup,
    part: &Partition,
    dim: usize,
    name: &str,
    gather: bool,
) -> Result<Tensor> {
    check_partition(x, pg, part, dim, name, gather)?;
    if pg.size() == 1 {
        return Ok(x.clone());
    }
    let sizes = part.sizes();
    let all_gather = Kind::AllGather {
        dim,
        sizes: sizes.clone(),
    };
    let reduce_scatter = Kind::ReduceScatter {
        dim,
        sizes,
        op: ReduceOp::Sum,
    };
    let (fwd, bwd) = if gather {
        (all_gather, reduce_scatter)
    } else {
        (reduce_scatter, all_gather)
    };
    CollectiveOp::apply(pg, x, fwd, Some(bwd))
}
