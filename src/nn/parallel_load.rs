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

/// Rows `rows` and columns `cols` of the `[out, inp]` tensor `name`, transposed to the
/// `[in, out]` block the 2D and 3D layers keep. Only the rows are read from the source.
fn load_block(
    vb: &ShardedVarBuilder,
    name: &str,
    (out, inp): (usize, usize),
    rows: Range<usize>,
    cols: Range<usize>,
) -> Result<Tensor> {
    vb.get_ranges((out, inp), name, 0, &[rows])?
        .narrow(1, cols.start, cols.len())?
        .t()?
        .contiguous()
}

/// Elements `range` of the `[n]` vector `name`.
fn load_part(vb: &ShardedVarBuilder, name: &str, n: usize, range: Range<usize>) -> Result<Tensor> {
    vb.get_ranges(n, name, 0, &[range])
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
        let (rows, cols) = grid.weight_ranges(&layer, out_features, in_features)?;
        let w = load_block(&vb, "weight", (out_features, in_features), rows, cols)?;
        let b = if bias {
            let r = grid.vector_range(&layer, out_features)?;
            Some(load_part(&vb, "bias", out_features, r)?)
        } else {
            None
        };
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
        let w = load_part(&vb, "weight", hidden, r.clone())?;
        let b = load_part(&vb, "bias", hidden, r)?;
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
        let (rows, cols) = g.weight_ranges(&layer, out_features, in_features, input)?;
        let w = load_block(&vb, "weight", (out_features, in_features), rows, cols)?;
        let b = if bias {
            let r = g.vector_range(&layer, out_features, input.rows, input.features)?;
            Some(load_part(&vb, "bias", out_features, r)?)
        } else {
            None
        };
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
        let w = load_part(&vb, "weight", hidden, r.clone())?;
        let b = load_part(&vb, "bias", hidden, r)?;
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
