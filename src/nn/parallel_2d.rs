//! 2D tensor parallelism (SUMMA) on a `q × q` grid of ranks ([`DeviceMesh::grid_2d`],
//! `rank = row * q + col`). Optimus / Colossal-AI 2D, built on the scalable universal matrix
//! multiplication algorithm (van de Geijn & Watts).
//!
//! # Layout (the same for the input and output of every layer, so layers chain)
//!
//! An activation `X` of shape `[batch, …, hidden]` is cut in `q × q` blocks: rank
//! `(row, col)` holds rows `row` of `batch` (dim 0, `batch / q` of them) and block `col` of
//! `hidden` (the last dim, `hidden / q`). Other dims (the sequence) are not split.
//! [`scatter_2d`] cuts a full tensor this way, [`gather_2d`] puts it back together.
//!
//! A weight is stored as `[in, out]` (the transpose of candle's `[out, in]`), cut in `q × q`
//! blocks: rank `(row, col)` holds block `(row, col)`, `[in / q, out / q]`. A bias (and a
//! LayerNorm's scale and shift) block `col`, `out / q` long, is itself split over the column
//! group: rank `(row, col)` holds part `row` of it (`Partition::new(out / q, q)`), so
//! parameter memory is `O(1 / q²)` throughout.
//!
//! # Communication
//!
//! - `Linear2d` forward, `Y = X W`: `q` SUMMA steps; step `t` broadcasts `X[row, t]` along
//!   the row group and `W[t, col]` along the column group, then multiplies locally.
//! - backward, `dX = dY Wᵀ`: step `t` broadcasts `W[t, col]` along the column group and
//!   reduces `dY[row, col] W[t, col]ᵀ` along the row group to rank `(row, t)`;
//!   `dW = Xᵀ dY`: step `t` broadcasts `X[row, t]` along the row group and reduces
//!   `X[row, t]ᵀ dY[row, col]` along the column group to rank `(t, col)`.
//! - Bias: all-gather of the bias block over the column group (its gradient:
//!   reduce-scatter). LayerNorm: two all-reduces of per-row sums over the row group.
//!
//! On the CPU the matrix product is one Candle `CustomOp2` whose `bwd` runs the two backward
//! SUMMAs, so the layers train through Candle's `backward()`; on other devices (CUDA) it is
//! built from broadcasts whose gradient is a reduce to the root, and Candle's backward through
//! them runs the same SUMMAs. f32/f64/f16/bf16.

mod grid;
mod summa;

use candle_core::{Module, Result, Tensor};
use candle_nn::Activation;

use super::mlp::TwoLayerMlp;
use super::parallel_parts::{part_accessors, LinearParts, NormParts};
use crate::comm::DeviceMesh;
use crate::ShardedVarBuilder;
pub use grid::Grid2d;
use summa::Summa;

/// Cuts a full activation `[batch, …, hidden]` into this rank's 2D block
/// `[batch / q, …, hidden / q]` (see the [module docs](self)). Errors name the size that `q`
/// does not divide.
pub fn scatter_2d(x: &Tensor, mesh: &DeviceMesh) -> Result<Tensor> {
    let g = Grid2d::new(mesh)?;
    if x.rank() < 2 {
        candle_core::bail!(
            "scatter_2d: the activation must be [batch, ..., hidden], got shape {:?}",
            x.dims()
        );
    }
    let last = x.rank() - 1;
    let b = g.divide("scatter_2d", "the batch size (dim 0)", x.dims()[0])?;
    let h = g.divide("scatter_2d", "the hidden size (last dim)", x.dims()[last])?;
    x.narrow(0, g.row * b, b)?.narrow(last, g.col * h, h)
}

/// Reassembles a full activation from the 2D blocks of every rank (all-gathers over the row
/// group, then over the column group). Not differentiable; for inspection and tests.
pub fn gather_2d(x: &Tensor, mesh: &DeviceMesh) -> Result<Tensor> {
    let g = Grid2d::new(mesh)?;
    let last = x.rank().saturating_sub(1);
    let x = g.row_group.all_gather(x, last)?;
    g.col_group.all_gather(&x, 0)
}

/// A linear layer `y = x W + b` on a `q × q` grid (SUMMA). Input and output have the 2D
/// layout of the [module docs](self): `[batch / q, …, in / q]` → `[batch / q, …, out / q]`.
#[derive(Debug, Clone)]
pub struct Linear2d {
    parts: LinearParts,
    grid: Grid2d,
}

