//! Sampling the next token from vocabulary-parallel logits, without gathering the vocabulary.
//!
//! Each rank holds the logits of its slice of the vocabulary; every rank ends with the same
//! token, without a broadcast:
//!
//! - Greedy: each rank's best (value, id); one all-gather of one pair per rank, ties to the
//!   lowest id.
//! - Temperature alone: the whole vocabulary is drawn from, by a Gumbel-max race (the
//!   exponential race `argmin E_i / p_i`): each rank adds to each of its logits over the
//!   temperature the Gumbel number of its *global* token id (a pure function of seed, draw and
//!   id, `generate/noise.rs`) and keeps its best (score, id); one all-gather of one pair per
//!   rank picks the winner, ties to the lowest id. One pass over the shard, no sort, an exact
//!   draw from the softmax, and the same token at every world size for the same seed.
//! - Top-k / top-p: the candidates are gathered (`generate/candidates.rs`), then
//!   drawn by the same race with the same numbers, so `top_p = 1` or a `top_k` past the
//!   vocabulary draws what no filter draws.
//!
//! The order of operations follows Hugging Face's warpers: temperature, then top-k, then
//! top-p (renormalised over what top-k kept).

use candle_core::{DType, Result, Tensor};

use crate::comm::ProcessGroup;
use crate::generate::candidates::sample_candidates;
use crate::generate::noise::DrawNoise;
use crate::generate::race::{race_best, race_pick, RowDraw};
use crate::nn::ParallelLmHead;
use crate::Partition;

/// Temperatures below this draw greedily (vLLM's `_SAMPLING_EPS`): a smaller one scales the
/// logits' differences past anything a draw can tell apart, and a tiny one (1e-308) would
/// scale finite logits to -inf in f64, leaving no token to draw.
pub const GREEDY_BELOW: f64 = 1e-5;

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; below [`GREEDY_BELOW`] (`0` included) means greedy (argmax).
    pub temperature: f64,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `p`.
    pub top_p: Option<f64>,
    /// Seed of the draws; the same on every rank.
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

    /// Checks the values: a finite temperature, `top_k` at least 1, `top_p` in `[0, 1]`.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() {
            candle_core::bail!(
                "sampling: temperature = {} must be a finite number (0 or below: greedy)",
                self.temperature
            );
        }
        if self.top_k == Some(0) {
            candle_core::bail!("sampling: top_k = 0 keeps no token (leave it unset to keep all)");
        }
        if let Some(p) = self.top_p {
            if !(0.0..=1.0).contains(&p) {
                candle_core::bail!("sampling: top_p = {p} must be in [0, 1]");
            }
        }
        Ok(())
    }

    /// Greedy: a temperature below [`GREEDY_BELOW`] (0 or below included), or top-k of 1.
    fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW || self.top_k == Some(1)
    }
}

/// Draws tokens from vocabulary-parallel logits; every rank of the group gets the same token.
///
/// The `n`-th draw of a sampler seeded `seed` uses the random numbers of (seed, `n`), whatever
/// the world size: the same logits give the same tokens on 1, 2 or 3 ranks.
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
    /// Draws made so far: the counter of the next draw's random numbers.
    step: u64,
}

impl DistributedSampler {
    /// A sampler whose draws are seeded by `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Self { params, step: 0 }
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
        let ids = sample_batch(&mut [(self, local_logits)], part, pg)?;
        Ok(ids[0])
    }
}

/// How one row is drawn once every rank's (score, id) pair is known.
enum Draw {
    /// Invalid parameters: this row alone fails, with why.
    Failed(String),
    Greedy,
    Race,
    /// Top-k / top-p: drawn after the pairs, with collectives of its own.
    Candidates(Filtered),
}

/// A top-k / top-p row waiting for its candidates.
struct Filtered {
    local: Vec<f32>,
    inv_t: f64,
    top_k: Option<usize>,
    top_p: Option<f64>,
    noise: DrawNoise,
}

