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
//! The matrix product is one Candle `CustomOp2` whose `bwd` runs the two backward SUMMAs, so
//! the layers train through Candle's `backward()`. CPU tensors, f32/f64/f16/bf16.

use std::ops::Range;

use candle_core::{
    CpuStorage, CustomOp2, DType, Device, Layout, Module, Result, Shape, Tensor, WithDType, D,
};
use candle_nn::Activation;

use crate::comm::{DeviceMesh, Element, ProcessGroup, ReduceOp};
use crate::ops::{copy_to_tp, gather_from_sp, reduce_from_tp};
use crate::Partition;

/// This rank's place in a `q × q` grid and the two groups 2D layers talk over.
#[derive(Debug, Clone)]
pub struct Grid2d {
    q: usize,
    row: usize,
    col: usize,
    row_group: ProcessGroup,
    col_group: ProcessGroup,
}

impl Grid2d {
    /// The grid of a 2D mesh (two axes of the same size `q`).
    pub fn new(mesh: &DeviceMesh) -> Result<Self> {
        let dims = mesh.dims();
        let (Some(row_group), Some(col_group)) = (mesh.row_group(), mesh.col_group()) else {
            candle_core::bail!(
                "2D tensor parallelism needs a q x q mesh (DeviceMesh::grid_2d), got dims {dims:?}"
            );
        };
        if dims[0] != dims[1] {
            candle_core::bail!(
                "2D tensor parallelism needs a square q x q mesh, got {} x {}",
                dims[0],
                dims[1]
            );
        }
        Ok(Self {
            q: dims[0],
            row: mesh.coord()[0],
            col: mesh.coord()[1],
            row_group: row_group.clone(),
            col_group: col_group.clone(),
        })
    }

    /// The side of the grid.
    pub fn q(&self) -> usize {
        self.q
    }

    /// This rank's row.
    pub fn row(&self) -> usize {
        self.row
    }

    /// This rank's column.
    pub fn col(&self) -> usize {
        self.col
    }

    /// The ranks of this rank's row (same `row`, ordered by `col`).
    pub fn row_group(&self) -> &ProcessGroup {
        &self.row_group
    }

    /// The ranks of this rank's column (same `col`, ordered by `row`).
    pub fn col_group(&self) -> &ProcessGroup {
        &self.col_group
    }

    fn divide(&self, layer: &str, what: &str, n: usize) -> Result<usize> {
        if n == 0 || n % self.q != 0 {
            candle_core::bail!(
                "{layer}: {what} = {n} must be a positive multiple of q = {} (2D tensor parallelism on a {} x {} grid)",
                self.q,
                self.q,
                self.q
            );
        }
        Ok(n / self.q)
    }

    /// How the block `col` of a vector of `n` features (a bias) is split over the column
    /// group: this rank holds `part.range(row)` of it.
    fn vector_part(&self, layer: &str, n: usize) -> Result<Partition> {
        let block = self.divide(layer, "the feature count", n)?;
        Partition::new(block, self.q).map_err(|e| {
            candle_core::Error::msg(format!(
                "{layer}: cannot split a block of {block} features over the {} ranks of a column: {e}",
                self.q
            ))
        })
    }

    /// The elements of a full vector of `n` features (bias, LayerNorm scale) this rank holds.
    pub(crate) fn vector_range(&self, layer: &str, n: usize) -> Result<Range<usize>> {
        let r = self.vector_part(layer, n)?.range(self.row);
        let base = self.col * (n / self.q);
        Ok(base + r.start..base + r.end)
    }

    /// The rows (output features) and columns (input features) of a dense `[out, in]` weight
    /// that make this rank's block.
    pub(crate) fn weight_ranges(
        &self,
        layer: &str,
        out: usize,
        inp: usize,
    ) -> Result<(Range<usize>, Range<usize>)> {
        let i = self.divide(layer, "in_features", inp)?;
        let o = self.divide(layer, "out_features", out)?;
        Ok((
            self.col * o..(self.col + 1) * o,
            self.row * i..(self.row + 1) * i,
        ))
    }

    /// This rank's part of a full vector of `n` features (bias, LayerNorm scale).
    fn slice_vector(&self, layer: &str, v: &Tensor) -> Result<Tensor> {
        let r = self.vector_range(layer, v.dims1()?)?;
        v.narrow(0, r.start, r.len())
    }

