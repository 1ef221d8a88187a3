//! How each element type crosses MPI: natively, or widened to f32 (f16, bf16) for reductions
//! and moved as u16 bits for gathers and broadcasts; `Max` of floats propagates NaN.

use ::mpi::datatype::{Partition, PartitionMut};
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::*;
use half::{bf16, f16};

use super::exchange::{self, Disagreement};
use crate::comm::element::{Element, ReduceOp};

/// What MPI moves for an element type: itself, or f32 for the half types.
pub(super) trait Wire: Element {
    /// Reduces `src` into `dst` with `op` across `comm`.
    fn all_reduce(comm: &SimpleCommunicator, src: &[Self], dst: &mut [Self], op: ReduceOp);
    /// Agrees on `meta` and reduces `data` in place with `op`, in one exchange per step
    /// ([`exchange::all_reduce`]; `comm` the exchange's communicator).
    fn all_reduce_small(
        comm: &SimpleCommunicator,
        meta: [u64; 4],
        data: &mut [Self],
        op: ReduceOp,
    ) -> Result<(), Disagreement>;
    /// Gathers / broadcasts raw values.
    fn all_gather_v(
        comm: &SimpleCommunicator,
        src: &[Self],
        dst: &mut [Self],
        c: &[i32],
        d: &[i32],
    );
    fn broadcast(comm: &SimpleCommunicator, buf: &mut [Self], root: usize);
    /// `MPI_Alltoallv` of raw values: block `d` of `src` (`sc[d]` elements at `sd[d]`) to
    /// rank `d`, rank `s`'s block for this one into `dst` (`rc[s]` elements at `rd[s]`).
    fn all_to_all_v(
        comm: &SimpleCommunicator,
        send: (&[Self], &[i32], &[i32]),
        recv: (&mut [Self], &[i32], &[i32]),
    );
}

macro_rules! native_wire {
    ($t:ty, float) => {
        native_wire!($t, |comm, src, dst| nan_max_fixup(
            comm,
            src,
            dst,
            |v: &$t| v.is_nan(),
            <$t>::NAN
        ));
    };
    ($t:ty, int) => {
        native_wire!($t, |_comm, _src, _dst| ());
    };
    ($t:ty, $fixup:expr) => {
        impl Wire for $t {
            fn all_reduce(comm: &SimpleCommunicator, src: &[Self], dst: &mut [Self], op: ReduceOp) {
                match op {
                    ReduceOp::Sum => {
                        comm.all_reduce_into(src, dst, ::mpi::collective::SystemOperation::sum())
                    }
                    ReduceOp::Max => {
                        comm.all_reduce_into(src, dst, ::mpi::collective::SystemOperation::max());
                        let fixup: fn(&SimpleCommunicator, &[$t], &mut [$t]) = $fixup;
                        fixup(comm, src, dst);
                    }
                }
            }
            fn all_reduce_small(
                comm: &SimpleCommunicator,
                meta: [u64; 4],
                data: &mut [Self],
                op: ReduceOp,
            ) -> Result<(), Disagreement> {
                exchange::all_reduce(comm, meta, data, op)
            }
            fn all_gather_v(
                comm: &SimpleCommunicator,
                src: &[Self],
                dst: &mut [Self],
                c: &[i32],
                d: &[i32],
            ) {
                let mut part = PartitionMut::new(dst, c, d);
                comm.all_gather_varcount_into(src, &mut part);
            }
            fn broadcast(comm: &SimpleCommunicator, buf: &mut [Self], root: usize) {
                comm.process_at_rank(root as i32).broadcast_into(buf);
            }
            fn all_to_all_v(
                comm: &SimpleCommunicator,
                (src, sc, sd): (&[Self], &[i32], &[i32]),
                (dst, rc, rd): (&mut [Self], &[i32], &[i32]),
            ) {
                let send = Partition::new(src, sc, sd);
                let mut recv = PartitionMut::new(dst, rc, rd);
                comm.all_to_all_varcount_into(&send, &mut recv);
            }
        }
    };
}

native_wire!(f32, float);
native_wire!(f64, float);
native_wire!(u8, int);
native_wire!(u32, int);
native_wire!(i16, int);
native_wire!(i32, int);
native_wire!(i64, int);

