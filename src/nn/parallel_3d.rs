//! 3D tensor parallelism on a `q × q × q` cube of ranks ([`DeviceMesh::cube_3d`],
//! `rank = i * q² + j * q + k`; Agarwal et al.'s 3D matrix multiplication, as in Colossal-AI
//! 3D).
//!
//! # Layout, stated by every layer
//!
//! Axis `i` (0) always splits the batch. The two other axes (`j` = 1, `k` = 2) split the
//! features and the batch a second time; a [`Layout3d`] says which does which. An activation
//! `[batch, …, hidden]` in layout `L` is held by rank `(i, j, k)` as rows block
//! `i * q + coord[L.rows]` of `batch` (`batch / q²` rows, dim 0) and block
//! `coord[L.features]` of `hidden` (`hidden / q`, the last dim). [`scatter_3d`] and
//! [`gather_3d`] convert.
//!
//! A [`Linear3d`] with input layout `L = (features: a, rows: b)` produces its output in layout
//! `L.swapped() = (features: b, rows: a)`; the next layer is built with that input layout, so
//! layers chain with no hidden state (Colossal-AI instead swaps global input/output groups
//! every time it constructs a 3D layer). [`Mlp3d`] returns to its input's layout.
//!
//! # Linear3d, `Y = X W + b`, input layout `(a, b)`
//!
//! - Weight `[in, out]`: block `(coord[a], coord[b])` (`[in / q, out / q]`), split over axis
//!   `i` along `out`: rank holds part `coord[i]` of `Partition::new(out / q, q)`.
//! - Forward: all-gather `X` over the `b` group (rows) and `W` over the `i` group (columns),
//!   multiply locally, reduce-scatter `Y` over the `a` group (rows).
//! - Backward (Candle's autograd of those mappings): all-gather `dY` over `a`, two local
//!   products, reduce-scatter `dX` over `b` and `dW` over `i`.
//! - Bias: block `coord[b]` of `out`, split over `a` (part `coord[a]`), replicated over `i`;
//!   gathered over `a` (gradient: reduce-scatter) after a copy whose gradient is all-reduced
//!   over `i`.
//!
//! LayerNorm3d: statistics summed over the group of the features axis; scale and shift block
//! `coord[features]`, split over the rows axis and replicated over `i`, like a bias.

use std::ops::Range;

use candle_core::{Module, Result, Tensor};
use candle_nn::Activation;

use super::mlp::TwoLayerMlp;
use super::parallel_parts::{part_accessors, LinearParts, NormParts, Placement};
use crate::comm::{DeviceMesh, ProcessGroup};
use crate::ops::{copy_to_tp, gather_from_sp, reduce_scatter_to_sp};
use crate::{Partition, ShardedVarBuilder};

/// Which axis of the cube splits an activation's features and which splits its rows a second
/// time (axis 0, `i`, always splits the rows first). See the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout3d {
    /// The axis (1 or 2) whose coordinate picks the block of features.
    pub features: usize,
    /// The axis (2 or 1) whose coordinate picks the sub-block of rows within block `i`.
    pub rows: usize,
}

impl Layout3d {
    /// Features split by `j`, rows by `k`: the input of a first layer.
    pub const JK: Layout3d = Layout3d {
        features: 1,
        rows: 2,
    };
    /// Features split by `k`, rows by `j`: the output of a layer that takes [`Layout3d::JK`].
    pub const KJ: Layout3d = Layout3d {
        features: 2,
        rows: 1,
    };

    /// The layout with the two axes exchanged: a [`Linear3d`]'s output layout.
    pub fn swapped(self) -> Self {
        Layout3d {
            features: self.rows,
            rows: self.features,
        }
    }

    pub(crate) fn check(self, what: &str) -> Result<()> {
        if !matches!((self.features, self.rows), (1, 2) | (2, 1)) {
            candle_core::bail!(
                "{what}: a 3D layout splits features and rows by axes 1 and 2 (j and k), got features {}, rows {}",
                self.features,
                self.rows
            );
        }
        Ok(())
    }
}