impl Linear2d {
    /// A layer from this rank's blocks: `weight` is block `(row, col)` of the `[in, out]`
    /// matrix, `[in / q, out / q]`; `bias` (if any) is part `row` (split as
    /// `Partition::new(out / q, q)`) of bias block `col`.
    pub fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        in_features: usize,
        out_features: usize,
        mesh: &DeviceMesh,
    ) -> Result<Self> {
        let parts = LinearParts::new(weight, bias, in_features, out_features);
        Self::from_parts(parts, mesh)
    }

    fn from_parts(parts: LinearParts, mesh: &DeviceMesh) -> Result<Self> {
        let name = "Linear2d";
        let grid = Grid2d::new(mesh)?;
        let i = grid.divide(name, "in_features", parts.in_features)?;
        let o = grid.divide(name, "out_features", parts.out_features)?;
        if parts.weight.dims() != [i, o] {
            candle_core::bail!(
                "{name}: rank ({}, {}) has a weight block of shape {:?}, expected [in / q, out / q] = [{i}, {o}]",
                grid.row,
                grid.col,
                parts.weight.dims()
            );
        }
        if let Some(b) = &parts.bias {
            let want = grid.vector_part(name, parts.out_features)?.size(grid.row);
            if b.dims() != [want] {
                candle_core::bail!(
                    "{name}: rank ({}, {}) has a bias part of shape {:?}, expected [{want}]",
                    grid.row,
                    grid.col,
                    b.dims()
                );
            }
        }
        Ok(Self { parts, grid })
    }

    /// A layer from the full dense weight in candle's `[out, in]` layout and bias `[out]`:
    /// every rank keeps its blocks.
    pub fn from_dense(weight: &Tensor, bias: Option<&Tensor>, mesh: &DeviceMesh) -> Result<Self> {
        let grid = Grid2d::new(mesh)?;
        Self::from_parts(
            LinearParts::from_dense(&grid, "Linear2d", weight, bias)?,
            mesh,
        )
    }

    /// Loads this rank's block of `weight` `[out_features, in_features]` and its part of
    /// `bias` `[out_features]` (if `bias`) from `vb`: the tensors of a dense
    /// `candle_nn::linear`. Each rank reads only the rows of the weight that hold its block
    /// (`1 / q` of the tensor) and only its part of the bias, and keeps exactly what
    /// [`Linear2d::from_dense`] would have cut from the full tensors.
    ///
    /// ```no_run
    /// # fn main() -> candle_core::Result<()> {
    /// use candle_core::{DType, Device, Module, Tensor};
    /// use candle_tp::comm::DeviceMesh;
    /// use candle_tp::{Linear2d, ShardedVarBuilder};
    ///
    /// let pg = candle_tp::init_from_env(&Device::Cpu)?; // 4 ranks under tprun
    /// let mesh = DeviceMesh::grid_2d(&pg)?;
    /// let vb = ShardedVarBuilder::from_safetensors_dir("model/", DType::F32, &Device::Cpu, pg)?;
    /// let fc1 = Linear2d::load(512, 2048, true, &mesh, vb.pp("mlp.fc1"))?;
    /// # Ok(()) }
    /// ```
    pub fn load(
        in_features: usize,
        out_features: usize,
        bias: bool,
        mesh: &DeviceMesh,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let layer = format!("Linear2d '{}'", vb.prefix());
        let grid = Grid2d::new(mesh)?;
        let parts = LinearParts::load(&grid, &layer, &vb, (in_features, out_features), bias)?;
        Self::from_parts(parts, mesh)
    }

    part_accessors!(linear);

    /// The grid the layer runs on.
    pub fn grid(&self) -> &Grid2d {
        &self.grid
    }
}

