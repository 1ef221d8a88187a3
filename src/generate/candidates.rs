//! Top-k / top-p from vocabulary-parallel logits: each rank's best candidates cross, never
//! the vocabulary (vLLM's `get_top_tokens` idea).
//!
//! Every rank sends its `k` best (scaled logit, global id); every rank then sorts the same
//! union, keeps the same tokens and draws the same one by the Gumbel-max race of
//! [`sampling`](super::sampling), with the same per-token numbers. With top-k, `k` is the
//! requested `top_k`: the union holds the global top-k. With top-p alone, `k` starts at
//! [`FIRST_CANDIDATES`] and doubles until the nucleus is found among the candidates that are
//! known to be the vocabulary's best in order; a flat distribution can need every token.

use candle_core::Result;
use std::cmp::Ordering;

use crate::comm::ProcessGroup;
use crate::generate::noise::DrawNoise;
use crate::generate::race::{RowDraw, ALL_NEG_INF};
use crate::Partition;

/// Candidates gathered per rank for top-p alone, before doubling.
pub(crate) const FIRST_CANDIDATES: usize = 64;

/// The id a rank sends to pad its candidates to `k` (it holds fewer tokens).
const NO_TOKEN: f64 = f64::MAX;

/// The candidates' order: scaled logit descending, then id ascending (the order of the
/// vocabulary sorted by probability, ties to the lowest id).
fn order(a: &(f64, usize), b: &(f64, usize)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Draws a token under top-k and / or top-p (at least one set) from this rank's scaled logits
/// (`logit / temperature`), whose first global id is `offset`.
///
/// The outer error is a collective's (the step cannot go on); the inner one is this row's
/// (every logit -inf, a NaN logit), seen alike by every rank from the gathered candidates, so
/// that the row fails alone and every rank stays in step.
pub(crate) fn sample_candidates(
    scaled: &[f64],
    offset: usize,
    top_k: Option<usize>,
    top_p: Option<f64>,
    noise: &DrawNoise,
    part: &Partition,
    pg: &ProcessGroup,
) -> Result<RowDraw> {
    let nan = scaled.iter().position(|v| v.is_nan());
    // The softmax normaliser over the whole vocabulary: only top-p without top-k needs it.
    let sum = match (top_k, top_p) {
        (None, Some(_)) => Some(softmax_sum(scaled, pg)?),
        _ => None,
    };
    let largest_share = part.sizes().into_iter().max().unwrap_or(1);
    let mut k = top_k.unwrap_or(FIRST_CANDIDATES).min(largest_share).max(1);
    loop {
        let (cands, exact) = match gather_candidates(scaled, nan, offset, k, part, pg)? {
            Ok(got) => got,
            Err(why) => return Ok(Err(why)),
        };
        let max = cands[0].0;
        if max == f64::NEG_INFINITY {
            return Ok(Err(ALL_NEG_INF.to_string()));
        }
        let kept = match top_k {
            Some(tk) => &cands[..tk.min(cands.len())],
            None => &cands[..],
        };
        let kept_len = match top_p {
            None => kept.len(),
            Some(p) => {
                // Probabilities: renormalised over top-k if it was applied, else over the
                // vocabulary.
                let norm = match sum {
                    Some((m, s)) => s * (m - max).exp(),
                    None => kept.iter().map(|c| (c.0 - max).exp()).sum::<f64>(),
                };
                let mut acc = 0.0;
                let found = kept[..exact.min(kept.len())].iter().position(|c| {
                    acc += (c.0 - max).exp() / norm;
                    acc >= p
                });
                match found {
                    Some(i) => i + 1,
                    // The nucleus reaches past the candidates known to be in order: gather
                    // more (every rank sees the same candidates, so every rank takes this
                    // branch).
                    None if top_k.is_none() && k < largest_share => {
                        k = (k * 2).min(largest_share);
                        continue;
                    }
                    None => kept.len(),
                }
            }
        };
        let (mut best, mut best_id) = (f64::NEG_INFINITY, usize::MAX);
        for &(v, id) in &kept[..kept_len] {
            let score = v + noise.gumbel(id);
            if score > best || (score == best && id < best_id) {
                best = score;
                best_id = id;
            }
        }
        return Ok(Ok(best_id as u32));
    }
}

/// (max, sum of `exp(v - max)`) over the whole vocabulary, NaN logits left out (they fail the
/// gathering that follows): one all-gather of one pair per rank.
fn softmax_sum(scaled: &[f64], pg: &ProcessGroup) -> Result<(f64, f64)> {
    let m = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let s = if m == f64::NEG_INFINITY {
        0.0
    } else {
        scaled
            .iter()
            .filter(|v| !v.is_nan())
            .map(|v| (v - m).exp())
            .sum()
    };
    let mut all = vec![0f64; 2 * pg.size()];
    pg.all_gather_slice(&[m, s], &mut all)?;
    let max = all
        .chunks_exact(2)
        .map(|p| p[0])
        .fold(f64::NEG_INFINITY, f64::max);
    let sum = all
        .chunks_exact(2)
        .filter(|p| p[0] > f64::NEG_INFINITY)
        .map(|p| p[1] * (p[0] - max).exp())
        .sum();
    Ok((max, sum))
}

/// The gathered candidates (scaled logit, id) in order, and how many of them, from the first,
/// are known to be the vocabulary's best in that order.
type Candidates = (Vec<(f64, usize)>, usize);

/// Each rank's `k` best (scaled logit, id), gathered and sorted by [`order`], and how many of
/// them, from the first, are the vocabulary's best in that order.
///
/// The union of every rank's `k` best holds the global `k` best, but past them it can skip
/// tokens: a rank with more than `k` tokens sent nothing after its `k`-th, which may come
/// before another rank's candidates. The candidates up to the earliest of those `k`-th
/// tokens are exact. A NaN logit is sent in place of the first candidate, and fails every rank
/// alike.
fn gather_candidates(
    scaled: &[f64],
    nan: Option<usize>,
    offset: usize,
    k: usize,
    part: &Partition,
    pg: &ProcessGroup,
) -> Result<std::result::Result<Candidates, String>> {
    let mut idx: Vec<usize> = (0..scaled.len()).collect();
    let take = k.min(scaled.len());
    if take < idx.len() {
        idx.select_nth_unstable_by(take, |&a, &b| order(&(scaled[a], a), &(scaled[b], b)));
        idx.truncate(take);
    }
    // Padded to k so every rank sends the same count.
    let mut mine = Vec::with_capacity(2 * k);
    for j in 0..k {
        match idx.get(j) {
            Some(&i) => mine.extend_from_slice(&[scaled[i], (offset + i) as f64]),
            None => mine.extend_from_slice(&[f64::NEG_INFINITY, NO_TOKEN]),
        }
    }
    if let Some(i) = nan {
        mine[0] = f64::NAN;
        mine[1] = (offset + i) as f64;
    }
    let mut all = vec![0f64; mine.len() * pg.size()];
    pg.all_gather_slice(&mine, &mut all)?;
    if let Some(p) = all.chunks_exact(2).find(|p| p[0].is_nan()) {
        return Ok(Err(format!("sampling: the logit of token {} is NaN", p[1])));
    }
    let pair = |p: &[f64]| (p[0], p[1] as usize);
    // The earliest last candidate of a rank that had more to send.
    let bound = all
        .chunks_exact(2 * k)
        .enumerate()
        .filter(|(r, _)| part.size(*r) > k)
        .filter_map(|(_, sent)| sent.chunks_exact(2).map(pair).max_by(order))
        .min_by(order);
    let mut cands: Vec<(f64, usize)> = all
        .chunks_exact(2)
        .filter(|p| p[1] != NO_TOKEN)
        .map(pair)
        .collect();
    cands.sort_by(order);
    let exact = match bound {
        None => cands.len(),
        Some(b) => cands
            .iter()
            .take_while(|c| order(c, &b) != Ordering::Greater)
            .count(),
    };
    Ok(Ok((cands, exact)))
}
