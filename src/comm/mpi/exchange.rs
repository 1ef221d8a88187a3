//! The agreement on sizes, and small all-reduces, in one network exchange per step.
//!
//! Every collective of the MPI backend first makes sure that every rank called the same
//! collective with the same sizes (an error instead of a hang or corrupt data). Done as an
//! `MPI_Allgather` of those sizes, that is a network round trip before the collective's own:
//! across hosts, where one round trip costs tens of microseconds, it doubles the latency of the
//! small all-reduces that decoding makes twice per layer. Here the sizes travel in a header in
//! front of the data instead, by recursive doubling over point-to-point messages on a
//! duplicate of the group's communicator (so user traffic cannot interleave):
//!
//! - `p` a power of two: `log2 p` steps; at step `k` each rank exchanges header and data with
//!   the rank whose index differs in bit `k`, and both combine the two halves in the same
//!   order (the lower-indexed side first), so every rank ends with the same bits.
//! - Otherwise the first `2 (p - p2)` ranks fold in pairs first (the even one hands its data to
//!   the odd one, which stands for both) and get the result back at the end (`p2` the largest
//!   power of two below `p`), as MPICH's recursive doubling does.
//! - A rank whose partner's header differs marks itself failed, keeps going with every step
//!   (so nobody waits for a message that never comes), and hands the mark on in its own header:
//!   after the last step every rank knows, and each returns the error naming a rank that
//!   disagreed and that rank's sizes.
//!
//! With no data the same exchange is the agreement alone (before a large collective, which
//! MPI's own algorithms then move).

use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::*;

use crate::comm::element::{Element, ReduceOp};

/// The message tag of the exchange (on its own communicator).
const TAG: i32 = 0x5ce;
/// First word of every header: catches a message that is not an exchange header.
const MAGIC: u64 = 0x6374_705f_7863_6801;
/// Header words: magic, meta (4), failed flag, then the two ranks that disagreed, each with
/// its meta (2 x 5).
const HEADER: usize = 16;

/// Payloads up to this many bytes go with the header (recursive doubling moves the whole
/// buffer at every step: above this MPI's own bandwidth-optimal algorithms are faster).
pub(super) const SMALL_ALL_REDUCE_BYTES: usize = 64 * 1024;

/// Two ranks that called different collectives or passed different sizes: each one's index
/// in the group and what it passed, (kind, dtype, count, aux) as `meta`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Disagreement {
    pub first: (usize, [u64; 4]),
    pub second: (usize, [u64; 4]),
}

/// Agrees on `meta` with every rank of `comm` (no data).
pub(super) fn agree(comm: &SimpleCommunicator, meta: [u64; 4]) -> Result<(), Disagreement> {
    run::<u8>(comm, meta, None)
}

/// Agrees on `meta` and all-reduces `data` in place with `op`.
pub(super) fn all_reduce<T: Element<Acc = T>>(
    comm: &SimpleCommunicator,
    meta: [u64; 4],
    data: &mut [T],
    op: ReduceOp,
) -> Result<(), Disagreement> {
    run(comm, meta, Some((data, op)))
}

/// One rank's state through the steps.
struct State<'a, T> {
    comm: &'a SimpleCommunicator,
    rank: usize,
    meta: [u64; 4],
    data: Option<(&'a mut [T], ReduceOp)>,
    failed: Option<Disagreement>,
}

fn run<T: Element<Acc = T>>(
    comm: &SimpleCommunicator,
    meta: [u64; 4],
    data: Option<(&mut [T], ReduceOp)>,
) -> Result<(), Disagreement> {
    let (rank, size) = (comm.rank() as usize, comm.size() as usize);
    if size == 1 {
        return Ok(());
    }
    let mut s = State {
        comm,
        rank,
        meta,
        data,
        failed: None,
    };
    let p2 = 1usize << (usize::BITS - 1 - size.leading_zeros());
    let rem = size - p2;
    // Fold in: of each pair (2i, 2i + 1) below 2 rem, the odd rank stands for both.
    let index = if rank < 2 * rem {
        if rank % 2 == 0 {
            s.send(rank + 1);
            None
        } else {
            s.receive(rank - 1, true);
            Some(rank / 2)
        }
    } else {
        Some(rank - rem)
    };
    if let Some(index) = index {
        let mut mask = 1;
        while mask < p2 {
            let partner_index = index ^ mask;
            let partner = if partner_index < rem {
                2 * partner_index + 1
            } else {
                partner_index + rem
            };
            s.exchange(partner, index < partner_index);
            mask <<= 1;
        }
    }
    // Fold out: the odd rank hands the result (and any failure) back.
    if rank < 2 * rem {
        if rank % 2 == 1 {
            s.send(rank - 1);
        } else {
            s.receive_result(rank + 1);
        }
    }
    match s.failed {
        Some(d) => Err(d),
        None => Ok(()),
    }
}