    /// The full block `col` of a vector from this rank's part (all-gather over the column
    /// group; the gradient is reduce-scattered back).
    fn gather_vector(&self, layer: &str, v: &Tensor, n: usize) -> Result<Tensor> {
        let part = self.vector_part(layer, n)?;
        gather_from_sp(v, &self.col_group, &part, 0)
    }
}

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

/// An op that is an all-reduce forward and an all-reduce of the gradient backward: a sum
/// that every rank of `pg` uses differently (LayerNorm statistics over split features).
pub(crate) fn all_reduce_both(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    reduce_from_tp(&copy_to_tp(x, pg)?, pg)
}

/// LayerNorm over a hidden dimension whose `hidden` features are split over `pg`: statistics
/// are summed over the group (forward and backward). `x` is this rank's slice, normalised over
/// its last dim.
pub(crate) fn split_layer_norm(
    x: &Tensor,
    pg: &ProcessGroup,
    hidden: usize,
    eps: f64,
) -> Result<Tensor> {
    let n = hidden as f64;
    let mean = (all_reduce_both(&x.sum_keepdim(D::Minus1)?, pg)? / n)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = (all_reduce_both(&xc.sqr()?.sum_keepdim(D::Minus1)?, pg)? / n)?;
    xc.broadcast_div(&(var + eps)?.sqrt()?)
}

/// Copies a contiguous CPU buffer into a tensor.
pub(crate) fn storage_to_tensor(s: &CpuStorage, l: &Layout, op: &str) -> Result<Tensor> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("{op}: the input must be contiguous");
    };
    let dev = Device::Cpu;
    match s {
        CpuStorage::F32(v) => Tensor::from_slice(&v[a..b], l.dims(), &dev),
        CpuStorage::F64(v) => Tensor::from_slice(&v[a..b], l.dims(), &dev),
        CpuStorage::F16(v) => Tensor::from_slice(&v[a..b], l.dims(), &dev),
        CpuStorage::BF16(v) => Tensor::from_slice(&v[a..b], l.dims(), &dev),
        other => candle_core::bail!(
            "{op}: dtype {:?} is not supported (use f32, f64, f16 or bf16)",
            candle_core::backend::BackendStorage::dtype(other)
        ),
    }
}

/// The storage of a CPU tensor (copied).
pub(crate) fn tensor_to_storage(t: &Tensor, op: &str) -> Result<(CpuStorage, Shape)> {
    let flat = t.flatten_all()?;
    let s = match t.dtype() {
        DType::F32 => CpuStorage::F32(flat.to_vec1()?),
        DType::F64 => CpuStorage::F64(flat.to_vec1()?),
        DType::F16 => CpuStorage::F16(flat.to_vec1()?),
        DType::BF16 => CpuStorage::BF16(flat.to_vec1()?),
        d => candle_core::bail!("{op}: dtype {d:?} is not supported (use f32, f64, f16 or bf16)"),
    };
    Ok((s, t.shape().clone()))
}

fn reduce_typed<T: Element + WithDType>(
    pg: &ProcessGroup,
    t: &Tensor,
    root: usize,
) -> Result<Option<Tensor>> {
    let src = t.flatten_all()?.to_vec1::<T>()?;
    let counts: Vec<usize> = (0..pg.size())
        .map(|r| if r == root { src.len() } else { 0 })
        .collect();
    let mut dst = vec![T::default(); counts[pg.rank()]];
    pg.reduce_scatter_v_slice(&src, &mut dst, &counts, ReduceOp::Sum)?;
    if pg.rank() == root {
        Ok(Some(Tensor::from_vec(dst, t.shape(), t.device())?))
    } else {
        Ok(None)
    }
}

/// Sums `t` over `pg` into rank `root` (`Some` there, `None` elsewhere): MPI's reduce, as a
/// reduce-scatter in which the root owns every element.
pub(crate) fn reduce_to(pg: &ProcessGroup, t: &Tensor, root: usize) -> Result<Option<Tensor>> {
    if pg.size() == 1 {
        return Ok(Some(t.clone()));
    }
    match t.dtype() {
        DType::F32 => reduce_typed::<f32>(pg, t, root),
        DType::F64 => reduce_typed::<f64>(pg, t, root),
        DType::F16 => reduce_typed::<half::f16>(pg, t, root),
        DType::BF16 => reduce_typed::<half::bf16>(pg, t, root),
        d => candle_core::bail!(
            "reduce on group '{}': dtype {d:?} is not supported",
            pg.name()
        ),
    }
}

