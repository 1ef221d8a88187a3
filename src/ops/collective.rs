//! Collectives on Candle tensors, as `CustomOp1`s whose backward is the conjugate collective.
//!
//! One op type serves everything: a forward [`Kind`] and the kind its gradient goes through.
//! The backward of an op applies another op of this type with the two kinds swapped, so
//! double backward works too.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::kind::who;
// Re-exported: the 2D layers build their ops from it (`nn/parallel_2d/summa.rs`).
pub(crate) use super::kind::Kind;
use crate::comm::{Element, ProcessGroup, ReduceOp};

/// A collective as a Candle op: `fwd` in the forward pass, `bwd` on the gradient.
pub(crate) struct CollectiveOp {
    pub(crate) pg: ProcessGroup,
    pub(crate) fwd: Kind,
    /// `None`: the op has no gradient (plain collectives such as `broadcast`).
    pub(crate) bwd: Option<Kind>,
}

impl CollectiveOp {
    /// Applies the op to `x` (made contiguous first).
    pub(crate) fn apply(
        pg: &ProcessGroup,
        x: &Tensor,
        fwd: Kind,
        bwd: Option<Kind>,
    ) -> Result<Tensor> {
        let op = CollectiveOp {
            pg: pg.clone(),
            fwd,
            bwd,
        };
        let x = x.contiguous()?;
        if op.bwd.is_some() {
            x.apply_op1(op)
        } else {
            x.apply_op1_no_bwd(&op)
        }
    }
}

fn prod(d: &[usize]) -> usize {
    d.iter().product()
}

/// Runs `kind` on a contiguous buffer with dims `dims`; returns the output and its dims.
pub(crate) fn run_kind<T: Element>(
    pg: &ProcessGroup,
    kind: &Kind,
    data: &[T],
    dims: &[usize],
) -> Result<(Vec<T>, Vec<usize>)> {
    let who = || who(pg, kind);
    // Argument errors abort the group (`refuse`): the peers are already waiting in the
    // collective this rank will not start.
    let check_dim = |dim: usize| -> Result<()> {
        if dim >= dims.len() {
            return Err(pg.refuse(format!(
                "{}: tensor of shape {dims:?} has no dimension {dim}",
                who()
            )));
        }
        Ok(())
    };
    let check_sizes = |sizes: &[usize]| -> Result<()> {
        if sizes.len() != pg.size() {
            return Err(pg.refuse(format!(
                "{}: {} per-rank sizes for {} ranks",
                who(),
                sizes.len(),
                pg.size()
            )));
        }
        Ok(())
    };
    // A split of dim `dim` into per-rank `sizes` that must add up to it: (dim, its size, the
    // elements before it, the elements after it).
    let check_shares = |dim: usize, sizes: &[usize]| -> Result<(usize, usize, usize, usize)> {
        check_dim(dim)?;
        check_sizes(sizes)?;
        let total: usize = sizes.iter().sum();
        if dims[dim] != total {
            return Err(pg.refuse(format!("{}: tensor has {} along dim {dim} (shape {dims:?}), the shares {sizes:?} add up to {total}", who(), dims[dim])));
        }
        Ok((dim, total, prod(&dims[..dim]), prod(&dims[dim + 1..])))
    };
    match kind {
        Kind::Identity => Ok((data.to_vec(), dims.to_vec())),
        Kind::AllReduce(op) => {
            // Out of place: the engine reads the input where it lies (no copy first), and a
            // zeroed f32 buffer is a lazily mapped allocation.
            let mut out = vec![T::default(); data.len()];
            pg.all_reduce_slice_into(data, &mut out, *op)?;
            Ok((out, dims.to_vec()))
        }
        Kind::Broadcast { root } => {
            let mut out = data.to_vec();
            pg.broadcast_slice(&mut out, *root)?;
            Ok((out, dims.to_vec()))
        }
        Kind::Reduce { root } => {
            if *root >= pg.size() {
                return Err(pg.refuse(format!("{}: root {root} is not a rank", who())));
            }
            // A reduce-scatter in which the root owns every element.
            let counts: Vec<usize> = (0..pg.size())
                .map(|r| if r == *root { data.len() } else { 0 })
                .collect();
            let mut out = vec![T::default(); counts[pg.rank()]];
            pg.reduce_scatter_v_slice(data, &mut out, &counts, ReduceOp::Sum)?;
            if pg.rank() != *root {
                out = vec![T::default(); data.len()];
            }
            Ok((out, dims.to_vec()))
        }
        Kind::AllToAll { send, recv } => {
            check_dim(0)?;
            check_sizes(send)?;
            check_sizes(recv)?;
            let rows: usize = send.iter().sum();
            if dims[0] != rows {
                return Err(pg.refuse(format!(
                    "{}: tensor has {} rows (shape {dims:?}), the rows sent {send:?} add up to {rows}",
                    who(),
                    dims[0]
                )));
            }
            let inner = prod(&dims[1..]);
            let sends: Vec<usize> = send.iter().map(|r| r * inner).collect();
            let recvs: Vec<usize> = recv.iter().map(|r| r * inner).collect();
            let mut out = vec![T::default(); recvs.iter().sum()];
            pg.all_to_all_v_slice(data, &sends, &mut out, &recvs)?;
            let mut out_dims = dims.to_vec();
            out_dims[0] = recv.iter().sum();
            Ok((out, out_dims))
        }
        Kind::AllGather { dim, sizes } => {
            check_dim(*dim)?;
            check_sizes(sizes)?;
            let (dim, me) = (*dim, pg.rank());
            if dims[dim] != sizes[me] {
                return Err(pg.refuse(format!(
                    "{}: this rank's tensor has {} along dim {dim} (shape {dims:?}) but its share is {} (shares {sizes:?})",
                    who(), dims[dim], sizes[me]
                )));
            }
            let (outer, inner) = (prod(&dims[..dim]), prod(&dims[dim + 1..]));
            let counts: Vec<usize> = sizes.iter().map(|s| s * outer * inner).collect();
            let total: usize = sizes.iter().sum();
            let mut gathered = vec![T::default(); counts.iter().sum()];
            pg.all_gather_v_slice(data, &mut gathered, &counts)?;
            let mut out_dims = dims.to_vec();
            out_dims[dim] = total;
            if outer == 1 {
                return Ok((gathered, out_dims));
            }
            // Rank-major blocks [r][outer][s_r * inner] -> [outer][total * inner].
            let mut out = vec![T::default(); gathered.len()];
            let (mut src_off, mut col) = (0, 0);
            for &s in sizes {
                let run = s * inner;
                for o in 0..outer {
                    let dst = o * total * inner + col;
                    out[dst..dst + run]
                        .copy_from_slice(&gathered[src_off + o * run..src_off + (o + 1) * run]);
                }
                src_off += outer * run;
                col += run;
            }
            Ok((out, out_dims))
        }
        Kind::Split { dim, sizes } => {
            let (dim, total, outer, inner) = check_shares(*dim, sizes)?;
            let start: usize = sizes[..pg.rank()].iter().sum::<usize>() * inner;
            let run = sizes[pg.rank()] * inner;
            let mut out = Vec::with_capacity(outer * run);
            for o in 0..outer {
                let base = o * total * inner + start;
                out.extend_from_slice(&data[base..base + run]);
            }
            let mut out_dims = dims.to_vec();
            out_dims[dim] = sizes[pg.rank()];
            Ok((out, out_dims))
        }
        Kind::ReduceScatter { dim, sizes, op } => {
            let (dim, total, outer, inner) = check_shares(*dim, sizes)?;
            let counts: Vec<usize> = sizes.iter().map(|s| s * outer * inner).collect();
            let mut out = vec![T::default(); counts[pg.rank()]];
            if outer == 1 {
                pg.reduce_scatter_v_slice(data, &mut out, &counts, *op)?;
            } else {
                // [outer][total * inner] -> rank-major blocks [r][outer][s_r * inner].
                let mut blocks = Vec::with_capacity(data.len());
                let mut col = 0;
                for &s in sizes {
                    let run = s * inner;
                    for o in 0..outer {
                        let src = o * total * inner + col;
                        blocks.extend_from_slice(&data[src..src + run]);
                    }
                    col += run;
                }
                pg.reduce_scatter_v_slice(&blocks, &mut out, &counts, *op)?;
            }
            let mut out_dims = dims.to_vec();
            out_dims[dim] = sizes[pg.rank()];
            Ok((out, out_dims))
        }
    }
}

