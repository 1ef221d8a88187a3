//! Log-probabilities of sampled tokens (and of each position's most likely tokens) from
//! vocabulary-parallel logits, without gathering the vocabulary.
//!
//! `log p(i) = logit_i - logsumexp(logits)`. Each rank reduces its shard to a few numbers: its
//! largest logit `m_r`, `s_r = Σ exp(logit - m_r)` over its shard, the chosen token's logit if
//! it holds that token (else -inf), and its own `n` best (logit, global id). One all-gather of
//! these records for every row of a step (a few dozen f64 per row and rank, whatever the
//! vocabulary) gives every rank the global `logsumexp = M + ln Σ_r s_r exp(m_r - M)` with
//! `M = max_r m_r`, the chosen token's logit, and the global top `n` (the union of each rank's
//! top `n` holds it), ordered by logit, ties to the lowest id.
//!
//! The sums are in f64 from the f32 logits, so the result equals a dense f64 log-softmax of
//! the same logits to about 1e-12 of the logsumexp.

use candle_core::Result;
use std::cmp::Ordering;

use crate::comm::ProcessGroup;
use crate::Partition;

/// The most top log-probabilities a position reports (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The id a rank sends to pad its top entries (it holds fewer tokens than asked for).
const NO_TOKEN: f64 = f64::MAX;

/// One position's log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The sampled token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f64,
    /// The most likely tokens and their log-probabilities, most likely first (ties to the
    /// lowest id); as many as were asked for (fewer only for a smaller vocabulary).
    pub top: Vec<(u32, f64)>,
}

/// One row of a step: this rank's logits, the token drawn, and how many top entries to report.
#[derive(Debug, Clone, Copy)]
pub struct LogprobRow<'a> {
    /// This rank's slice of the row's logits (the vocabulary split as `part`).
    pub local: &'a [f32],
    /// The token drawn at this position (a global id).
    pub token: u32,
    /// Top entries to report, at most [`MAX_TOP_LOGPROBS`].
    pub top_n: usize,
}

/// The order of the top entries: logit descending, then id ascending.
fn order(a: &(f64, f64), b: &(f64, f64)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.total_cmp(&b.1))
}

/// This rank's record of one row: `[m, s, chosen, (logit, id) x top_n]`.
fn record(row: &LogprobRow<'_>, offset: usize, out: &mut Vec<f64>) {
    let m = row
        .local
        .iter()
        .fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
    let s: f64 = if m == f64::NEG_INFINITY {
        0.0
    } else {
        row.local.iter().map(|&v| (v as f64 - m).exp()).sum()
    };
    // A NaN logit makes the row NaN (m ignores NaN in `max`, the sum does not).
    let chosen = (row.token as usize)
        .checked_sub(offset)
        .and_then(|i| row.local.get(i))
        .map_or(f64::NEG_INFINITY, |&v| v as f64);
    out.extend_from_slice(&[m, s, chosen]);
    let mut idx: Vec<usize> = (0..row.local.len()).collect();
    let key = |i: usize| (row.local[i] as f64, (offset + i) as f64);
    let take = row.top_n.min(idx.len());
    if take < idx.len() {
        idx.select_nth_unstable_by(take, |&a, &b| order(&key(a), &key(b)));
        idx.truncate(take);
    }
    for j in 0..row.top_n {
        match idx.get(j) {
            Some(&i) => out.extend_from_slice(&[row.local[i] as f64, (offset + i) as f64]),
            None => out.extend_from_slice(&[f64::NEG_INFINITY, NO_TOKEN]),
        }
    }
}

/// The log-probabilities of every row's token and top entries, the same on every rank. Every
/// rank must pass the same rows (tokens and `top_n`) in the same order; one all-gather for
/// all of them (none when `rows` is empty).
///
/// ```
/// use candle_tp::generate::{shard_logprobs, LogprobRow};
/// use candle_tp::{run_threads, Partition};
/// let logits = [1.0f32, 3.0, 2.0, 0.5, -1.0];
/// let got = run_threads(2, |pg| {
///     let part = Partition::new(5, 2)?;
///     let local = &logits[part.range(pg.rank())];
///     shard_logprobs(&[LogprobRow { local, token: 2, top_n: 2 }], &part, &pg)
/// }).unwrap();
/// let lse = logits.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
/// assert!((got[1][0].logprob - (2.0 - lse)).abs() < 1e-12);
/// assert_eq!(got[0][0].top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
/// ```
pub fn shard_logprobs(
    rows: &[LogprobRow<'_>],
    part: &Partition,
    pg: &ProcessGroup,
) -> Result<Vec<TokenLogprobs>> {
    let rank = pg.rank();
    if part.parts() != pg.size() {
        candle_core::bail!(
            "logprobs on rank {rank}: the vocabulary of {} is split over {} parts, the group has {} ranks",
            part.total(),
            part.parts(),
            pg.size()
        );
    }
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let offset = part.offset(rank);
    let mut mine = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        if row.local.len() != part.size(rank) {
            candle_core::bail!(
                "logprobs on rank {rank}, row {i}: got {} logits, this rank's share of the vocabulary of {} is {}",
                row.local.len(),
                part.total(),
                part.size(rank)
            );
        }
        if row.top_n > MAX_TOP_LOGPROBS {
            candle_core::bail!(
                "logprobs: row {i} asks for {} top entries, at most {MAX_TOP_LOGPROBS}",
                row.top_n
            );
        }
        if row.token as usize >= part.total() {
            candle_core::bail!(
                "logprobs: row {i}'s token {} is outside the vocabulary of {}",
                row.token,
                part.total()
            );
        }
        record(row, offset, &mut mine);
    }
    let mut all = vec![0f64; mine.len() * pg.size()];
    pg.all_gather_slice(&mine, &mut all)?;
    let per_rank = mine.len();
    let mut out = Vec::with_capacity(rows.len());
    let mut at = 0;
    for row in rows {
        let len = 3 + 2 * row.top_n;
        let recs: Vec<&[f64]> = (0..pg.size())
            .map(|r| &all[r * per_rank + at..r * per_rank + at + len])
            .collect();
        at += len;
        let max = recs.iter().fold(f64::NEG_INFINITY, |a, r| a.max(r[0]));
        let lse = if max == f64::NEG_INFINITY {
            f64::NEG_INFINITY
        } else {
            let sum: f64 = recs
                .iter()
                .filter(|r| r[0] > f64::NEG_INFINITY || r[0].is_nan())
                .map(|r| r[1] * (r[0] - max).exp())
                .sum();
            max + sum.ln()
        };
        let chosen = recs.iter().fold(f64::NEG_INFINITY, |a, r| a.max(r[2]));
        let mut top: Vec<(f64, f64)> = recs
            .iter()
            .flat_map(|r| r[3..].chunks_exact(2).map(|p| (p[0], p[1])))
            .filter(|p| p.1 != NO_TOKEN)
            .collect();
        top.sort_by(order);
        top.truncate(row.top_n);
        out.push(TokenLogprobs {
            token: row.token,
            logprob: chosen - lse,
            top: top
                .into_iter()
                .map(|(v, id)| (id as u32, v - lse))
                .collect(),
        });
    }
    Ok(out)
}
