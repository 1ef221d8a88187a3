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
//!
//! Every transfer carries a 16-byte header in the same message: its tag ([`send_tagged`],
//! [`recv_tagged`]; 0 for [`send`] / [`recv`]), whether it is a forward tensor or a gradient,
//! and whether the sent tensor tracks gradients. A receiver checks the tag and the kind, so
//! that two transfers taken in different orders by the two ranks (two micro-batches' tensors
//! of one shape, a backward that runs its transfers in another order) are an error naming
//! both tags, never a silent swap. A [`recv`] with `grad = true` of a tensor whose sender does
//! not track gradients sends no gradient back (the sender waits for none).

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor, Var};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
    send_tagged(x, pg, peer, 0)
}

/// [`send`] with a tag: the peer's [`recv_tagged`] must name the same tag (an error on both
/// sides otherwise), and the gradient that comes back carries it too. A pipeline tags each
/// micro-batch's transfers with its index.
pub fn send_tagged(x: &Tensor, pg: &ProcessGroup, peer: usize, tag: u64) -> Result<Tensor> {
    send_kind(x, pg, peer, tag, Kind::Forward)
}

/// Sends `x` as a transfer of `kind` (a forward tensor, or a [`recv`]'s gradient going back).
fn send_kind(x: &Tensor, pg: &ProcessGroup, peer: usize, tag: u64, kind: Kind) -> Result<Tensor> {
    let x = x.contiguous()?;
    let op = P2pOp {
        pg: pg.clone(),
        peer,
        dir: Dir::Send,
        kind,
        tag,
        shape: x.shape().clone(),
        tracks: Arc::new(AtomicBool::new(x.track_op())),
    };
    if x.track_op() {
        x.apply_op1(op)
    } else {
        x.apply_op1_no_bwd(&op)
    }
}

/// Receives a tensor of `shape` and `dtype` from rank `peer` of `pg` (which calls [`send`]),
/// on `device`. With `grad`, the result tracks gradients and its backward sends its gradient
/// to `peer` (unless the sent tensor tracked none: then nobody waits for it).
pub fn recv(
    shape: &[usize],
    dtype: DType,
    device: &Device,
    pg: &ProcessGroup,
    peer: usize,
    grad: bool,
) -> Result<Tensor> {
    recv_tagged(shape, dtype, device, pg, peer, grad, 0)
}

/// [`recv`] of the transfer that the peer's [`send_tagged`] tagged `tag`.
pub fn recv_tagged(
    shape: &[usize],
    dtype: DType,
    device: &Device,
    pg: &ProcessGroup,
    peer: usize,
    grad: bool,
    tag: u64,
) -> Result<Tensor> {
    recv_kind(shape, dtype, device, pg, peer, grad, tag, Kind::Forward)
}

#[allow(clippy::too_many_arguments)]
fn recv_kind(
    shape: &[usize],
    dtype: DType,
    device: &Device,
    pg: &ProcessGroup,
    peer: usize,
    grad: bool,
    tag: u64,
    kind: Kind,
) -> Result<Tensor> {
    let op = P2pOp {
        pg: pg.clone(),
        peer,
        dir: Dir::Recv,
        kind,
        tag,
        shape: Shape::from(shape),
        tracks: Arc::new(AtomicBool::new(false)),
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

/// What a transfer carries: a forward tensor, or the gradient of one (sent back by a
/// [`recv`]'s backward).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Forward,
    Gradient,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Forward => "tensor",
            Kind::Gradient => "gradient",
        }
    }
}

/// The header's bytes, after the data: tag, then flags (bit 0: the sent tensor tracks
/// gradients; bit 1: a gradient) with [`MAGIC`] in the high byte.
const HEADER_BYTES: usize = 16;
const MAGIC: u64 = 0xC7 << 56;

struct P2pOp {
    pg: ProcessGroup,
    peer: usize,
    dir: Dir,
    kind: Kind,
    tag: u64,
    /// The tensor sent or received (the backward's gradient has it too).
    shape: Shape,
    /// Send: whether the sent tensor tracks gradients. Recv: whether the sender's did (set by
    /// the forward, read by the backward).
    tracks: Arc<AtomicBool>,
}