/// Runs `$body` on the contiguous slice of a CPU storage of any dtype collectives carry, with
/// `$v` the typed slice; `$body` gives `(Vec<T>, shape)`, wrapped back in the same dtype.
/// `$name` names the op in errors.
macro_rules! map_cpu_storage {
    ($storage:expr, $layout:expr, $name:expr, |$v:ident| $body:expr) => {{
        let Some((start, end)) = $layout.contiguous_offsets() else {
            candle_core::bail!("{}: the input must be contiguous", $name);
        };
        map_cpu_storage!(@arms $storage, start, end, $name, |$v| $body,
            [F32, F64, F16, BF16, U8, U32, I16, I32, I64])
    }};
    (@arms $storage:expr, $start:ident, $end:ident, $name:expr, |$v:ident| $body:expr,
        [$($variant:ident),*]) => {
        match $storage {
            $(CpuStorage::$variant(all) => {
                let $v = &all[$start..$end];
                let (out, shape) = $body;
                Ok((CpuStorage::$variant(out), shape))
            })*
            other => candle_core::bail!(
                "{}: dtype {:?} is not supported by collectives (use f32, f64, f16, bf16, u8, u32, i16, i32, i64)",
                $name, candle_core::backend::BackendStorage::dtype(other)
            ),
        }
    };
}
pub(super) use map_cpu_storage;

impl CustomOp1 for CollectiveOp {
    fn name(&self) -> &'static str {
        self.fwd.name()
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = layout.dims();
        map_cpu_storage!(storage, layout, self.fwd.name(), |v| {
            let (out, d) = run_kind(&self.pg, &self.fwd, v, dims)?;
            (out, Shape::from(d))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::fwd(&self.pg, &self.fwd, storage, layout, |cpu, l| {
            self.cpu_fwd(cpu, l)
        })
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        match &self.bwd {
            None => candle_core::bail!("{} has no gradient", self.fwd.name()),
            Some(Kind::Identity) => Ok(Some(grad_res.clone())),
            Some(k) => Ok(Some(CollectiveOp::apply(
                &self.pg,
                grad_res,
                k.clone(),
                Some(self.fwd.clone()),
            )?)),
        }
    }
}