/// `Y = X W` on 2D blocks, by SUMMA, with the backward SUMMAs as its gradient.
struct Summa {
    grid: Grid2d,
}

impl Summa {
    /// `Y[row, col] = Σ_t X[row, t] W[t, col]`.
    fn ab(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let g = &self.grid;
        let mut y: Option<Tensor> = None;
        for t in 0..g.q {
            let a = g.row_group.broadcast(x, t)?;
            let b = g.col_group.broadcast(w, t)?;
            let p = a.matmul(&b)?;
            y = Some(match y {
                None => p,
                Some(y) => (y + p)?,
            });
        }
        y.ok_or_else(|| candle_core::Error::msg("SUMMA on an empty grid"))
    }

    /// `dX[row, t] = Σ_col dY[row, col] W[t, col]ᵀ`.
    fn abt(&self, dy: &Tensor, w: &Tensor) -> Result<Tensor> {
        let g = &self.grid;
        let mut dx = None;
        for t in 0..g.q {
            let b = g.col_group.broadcast(w, t)?;
            let p = dy.matmul(&b.t()?)?;
            if let Some(s) = reduce_to(&g.row_group, &p, t)? {
                dx = Some(s);
            }
        }
        dx.ok_or_else(|| candle_core::Error::msg("SUMMA dX: this rank received no block"))
    }

    /// `dW[t, col] = Σ_row X[row, t]ᵀ dY[row, col]`.
    fn atb(&self, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let g = &self.grid;
        let mut dw = None;
        for t in 0..g.q {
            let a = g.row_group.broadcast(x, t)?;
            let p = a.t()?.matmul(dy)?;
            if let Some(s) = reduce_to(&g.col_group, &p, t)? {
                dw = Some(s);
            }
        }
        dw.ok_or_else(|| candle_core::Error::msg("SUMMA dW: this rank received no block"))
    }
}

impl CustomOp2 for Summa {
    fn name(&self) -> &'static str {
        "candle-tp-summa-2d"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = storage_to_tensor(s1, l1, self.name())?;
        let w = storage_to_tensor(s2, l2, self.name())?;
        tensor_to_storage(&self.ab(&x, &w)?, self.name())
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dy.contiguous()?;
        let (x, w) = (x.detach(), w.detach());
        Ok((Some(self.abt(&dy, &w)?), Some(self.atb(&x, &dy)?)))
    }
}

/// A linear layer `y = x W + b` on a `q × q` grid (SUMMA). Input and output have the 2D
/// layout of the [module docs](self): `[batch / q, …, in / q]` → `[batch / q, …, out / q]`.
#[derive(Debug, Clone)]
pub struct Linear2d {
    weight: Tensor,
    bias: Option<Tensor>,
    in_features: usize,
    out_features: usize,
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
        let name = "Linear2d";
        let grid = Grid2d::new(mesh)?;
        let i = grid.divide(name, "in_features", in_features)?;
        let o = grid.divide(name, "out_features", out_features)?;
        if weight.dims() != [i, o] {
            candle_core::bail!(
                "{name}: rank ({}, {}) has a weight block of shape {:?}, expected [in / q, out / q] = [{i}, {o}]",
                grid.row,
                grid.col,
                weight.dims()
            );
        }
        if let Some(b) = &bias {
            let want = grid.vector_part(name, out_features)?.size(grid.row);
            if b.dims() != [want] {
                candle_core::bail!(
                    "{name}: rank ({}, {}) has a bias part of shape {:?}, expected [{want}]",
                    grid.row,
                    grid.col,
                    b.dims()
                );
            }
        }
        Ok(Self {
            weight,
            bias,
            in_features,
            out_features,
            grid,
        })
    }

    /// A layer from the full dense weight in candle's `[out, in]` layout and bias `[out]`:
    /// every rank keeps its blocks.
    pub fn from_dense(weight: &Tensor, bias: Option<&Tensor>, mesh: &DeviceMesh) -> Result<Self> {
        let name = "Linear2d";
        let grid = Grid2d::new(mesh)?;
        let (out, inp) = weight.dims2()?;
        let (rows, cols) = grid.weight_ranges(name, out, inp)?;
        let w = weight
            .narrow(0, rows.start, rows.len())?
            .narrow(1, cols.start, cols.len())?
            .t()?
            .contiguous()?;
        let b = bias.map(|b| grid.slice_vector(name, b)).transpose()?;
        Self::new(w, b, inp, out, mesh)
    }

    /// This rank's weight block `[in / q, out / q]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// This rank's part of the bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Input features (full).
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features (full).
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// The grid the layer runs on.
    pub fn grid(&self) -> &Grid2d {
        &self.grid
    }
}