impl P2pOp {
    fn who(&self) -> String {
        let (verb, dir) = match self.dir {
            Dir::Send => ("send", "to"),
            Dir::Recv => ("recv", "from"),
        };
        format!(
            "{verb} of a {} of tag {} {dir} rank {} (group '{}', rank {})",
            self.kind.name(),
            self.tag,
            self.peer,
            self.pg.name(),
            self.pg.rank()
        )
    }

    fn run<T: Element + candle_core::WithDType>(&self, data: &[T]) -> Result<(Vec<T>, Shape)> {
        let h = HEADER_BYTES / std::mem::size_of::<T>();
        match self.dir {
            Dir::Send => {
                let mut flags = MAGIC;
                if self.tracks.load(Ordering::Relaxed) {
                    flags |= 1;
                }
                if self.kind == Kind::Gradient {
                    flags |= 2;
                }
                let mut buf = Vec::with_capacity(data.len() + h);
                buf.extend_from_slice(data);
                buf.resize(data.len() + h, T::default());
                write_header(&mut buf[data.len()..], [self.tag, flags]);
                // The one copy of the data: the buffer goes to the transfer as it is.
                self.pg.send_vec(buf, self.peer)?;
                Ok((vec![T::default()], Shape::from(())))
            }
            Dir::Recv => {
                let n = self.shape.elem_count();
                let mut out = vec![T::default(); n + h];
                self.pg.recv_slice(&mut out, self.peer)?;
                let [tag, flags] = read_header(&out[n..]);
                if flags & (0xFF << 56) != MAGIC {
                    candle_core::bail!(
                        "{}: the message has no transfer header (the peer sent it with \
                         ProcessGroup::send_slice, not ops::send)",
                        self.who()
                    );
                }
                let kind = if flags & 2 != 0 {
                    Kind::Gradient
                } else {
                    Kind::Forward
                };
                if tag != self.tag || kind != self.kind {
                    candle_core::bail!(
                        "{}: the peer sent the {} of tag {tag}; the two ranks take their \
                         transfers in different orders",
                        self.who(),
                        kind.name()
                    );
                }
                self.tracks.store(flags & 1 != 0, Ordering::Relaxed);
                out.truncate(n);
                Ok((out, self.shape.clone()))
            }
        }
    }
}

/// Writes two u64 into the tail of a buffer of plain values (every element type of the
/// collectives is plain data of 1, 2, 4 or 8 bytes: 16 bytes are whole elements).
fn write_header<T: Element>(tail: &mut [T], words: [u64; 2]) {
    debug_assert_eq!(std::mem::size_of_val(tail), HEADER_BYTES);
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    // SAFETY: `tail` is `HEADER_BYTES` bytes of plain data, for which any bytes are valid.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), tail.as_mut_ptr().cast::<u8>(), HEADER_BYTES)
    };
}

/// The two u64 that [`write_header`] wrote.
fn read_header<T: Element>(tail: &[T]) -> [u64; 2] {
    let mut bytes = [0u8; HEADER_BYTES];
    // SAFETY: `tail` is `HEADER_BYTES` bytes of plain data.
    unsafe {
        std::ptr::copy_nonoverlapping(tail.as_ptr().cast::<u8>(), bytes.as_mut_ptr(), HEADER_BYTES)
    };
    let word = |i: usize| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().expect("8 bytes"));
    [word(0), word(1)]
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
            // The gradient of what was sent comes back from the peer, with the same tag.
            // (times the handle's own gradient, 1 when the stage calls `handle.backward()`).
            Dir::Send => {
                let g = recv_kind(
                    self.shape.dims(),
                    arg.dtype(),
                    arg.device(),
                    &self.pg,
                    self.peer,
                    false,
                    self.tag,
                    Kind::Gradient,
                )?;
                Ok(Some(g.broadcast_mul(grad_res)?))
            }
            // The gradient of what was received goes back to the peer (when the peer's tensor
            // tracks gradients: otherwise it waits for none); the placeholder's own gradient
            // is zero.
            Dir::Recv => {
                if self.tracks.load(Ordering::Relaxed) {
                    let g = grad_res.detach();
                    send_kind(&g, &self.pg, self.peer, self.tag, Kind::Gradient)?;
                }
                Ok(Some(arg.zeros_like()?))
            }
        }
    }
}
