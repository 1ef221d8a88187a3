//! Sampling the next token from vocabulary-parallel logits, without gathering the vocabulary.
//!
//! Each rank holds the logits of its slice of the vocabulary. Greedy decoding all-gathers one
//! (value, id) pair per rank. Temperature / top-k / top-p sampling all-reduces the maximum and
//! the sum of exponentials (the softmax normaliser over the whole vocabulary), then
//! all-gathers each rank's `k` best candidates; every rank then draws the same token from the
//! same candidates with the same seeded generator, so all ranks agree without a broadcast.
//! (vLLM's `get_top_tokens` idea.) Only when top-p is asked without top-k and the candidates
//! known to be the vocabulary's best in order do not yet cover the nucleus are more candidates
//! gathered (doubling).
//!
//! The order of operations follows Hugging Face's warpers: temperature, then top-k, then
//! top-p (renormalised over what top-k kept).

use candle_core::{DType, Result, Tensor};

use crate::comm::{ProcessGroup, ReduceOp};
use crate::nn::ParallelLmHead;
use crate::rng::SplitMix64;
use crate::Partition;

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` (or below) means greedy (argmax).
    pub temperature: f64,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `p`.
    pub top_p: Option<f64>,
    /// Seed of the generator; the same on every rank.
    pub seed: u64,
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }

    fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == Some(1)
    }
}

/// Candidates gathered per rank for top-p alone, before doubling.
const FIRST_CANDIDATES: usize = 64;

/// Draws tokens from vocabulary-parallel logits; every rank of the group gets the same token.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_tp::generate::{DistributedSampler, SamplingParams};
/// use candle_tp::{run_threads, Partition};
/// let logits: Vec<f32> = vec![0.1, 2.0, -1.0, 5.0, 0.3];
/// let ids = run_threads(2, |pg| {
///     let part = Partition::new(5, 2)?;
///     let r = part.range(pg.rank());
///     let local = Tensor::new(&logits[r], &Device::Cpu)?;
///     DistributedSampler::new(SamplingParams::greedy()).sample_shard(&local, &part, &pg)
/// }).unwrap();
/// assert_eq!(ids, vec![3, 3]);
/// ```
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl DistributedSampler {
    /// A sampler with its generator seeded by `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            rng: SplitMix64::new(params.seed ^ 0x5DEE_CE66_D1CE_4E5B),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Samples from this rank's slice of the logits as produced by `head`.
    pub fn sample(&mut self, local_logits: &Tensor, head: &ParallelLmHead) -> Result<u32> {
        self.sample_shard(local_logits, head.partition(), head.pg())
    }

    /// Samples from this rank's slice of the logits (`part.size(rank)` values of the last
    /// position; leading dimensions of size 1 are accepted).
    pub fn sample_shard(
        &mut self,
        local_logits: &Tensor,
        part: &Partition,
        pg: &ProcessGroup,
    ) -> Result<u32> {
        let local: Vec<f32> = local_logits
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1()?;
        let rank = pg.rank();
        if part.parts() != pg.size() || local.len() != part.size(rank) {
            candle_core::bail!(
                "sampling on rank {rank}: got {} logits, this rank's share of the vocabulary of {} over {} ranks is {}",
                local.len(),
                part.total(),
                pg.size(),
                part.size(rank.min(part.parts().saturating_sub(1)))
            );
        }
        let offset = part.offset(rank);
        if self.params.is_greedy() {
            return greedy(&local, offset, pg);
        }
        let inv_t = 1.0 / self.params.temperature;
        let scaled: Vec<f64> = local.iter().map(|&v| v as f64 * inv_t).collect();
        // Softmax normaliser over the whole vocabulary (used when top-k is not set).
        let mut max = [scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max)];
        pg.all_reduce_slice(&mut max, ReduceOp::Max)?;
        let mut sum = [scaled.iter().map(|v| (v - max[0]).exp()).sum::<f64>()];
        pg.all_reduce_slice(&mut sum, ReduceOp::Sum)?;
        let largest_share = (0..pg.size()).map(|r| part.size(r)).max().unwrap_or(0);
        let mut k = self
            .params
            .top_k
            .unwrap_or(FIRST_CANDIDATES)
            .min(largest_share)
            .max(1);
        loop {
            let (cands, exact) = gather_top_k(&scaled, offset, k, part, pg)?;
            let kept: Vec<(f64, u32)> = match self.params.top_k {
                Some(tk) => cands.into_iter().take(tk).collect(),
                None => cands,
            };
            // Probabilities: renormalised over top-k if it was applied, else over the vocabulary.
            let norm = if self.params.top_k.is_some() {
                kept.iter().map(|(v, _)| (v - max[0]).exp()).sum::<f64>()
            } else {
                sum[0]
            };
            let probs: Vec<f64> = kept
                .iter()
                .map(|(v, _)| (v - max[0]).exp() / norm)
                .collect();
            let kept_len = match self.params.top_p {
                None => kept.len(),
                Some(p) => {
                    let mut acc = 0.0;
                    match probs[..exact.min(probs.len())].iter().position(|q| {
                        acc += q;
                        acc >= p
                    }) {
                        Some(i) => i + 1,
                        // The nucleus reaches past the candidates known to be in order:
                        // gather more (every rank sees the same candidates, so every rank
                        // takes this branch).
                        None if self.params.top_k.is_none() && k < largest_share => {
                            k = (k * 2).min(largest_share);
                            continue;
                        }
                        None => kept.len(),
                    }
                }
            };
            let total: f64 = probs[..kept_len].iter().sum();
            let u = self.rng.next_f64() * total;
            let mut acc = 0.0;
            for (i, q) in probs[..kept_len].iter().enumerate() {
                acc += q;
                if u < acc {
                    return Ok(kept[i].1);
                }
            }
            return Ok(kept[kept_len - 1].1);
        }
    }
}

