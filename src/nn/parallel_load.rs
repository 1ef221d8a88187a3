//! Loading the 2D and 3D layers from a [`ShardedVarBuilder`] under the dense model's tensor
//! names: `weight` `[out, in]` and `bias` `[out]` as `candle_nn::linear` stores them, `weight`
//! and `bias` of a `candle_nn::layer_norm`. Each rank reads only the rows of the weight that
//! hold its block (`1 / q` of the tensor in 2D, `1 / q²` in 3D) and only its part of a vector,
//! and keeps exactly what `from_dense` would have cut from the full tensor.
//!
//! ```no_run
//! # fn main() -> candle_core::Result<()> {
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_tp::comm::DeviceMesh;
//! use candle_tp::{Linear2d, ShardedVarBuilder};
//!
//! let pg = candle_tp::init_from_env(&Device::Cpu)?; // 4 ranks under tprun
//! let mesh = DeviceMesh::grid_2d(&pg)?;
//! let vb = ShardedVarBuilder::from_safetensors_dir("model/", DType::F32, &Device::Cpu, pg)?;
//! let fc1 = Linear2d::load(512, 2048, true, &mesh, vb.pp("mlp.fc1"))?;
//! # Ok(()) }
//! ```

use std::ops::Range;

use candle_core::{Result, Tensor};
use candle_nn::Activation;

use super::parallel_2d::{Grid2d, LayerNorm2d, Linear2d, Mlp2d};
use super::parallel_3d::{Grid3d, LayerNorm3d, Layout3d, Linear3d, Mlp3d};
use crate::ShardedVarBuilder;

/// A linear layer's `weight` (rows `rows`, columns `cols` of the `[out, inp]` tensor, transposed
/// to the `[in, out]` block the 2D and 3D layers keep; only those rows are read) and, with
/// `bias_range`, elements `bias_range` of its `bias` `[out]`.
fn load_linear(
    vb: &ShardedVarBuilder,
    (out, inp): (usize, usize),
    (rows, cols): (Range<usize>, Range<usize>),
    bias_range: Option<Range<usize>>,
) -> Result<(Tensor, Option<Tensor>)> {
    let w = vb
        .get_ranges((out, inp), "weight", 0, &[rows])?
        .narrow(1, cols.start, cols.len())?
        .t()?
        .contiguous()?;
    let b = bias_range
        .map(|r| vb.get_ranges(out, "bias", 0, &[r]))
        .transpose()?;
    Ok((w, b))
}

/// Elements `range` of a layer norm's `weight` and `bias` `[hidden]`.
fn load_norm(
    vb: &ShardedVarBuilder,
    hidden: usize,
    range: Range<usize>,
) -> Result<(Tensor, Tensor)> {
    let ranges = [range];
    let w = vb.get_ranges(hidden, "weight", 0, &ranges)?;
    Ok((w, vb.get_ranges(hidden, "bias", 0, &ranges)?))
}

impl Linear2d {
    /// Loads this rank's block of `weight` `[out_features, in_features]` and its part of
    /// `bias` `[out_features]` (if `bias`) from `vb`: the tensors of a dense
    /// `candle_nn::linear`.
    pub fn load(
        in_features: usize,
        out_features: usize,
        bias: bool,
        mesh: &crate::comm::DeviceMesh,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let layer = format!("Linear2d '{}'", vb.prefix());
        let grid = Grid2d::new(mesh)?;
        let ranges = grid.weight_ranges(&layer, out_features, in_features)?;
        let bias_range = bias
            .then(|| grid.vector_range(&layer, out_features))
            .transpose()?;
        let (w, b) = load_linear(&vb, (out_features, in_features), ranges, bias_range)?;
        Self::new(w, b, in_features, out_features, mesh)
    }
}

impl LayerNorm2d {
    /// Loads this rank's parts of `weight` and `bias` `[hidden]` from `vb`: the tensors of a
    /// dense `candle_nn::layer_norm`.
    pub fn load(
        hidden: usize,
        eps: f64,
        mesh: &crate::comm::DeviceMesh,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let layer = format!("LayerNorm2d '{}'", vb.prefix());
        let r = Grid2d::new(mesh)?.vector_range(&layer, hidden)?;
        let (w, b) = load_norm(&vb, hidden, r)?;
        Self::new(w, Some(b), hidden, eps, mesh)
    }
}

impl Mlp2d {
    /// Loads `fc1` (`[d_ff, d_model]`) and `fc2` (`[d_model, d_ff]`), both with bias, under
    /// the names `fc1_name` and `fc2_name` of `vb`.
    pub fn load(
        d_model: usize,
        d_ff: usize,
        act: Activation,
        fc1_name: &str,
        fc2_name: &str,
        mesh: &crate::comm::DeviceMesh,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let fc1 = Linear2d::load(d_model, d_ff, true, mesh, vb.pp(fc1_name))?;
        let fc2 = Linear2d::load(d_ff, d_model, true, mesh, vb.pp(fc2_name))?;
        Self::new(fc1, fc2, act)
    }
}

impl Linear3d {
    /// Loads this rank's block of `weight` `[out_features, in_features]` and its part of
    /// `bias` `[out_features]` (if `bias`) from `vb`, for an input in layout `input`.
    pub fn load(
        in_features: usize,
        out_features: usize,
        bias: bool,
        input: Layout3d,
        mesh: &crate::comm::DeviceMesh,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let layer = format!("Linear3d '{}'", vb.prefix());
        input.check(&layer)?;
        let g = Grid3d::new(mesh)?;
        let ranges = g.weight_ranges(&layer, out_features, in_features, input)?;
        let bias_range = bias
            .then(|| g.vector_range(&layer, out_features, input.rows, input.features))
            .transpose()?;
        let (w, b) = load_linear(&vb, (out_features, in_features), ranges, bias_range)?;
        Self::new(w, b, in_features, out_features, input, mesh)
    }
}

impl LayerNorm3d {
    /// Loads this rank's parts of `weight` and `bias` `[hidden]` from `vb`, for activations
    /// in `layout`.
    pub fn load(
        hidden: usize,
        eps: f64,
        layout: Layout3d,
        mesh: &crate::comm::DeviceMesh,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let layer = format!("LayerNorm3d '{}'", vb.prefix());
        layout.check(&layer)?;
        let r = Grid3d::new(mesh)?.vector_range(&layer, hidden, layout.features, layout.rows)?;
        let (w, b) = load_norm(&vb, hidden, r)?;
        Self::new(w, Some(b), hidden, eps, layout, mesh)
    }
}

impl Mlp3d {
    /// Loads `fc1` (`[d_ff, d_model]`, input in layout `input`) and `fc2` (`[d_model, d_ff]`,
    /// input in `fc1`'s output layout), both with bias, under the names `fc1_name` and
    /// `fc2_name` of `vb`.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        d_model: usize,
        d_ff: usize,
        act: Activation,
        fc1_name: &str,
        fc2_name: &str,
        input: Layout3d,
        mesh: &crate::comm::DeviceMesh,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let fc1 = Linear3d::load(d_model, d_ff, true, input, mesh, vb.pp(fc1_name))?;
        let fc2 = Linear3d::load(
            d_ff,
            d_model,
            true,
            fc1.output_layout(),
            mesh,
            vb.pp(fc2_name),
        )?;
        Self::new(fc1, fc2, act)
    }
}