impl Module for Linear2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let g = &self.grid;
        let (in_features, out_features) = (self.parts.in_features, self.parts.out_features);
        let i = in_features / g.q;
        if x.rank() < 2 || x.dims()[x.rank() - 1] != i {
            candle_core::bail!(
                "Linear2d on rank ({}, {}): the input block has shape {:?}, expected [batch / q, ..., in / q = {i}]",
                g.row,
                g.col,
                x.dims()
            );
        }
        let mut out_dims = x.dims().to_vec();
        let last = out_dims.len() - 1;
        out_dims[last] = out_features / g.q;
        let x2 = x.reshape(((), i))?.contiguous()?;
        let w = self.parts.weight.contiguous()?;
        let y = if x2.device().is_cpu() && w.device().is_cpu() {
            x2.apply_op2(&w, Summa { grid: g.clone() })?
        } else {
            summa::summa_graph(g, &x2, &w)?
        }
        .reshape(out_dims)?;
        match &self.parts.bias {
            None => Ok(y),
            Some(b) => y.broadcast_add(&g.gather_vector("Linear2d", b, out_features)?),
        }
    }
}

/// LayerNorm over a hidden dimension split in the 2D layout: statistics summed over the row
/// group; scale and shift split like a bias.
#[derive(Debug, Clone)]
pub struct LayerNorm2d {
    parts: NormParts,
    eps: f64,
    grid: Grid2d,
}

impl LayerNorm2d {
    /// From this rank's parts of the scale and shift (split like [`Linear2d`]'s bias).
    pub fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        hidden: usize,
        eps: f64,
        mesh: &DeviceMesh,
    ) -> Result<Self> {
        let parts = NormParts::new(weight, bias, hidden);
        Self::from_parts(parts, eps, mesh)
    }

    fn from_parts(parts: NormParts, eps: f64, mesh: &DeviceMesh) -> Result<Self> {
        let name = "LayerNorm2d";
        let grid = Grid2d::new(mesh)?;
        let want = grid.vector_part(name, parts.hidden)?.size(grid.row);
        parts.check(name, &format!("({}, {})", grid.row, grid.col), want)?;
        Ok(Self { parts, eps, grid })
    }

    /// From the full scale and shift `[hidden]`.
    pub fn from_dense(
        weight: &Tensor,
        bias: Option<&Tensor>,
        eps: f64,
        mesh: &DeviceMesh,
    ) -> Result<Self> {
        let grid = Grid2d::new(mesh)?;
        let parts = NormParts::from_dense(&grid, "LayerNorm2d", weight, bias)?;
        Self::from_parts(parts, eps, mesh)
    }

    /// Loads this rank's parts of `weight` and `bias` `[hidden]` from `vb`: the tensors of a
    /// dense `candle_nn::layer_norm`.
    pub fn load(hidden: usize, eps: f64, mesh: &DeviceMesh, vb: ShardedVarBuilder) -> Result<Self> {
        let layer = format!("LayerNorm2d '{}'", vb.prefix());
        let parts = NormParts::load(&Grid2d::new(mesh)?, &layer, &vb, hidden)?;
        Self::from_parts(parts, eps, mesh)
    }

    part_accessors!(norm);
}

impl Module for LayerNorm2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let g = &self.grid;
        let who = || format!("LayerNorm2d on rank ({}, {})", g.row, g.col);
        let gather = |v: &Tensor| g.gather_vector("LayerNorm2d", v, self.parts.hidden);
        self.parts
            .forward(&who, x, g.q, &g.row_group, self.eps, gather)
    }
}

/// The two-layer MLP `fc2(act(fc1(x)))` in the 2D layout (the output has the input's layout).
pub type Mlp2d = TwoLayerMlp<Linear2d, Linear2d>;

impl Mlp2d {
    /// From two layers; `fc1`'s output features must be `fc2`'s input features.
    pub fn new(fc1: Linear2d, fc2: Linear2d, act: Activation) -> Result<Self> {
        if fc1.out_features() != fc2.in_features() {
            candle_core::bail!(
                "Mlp2d: fc1 has {} output features but fc2 takes {}",
                fc1.out_features(),
                fc2.in_features()
            );
        }
        Ok(Self { fc1, fc2, act })
    }

    /// Loads `fc1` (`[d_ff, d_model]`) and `fc2` (`[d_model, d_ff]`), both with bias, under
    /// the names `fc1_name` and `fc2_name` of `vb`.
    pub fn load(
        d_model: usize,
        d_ff: usize,
        act: Activation,
        fc1_name: &str,
        fc2_name: &str,
        mesh: &DeviceMesh,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let fc1 = Linear2d::load(d_model, d_ff, true, mesh, vb.pp(fc1_name))?;
        let fc2 = Linear2d::load(d_ff, d_model, true, mesh, vb.pp(fc2_name))?;
        Self::new(fc1, fc2, act)
    }
}
