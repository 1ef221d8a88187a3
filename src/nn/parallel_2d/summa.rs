//! The SUMMA matrix product on a 2D grid as a Candle op, its backward SUMMAs as the gradient.

use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Tensor};

use super::grid::Grid2d;
use crate::comm::ProcessGroup;
use crate::ops::collective::{CollectiveOp, Kind};

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

/// Sums `t` over `pg` into rank `root` (`Some` there, `None` elsewhere): MPI's reduce
/// ([`Kind::Reduce`], without a gradient: the backward SUMMAs call it).
pub(crate) fn reduce_to(pg: &ProcessGroup, t: &Tensor, root: usize) -> Result<Option<Tensor>> {
    if pg.size() == 1 {
        return Ok(Some(t.clone()));
    }
    let sum = CollectiveOp::apply(pg, t, Kind::Reduce { root }, None)?;
    Ok((pg.rank() == root).then_some(sum))
}

/// `Y = X W` on 2D blocks by SUMMA, built from differentiable collectives: step `t`
/// multiplies the row group's broadcast of `X[row, t]` by the column group's broadcast of
/// `W[t, col]`. A broadcast's gradient is the sum of its outputs' gradients on the root
/// ([`Kind::Reduce`]), so Candle's backward through these steps runs the two backward SUMMAs
/// of [`Summa`]. Any device whose collectives have a forward (CUDA: NCCL, or the CPU engines
/// through host memory); [`Summa`] is the CPU's, which keeps no graph of `q` steps.
pub(super) fn summa_graph(grid: &Grid2d, x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let bcast = |pg: &ProcessGroup, t: &Tensor, root: usize| -> Result<Tensor> {
        if !t.track_op() {
            return pg.broadcast(t, root);
        }
        CollectiveOp::apply(pg, t, Kind::Broadcast { root }, Some(Kind::Reduce { root }))
    };
    let mut y: Option<Tensor> = None;
    for t in 0..grid.q {
        let a = bcast(&grid.row_group, x, t)?;
        let b = bcast(&grid.col_group, w, t)?;
        let p = a.matmul(&b)?;
        y = Some(match y {
            None => p,
            Some(y) => (y + p)?,
        });
    }
    y.ok_or_else(|| candle_core::Error::msg("SUMMA on an empty grid"))
}

/// `Y = X W` on 2D blocks, by SUMMA, with the backward SUMMAs as its gradient.
pub(super) struct Summa {
    pub(super) grid: Grid2d,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::DeviceMesh;
    use candle_core::Var;

    /// The broadcast-built SUMMA (the path off the CPU) against the `Summa` op, on a 2 x 2 grid
    /// of CPU threads: the same product, and through Candle's backward the same gradients of
    /// both blocks, up to summation order (f32).
    #[test]
    fn summa_graph_equals_the_summa_op() -> Result<()> {
        let errs = crate::run_threads(4, |pg| {
            let mesh = DeviceMesh::grid_2d(&pg).map_err(candle_core::Error::wrap)?;
            let grid = Grid2d::new(&mesh)?;
            let seed = 10 * pg.rank() as u64;
            let x = Var::from_tensor(&crate::rng::seeded_uniform(
                &[3, 4],
                seed,
                1.0,
                &Device::Cpu,
            )?)?;
            let w = Var::from_tensor(&crate::rng::seeded_uniform(
                &[4, 5],
                seed + 1,
                1.0,
                &Device::Cpu,
            )?)?;
            let dy = crate::rng::seeded_uniform(&[3, 5], seed + 2, 1.0, &Device::Cpu)?;
            let run = |graph: bool| -> Result<(Tensor, Tensor, Tensor)> {
                let y = if graph {
                    summa_graph(&grid, x.as_tensor(), w.as_tensor())?
                } else {
                    x.as_tensor()
                        .apply_op2(w.as_tensor(), Summa { grid: grid.clone() })?
                };
                let g = (&y * &dy)?.sum_all()?.backward()?;
                let gx = g.get(x.as_tensor()).cloned().expect("dX");
                let gw = g.get(w.as_tensor()).cloned().expect("dW");
                Ok((y, gx, gw))
            };
            let (a, b) = (run(true)?, run(false)?);
            let d = |p: &Tensor, q: &Tensor| -> Result<f32> {
                let v: Vec<f32> = (p - q)?.abs()?.flatten_all()?.to_vec1()?;
                assert!(v.iter().all(|e| e.is_finite()), "non-finite");
                Ok(v.into_iter().fold(0f32, f32::max))
            };
            // A gradient that is all zeros would pass trivially: the blocks' gradients are not.
            assert!(a.1.abs()?.sum_all()?.to_scalar::<f32>()? > 0.1);
            Ok([d(&a.0, &b.0)?, d(&a.1, &b.1)?, d(&a.2, &b.2)?])
        })?;
        for (rank, e) in errs.iter().enumerate() {
            assert!(
                e.iter().all(|&e| e <= 1e-5),
                "rank {rank}: y, dX, dW differ by {e:?}"
            );
        }
        Ok(())
    }
}