impl Module for Linear2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let g = &self.grid;
        let i = self.in_features / g.q;
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
        out_dims[last] = self.out_features / g.q;
        let x2 = x.reshape(((), i))?.contiguous()?;
        let w = self.weight.contiguous()?;
        let y = x2
            .apply_op2(&w, Summa { grid: g.clone() })?
            .reshape(out_dims)?;
        match &self.bias {
            None => Ok(y),
            Some(b) => y.broadcast_add(&g.gather_vector("Linear2d", b, self.out_features)?),
        }
    }
}

/// LayerNorm over a hidden dimension split in the 2D layout: statistics summed over the row
/// group; scale and shift split like a bias.
#[derive(Debug, Clone)]
pub struct LayerNorm2d {
    weight: Tensor,
    bias: Option<Tensor>,
    hidden: usize,
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
        let name = "LayerNorm2d";
        let grid = Grid2d::new(mesh)?;
        let want = grid.vector_part(name, hidden)?.size(grid.row);
        for (what, t) in [("scale", Some(&weight)), ("shift", bias.as_ref())] {
            if let Some(t) = t {
                if t.dims() != [want] {
                    candle_core::bail!(
                        "{name}: rank ({}, {}) has a {what} part of shape {:?}, expected [{want}]",
                        grid.row,
                        grid.col,
                        t.dims()
                    );
                }
            }
        }
        Ok(Self {
            weight,
            bias,
            hidden,
            eps,
            grid,
        })
    }

    /// From the full scale and shift `[hidden]`.
    pub fn from_dense(
        weight: &Tensor,
        bias: Option<&Tensor>,
        eps: f64,
        mesh: &DeviceMesh,
    ) -> Result<Self> {
        let grid = Grid2d::new(mesh)?;
        let hidden = weight.dims1()?;
        let w = grid.slice_vector("LayerNorm2d", weight)?;
        let b = bias
            .map(|b| grid.slice_vector("LayerNorm2d", b))
            .transpose()?;
        Self::new(w, b, hidden, eps, mesh)
    }

    /// This rank's part of the scale.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// This rank's part of the shift.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl Module for LayerNorm2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let g = &self.grid;
        let h = self.hidden / g.q;
        if x.dims().last() != Some(&h) {
            candle_core::bail!(
                "LayerNorm2d on rank ({}, {}): the input block has shape {:?}, its last dim must be hidden / q = {h}",
                g.row,
                g.col,
                x.dims()
            );
        }
        let name = "LayerNorm2d";
        let xn = split_layer_norm(x, &g.row_group, self.hidden, self.eps)?;
        let y = xn.broadcast_mul(&g.gather_vector(name, &self.weight, self.hidden)?)?;
        match &self.bias {
            None => Ok(y),
            Some(b) => y.broadcast_add(&g.gather_vector(name, b, self.hidden)?),
        }
    }
}

/// The two-layer MLP `fc2(act(fc1(x)))` in the 2D layout (the output has the input's layout).
#[derive(Debug, Clone)]
pub struct Mlp2d {
    fc1: Linear2d,
    fc2: Linear2d,
    act: Activation,
}

impl Mlp2d {
    /// From two layers; `fc1`'s output features must be `fc2`'s input features.
    pub fn new(fc1: Linear2d, fc2: Linear2d, act: Activation) -> Result<Self> {
        if fc1.out_features != fc2.in_features {
            candle_core::bail!(
                "Mlp2d: fc1 has {} output features but fc2 takes {}",
                fc1.out_features,
                fc2.in_features
            );
        }
        Ok(Self { fc1, fc2, act })
    }

    /// The first layer.
    pub fn fc1(&self) -> &Linear2d {
        &self.fc1
    }

    /// The second layer.
    pub fn fc2(&self) -> &Linear2d {
        &self.fc2
    }
}

impl Module for Mlp2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.forward(&self.act.forward(&self.fc1.forward(x)?)?)
    }
}
