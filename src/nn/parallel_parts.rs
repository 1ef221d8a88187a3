//! What the 2D and 3D layers share: the parts of a dense linear layer or layer norm that a
//! rank keeps, cut from the full tensors (`from_dense`) or read from a [`ShardedVarBuilder`]
//! under the dense model's names (`load`), and the layer norm over split features.
//!
//! Each grid says which parts a rank holds through [`Placement`]; the parts are then cut the
//! same way: the rows and columns of the weight (candle's `[out, in]`, transposed to the
//! `[in, out]` block the layers keep; a loading rank reads only those rows), and a range of
//! each vector (bias, scale, shift). Loading keeps exactly what `from_dense` would have cut.

use std::ops::Range;

use candle_core::{Result, Tensor, D};

use crate::comm::ProcessGroup;
use crate::ops::{copy_to_tp, reduce_from_tp};
use crate::ShardedVarBuilder;

/// Which parts of a dense layer's tensors a rank of a 2D or 3D grid holds. `layer` names the
/// layer in errors.
pub(crate) trait Placement {
    /// The rows (output features) and columns (input features) of a dense `[out, in]`
    /// weight that make this rank's block.
    fn weight_ranges(
        &self,
        layer: &str,
        out: usize,
        inp: usize,
    ) -> Result<(Range<usize>, Range<usize>)>;

    /// The elements of a full bias of `n` features this rank holds.
    fn bias_range(&self, layer: &str, n: usize) -> Result<Range<usize>>;

    /// The elements of a full layer-norm scale or shift of `n` features this rank holds.
    fn norm_range(&self, layer: &str, n: usize) -> Result<Range<usize>>;
}

/// Elements `r` of the vector `v`.
fn narrow_vector(v: &Tensor, r: Range<usize>) -> Result<Tensor> {
    v.narrow(0, r.start, r.len())
}

/// The parts of a linear layer a rank keeps: its weight block (`[in part, out part]`), its
/// part of the bias, and the full sizes.
#[derive(Debug, Clone)]
pub(crate) struct LinearParts {
    pub(crate) weight: Tensor,
    pub(crate) bias: Option<Tensor>,
    pub(crate) in_features: usize,
    pub(crate) out_features: usize,
}

impl LinearParts {
    /// The parts as given.
    pub(crate) fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        in_features: usize,
        out_features: usize,
    ) -> Self {
        Self {
            weight,
            bias,
            in_features,
            out_features,
        }
    }

    /// Cuts the parts from the full dense weight in candle's `[out, in]` layout and bias
    /// `[out]`.
    pub(crate) fn from_dense(
        place: &impl Placement,
        layer: &str,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Self> {
        let (out, inp) = weight.dims2()?;
        let (rows, cols) = place.weight_ranges(layer, out, inp)?;
        let w = weight
            .narrow(0, rows.start, rows.len())?
            .narrow(1, cols.start, cols.len())?
            .t()?
            .contiguous()?;
        let bias = bias
            .map(|b| narrow_vector(b, place.bias_range(layer, b.dims1()?)?))
            .transpose()?;
        Ok(Self::new(w, bias, inp, out))
    }

    /// Reads the parts of `weight` `[out_features, in_features]` and (if `bias`) `bias`
    /// `[out_features]` from `vb`: only the weight rows of the block, only the bias part.
    pub(crate) fn load(
        place: &impl Placement,
        layer: &str,
        vb: &ShardedVarBuilder,
        (in_features, out_features): (usize, usize),
        bias: bool,
    ) -> Result<Self> {
        let (out, inp) = (out_features, in_features);
        let (rows, cols) = place.weight_ranges(layer, out, inp)?;
        let bias_range = bias.then(|| place.bias_range(layer, out)).transpose()?;
        let weight = vb
            .get_ranges((out, inp), "weight", 0, &[rows])?
            .narrow(1, cols.start, cols.len())?
            .t()?
            .contiguous()?;
        let bias = bias_range
            .map(|r| vb.get_ranges(out, "bias", 0, &[r]))
            .transpose()?;
        Ok(Self::new(weight, bias, in_features, out_features))
    }
}

/// The parts of a layer norm a rank keeps: its parts of the scale and the shift.
#[derive(Debug, Clone)]
pub(crate) struct NormParts {
    pub(crate) weight: Tensor,
    pub(crate) bias: Option<Tensor>,
    pub(crate) hidden: usize,
}

impl NormParts {
    /// The parts as given.
    pub(crate) fn new(weight: Tensor, bias: Option<Tensor>, hidden: usize) -> Self {
        Self {
            weight,
            bias,
            hidden,
        }
    }