/// Samples the next token of several sequences at once, one row of this rank's logits each
/// (as [`DistributedSampler::sample_shard`], and the same tokens). The greedy and
/// temperature-only rows cross ranks together, in one all-gather of one (score, id) pair per
/// row and rank; top-k / top-p rows then gather their candidates one row at a time.
///
/// Every rank must pass the same samplers (parameters and draws made) in the same order.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_tp::generate::{sample_batch, DistributedSampler, SamplingParams};
/// use candle_tp::{run_threads, Partition};
/// let rows: [Vec<f32>; 2] = [vec![0.1, 2.0, -1.0, 5.0, 0.3], vec![9.0, 0.0, 0.0, 0.0, 0.0]];
/// let ids = run_threads(2, |pg| {
///     let part = Partition::new(5, 2)?;
///     let r = part.range(pg.rank());
///     let a = Tensor::new(&rows[0][r.clone()], &Device::Cpu)?;
///     let b = Tensor::new(&rows[1][r], &Device::Cpu)?;
///     let mut s = DistributedSampler::new(SamplingParams::greedy());
///     let mut t = DistributedSampler::new(SamplingParams::greedy());
///     sample_batch(&mut [(&mut s, &a), (&mut t, &b)], &part, &pg)
/// }).unwrap();
/// assert_eq!(ids, vec![vec![3, 0], vec![3, 0]]);
/// ```
pub fn sample_batch(
    rows: &mut [(&mut DistributedSampler, &Tensor)],
    part: &Partition,
    pg: &ProcessGroup,
) -> Result<Vec<u32>> {
    sample_rows(rows, part, pg)?
        .into_iter()
        .map(|r| r.map_err(candle_core::Error::msg))
        .collect()
}

/// [`sample_batch`] with each row's own failure apart: the outer error ends the step (a
/// collective failed, a shard of the wrong size); an inner one is that row's alone (its
/// parameters are invalid, every logit is -inf, a logit is NaN) and the other rows still get
/// their tokens. Every rank sees the same gathered values, so every rank fails the same rows.
pub(crate) fn sample_rows(
    rows: &mut [(&mut DistributedSampler, &Tensor)],
    part: &Partition,
    pg: &ProcessGroup,
) -> Result<Vec<RowDraw>> {
    let rank = pg.rank();
    if part.parts() != pg.size() {
        candle_core::bail!(
            "sampling on rank {rank}: the vocabulary of {} is split over {} parts, the group has {} ranks",
            part.total(),
            part.parts(),
            pg.size()
        );
    }
    let offset = part.offset(rank);
    let mut draws = Vec::with_capacity(rows.len());
    let mut mine = Vec::with_capacity(2 * rows.len());
    for (sampler, logits) in rows.iter_mut() {
        let local: Vec<f32> = logits.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        if local.len() != part.size(rank) {
            candle_core::bail!(
                "sampling on rank {rank}: got {} logits, this rank's share of the vocabulary of {} over {} ranks is {}",
                local.len(),
                part.total(),
                pg.size(),
                part.size(rank)
            );
        }
        let params = sampler.params;
        let noise = DrawNoise::new(params.seed, sampler.step);
        sampler.step += 1;
        // Filters that keep every token are no filters (and need no candidates).
        let top_k = params.top_k.filter(|&k| k < part.total());
        let top_p = params.top_p.filter(|&p| p < 1.0);
        // The parameters are the same on every rank: every rank leaves this row out alike.
        let draw = if let Err(e) = params.validate() {
            Draw::Failed(e.to_string())
        } else if params.is_greedy() {
            mine.extend_from_slice(&greedy_best(&local, offset));
            Draw::Greedy
        } else if top_k.is_none() && top_p.is_none() {
            mine.extend_from_slice(&race_best(&local, offset, 1.0 / params.temperature, &noise));
            Draw::Race
        } else {
            Draw::Candidates(Filtered {
                local,
                inv_t: 1.0 / params.temperature,
                top_k,
                top_p,
                noise,
            })
        };
        draws.push(draw);
    }
    let mut all = vec![0f64; mine.len() * pg.size()];
    if !mine.is_empty() {
        pg.all_gather_slice(&mine, &mut all)?;
    }
    let mut pair = 0;
    let mut ids = Vec::with_capacity(draws.len());
    for draw in draws {
        let id = match draw {
            Draw::Failed(why) => Err(why),
            Draw::Greedy | Draw::Race => {
                let j = pair;
                pair += 1;
                let pairs = all
                    .chunks_exact(mine.len())
                    .map(move |r| (r[2 * j], r[2 * j + 1]));
                if matches!(draw, Draw::Greedy) {
                    Ok(greedy_pick(pairs))
                } else {
                    race_pick(pairs)
                }
            }
            Draw::Candidates(c) => {
                let scaled: Vec<f64> = c.local.iter().map(|&v| v as f64 * c.inv_t).collect();
                sample_candidates(&scaled, offset, c.top_k, c.top_p, &c.noise, part, pg)?
            }
        };
        ids.push(id);
    }
    Ok(ids)
}

