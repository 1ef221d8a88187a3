//! Collectives on Candle tensors, as methods of [`ProcessGroup`]. They do not take part in
//! autograd; the mappings in [`crate::ops`] are the differentiable versions.

use candle_core::{Result, Tensor};

use super::collective::CollectiveOp;
use super::kind::Kind;
use crate::comm::{ProcessGroup, ReduceOp};
use crate::Partition;

fn check_dim(pg: &ProcessGroup, t: &Tensor, dim: usize, op: &str) -> Result<()> {
    if dim >= t.rank() {
        // Aborts the group: the peers are waiting in the collective this rank will not start.
        return Err(pg.refuse(format!(
            "{op} on group '{}' (rank {}): tensor of shape {:?} has no dimension {dim}",
            pg.name(),
            pg.rank(),
            t.dims()
        )));
    }
    Ok(())
}

impl ProcessGroup {
    /// Element-wise reduction of `t` across the group; every rank gets the result.
    ///
    /// ```
    /// # use candle_core::{Device, Tensor};
    /// # use candle_tp::comm::{run_threads, ReduceOp};
    /// let out = run_threads(2, |pg| {
    ///     let t = Tensor::new(&[pg.rank() as f32, 1.0], &Device::Cpu)?;
    ///     pg.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f32>()
    /// }).unwrap();
    /// assert_eq!(out[0], vec![1.0, 2.0]);
    /// ```
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if self.returns_input() {
            return Ok(t.clone());
        }
        CollectiveOp::apply(self, t, Kind::AllReduce(op), None)
    }

    /// Concatenates every rank's `t` along `dim`, in rank order. Sizes along `dim` may differ
    /// between ranks (they are exchanged first); use
    /// [`all_gather_with_sizes`](Self::all_gather_with_sizes) when they are known.
    pub fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        check_dim(self, t, dim, "all_gather")?;
        if self.returns_input() {
            return Ok(t.clone());
        }
        let mut sizes = vec![0i64; self.size()];
        self.all_gather_slice(&[t.dims()[dim] as i64], &mut sizes)?;
        let sizes: Vec<usize> = sizes.into_iter().map(|s| s as usize).collect();
        self.all_gather_with_sizes(t, dim, &sizes)
    }

    /// Concatenates every rank's `t` along `dim`, rank `r` holding `sizes[r]` along it.
    pub fn all_gather_with_sizes(&self, t: &Tensor, dim: usize, sizes: &[usize]) -> Result<Tensor> {
        check_dim(self, t, dim, "all_gather")?;
        CollectiveOp::apply(
            self,
            t,
            Kind::AllGather {
                dim,
                sizes: sizes.to_vec(),
            },
            None,
        )
    }

    /// Reduces `t` across the group and returns this rank's part of `dim`, split as
    /// [`Partition::new`] splits it (uneven sizes allowed).
    pub fn reduce_scatter(&self, t: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        check_dim(self, t, dim, "reduce_scatter")?;
        let part = Partition::new(t.dims()[dim], self.size()).map_err(|e| {
            candle_core::Error::msg(format!(
                "reduce_scatter on group '{}' along dim {dim}: {e}",
                self.name()
            ))
        })?;
        if self.returns_input() {
            return Ok(t.clone());
        }
        CollectiveOp::apply(
            self,
            t,
            Kind::ReduceScatter {
                dim,
                sizes: part.sizes(),
                op,
            },
            None,
        )
    }

    /// Returns `root`'s `t` on every rank (every rank passes a tensor of the same shape and
    /// dtype, as with `torch.distributed.broadcast`).
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if self.size() == 1 && root != 0 {
            candle_core::bail!("broadcast on a 1-rank group: root {root} does not exist");
        }
        if self.returns_input() {
            return Ok(t.clone());
        }
        CollectiveOp::apply(self, t, Kind::Broadcast { root }, None)
    }

    /// Whether a tensor collective here returns its input as it is: one rank and no NCCL
    /// communicator. A one-rank NCCL group still runs NCCL (a device copy), so that one GPU
    /// exercises the NCCL path (`scripts/gpu-smoke.sh`) and counts in [`stats`](Self::stats).
    fn returns_input(&self) -> bool {
        #[cfg(feature = "nccl")]
        if self.device_collectives().is_some() {
            return false;
        }
        self.size() == 1
    }
}