    /// Cuts the parts from the full scale and shift `[hidden]`.
    pub(crate) fn from_dense(
        place: &impl Placement,
        layer: &str,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Self> {
        let hidden = weight.dims1()?;
        let cut = |v: &Tensor| narrow_vector(v, place.norm_range(layer, v.dims1()?)?);
        Ok(Self {
            bias: bias.map(cut).transpose()?,
            weight: cut(weight)?,
            hidden,
        })
    }

    /// Reads the parts of `weight` and `bias` `[hidden]` from `vb`.
    pub(crate) fn load(
        place: &impl Placement,
        layer: &str,
        vb: &ShardedVarBuilder,
        hidden: usize,
    ) -> Result<Self> {
        let ranges = [place.norm_range(layer, hidden)?];
        Ok(Self {
            weight: vb.get_ranges(hidden, "weight", 0, &ranges)?,
            bias: Some(vb.get_ranges(hidden, "bias", 0, &ranges)?),
            hidden,
        })
    }

    /// Checks that the scale and shift parts have `want` elements; `rank` names this rank's
    /// place in the grid in the error.
    pub(crate) fn check(&self, layer: &str, rank: &str, want: usize) -> Result<()> {
        for (what, t) in [("scale", Some(&self.weight)), ("shift", self.bias.as_ref())] {
            if let Some(t) = t {
                if t.dims() != [want] {
                    candle_core::bail!(
                        "{layer}: rank {rank} has a {what} part of shape {:?}, expected [{want}]",
                        t.dims()
                    );
                }
            }
        }
        Ok(())
    }
}

impl NormParts {
    /// The layer norm of `x`, this rank's block (last dim `hidden / q`) of activations whose
    /// features are split over `pg`: statistics summed over `pg`, then the scale and shift,
    /// each a full block made by `gather` from this rank's part. `who` names the layer and
    /// the rank in errors.
    pub(crate) fn forward(
        &self,
        who: &dyn Fn() -> String,
        x: &Tensor,
        q: usize,
        pg: &ProcessGroup,
        eps: f64,
        gather: impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let h = self.hidden / q;
        if x.dims().last() != Some(&h) {
            candle_core::bail!(
                "{}: the input block has shape {:?}, its last dim must be hidden / q = {h}",
                who(),
                x.dims()
            );
        }
        let y = split_layer_norm(x, pg, self.hidden, eps)?.broadcast_mul(&gather(&self.weight)?)?;
        match &self.bias {
            None => Ok(y),
            Some(b) => y.broadcast_add(&gather(b)?),
        }
    }
}

/// The accessors of a 2D or 3D layer whose parts are in `self.parts`: `linear` for a
/// [`LinearParts`], `norm` for a [`NormParts`].
macro_rules! part_accessors {
    (linear) => {
        /// This rank's block of the weight, `[in part, out part]` (candle's `[out, in]`
        /// transposed).
        pub fn weight(&self) -> &Tensor {
            &self.parts.weight
        }

        /// This rank's part of the bias.
        pub fn bias(&self) -> Option<&Tensor> {
            self.parts.bias.as_ref()
        }

        /// Input features (full).
        pub fn in_features(&self) -> usize {
            self.parts.in_features
        }

        /// Output features (full).
        pub fn out_features(&self) -> usize {
            self.parts.out_features
        }
    };
    (norm) => {
        /// This rank's part of the scale.
        pub fn weight(&self) -> &Tensor {
            &self.parts.weight
        }

        /// This rank's part of the shift.
        pub fn bias(&self) -> Option<&Tensor> {
            self.parts.bias.as_ref()
        }
    };
}
pub(crate) use part_accessors;

/// An op that is an all-reduce forward and an all-reduce of the gradient backward: a sum
/// that every rank of `pg` uses differently (LayerNorm statistics over split features).
fn all_reduce_both(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    reduce_from_tp(&copy_to_tp(x, pg)?, pg)
}

/// LayerNorm over a hidden dimension whose `hidden` features are split over `pg`: statistics
/// are summed over the group (forward and backward). `x` is this rank's slice, normalised over
/// its last dim.
fn split_layer_norm(x: &Tensor, pg: &ProcessGroup, hidden: usize, eps: f64) -> Result<Tensor> {
    let n = hidden as f64;
    let mean = (all_reduce_both(&x.sum_keepdim(D::Minus1)?, pg)? / n)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = (all_reduce_both(&xc.sqr()?.sum_keepdim(D::Minus1)?, pg)? / n)?;
    xc.broadcast_div(&(var + eps)?.sqrt()?)
}