/// This rank's largest logit and its global id (the first of equal ones; a NaN first in the
/// shard is kept, as before the Gumbel race existed).
///
/// Two passes that vectorize, where the one-pass scan's branch on each logit did not (a
/// 49152-token vocabulary is 24576 logits per rank and row, 16 rows a step when serving): the
/// largest value in eight independent lanes (a NaN is never larger, so it is skipped as the
/// scan skips it), then the first logit equal to it.
fn greedy_best(local: &[f32], offset: usize) -> [f64; 2] {
    match local.first() {
        None => return [f64::NEG_INFINITY, offset as f64],
        Some(v) if v.is_nan() => return [f64::NAN, offset as f64],
        Some(_) => {}
    }
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = local.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let best_v = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    // `local[0]` is not a NaN, so `best_v` is one of the logits (or -inf, which `local[0]`
    // then is).
    let best_i = local.iter().position(|&v| v == best_v).unwrap_or(0);
    [best_v as f64, (offset + best_i) as f64]
}

/// The global argmax from every rank's best: ties go to the lowest id, as `argmax` over the
/// full logits does.
fn greedy_pick(mut pairs: impl Iterator<Item = (f64, f64)>) -> u32 {
    let (mut val, mut id) = pairs.next().expect("a group has at least one rank");
    for (v, i) in pairs {
        if v > val || (v == val && i < id) {
            val = v;
            id = i;
        }
    }
    id as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The two-pass argmax gives the one-pass scan's value and index: ties to the first,
    /// NaNs skipped unless first, -inf rows, any length (tails of 0-7 after the lanes).
    #[test]
    fn greedy_best_is_the_first_largest_logit() {
        fn scan(local: &[f32], offset: usize) -> [f64; 2] {
            let (mut best_i, mut best_v) = (0usize, f32::NEG_INFINITY);
            for (i, &v) in local.iter().enumerate() {
                if v > best_v || (i == 0 && v.is_nan()) {
                    best_i = i;
                    best_v = v;
                }
            }
            [best_v as f64, (offset + best_i) as f64]
        }
        let mut rng = crate::rng::SplitMix64::new(7);
        for len in [1usize, 2, 7, 8, 9, 15, 16, 17, 100, 24576] {
            for case in 0..8 {
                let mut v: Vec<f32> = (0..len)
                    .map(|_| (rng.next_normal() * 3.0).round() as f32)
                    .collect();
                match case {
                    1 => v[len / 2] = f32::NAN,
                    2 => v[0] = f32::NAN,
                    3 => v.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
                    4 => v.iter_mut().for_each(|x| *x = f32::NAN),
                    5 => v[len - 1] = 1e30,
                    6 => {
                        v.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
                        v[len - 1] = f32::NAN;
                    }
                    7 => v.iter_mut().for_each(|x| *x = -0.0),
                    _ => {}
                }
                let (got, want) = (greedy_best(&v, 5), scan(&v, 5));
                assert_eq!(got[1], want[1], "len {len} case {case}: index");
                // (+0 and -0 compare equal, as the ranks compare their bests.)
                assert!(
                    got[0] == want[0] || (got[0].is_nan() && want[0].is_nan()),
                    "len {len} case {case}: {} vs {}",
                    got[0],
                    want[0]
                );
            }
        }
        assert_eq!(greedy_best(&[], 3)[1], 3.0);
    }

    /// Rows that cannot be drawn from (every logit -inf, a NaN logit, invalid parameters) fail
    /// alone at 2 ranks, on both ranks alike, in every kind of draw (greedy, race, top-k /
    /// top-p), and the rows around them get the tokens they get in a batch of their own.
    #[test]
    fn a_row_that_cannot_be_drawn_fails_alone() {
        let n = 11usize;
        let good: Vec<f32> = (0..n)
            .map(|i| ((i * 7) % 5) as f32 - 0.5 * i as f32)
            .collect();
        let ninf = vec![f32::NEG_INFINITY; n];
        let mut nan = good.clone();
        nan[8] = f32::NAN; // on rank 1's shard
        let sampled = |t: f64, k: Option<usize>, p: Option<f64>| SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            seed: 3,
        };
        let rows: Vec<(Vec<f32>, SamplingParams, bool)> = vec![
            (good.clone(), SamplingParams::greedy(), true),
            (ninf.clone(), sampled(1.0, None, None), false),
            (good.clone(), sampled(0.7, None, None), true),
            (nan.clone(), sampled(1.0, None, None), false),
            (ninf.clone(), sampled(1.0, Some(3), None), false),
            (nan, sampled(1.0, None, Some(0.5)), false),
            (good.clone(), sampled(f64::NAN, None, None), false),
            (good.clone(), sampled(1.3, Some(4), Some(0.8)), true),
            (good, sampled(1e-308, None, None), true),
        ];
        let got = crate::run_threads(2, |pg| {
            let part = Partition::new(n, 2)?;
            let range = part.range(pg.rank());
            let tensors: Vec<Tensor> = rows
                .iter()
                .map(|(v, _, _)| Tensor::new(&v[range.clone()], &Device::Cpu))
                .collect::<Result<_>>()?;
            let mut samplers: Vec<DistributedSampler> = rows
                .iter()
                .map(|(_, p, _)| DistributedSampler::new(*p))
                .collect();
            let mut batch: Vec<(&mut DistributedSampler, &Tensor)> =
                samplers.iter_mut().zip(&tensors).collect();
            let together = sample_rows(&mut batch, &part, &pg)?;
            // Each good row alone, with a fresh sampler (the same draw number).
            let mut alone = Vec::new();
            for ((_, p, ok), t) in rows.iter().zip(&tensors) {
                if *ok {
                    let mut s = DistributedSampler::new(*p);
                    alone.push(Some(sample_batch(&mut [(&mut s, t)], &part, &pg)?[0]));
                } else {
                    alone.push(None);
                }
            }
            Ok((together, alone))
        })
        .unwrap();
        assert_eq!(got[0], got[1], "both ranks fail the same rows alike");
        let (together, alone) = &got[0];
        for (r, ((row, want), (_, p, ok))) in together.iter().zip(alone).zip(&rows).enumerate() {
            match (row, want) {
                (Ok(id), Some(want)) => assert_eq!(id, want, "row {r} {p:?}"),
                (Err(why), None) => assert!(
                    why.contains("-inf") || why.contains("NaN"),
                    "row {r} {p:?}: {why}"
                ),
                _ => panic!("row {r} {p:?} (good: {ok}): {row:?}"),
            }
        }
        // A batch of failing rows alone fails as a whole through the public entry.
        let e = crate::run_threads(1, |pg| {
            let part = Partition::new(n, 1)?;
            let t = Tensor::new(&ninf[..], &Device::Cpu)?;
            let mut s = DistributedSampler::new(sampled(1.0, None, None));
            sample_batch(&mut [(&mut s, &t)], &part, &pg)
        })
        .unwrap_err();
        assert!(e.to_string().contains("-inf"), "{e}");
    }
}
