//! Drawing a step's tokens: penalties, `min_tokens` and grammar masks on each rank's
//! vocabulary shard, one
//! [`sample_batch`](crate::generate::sample_batch) call, log-probabilities on the shards; and, on a pipeline, handing the
//! last stage's draws to every stage.

use candle_core::{DType, Result, Tensor};

use super::sequences::BatchDecoder;

/// The token of a row whose draw failed (no model has `u32::MAX` ids): it crosses pipeline
/// stages with the others, and every stage fails that row alone.
pub(super) const FAILED_DRAW: u32 = u32::MAX;

/// A step's draws: one token per ready row ([`FAILED_DRAW`] where it failed), the rows'
/// log-probabilities where asked for, and why each failed row failed (index into the rows).
pub(super) type Drawn = (Vec<u32>, Vec<Option<TokenLogprobs>>, Vec<(usize, String)>);
use crate::generate::constraint::mask_shard;
use crate::generate::logprobs::{shard_logprobs, LogprobRow, TokenLogprobs};
use crate::generate::penalties::apply_penalties;
use crate::generate::sampling::sample_rows;
use crate::generate::DistributedSampler;
use crate::models::CausalLm;

impl BatchDecoder {
    /// The tokens of the `ready` sequences (plan row, sequence) from `logits` (this rank's
    /// slices, one per plan row), and their log-probabilities where asked for: penalties and
    /// the `min_tokens` mask applied, then each row's grammar mask (`masks`, one per row of
    /// `ready`: rank 0's allowed ids, which hold `min_tokens` already), then one
    /// [`sample_batch`](crate::generate::sample_batch) call. A row that cannot be drawn from (every logit -inf, a NaN) gets
    /// [`FAILED_DRAW`] and its reason in the third list (index into `ready`); the other rows
    /// go on.
    pub(super) fn draw(
        &mut self,
        model: &CausalLm,
        logits: &[Tensor],
        ready: &[(usize, usize)],
        masks: &[Option<Vec<u32>>],
    ) -> Result<Drawn> {
        let head = model.head("BatchDecoder::step")?;
        let range = head.partition().range(head.pg().rank());
        let mut rows_logits: Vec<Tensor> = Vec::with_capacity(ready.len());
        // The raw logits of the rows that report log-probabilities (index into `ready`).
        let mut raw: Vec<(usize, Vec<f32>)> = Vec::new();
        for (&(row, i), bits) in ready.iter().zip(masks) {
            let s = &self.seqs[i];
            let mut row_logits = logits[row].clone();
            if s.req.options.logprobs.is_some() {
                raw.push((rows_logits.len(), to_f32(&row_logits)?));
            }
            let mask =
                bits.is_none() && s.generated < s.req.min_tokens && !s.req.stop_ids.is_empty();
            if mask || bits.is_some() || !s.req.options.penalties.is_neutral() {
                let mut v = to_f32(&row_logits)?;
                apply_penalties(&mut v, range.clone(), &s.req.options.penalties, &s.history);
                if mask {
                    mask_ids(&mut v, &s.req.stop_ids, range.clone());
                }
                if let Some(bits) = bits {
                    mask_shard(&mut v, range.clone(), bits);
                }
                row_logits = Tensor::from_vec(v, row_logits.shape(), row_logits.device())?;
            }
            rows_logits.push(row_logits);
        }
        let tokens = {
            // `ready` is in batch order.
            let mut pending = ready.iter().zip(&rows_logits).peekable();
            let mut rows: Vec<(&mut DistributedSampler, &Tensor)> = Vec::new();
            for (i, s) in self.seqs.iter_mut().enumerate() {
                if let Some((_, row_logits)) = pending.next_if(|r| r.0 .1 == i) {
                    rows.push((&mut s.sampler, row_logits));
                }
            }
            sample_rows(&mut rows, head.partition(), head.pg())?
        };
        let mut failed = Vec::new();
        let tokens: Vec<u32> = tokens
            .into_iter()
            .enumerate()
            .map(|(r, t)| {
                t.unwrap_or_else(|why| {
                    failed.push((r, why));
                    FAILED_DRAW
                })
            })
            .collect();
        let mut logprobs: Vec<Option<TokenLogprobs>> = vec![None; ready.len()];
        if !raw.is_empty() {
            // A failed row has no token to report (every rank leaves it out alike).
            raw.retain(|(r, _)| tokens[*r] != FAILED_DRAW);
            let rows: Vec<LogprobRow<'_>> = raw
                .iter()
                .map(|(r, local)| LogprobRow {
                    local,
                    token: tokens[*r],
                    top_n: self.seqs[ready[*r].1].req.options.logprobs.unwrap_or(0),
                })
                .collect();
            let got = shard_logprobs(&rows, head.partition(), head.pg())?;
            for ((r, _), lp) in raw.iter().zip(got) {
                logprobs[*r] = Some(lp);
            }
        }
        Ok((tokens, logprobs, failed))
    }

