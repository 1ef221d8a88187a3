//! Point-to-point transfers of tensors with autograd, for pipeline stages:
//!
//! | function | forward | backward |
//! |---|---|---|
//! | [`send`] | sends `x` to `peer`, returns a scalar handle (0) | receives `x`'s gradient from `peer` |
//! | [`recv`] | receives a tensor from `peer` | sends its gradient to `peer` |
//!
//! A stage that sends its output calls `send(&y, pg, next)?.backward()` after the next stage
//! has run its backward: the handle's backward receives `∂L/∂y` and carries it on into the
//! stage's own graph (Candle has no `backward(grad)`; the handle is how a stage's backward
//! starts from a gradient that another process computed). [`recv`] with `grad = true` returns
//! a tensor that tracks gradients, whose backward sends `∂L/∂x` back. Transfers between two
//! ranks are matched in order (`ProcessGroup::send_slice`).

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor, Var};

use super::collective::map_cpu_storage;
use crate::comm::{Element, ProcessGroup};

/// Sends `x` to rank `peer` of `pg` and returns a scalar handle (0, of `x`'s dtype). When `x`
/// tracks gradients, the handle's backward receives `x`'s gradient (same shape) from `peer`,
/// which gets it from its [`recv`]'s backward.
///
/// ```
/// use candle_core::{Device, DType, Tensor, Var};
/// use candle_tp::comm::run_threads;
/// let grads = run_threads(2, |pg| {
///     if pg.rank() == 0 {
///         let w = Var::new(&[1f32, 2.0], &Device::Cpu)?;
///         let y = (w.as_tensor() * 3.0)?; // stage 0
///         let g = candle_tp::ops::send(&y, &pg, 1)?.backward()?; // waits for stage 1's gradient
///         g.get(&w).unwrap().to_vec1::<f32>()
///     } else {
///         let x = candle_tp::ops::recv(&[2], DType::F32, &Device::Cpu, &pg, 0, true)?;
///         x.sqr()?.sum_all()?.backward()?; // stage 1: L = Σ x², sends ∂L/∂x = 2x back
///         Ok(vec![])
///     }
/// })
/// .unwrap();
/// assert_eq!(grads[0], vec![18.0, 36.0]); // ∂L/∂w = 2 · 3w · 3
/// ```
pub fn send(x: &Tensor, pg: &ProcessGroup, peer: usize) -> Result<Tensor> {
    let op = P2pOp {
        pg: pg.clone(),
        peer,
        dir: Dir::Send,
        shape: x.shape().clone(),
    };
    let x = x.contiguous()?;
    if x.track_op() {
        x.apply_op1(op)
    } else {
        x.apply_op1_no_bwd(&op)
    }
}

/// Receives a tensor of `shape` and `dtype` from rank `peer` of `pg` (which calls [`send`]),
/// on `device`. With `grad`, the result tracks gradients and its backward sends its gradient
/// to `peer`.
pub fn recv(
    shape: &[usize],
    dtype: DType,
    device: &Device,
    pg: &ProcessGroup,
    peer: usize,
    grad: bool,
) -> Result<Tensor> {
    let op = P2pOp {
        pg: pg.clone(),
        peer,
        dir: Dir::Recv,
        shape: Shape::from(shape),
    };
    let placeholder = Tensor::zeros(shape, dtype, device)?;
    if grad {
        // A variable, so that autograd reaches this op and runs its backward.
        Var::from_tensor(&placeholder)?.as_tensor().apply_op1(op)
    } else {
        placeholder.apply_op1_no_bwd(&op)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    Send,
    Recv,
}

struct P2pOp {
    pg: ProcessGroup,
    peer: usize,
    dir: Dir,
    /// The tensor sent or received (the backward's gradient has it too).
    shape: Shape,
}

impl P2pOp {
    fn run<T: Element + candle_core::WithDType>(&self, data: &[T]) -> Result<(Vec<T>, Shape)> {
        match self.dir {
            Dir::Send => {
                self.pg.send_slice(data, self.peer)?;
                Ok((vec![T::default()], Shape::from(())))
            }
            Dir::Recv => {
                let mut out = vec![T::default(); self.shape.elem_count()];
                self.pg.recv_slice(&mut out, self.peer)?;
                Ok((out, self.shape.clone()))
            }
        }
    }
}

impl CustomOp1 for P2pOp {
    fn name(&self) -> &'static str {
        match self.dir {
            Dir::Send => "send",
            Dir::Recv => "recv",
        }
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        map_cpu_storage!(storage, layout, self.name(), |v| self.run(v)?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        // Through host memory (the backend stages NCCL transfers itself).
        let cpu = storage.to_cpu_storage()?;
        let (out, shape) = self.cpu_fwd(&cpu, layout)?;
        Ok((storage.device().storage_from_cpu_storage(&out)?, shape))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        match self.dir {
            // The gradient of what was sent comes back from the peer.
            // (times the handle's own gradient, 1 when the stage calls `handle.backward()`).
            Dir::Send => {
                let g = recv(
                    self.shape.dims(),
                    arg.dtype(),
                    arg.device(),
                    &self.pg,
                    self.peer,
                    false,
                )?;
                Ok(Some(g.broadcast_mul(grad_res)?))
            }
            // The gradient of what was received goes back to the peer; the placeholder's own
            // gradient is zero.
            Dir::Recv => {
                send(&grad_res.detach(), &self.pg, self.peer)?;
                Ok(Some(arg.zeros_like()?))
            }
        }
    }
}