/// The global argmax: one (value, id) pair per rank crosses; ties go to the lowest id, as
/// `argmax` over the full logits does.
fn greedy(local: &[f32], offset: usize, pg: &ProcessGroup) -> Result<u32> {
    let (mut best_i, mut best_v) = (0usize, f32::NEG_INFINITY);
    for (i, &v) in local.iter().enumerate() {
        if v > best_v || (i == 0 && v.is_nan()) {
            best_i = i;
            best_v = v;
        }
    }
    let mine = [best_v as f64, (offset + best_i) as f64];
    let mut all = vec![0f64; 2 * pg.size()];
    pg.all_gather_slice(&mine, &mut all)?;
    let (mut id, mut val) = (all[1], all[0]);
    for pair in all.chunks_exact(2).skip(1) {
        if pair[0] > val || (pair[0] == val && pair[1] < id) {
            val = pair[0];
            id = pair[1];
        }
    }
    Ok(id as u32)
}

/// Each rank's `k` best (value, id), gathered and sorted: by value descending, then by id; and
/// how many of them, from the first, are the vocabulary's best in that order.
///
/// The union of every rank's `k` best holds the global `k` best, but past them it can skip
/// tokens: a rank with more than `k` tokens sent nothing after its `k`-th, which may come
/// before another rank's candidates. The candidates up to the earliest of those `k`-th tokens
/// are exact.
fn gather_top_k(
    scaled: &[f64],
    offset: usize,
    k: usize,
    part: &Partition,
    pg: &ProcessGroup,
) -> Result<(Vec<(f64, u32)>, usize)> {
    let mut idx: Vec<usize> = (0..scaled.len()).collect();
    let take = k.min(scaled.len());
    if take < idx.len() {
        idx.select_nth_unstable_by(take, |&a, &b| {
            scaled[b].total_cmp(&scaled[a]).then(a.cmp(&b))
        });
        idx.truncate(take);
    }
    // Pad to k so every rank contributes the same count.
    let mut mine = Vec::with_capacity(2 * k);
    for j in 0..k {
        match idx.get(j) {
            Some(&i) => mine.extend_from_slice(&[scaled[i], (offset + i) as f64]),
            None => mine.extend_from_slice(&[f64::NEG_INFINITY, f64::MAX]),
        }
    }
    let mut all = vec![0f64; mine.len() * pg.size()];
    pg.all_gather_slice(&mine, &mut all)?;
    let order = |a: &(f64, u32), b: &(f64, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    // The earliest last candidate of a rank that had more to send.
    let bound = all
        .chunks_exact(2 * k)
        .enumerate()
        .filter(|(r, _)| part.size(*r) > k)
        .filter_map(|(_, sent)| {
            sent.chunks_exact(2)
                .map(|p| (p[0], p[1] as u32))
                .max_by(order)
        })
        .min_by(order);
    let mut cands: Vec<(f64, u32)> = all
        .chunks_exact(2)
        .filter(|p| p[1] != f64::MAX)
        .map(|p| (p[0], p[1] as u32))
        .collect();
    cands.sort_by(order);
    let exact = match bound {
        None => cands.len(),
        Some(b) => cands
            .iter()
            .take_while(|c| order(c, &b) != std::cmp::Ordering::Greater)
            .count(),
    };
    Ok((cands, exact))
}