    /// On a pipeline, the last stage's draws handed to every stage (one broadcast of the
    /// tokens, one of the log-probabilities when a sequence asked for them); without one,
    /// the draws as they are.
    pub(super) fn share_draws(
        &self,
        model: &CausalLm,
        ready: &[(usize, usize)],
        mut tokens: Vec<u32>,
        logprobs: Vec<Option<TokenLogprobs>>,
    ) -> Result<(Vec<u32>, Vec<Option<TokenLogprobs>>)> {
        let Some(stage) = model.pipeline() else {
            return Ok((tokens, logprobs));
        };
        stage.share_from_last(&mut tokens)?;
        // Per row that asked for n top entries: [entries, logprob, (id, logprob) x n].
        let asked: Vec<Option<usize>> = ready
            .iter()
            .map(|&(_, i)| self.seqs[i].req.options.logprobs)
            .collect();
        let len: usize = asked.iter().flatten().map(|n| 2 + 2 * n).sum();
        if len == 0 {
            return Ok((tokens, logprobs));
        }
        let mut flat = vec![0f64; len];
        if stage.is_last() {
            let mut at = 0;
            for (lp, n) in logprobs.iter().zip(&asked) {
                let (Some(lp), Some(n)) = (lp, n) else {
                    continue;
                };
                flat[at] = lp.top.len() as f64;
                flat[at + 1] = lp.logprob;
                for (k, (id, l)) in lp.top.iter().take(*n).enumerate() {
                    flat[at + 2 + 2 * k] = f64::from(*id);
                    flat[at + 3 + 2 * k] = *l;
                }
                at += 2 + 2 * n;
            }
        }
        stage.share_from_last(&mut flat)?;
        let mut out = vec![None; ready.len()];
        let mut at = 0;
        for (r, n) in asked.iter().enumerate() {
            let Some(n) = n else { continue };
            let entries = (flat[at] as usize).min(*n);
            out[r] = Some(TokenLogprobs {
                token: tokens[r],
                logprob: flat[at + 1],
                top: (0..entries)
                    .map(|k| (flat[at + 2 + 2 * k] as u32, flat[at + 3 + 2 * k]))
                    .collect(),
            });
            at += 2 + 2 * n;
        }
        Ok((tokens, out))
    }
}

/// One row of logits as f32 values.
fn to_f32(row: &Tensor) -> Result<Vec<f32>> {
    row.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()
}

/// Sets the ids in `ids` that fall in `range` (this rank's share of the vocabulary, whose
/// logits `local` holds) to minus infinity: they cannot be drawn.
fn mask_ids(local: &mut [f32], ids: &[u32], range: std::ops::Range<usize>) {
    for &id in ids {
        let id = id as usize;
        if range.contains(&id) {
            local[id - range.start] = f32::NEG_INFINITY;
        }
    }
}
