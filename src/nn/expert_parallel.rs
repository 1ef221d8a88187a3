//! Expert parallelism (Megatron-core's and vLLM's EP): whole experts on each rank of a group,
//! each token's hidden state sent to the ranks of its experts by an all-to-all, their outputs
//! brought back by the reverse all-to-all and summed with the routing weights on the token's
//! own rank. No capacity limit drops a token: every rank computes exactly what one rank with
//! every expert computes, and gradients flow through both all-to-alls
//! ([`crate::ops::all_to_all`]).
//!
//! [`SparseMoe`](super::SparseMoe) chooses this path when it was loaded with
//! [`SparseMoe::load_expert_parallel`](super::SparseMoe::load_expert_parallel); the
//! assignment of experts to ranks is one [`Partition`] of the expert index (contiguous runs,
//! uneven counts allowed).

use candle_core::{Module, Result, Tensor};

use super::routing::Routing;
use crate::comm::ProcessGroup;
use crate::nn::GatedMlp;
use crate::ops::all_to_all;
use crate::Partition;

/// The MoE output of this rank's own tokens `x` `[n, hidden]` (`routing`: the rows routed to
/// each expert and their weights), with the experts of rank `r` of `pg` being
/// `owners.range(r)` and this rank's in `experts` (whole, in expert order).
pub(crate) fn forward_local(
    pg: &ProcessGroup,
    owners: &Partition,
    experts: &[GatedMlp],
    x: &Tensor,
    routing: &Routing,
) -> Result<Tensor> {
    let (p, me) = (pg.size(), pg.rank());
    let hidden = x.dim(1)?;
    let mine = owners.range(me);
    // This rank's rows in the order they leave: by destination rank, then by expert.
    let mut rows: Vec<u32> = Vec::new();
    let mut slots: Vec<u32> = Vec::new();
    let mut counts: Vec<i64> = Vec::with_capacity(routing.experts.len());
    let mut send_rows = vec![0usize; p];
    for (d, sent) in send_rows.iter_mut().enumerate() {
        for (r, w) in &routing.experts[owners.range(d)] {
            rows.extend_from_slice(r);
            slots.extend_from_slice(w);
            counts.push(r.len() as i64);
            *sent += r.len();
        }
    }
    // Every rank's counts for this rank's experts: recv_counts[s * mine.len() + j].
    let per_rank: Vec<usize> = (0..p).map(|d| owners.size(d)).collect();
    let mut recv_counts = vec![0i64; p * mine.len()];
    pg.all_to_all_v_slice(&counts, &per_rank, &mut recv_counts, &vec![mine.len(); p])?;
    // Every rank holds at least one expert (a Partition gives every part one).
    let recv_rows: Vec<usize> = recv_counts
        .chunks(mine.len())
        .map(|c| c.iter().map(|&n| n as usize).sum())
        .collect();
    let device = x.device();
    let n_sent = rows.len();
    let idx = Tensor::from_vec(rows, n_sent, device)?;
    let outgoing = x.index_select(&idx, 0)?;
    let incoming = all_to_all(&outgoing, pg, &send_rows, &recv_rows)?;
    // Each local expert over its rows of every source, written back where they came in.
    let total_in: usize = recv_rows.iter().sum();
    let mut out: Option<Tensor> = None;
    for (j, expert) in experts.iter().enumerate() {
        let mut at = Vec::new();
        let mut start = 0usize;
        for s in 0..p {
            let c = &recv_counts[s * mine.len()..(s + 1) * mine.len()];
            let before: usize = c[..j].iter().map(|&n| n as usize).sum();
            at.extend((start + before..start + before + c[j] as usize).map(|i| i as u32));
            start += recv_rows[s];
        }
        if at.is_empty() {
            continue;
        }
        let n = at.len();
        let at = Tensor::from_vec(at, n, device)?;
        let y = expert.forward(&incoming.index_select(&at, 0)?)?;
        let acc = match out.take() {
            Some(acc) => acc,
            None => Tensor::zeros((total_in, hidden), y.dtype(), device)?,
        };
        out = Some(acc.index_add(&at, &y, 0)?);
    }
    let out = match out {
        Some(out) => out,
        None => Tensor::zeros((total_in, hidden), x.dtype(), device)?,
    };
    let back = all_to_all(&out, pg, &recv_rows, &send_rows)?;
    let w = routing.select(&slots)?.to_dtype(back.dtype())?;
    Tensor::zeros((x.dim(0)?, hidden), back.dtype(), device)?.index_add(
        &idx,
        &back.broadcast_mul(&w)?,
        0,
    )
}