/// This rank's place in a `q × q × q` cube and its three axis groups.
#[derive(Debug, Clone)]
pub struct Grid3d {
    q: usize,
    coord: [usize; 3],
    groups: [ProcessGroup; 3],
}

impl Grid3d {
    /// The cube of a 3D mesh (three axes of the same size `q`).
    pub fn new(mesh: &DeviceMesh) -> Result<Self> {
        let dims = mesh.dims();
        let side = mesh.side();
        let (3, Some(q)) = (dims.len(), side) else {
            candle_core::bail!(
                "3D tensor parallelism needs a q x q x q mesh (DeviceMesh::cube_3d), got dims {dims:?}"
            );
        };
        let g = |a: usize| {
            mesh.group_along(a)
                .cloned()
                .ok_or_else(|| candle_core::Error::msg("3D mesh without axis groups"))
        };
        let c = mesh.coord();
        Ok(Self {
            q,
            coord: [c[0], c[1], c[2]],
            groups: [g(0)?, g(1)?, g(2)?],
        })
    }

    /// The side of the cube.
    pub fn q(&self) -> usize {
        self.q
    }

    /// This rank's coordinates `(i, j, k)`.
    pub fn coord(&self) -> [usize; 3] {
        self.coord
    }

    /// The ranks that differ from this one only along `axis` (0, 1 or 2).
    pub fn group(&self, axis: usize) -> &ProcessGroup {
        &self.groups[axis.min(2)]
    }

    fn divide(&self, layer: &str, what: &str, n: usize, by: usize) -> Result<usize> {
        if n == 0 || !n.is_multiple_of(by) {
            candle_core::bail!(
                "{layer}: {what} = {n} must be a positive multiple of {by} (3D tensor parallelism on a {q} x {q} x {q} cube)",
                q = self.q
            );
        }
        Ok(n / by)
    }

    /// The split of a block of `n / q` features over `q` ranks.
    fn block_part(&self, layer: &str, n: usize) -> Result<Partition> {
        let block = self.divide(layer, "the feature count", n, self.q)?;
        Partition::new(block, self.q).map_err(|e| {
            candle_core::Error::msg(format!(
                "{layer}: cannot split a block of {block} features over {} ranks: {e}",
                self.q
            ))
        })
    }

    /// The elements of a full `[n]` vector that this rank stores: block `coord[block_axis]`,
    /// part `coord[part_axis]` of it.
    fn vector_range(
        &self,
        layer: &str,
        n: usize,
        block_axis: usize,
        part_axis: usize,
    ) -> Result<Range<usize>> {
        let r = self.block_part(layer, n)?.range(self.coord[part_axis]);
        let base = self.coord[block_axis] * (n / self.q);
        Ok(base + r.start..base + r.end)
    }

    /// The rows (output features) and columns (input features) of a dense `[out, in]` weight
    /// that make this rank's block for a layer whose input has `input`'s layout.
    fn weight_ranges(
        &self,
        layer: &str,
        out: usize,
        inp: usize,
        input: Layout3d,
    ) -> Result<(Range<usize>, Range<usize>)> {
        let i = self.divide(layer, "in_features", inp, self.q)?;
        let o = self.divide(layer, "out_features", out, self.q)?;
        let r = self.block_part(layer, out)?.range(self.coord[0]);
        let (a, b) = (self.coord[input.features], self.coord[input.rows]);
        Ok((b * o + r.start..b * o + r.end, a * i..(a + 1) * i))
    }

    /// The full block of a vector from this rank's part: copy (gradient all-reduced over `i`),
    /// then all-gather over `part_axis` (gradient reduce-scattered).
    fn gather_vector(&self, layer: &str, v: &Tensor, n: usize, part_axis: usize) -> Result<Tensor> {
        let part = self.block_part(layer, n)?;
        let v = copy_to_tp(v, &self.groups[0])?;
        gather_from_sp(&v, &self.groups[part_axis], &part, 0)
    }
}

