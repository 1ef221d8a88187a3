//! [`Grid2d`]: this rank's place in the `q × q` grid of 2D tensor parallelism and the row
//! and column groups its layers talk over, and how it cuts a weight, a bias or a norm into
//! the blocks a rank holds. The 2D layers (`parallel_2d.rs`) and their SUMMA op
//! (`parallel_2d/summa.rs`) both read it.

use std::ops::Range;

use candle_core::{Result, Tensor};

use crate::comm::{DeviceMesh, ProcessGroup};
use crate::nn::parallel_parts::Placement;
use crate::ops::gather_from_sp;
use crate::Partition;

/// This rank's place in a `q × q` grid and the two groups 2D layers talk over.
#[derive(Debug, Clone)]
pub struct Grid2d {
    pub(super) q: usize,
    pub(super) row: usize,
    pub(super) col: usize,
    pub(super) row_group: ProcessGroup,
    pub(super) col_group: ProcessGroup,
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

    pub(super) fn divide(&self, layer: &str, what: &str, n: usize) -> Result<usize> {
        if n == 0 || !n.is_multiple_of(self.q) {
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
    pub(super) fn vector_part(&self, layer: &str, n: usize) -> Result<Partition> {
        let block = self.divide(layer, "the feature count", n)?;
        Partition::new(block, self.q).map_err(|e| {
            candle_core::Error::msg(format!(
                "{layer}: cannot split a block of {block} features over the {} ranks of a column: {e}",
                self.q
            ))
        })
    }

    /// The elements of a full vector of `n` features (bias, LayerNorm scale) this rank holds.
    pub(super) fn vector_range(&self, layer: &str, n: usize) -> Result<Range<usize>> {
        let r = self.vector_part(layer, n)?.range(self.row);
        let base = self.col * (n / self.q);
        Ok(base + r.start..base + r.end)
    }

    /// The rows (output features) and columns (input features) of a dense `[out, in]` weight
    /// that make this rank's block.
    pub(super) fn weight_block(
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

    /// The full block `col` of a vector from this rank's part (all-gather over the column
    /// group; the gradient is reduce-scattered back).
    pub(super) fn gather_vector(&self, layer: &str, v: &Tensor, n: usize) -> Result<Tensor> {
        let part = self.vector_part(layer, n)?;
        gather_from_sp(v, &self.col_group, &part, 0)
    }
}

/// A bias and a layer norm's scale and shift are split alike in 2D.
impl Placement for Grid2d {
    fn weight_ranges(
        &self,
        layer: &str,
        out: usize,
        inp: usize,
    ) -> Result<(Range<usize>, Range<usize>)> {
        self.weight_block(layer, out, inp)
    }

    fn bias_range(&self, layer: &str, n: usize) -> Result<Range<usize>> {
        self.vector_range(layer, n)
    }

    fn norm_range(&self, layer: &str, n: usize) -> Result<Range<usize>> {
        self.vector_range(layer, n)
    }
}
