//! `cuda_fwd` of the collective op (feature `cuda`).
//!
//! - NCCL groups (feature `nccl`): the collective runs on the `CudaStorage` slice itself, on
//!   the device's stream: no host copy and no synchronisation. Layout changes around it (the
//!   gathered dim is not the leading one, a local split) are `copy2d` kernels on the same
//!   stream.
//! - Groups without NCCL (one rank, or the CPU `threads`/`shm` backends given CUDA tensors):
//!   kinds that do not communicate (identity, split, anything on one rank) are device copies;
//!   the others are staged through host memory and run by the CPU engine.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, Layout, Result, Shape};

use super::kind::{who, Kind};
use crate::comm::ProcessGroup;

/// The geometry of a dim-wise collective: `outer` rows of `total * inner` elements.
struct Geometry {
    outer: usize,
    inner: usize,
    total: usize,
}

/// Checks `dim` and `sizes` against `dims`; `along` is the size the tensor must have along
/// `dim` (this rank's share for a gather, the total for a split or a reduce-scatter).
fn geometry(
    pg: &ProcessGroup,
    kind: &Kind,
    dims: &[usize],
    dim: usize,
    sizes: &[usize],
    gather: bool,
) -> Result<Geometry> {
    if dim >= dims.len() {
        candle_core::bail!(
            "{}: tensor of shape {dims:?} has no dimension {dim}",
            who(pg, kind)
        );
    }
    if sizes.len() != pg.size() {
        candle_core::bail!(
            "{}: {} per-rank sizes for {} ranks",
            who(pg, kind),
            sizes.len(),
            pg.size()
        );
    }
    let total: usize = sizes.iter().sum();
    let along = if gather { sizes[pg.rank()] } else { total };
    if dims[dim] != along {
        candle_core::bail!(
            "{}: tensor has {} along dim {dim} (shape {dims:?}), expected {along} (shares {sizes:?})",
            who(pg, kind),
            dims[dim]
        );
    }
    Ok(Geometry {
        outer: dims[..dim].iter().product(),
        inner: dims[dim + 1..].iter().product(),
        total,
    })
}

fn alloc(s: &CudaStorage, len: usize) -> Result<CudaStorage> {
    // SAFETY: every element of the buffer is written (by a copy or a collective) before the
    // storage is handed to candle.
    unsafe { s.device().alloc_uninit(&Shape::from(len), s.dtype()) }
}

/// Copies the `[outer][s_r * inner]` blocks of every rank between the rank-major layout
/// (rank after rank) and the interleaved one (`[outer][total * inner]`): from `src` (starting
/// at element `src_off`) into `dst`, towards the interleaved layout when `to_full`.
fn permute(
    src: &CudaStorage,
    src_off: usize,
    dst: &mut CudaStorage,
    g: &Geometry,
    sizes: &[usize],
    to_full: bool,
) -> Result<()> {
    let (mut block, mut col) = (0, 0);
    let row = g.total * g.inner;
    for &s in sizes {
        let run = s * g.inner;
        if run > 0 && g.outer > 0 {
            if to_full {
                src.copy2d(dst, g.outer, run, run, row, src_off + block, col)?;
            } else {
                src.copy2d(dst, g.outer, run, row, run, src_off + col, block)?;
            }
        }
        block += g.outer * run;
        col += run;
    }
    Ok(())
}

/// `cuda_fwd` of [`CollectiveOp`].
///
/// `cpu_fwd` is the op's CPU forward, for a group whose backend has no device collectives:
/// the data then goes through host memory.
pub(crate) fn fwd(
    pg: &ProcessGroup,
    kind: &Kind,
    s: &CudaStorage,
    l: &Layout,
    cpu_fwd: impl FnOnce(&CpuStorage, &Layout) -> Result<(CpuStorage, Shape)>,
) -> Result<(CudaStorage, Shape)> {
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("{}: the input must be contiguous", kind.name());
    };
    let dims = l.dims();
    #[cfg(feature = "nccl")]
    if let Some(n) = pg.device_collectives() {
        return nccl_fwd(pg, kind, n, s, start, end, dims);
    }
    let len = end - start;
    let copy = |s: &CudaStorage| -> Result<CudaStorage> {
        let mut out = alloc(s, len)?;
        if len > 0 {
            s.copy2d(&mut out, 1, len, len, len, start, 0)?;
        }
        Ok(out)
    };
    match kind {
        Kind::Identity => Ok((copy(s)?, Shape::from(dims))),
        Kind::Split { dim, sizes } => split(pg, kind, s, start, dims, *dim, sizes),
        Kind::AllReduce(_) | Kind::Broadcast { root: 0 } | Kind::Reduce { root: 0 }
            if pg.size() == 1 =>
        {
            Ok((copy(s)?, Shape::from(dims)))
        }
        Kind::AllGather { dim, sizes } | Kind::ReduceScatter { dim, sizes, .. }
            if pg.size() == 1 =>
        {
            geometry(pg, kind, dims, *dim, sizes, true)?;
            Ok((copy(s)?, Shape::from(dims)))
        }
        _ => {
            // A CPU backend given CUDA tensors: through host memory.
            let cpu = s.to_cpu_storage()?;
            let (out, shape) = cpu_fwd(&cpu, l)?;
            Ok((s.device().storage_from_cpu_storage(&out)?, shape))
        }
    }
}