/// A grid and the layout of a layer's input: which parts of its tensors the rank holds (a
/// bias is split by the layout's rows axis within its features block, a layer norm's scale
/// and shift the other way round).
struct Placed<'a> {
    grid: &'a Grid3d,
    layout: Layout3d,
}

impl Placement for Placed<'_> {
    fn weight_ranges(
        &self,
        layer: &str,
        out: usize,
        inp: usize,
    ) -> Result<(Range<usize>, Range<usize>)> {
        self.grid.weight_ranges(layer, out, inp, self.layout)
    }

    fn bias_range(&self, layer: &str, n: usize) -> Result<Range<usize>> {
        let l = self.layout;
        self.grid.vector_range(layer, n, l.rows, l.features)
    }

    fn norm_range(&self, layer: &str, n: usize) -> Result<Range<usize>> {
        let l = self.layout;
        self.grid.vector_range(layer, n, l.features, l.rows)
    }
}

/// Cuts a full activation `[batch, …, hidden]` into this rank's block in `layout`:
/// `[batch / q², …, hidden / q]`. Errors name the size that does not divide.
pub fn scatter_3d(x: &Tensor, layout: Layout3d, mesh: &DeviceMesh) -> Result<Tensor> {
    let g = Grid3d::new(mesh)?;
    layout.check("scatter_3d")?;
    if x.rank() < 2 {
        candle_core::bail!(
            "scatter_3d: the activation must be [batch, ..., hidden], got shape {:?}",
            x.dims()
        );
    }
    let last = x.rank() - 1;
    let q = g.q;
    let b = g.divide("scatter_3d", "the batch size (dim 0)", x.dims()[0], q * q)?;
    let h = g.divide(
        "scatter_3d",
        "the hidden size (last dim)",
        x.dims()[last],
        q,
    )?;
    let row_block = g.coord[0] * q + g.coord[layout.rows];
    x.narrow(0, row_block * b, b)?
        .narrow(last, g.coord[layout.features] * h, h)
}

/// Reassembles a full activation from every rank's block in `layout`. Not differentiable;
/// for inspection and tests.
pub fn gather_3d(x: &Tensor, layout: Layout3d, mesh: &DeviceMesh) -> Result<Tensor> {
    let g = Grid3d::new(mesh)?;
    layout.check("gather_3d")?;
    let last = x.rank().saturating_sub(1);
    let x = g.groups[layout.features].all_gather(x, last)?;
    let x = g.groups[layout.rows].all_gather(&x, 0)?;
    g.groups[0].all_gather(&x, 0)
}

/// A linear layer `y = x W + b` on a `q × q × q` cube. Input in [`Layout3d`] `input`
/// (`[batch / q², …, in / q]`), output in `input.swapped()` (`[batch / q², …, out / q]`).
#[derive(Debug, Clone)]
pub struct Linear3d {
    parts: LinearParts,
    input: Layout3d,
    grid: Grid3d,
}