/// NaN anywhere at an index makes the maximum NaN there.
fn nan_max_fixup<T: Copy>(
    comm: &SimpleCommunicator,
    src: &[T],
    dst: &mut [T],
    is_nan: impl Fn(&T) -> bool,
    nan: T,
) {
    let mine: Vec<u8> = src.iter().map(|v| u8::from(is_nan(v))).collect();
    let mut any = vec![0u8; mine.len()];
    comm.all_reduce_into(
        &mine[..],
        &mut any[..],
        ::mpi::collective::SystemOperation::max(),
    );
    for (d, &n) in dst.iter_mut().zip(&any) {
        if n != 0 {
            *d = nan;
        }
    }
}

macro_rules! half_wire {
    ($t:ty) => {
        impl Wire for $t {
            fn all_reduce(comm: &SimpleCommunicator, src: &[Self], dst: &mut [Self], op: ReduceOp) {
                // Widened to f32, reduced, rounded once.
                let wide: Vec<f32> = src.iter().map(|v| v.to_f32()).collect();
                let mut out = vec![0f32; wide.len()];
                <f32 as Wire>::all_reduce(comm, &wide, &mut out, op);
                for (d, v) in dst.iter_mut().zip(out) {
                    *d = <$t>::from_f32(v);
                }
            }
            fn all_reduce_small(
                comm: &SimpleCommunicator,
                meta: [u64; 4],
                data: &mut [Self],
                op: ReduceOp,
            ) -> Result<(), Disagreement> {
                // Widened to f32 for every step, rounded once at the end.
                let mut wide: Vec<f32> = data.iter().map(|v| v.to_f32()).collect();
                exchange::all_reduce(comm, meta, &mut wide, op)?;
                for (d, v) in data.iter_mut().zip(wide) {
                    *d = <$t>::from_f32(v);
                }
                Ok(())
            }
            fn all_gather_v(
                comm: &SimpleCommunicator,
                src: &[Self],
                dst: &mut [Self],
                c: &[i32],
                d: &[i32],
            ) {
                let s: Vec<u16> = src.iter().map(|v| v.to_bits()).collect();
                let mut out = vec![0u16; dst.len()];
                {
                    let mut part = PartitionMut::new(&mut out[..], c, d);
                    comm.all_gather_varcount_into(&s[..], &mut part);
                }
                for (d, b) in dst.iter_mut().zip(out) {
                    *d = <$t>::from_bits(b);
                }
            }
            fn all_to_all_v(
                comm: &SimpleCommunicator,
                (src, sc, sd): (&[Self], &[i32], &[i32]),
                (dst, rc, rd): (&mut [Self], &[i32], &[i32]),
            ) {
                let s: Vec<u16> = src.iter().map(|v| v.to_bits()).collect();
                let mut out = vec![0u16; dst.len()];
                <u16 as BitsWire>::all_to_all_v(comm, (&s, sc, sd), (&mut out, rc, rd));
                for (d, b) in dst.iter_mut().zip(out) {
                    *d = <$t>::from_bits(b);
                }
            }
            fn broadcast(comm: &SimpleCommunicator, buf: &mut [Self], root: usize) {
                let mut bits: Vec<u16> = buf.iter().map(|v| v.to_bits()).collect();
                comm.process_at_rank(root as i32)
                    .broadcast_into(&mut bits[..]);
                for (d, b) in buf.iter_mut().zip(bits) {
                    *d = <$t>::from_bits(b);
                }
            }
        }
    };
}

/// `MPI_Alltoallv` of the half types' bits (u16 is no collective's element type, so it has no
/// [`Wire`]).
trait BitsWire {
    fn all_to_all_v(
        comm: &SimpleCommunicator,
        send: (&[u16], &[i32], &[i32]),
        recv: (&mut [u16], &[i32], &[i32]),
    );
}

impl BitsWire for u16 {
    fn all_to_all_v(
        comm: &SimpleCommunicator,
        (src, sc, sd): (&[u16], &[i32], &[i32]),
        (dst, rc, rd): (&mut [u16], &[i32], &[i32]),
    ) {
        let send = Partition::new(src, sc, sd);
        let mut recv = PartitionMut::new(dst, rc, rd);
        comm.all_to_all_varcount_into(&send, &mut recv);
    }
}

half_wire!(f16);
half_wire!(bf16);