/// This rank's part of `dim` (no communication).
fn split(
    pg: &ProcessGroup,
    kind: &Kind,
    s: &CudaStorage,
    start: usize,
    dims: &[usize],
    dim: usize,
    sizes: &[usize],
) -> Result<(CudaStorage, Shape)> {
    let g = geometry(pg, kind, dims, dim, sizes, false)?;
    let me = pg.rank();
    let col: usize = sizes[..me].iter().sum::<usize>() * g.inner;
    let run = sizes[me] * g.inner;
    let mut out = alloc(s, g.outer * run)?;
    if g.outer * run > 0 {
        s.copy2d(
            &mut out,
            g.outer,
            run,
            g.total * g.inner,
            run,
            start + col,
            0,
        )?;
    }
    let mut out_dims = dims.to_vec();
    out_dims[dim] = sizes[me];
    Ok((out, Shape::from(out_dims)))
}

/// The input elements `start..end` of `s`, for a [`DeviceCollectives`](crate::comm::DeviceCollectives) call.
#[cfg(feature = "nccl")]
fn src(s: &CudaStorage, start: usize, end: usize) -> crate::comm::DeviceSrc<'_> {
    crate::comm::DeviceSrc {
        storage: s,
        range: start..end,
    }
}

#[cfg(feature = "nccl")]
fn nccl_fwd(
    pg: &ProcessGroup,
    kind: &Kind,
    n: &dyn crate::comm::DeviceCollectives,
    s: &CudaStorage,
    start: usize,
    end: usize,
    dims: &[usize],
) -> Result<(CudaStorage, Shape)> {
    let name = who(pg, kind);
    n.check_device(s.device(), kind.name())?;
    let len = end - start;
    let same = Shape::from(dims);
    match kind {
        Kind::Identity => {
            let mut out = alloc(s, len)?;
            if len > 0 {
                s.copy2d(&mut out, 1, len, len, len, start, 0)?;
            }
            Ok((out, same))
        }
        Kind::Split { dim, sizes } => split(pg, kind, s, start, dims, *dim, sizes),
        Kind::AllReduce(rop) => {
            let mut out = alloc(s, len)?;
            n.all_reduce(&name, src(s, start, end), &mut out, *rop)?;
            Ok((out, same))
        }
        Kind::Broadcast { root } => {
            let mut out = alloc(s, len)?;
            n.broadcast(&name, src(s, start, end), &mut out, *root)?;
            Ok((out, same))
        }
        Kind::Reduce { root } => {
            if *root >= pg.size() {
                candle_core::bail!("{name}: root {root} is not a rank");
            }
            // A reduce-scatter in which the root owns every element (grouped ncclReduce).
            let counts: Vec<usize> = (0..pg.size())
                .map(|r| if r == *root { len } else { 0 })
                .collect();
            let mut out = alloc(s, counts[pg.rank()])?;
            n.reduce_scatter_v(
                &name,
                src(s, start, end),
                &mut out,
                &counts,
                crate::comm::ReduceOp::Sum,
            )?;
            if pg.rank() != *root {
                out = s.device().zeros_impl(&same, s.dtype())?;
            }
            Ok((out, same))
        }
        Kind::AllToAll { send, recv } => {
            // Rows to elements; the sizes agreed on the host (a few values), the blocks moved
            // on the device by grouped ncclSend / ncclRecv.
            let rows: usize = send.iter().sum();
            if dims.is_empty() || dims[0] != rows {
                return Err(pg.refuse(format!(
                    "{name}: tensor has shape {dims:?}, the rows sent {send:?} add up to {rows}"
                )));
            }
            let inner: usize = dims[1..].iter().product();
            let sends: Vec<usize> = send.iter().map(|r| r * inner).collect();
            let recvs: Vec<usize> = recv.iter().map(|r| r * inner).collect();
            let total: usize = recvs.iter().sum();
            let matrix = pg.agree_all_to_all(&sends, &recvs, len, total)?;
            let sizes = crate::comm::BlockSizes::new(&name, pg.rank(), pg.size(), &matrix)?;
            let mut out = alloc(s, total)?;
            n.all_to_all_v(&name, src(s, start, end), &mut out, &sizes)?;
            let mut out_dims = dims.to_vec();
            out_dims[0] = recv.iter().sum();
            Ok((out, Shape::from(out_dims)))
        }
        Kind::AllGather { dim, sizes } => {
            let g = geometry(pg, kind, dims, *dim, sizes, true)?;
            let counts: Vec<usize> = sizes.iter().map(|s| s * g.outer * g.inner).collect();
            let mut gathered = alloc(s, counts.iter().sum())?;
            n.all_gather_v(&name, src(s, start, end), &mut gathered, &counts)?;
            let mut out_dims = dims.to_vec();
            out_dims[*dim] = g.total;
            if g.outer == 1 {
                return Ok((gathered, Shape::from(out_dims)));
            }
            let mut out = alloc(s, g.outer * g.total * g.inner)?;
            permute(&gathered, 0, &mut out, &g, sizes, true)?;
            Ok((out, Shape::from(out_dims)))
        }
        Kind::ReduceScatter {
            dim,
            sizes,
            op: rop,
        } => {
            let g = geometry(pg, kind, dims, *dim, sizes, false)?;
            let counts: Vec<usize> = sizes.iter().map(|s| s * g.outer * g.inner).collect();
            let mut out = alloc(s, counts[pg.rank()])?;
            if g.outer == 1 {
                n.reduce_scatter_v(&name, src(s, start, end), &mut out, &counts, *rop)?;
            } else {
                // [outer][total * inner] -> rank-major blocks [r][outer][s_r * inner].
                let mut blocks = alloc(s, len)?;
                permute(s, start, &mut blocks, &g, sizes, false)?;
                n.reduce_scatter_v(&name, src(&blocks, 0, len), &mut out, &counts, *rop)?;
            }
            let mut out_dims = dims.to_vec();
            out_dims[*dim] = sizes[pg.rank()];
            Ok((out, Shape::from(out_dims)))
        }
    }
}