impl Linear3d {
    /// A layer from this rank's parts (see the [module docs](self)): `weight`
    /// `[in / q, Partition::new(out / q, q).size(coord[i])]`, `bias`
    /// `[Partition::new(out / q, q).size(coord[input.features])]`.
    pub fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        in_features: usize,
        out_features: usize,
        input: Layout3d,
        mesh: &DeviceMesh,
    ) -> Result<Self> {
        let parts = LinearParts::new(weight, bias, in_features, out_features);
        Self::from_parts(parts, input, mesh)
    }

    fn from_parts(parts: LinearParts, input: Layout3d, mesh: &DeviceMesh) -> Result<Self> {
        let name = "Linear3d";
        input.check(name)?;
        let grid = Grid3d::new(mesh)?;
        let i = grid.divide(name, "in_features", parts.in_features, grid.q)?;
        let part = grid.block_part(name, parts.out_features)?;
        let o = part.size(grid.coord[0]);
        if parts.weight.dims() != [i, o] {
            candle_core::bail!(
                "{name}: rank {:?} has a weight part of shape {:?}, expected [in / q, part of out / q] = [{i}, {o}]",
                grid.coord,
                parts.weight.dims()
            );
        }
        if let Some(b) = &parts.bias {
            let want = part.size(grid.coord[input.features]);
            if b.dims() != [want] {
                candle_core::bail!(
                    "{name}: rank {:?} has a bias part of shape {:?}, expected [{want}]",
                    grid.coord,
                    b.dims()
                );
            }
        }
        Ok(Self { parts, input, grid })
    }

    /// A layer from the full dense weight in candle's `[out, in]` layout and bias `[out]`.
    pub fn from_dense(
        weight: &Tensor,
        bias: Option<&Tensor>,
        input: Layout3d,
        mesh: &DeviceMesh,
    ) -> Result<Self> {
        let name = "Linear3d";
        input.check(name)?;
        let grid = Grid3d::new(mesh)?;
        let place = Placed {
            grid: &grid,
            layout: input,
        };
        let parts = LinearParts::from_dense(&place, name, weight, bias)?;
        Self::from_parts(parts, input, mesh)
    }

    /// Loads this rank's block of `weight` `[out_features, in_features]` and its part of
    /// `bias` `[out_features]` (if `bias`) from `vb`, for an input in layout `input`: each
    /// rank reads only the rows of the weight that hold its block (`1 / q²` of the tensor)
    /// and keeps what [`Linear3d::from_dense`] would have cut.
    pub fn load(
        in_features: usize,
        out_features: usize,
        bias: bool,
        input: Layout3d,
        mesh: &DeviceMesh,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let layer = format!("Linear3d '{}'", vb.prefix());
        input.check(&layer)?;
        let grid = Grid3d::new(mesh)?;
        let place = Placed {
            grid: &grid,
            layout: input,
        };
        let parts = LinearParts::load(&place, &layer, &vb, (in_features, out_features), bias)?;
        Self::from_parts(parts, input, mesh)
    }

    /// The layout the input must have.
    pub fn input_layout(&self) -> Layout3d {
        self.input
    }

    /// The layout of the output (`input_layout().swapped()`).
    pub fn output_layout(&self) -> Layout3d {
        self.input.swapped()
    }

    part_accessors!(linear);
}

impl Module for Linear3d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let g = &self.grid;
        let q = g.q;
        let i = self.parts.in_features / q;
        if x.rank() < 2 || x.dims()[x.rank() - 1] != i {
            candle_core::bail!(
                "Linear3d on rank {:?}: the input block has shape {:?}, expected [batch / q², ..., in / q = {i}]",
                g.coord,
                x.dims()
            );
        }
        let out_features = self.parts.out_features;
        let (a, b) = (self.input.features, self.input.rows);
        let rows = x.dims()[0];
        let row_part = Partition::new(rows * q, q).map_err(candle_core::Error::wrap)?;
        // X[i, a]: rows block i, features block coord[a].
        let x = gather_from_sp(x, &g.groups[b], &row_part, 0)?;
        // W[a, b]: features block coord[a], outputs block coord[b].
        let out_part = g.block_part("Linear3d", out_features)?;
        let w = gather_from_sp(&self.parts.weight, &g.groups[0], &out_part, 1)?;
        let y = x.broadcast_matmul(&w)?;
        let y = reduce_scatter_to_sp(&y, &g.groups[a], &row_part, 0)?;
        match &self.parts.bias {
            None => Ok(y),
            Some(v) => y.broadcast_add(&g.gather_vector("Linear3d", v, out_features, a)?),
        }
    }
}

/// LayerNorm over a hidden dimension in a 3D layout: statistics summed over the features
/// axis group; the output has the input's layout.
#[derive(Debug, Clone)]
pub struct LayerNorm3d {
    parts: NormParts,
    eps: f64,
    layout: Layout3d,
    grid: Grid3d,
}

