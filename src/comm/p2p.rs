//! Point-to-point `send` / `recv` between two ranks of a group, on every backend.
//!
//! Each pair of ranks that talks gets a two-rank sub-group (`<group>/p2p[a,b]`, made on first
//! use by both and kept), and a message is that group's broadcast from the sender. So a send
//! and its receive meet like any collective: the same deadline, a size mismatch is an error on
//! both sides (the broadcast's agreement check), a dead peer is an error naming it, and
//! aborting the group stops them. Sends and receives between two ranks must come in the same
//! order on both (as with MPI on one tag); nothing is buffered, so a send waits for its
//! receive.

use super::element::Element;
use super::error::{CommError, CommResult};
use super::group::{lock, ProcessGroup};

impl ProcessGroup {
    /// Sends `buf` to rank `peer` of this group, which must call
    /// [`recv_slice`](Self::recv_slice) with a buffer of the same length and type.
    ///
    /// ```
    /// use candle_tp::comm::run_threads;
    /// let got = run_threads(2, |pg| {
    ///     let mut v = vec![0f32; 3];
    ///     if pg.rank() == 0 {
    ///         pg.send_slice(&[1.0f32, 2.0, 3.0], 1)?;
    ///     } else {
    ///         pg.recv_slice(&mut v, 0)?;
    ///     }
    ///     Ok(v)
    /// })
    /// .unwrap();
    /// assert_eq!(got[1], vec![1.0, 2.0, 3.0]);
    /// ```
    pub fn send_slice<T: Element>(&self, buf: &[T], peer: usize) -> CommResult<()> {
        self.send_vec(buf.to_vec(), peer)
    }

    /// [`send_slice`](Self::send_slice) of a buffer the caller gives away (the transfer is a
    /// broadcast over the pair, which writes its buffer: no copy of it is made here).
    pub(crate) fn send_vec<T: Element>(&self, mut buf: Vec<T>, peer: usize) -> CommResult<()> {
        let (pair, me) = self.pair("send", peer)?;
        pair.broadcast_slice(&mut buf, me)
    }

    /// Receives into `buf` what rank `peer` of this group sends with
    /// [`send_slice`](Self::send_slice).
    pub fn recv_slice<T: Element>(&self, buf: &mut [T], peer: usize) -> CommResult<()> {
        let (pair, me) = self.pair("recv", peer)?;
        pair.broadcast_slice(buf, 1 - me)
    }

    /// The two-rank group of this rank and `peer` (made on first use), and this rank's index
    /// in it.
    fn pair(&self, op: &str, peer: usize) -> CommResult<(ProcessGroup, usize)> {
        let who = || {
            format!(
                "{op} on group '{}' (rank {} of {})",
                self.name(),
                self.rank(),
                self.size()
            )
        };
        if peer >= self.size() {
            return Err(CommError::invalid(
                who(),
                format!("peer {peer} is not a rank of this group"),
            ));
        }
        if peer == self.rank() {
            return Err(CommError::invalid(
                who(),
                format!("peer {peer} is this rank itself"),
            ));
        }
        let me = usize::from(self.rank() > peer);
        let mut pairs = lock(&self.inner.pairs);
        if let Some(g) = pairs.get(&peer) {
            return Ok((g.clone(), me));
        }
        let ranks = [self.rank().min(peer), self.rank().max(peer)];
        let g = self
            .new_group_named(&ranks, "p2p")?
            .ok_or_else(|| CommError::invalid(who(), "this rank is not in its own pair"))?;
        pairs.insert(peer, g.clone());
        Ok((g, me))
    }
}