impl<T: Element<Acc = T>> State<'_, T> {
    /// Header and data, as bytes in a word-aligned buffer.
    fn message(&self) -> Vec<u64> {
        let mut words = Vec::with_capacity(HEADER + self.payload_bytes().div_ceil(8));
        words.push(MAGIC);
        words.extend_from_slice(&self.meta);
        words.push(u64::from(self.failed.is_some()));
        let none = (0, [0; 4]);
        let (a, b) = self
            .failed
            .as_ref()
            .map_or((&none, &none), |d| (&d.first, &d.second));
        for (rank, meta) in [a, b] {
            words.push(*rank as u64);
            words.extend_from_slice(meta);
        }
        let payload = self.payload_bytes();
        words.resize(HEADER + payload.div_ceil(8), 0);
        if let Some((d, _)) = &self.data {
            // SAFETY: `words` has room for `payload` bytes after the header; element types
            // are plain numbers.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    d.as_ptr().cast::<u8>(),
                    words.as_mut_ptr().add(HEADER).cast::<u8>(),
                    payload,
                );
            }
        }
        words
    }

    fn payload_bytes(&self) -> usize {
        self.data
            .as_ref()
            .map_or(0, |(d, _)| std::mem::size_of_val(&**d))
    }

    fn send(&self, peer: usize) {
        let words = self.message();
        self.comm
            .process_at_rank(peer as i32)
            .send_with_tag(as_bytes(&words, HEADER * 8 + self.payload_bytes()), TAG);
    }

    /// Sends to `peer` and receives from it at once, then combines (`first`: this rank's
    /// side goes first in the combination).
    fn exchange(&mut self, peer: usize, first: bool) {
        let words = self.message();
        let len = HEADER * 8 + self.payload_bytes();
        let received = ::mpi::request::scope(|scope| {
            let req = self
                .comm
                .process_at_rank(peer as i32)
                .immediate_send_with_tag(scope, as_bytes(&words, len), TAG);
            let received = self.take(peer);
            req.wait();
            received
        });
        self.absorb(peer, received, Some(first));
    }

    /// Receives `peer`'s partial result and combines it (the peer's side first when `peer_first`).
    fn receive(&mut self, peer: usize, peer_first: bool) {
        let received = self.take(peer);
        self.absorb(peer, received, Some(!peer_first));
    }

    /// Receives the final result from `peer` (fold out): replaces this rank's data.
    fn receive_result(&mut self, peer: usize) {
        let received = self.take(peer);
        self.absorb(peer, received, None);
    }

    /// The next message from `peer`, whatever its length, and its length in bytes.
    fn take(&self, peer: usize) -> (Vec<u64>, usize) {
        let (msg, status) = self
            .comm
            .process_at_rank(peer as i32)
            .matched_probe_with_tag(TAG);
        let len = status.count(u8::equivalent_datatype()).max(0) as usize;
        let mut words = vec![0u64; len.div_ceil(8).max(HEADER)];
        // SAFETY: `words` holds at least `len` bytes.
        let bytes = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) };
        msg.matched_receive_into(bytes);
        (words, len)
    }

    /// Checks `peer`'s header and takes its data: combined with ours (`Some(ours_first)`) or
    /// in place of ours (`None`, the final result).
    fn absorb(&mut self, peer: usize, (words, len): (Vec<u64>, usize), how: Option<bool>) {
        let payload = self.payload_bytes();
        let ours = (self.rank, self.meta);
        if len < HEADER * 8 || words[0] != MAGIC {
            // Not an exchange header (cannot happen on the exchange's own communicator).
            self.fail(Disagreement {
                first: ours,
                second: (peer, [u64::MAX; 4]),
            });
            return;
        }
        let meta_at = |at: usize| -> [u64; 4] { words[at..at + 4].try_into().expect("4 words") };
        if words[5] != 0 {
            self.fail(Disagreement {
                first: (words[6] as usize, meta_at(7)),
                second: (words[11] as usize, meta_at(12)),
            });
        }
        let theirs = meta_at(1);
        if theirs != self.meta {
            self.fail(Disagreement {
                first: ours,
                second: (peer, theirs),
            });
        }
        if self.failed.is_some() || len != HEADER * 8 + payload {
            return;
        }
        let Some((data, op)) = self.data.as_mut() else {
            return;
        };
        // SAFETY: the message holds `data.len()` elements after the header, word-aligned.
        let other = unsafe {
            std::slice::from_raw_parts(words.as_ptr().add(HEADER).cast::<T>(), data.len())
        };
        match how {
            None => data.copy_from_slice(other),
            Some(true) => T::combine(*op, other, data),
            Some(false) => {
                let mut acc = other.to_vec();
                T::combine(*op, data, &mut acc);
                data.copy_from_slice(&acc);
            }
        }
    }

    fn fail(&mut self, d: Disagreement) {
        if self.failed.is_none() {
            self.failed = Some(d);
        }
    }
}

/// The first `len` bytes of `words`.
fn as_bytes(words: &[u64], len: usize) -> &[u8] {
    assert!(len <= words.len() * 8);
    // SAFETY: in bounds (checked above); u8 has no alignment.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), len) }
}