impl LayerNorm3d {
    /// From this rank's parts of the scale and shift: block `coord[layout.features]`, part
    /// `coord[layout.rows]` of `Partition::new(hidden / q, q)`.
    pub fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        hidden: usize,
        eps: f64,
        layout: Layout3d,
        mesh: &DeviceMesh,
    ) -> Result<Self> {
        let parts = NormParts::new(weight, bias, hidden);
        Self::from_parts(parts, eps, layout, mesh)
    }

    fn from_parts(parts: NormParts, eps: f64, layout: Layout3d, mesh: &DeviceMesh) -> Result<Self> {
        let name = "LayerNorm3d";
        layout.check(name)?;
        let grid = Grid3d::new(mesh)?;
        let want = grid
            .block_part(name, parts.hidden)?
            .size(grid.coord[layout.rows]);
        parts.check(name, &format!("{:?}", grid.coord), want)?;
        Ok(Self {
            parts,
            eps,
            layout,
            grid,
        })
    }

    /// From the full scale and shift `[hidden]`.
    pub fn from_dense(
        weight: &Tensor,
        bias: Option<&Tensor>,
        eps: f64,
        layout: Layout3d,
        mesh: &DeviceMesh,
    ) -> Result<Self> {
        let name = "LayerNorm3d";
        layout.check(name)?;
        let grid = Grid3d::new(mesh)?;
        let place = Placed {
            grid: &grid,
            layout,
        };
        let parts = NormParts::from_dense(&place, name, weight, bias)?;
        Self::from_parts(parts, eps, layout, mesh)
    }

    /// Loads this rank's parts of `weight` and `bias` `[hidden]` from `vb`, for activations
    /// in `layout`.
    pub fn load(
        hidden: usize,
        eps: f64,
        layout: Layout3d,
        mesh: &DeviceMesh,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let layer = format!("LayerNorm3d '{}'", vb.prefix());
        layout.check(&layer)?;
        let grid = Grid3d::new(mesh)?;
        let place = Placed {
            grid: &grid,
            layout,
        };
        let parts = NormParts::load(&place, &layer, &vb, hidden)?;
        Self::from_parts(parts, eps, layout, mesh)
    }

    /// The layout of the input and output.
    pub fn layout(&self) -> Layout3d {
        self.layout
    }

    part_accessors!(norm);
}

impl Module for LayerNorm3d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let g = &self.grid;
        let (f, r) = (self.layout.features, self.layout.rows);
        let who = || format!("LayerNorm3d on rank {:?}", g.coord);
        let gather = |v: &Tensor| g.gather_vector("LayerNorm3d", v, self.parts.hidden, r);
        self.parts
            .forward(&who, x, g.q, &g.groups[f], self.eps, gather)
    }
}

/// The two-layer MLP `fc2(act(fc1(x)))` on a cube: `fc1` takes layout `L`, `fc2` takes
/// `L.swapped()`, so the output is back in `L`.
pub type Mlp3d = TwoLayerMlp<Linear3d, Linear3d>;

impl Mlp3d {
    /// From two layers; `fc2` must take `fc1`'s output layout and features.
    pub fn new(fc1: Linear3d, fc2: Linear3d, act: Activation) -> Result<Self> {
        if fc1.out_features() != fc2.in_features() || fc1.output_layout() != fc2.input_layout() {
            candle_core::bail!(
                "Mlp3d: fc1 gives {} features in layout {:?} but fc2 takes {} in layout {:?}",
                fc1.out_features(),
                fc1.output_layout(),
                fc2.in_features(),
                fc2.input_layout()
            );
        }
        Ok(Self { fc1, fc2, act })
    }

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
        mesh: &DeviceMesh,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let fc1 = Linear3d::load(d_model, d_ff, true, input, mesh, vb.pp(fc1_name))?;
        let output = fc1.output_layout();
        let fc2 = Linear3d::load(d_ff, d_model, true, output, mesh, vb.pp(fc2_name))?;
        Self::new(fc1, fc2, act)
    }

    /// The layout of the input and the output.
    pub fn layout(&self) -> Layout3d {
        self.fc1.input_layout()
    }
}
