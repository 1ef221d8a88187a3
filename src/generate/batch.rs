//! Continuous batching: many sequences decoded together through one model, joining and
//! leaving between steps.
//!
//! A [`BatchDecoder`] holds the active sequences (each with its own KV cache, sampler and
//! position). Each [`BatchDecoder::step`] runs one new token of every decoding sequence and a
//! bounded chunk of the prompts still being read (so a long prompt never stalls the running
//! streams for more than `prefill_chunk` tokens) through [`CausalLm::forward_batch`]: the
//! decoding sequences together (in passes of at most 16 rows), each prompt chunk in a pass of
//! its own, so that a sequence's logits do not depend on what else the step runs (batch
//! invariance, see `BatchDecoder::forward_groups`); then it samples
//! the next token of every sequence whose prompt is complete (with one
//! [`sample_batch`](crate::generate::sample_batch) call: the greedy and temperature-only
//! sequences cross ranks in one all-gather). A sequence under a grammar (structured outputs)
//! draws only what rank 0's grammar allows ([`constraint`](crate::generate::constraint)).
//!
//! Every rank of the model's group runs the same decoder with the same calls (the serving
//! scheduler broadcasts them from rank 0); the sampled tokens are the same on every rank, so
//! the sequences finish at the same step everywhere.

use candle_core::{IndexOp, Result, Tensor};

use crate::generate::constraint::{share_masks, MaskRequest, RowMask, TokenFilter};
use crate::generate::logprobs::MAX_TOP_LOGPROBS;
use crate::generate::penalties::History;
use crate::generate::DistributedSampler;
use crate::models::{CausalLm, SeqStep};

mod draw;
mod sequences;

use draw::FAILED_DRAW;
use sequences::Active;
pub use sequences::{BatchDecoder, FinishReason, SeqOptions, SeqRequest, TokenEvent};

impl BatchDecoder {
    /// A decoder for at most `max_batch` sequences of at most `max_seq_len` positions (prompt
    /// and generated tokens; fewer where the model's context is shorter), reading at most
    /// `prefill_chunk` prompt tokens per step.
    pub fn new(max_batch: usize, max_seq_len: usize, prefill_chunk: usize) -> Result<Self> {
        if max_batch == 0 || max_seq_len < 2 || prefill_chunk == 0 {
            candle_core::bail!(
                "batch decoder: max_batch = {max_batch} and prefill_chunk = {prefill_chunk} must be at least 1, max_seq_len = {max_seq_len} at least 2"
            );
        }
        Ok(Self {
            seqs: Vec::new(),
            failed: Vec::new(),
            max_batch,
            prefill_chunk,
            max_seq_len,
            forward_passes: 0,
        })
    }

    /// The forward passes the decoder has run: one per step and per 16 decoding sequences,
    /// plus one per prompt chunk unless the prompts share the decode pass
    /// ([`CausalLm::rows_invariant`]).
    pub fn forward_passes(&self) -> u64 {
        self.forward_passes
    }

    /// Active sequences.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// Whether no sequence is active.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Whether another sequence can join.
    pub fn has_room(&self) -> bool {
        self.seqs.len() < self.max_batch
    }

    /// The most sequences at once.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// The longest sequence (prompt and generated tokens).
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// KV cache positions held by the active sequences.
    pub fn cached_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.cache.len()).sum()
    }

    /// The ids of the active sequences, in batch order.
    pub fn ids(&self) -> Vec<u64> {
        self.seqs.iter().map(|s| s.req.id).collect()
    }

    /// Checks that `req` could join (sizes, id), without adding it.
    pub fn check(&self, req: &SeqRequest) -> Result<()> {
        if req.prompt.is_empty() {
            candle_core::bail!("sequence {}: the prompt has no tokens", req.id);
        }
        if req.max_tokens == 0 {
            candle_core::bail!("sequence {}: max_tokens must be at least 1", req.id);
        }
        if req.min_tokens > req.max_tokens {
            candle_core::bail!(
                "sequence {}: min_tokens = {} exceeds max_tokens = {}",
                req.id,
                req.min_tokens,
                req.max_tokens
            );
        }
        if req.prompt.len() >= self.max_seq_len {
            candle_core::bail!(
                "sequence {}: the prompt has {} tokens, the longest sequence is {} (prompt and at least one generated token)",
                req.id,
                req.prompt.len(),
                self.max_seq_len
            );
        }
        if self.seqs.iter().any(|s| s.req.id == req.id) {
            candle_core::bail!("sequence {} is already active", req.id);
        }
        if let Some(n) = req.options.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            candle_core::bail!(
                "sequence {}: {n} top log-probabilities asked for, at most {MAX_TOP_LOGPROBS}",
                req.id
            );
        }
        req.options
            .penalties
            .validate()
            .map_err(|e| candle_core::Error::msg(format!("sequence {}: {e}", req.id)))?;
        req.params
            .validate()
            .map_err(|e| candle_core::Error::msg(format!("sequence {}: {e}", req.id)))?;
        Ok(())
    }

    /// [`BatchDecoder::check`] and what `model` can run: every prompt id inside its
    /// vocabulary, the prompt shorter than its context (`max_position_embeddings`). A sequence
    /// that passes cannot fail the batched forward of a later step (which would end every
    /// sequence of the batch): it ends as [`FinishReason::Length`] at the model's last position.
    pub fn check_for(&self, model: &CausalLm, req: &SeqRequest) -> Result<()> {
        self.check(req)?;
        let vocab = model.config().vocab_size;
        if let Some((i, id)) = req
            .prompt
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= vocab)
        {
            candle_core::bail!(
                "sequence {}: prompt token {i} has id {id}, outside the model's vocabulary of {vocab} ids",
                req.id
            );
        }
        if let Some((id, _)) = req
            .options
            .penalties
            .logit_bias
            .iter()
            .find(|(id, _)| *id as usize >= vocab)
        {
            candle_core::bail!(
                "sequence {}: logit_bias names token {id}, outside the model's vocabulary of {vocab} ids",
                req.id
            );
        }
        if req.options.constrained && model.pipeline().is_some() {
            candle_core::bail!(
                "sequence {}: a grammar needs the model in one pipeline stage (rank 0 holds the grammars, the last stage draws)",
                req.id
            );
        }
        let limit = self.seq_limit(model);
        if req.prompt.len() >= limit {
            candle_core::bail!(
                "sequence {}: the prompt has {} tokens, the model holds {limit} positions (prompt and at least one generated token)",
                req.id,
                req.prompt.len()
            );
        }
        Ok(())
    }

    /// The longest sequence for `model`: `max_seq_len`, or the model's context if shorter.
    fn seq_limit(&self, model: &CausalLm) -> usize {
        self.max_seq_len.min(model.config().max_position_embeddings)
    }

    /// Adds a sequence (it starts reading its prompt at the next step).
    pub fn add(&mut self, model: &CausalLm, req: SeqRequest) -> Result<()> {
        self.add_constrained(model, req, None)
    }

    /// Adds a sequence with its grammar: on rank 0 `filter` is the grammar of a sequence whose
    /// `options.constrained` is set (elsewhere `None`: rank 0 shares its masks,
    /// [`share_masks`]). Grammars need the whole model on each rank's group (no pipeline
    /// stages: rank 0 of the world must be a rank of the LM head's group).
    pub fn add_constrained(
        &mut self,
        model: &CausalLm,
        req: SeqRequest,
        filter: Option<Box<dyn TokenFilter>>,
    ) -> Result<()> {
        self.check_for(model, &req)?;
        let rank = model.world().rank();
        if filter.is_some() != (req.options.constrained && rank == 0) {
            candle_core::bail!(
                "sequence {} on rank {rank}: constrained = {}, with{} a grammar (rank 0 alone holds the grammars)",
                req.id,
                req.options.constrained,
                if filter.is_some() { "" } else { "out" }
            );
        }
        if !self.has_room() {
            candle_core::bail!(
                "sequence {}: the batch is full ({} sequences)",
                req.id,
                self.max_batch
            );
        }
        self.seqs.push(Active {
            cache: model.new_kv_cache(),
            fed: 0,
            next: None,
            generated: 0,
            sampler: DistributedSampler::new(req.params),
            history: History::new(&req.prompt, &req.options.penalties),
            filter,
            req,
        });
        Ok(())
    }

    /// Drops sequence `id` (a cancelled request); whether it was active.
    pub fn cancel(&mut self, id: u64) -> bool {
        let before = self.seqs.len();
        self.seqs.retain(|s| s.req.id != id);
        self.seqs.len() != before
    }

    /// Drops every sequence.
    pub fn clear(&mut self) {
        self.seqs.clear();
    }

    /// The sequences that left the batch since the last call because their grammar failed (or
    /// allowed no token) or their token could not be drawn (every logit -inf, a NaN logit),
    /// with why (for a grammar, rank 0's message; a generic one on the other ranks).
    pub fn take_failed(&mut self) -> Vec<(u64, String)> {
        std::mem::take(&mut self.failed)
    }

    /// Which tokens each sequence runs this step, in batch order: a decoding sequence its last
    /// token; a sequence reading its prompt the next chunk of it. A prompt is read in chunks of
    /// `prefill_chunk` tokens (the last one shorter) whatever else is in the batch, so its
    /// chunks, hence its KV cache and first token, are those of the prompt alone; a step runs
    /// the first pending chunk and the others that fit in what is left of `prefill_chunk`
    /// tokens.
    fn plan(&self) -> Vec<(usize, Vec<u32>)> {
        let mut budget = self.prefill_chunk;
        let mut first = true;
        let mut plan: Vec<(usize, Vec<u32>)> = Vec::with_capacity(self.seqs.len());
        for (i, s) in self.seqs.iter().enumerate() {
            if let Some(t) = s.next {
                plan.push((i, vec![t]));
                continue;
            }
            let n = (s.req.prompt.len() - s.fed).min(self.prefill_chunk);
            if first || n <= budget {
                first = false;
                budget = budget.saturating_sub(n);
                plan.push((i, s.req.prompt[s.fed..s.fed + n].to_vec()));
            }
        }
        plan
    }

    /// The logits row of every planned sequence (this rank's vocabulary slice), in plan order.
    ///
    /// Batch invariance: the decoding sequences run in passes of at most
    /// [`SMALL_M_MAX_ROWS`](crate::quant::SMALL_M_MAX_ROWS) rows of their own, and each prompt
    /// chunk in a pass alone, so a product never mixes a decode row with a prefill chunk's
    /// rows. With the batch-invariant kernels (`set_batch_invariant_matmul`, or bf16/f16, or
    /// the crate's quantized kernels) a decoded token's logits are then the same bits whatever
    /// else the step runs, and a prompt chunk's are those of the chunk alone. The price: the
    /// weights are read once per pass (one pass per 16 decoding sequences, one per prompt
    /// chunk) rather than once per step. Where every product is the crate's quantized kernels
    /// ([`CausalLm::rows_invariant`]), whose rows are the same bits at any row count, the
    /// prompt chunks join the first decode pass instead (without a pipeline).
    ///
    /// On a pipeline stage other than the last, the passes hand their activations on and the
    /// result is `None`.
    fn forward_groups(
        &mut self,
        model: &mut CausalLm,
        plan: &[(usize, Vec<u32>)],
    ) -> Result<Option<Vec<Tensor>>> {
        let mut groups: Vec<Vec<usize>> = Vec::new(); // indices into `plan`
        let mut decode: Vec<usize> = Vec::new();
        let mut prompts: Vec<usize> = Vec::new();
        for (row, (i, _)) in plan.iter().enumerate() {
            if self.seqs[*i].next.is_some() {
                decode.push(row);
            } else {
                prompts.push(row);
            }
        }
        let stages = model.pipeline().map_or(1, |s| s.count());
        for rows in decode.chunks(decode_pass_rows(decode.len(), stages)) {
            groups.push(rows.to_vec());
        }
        // Products whose rows do not depend on the row count (the crate's quantized kernels
        // everywhere) let the prompt chunks share the first decode pass: the weights are read
        // once for both, and every row's logits are the bits they have alone. Otherwise each
        // chunk runs alone. Not on a pipeline, whose stages would each have to agree.
        if stages == 1 && !prompts.is_empty() && model.rows_invariant() {
            match groups.first_mut() {
                Some(first) => first.extend(prompts),
                None => groups.push(prompts),
            }
        } else {
            groups.extend(prompts.into_iter().map(|row| vec![row]));
        }
        self.forward_passes += groups.len() as u64;
        let mut out: Vec<Option<Tensor>> = vec![None; plan.len()];
        for rows in groups {
            let logits = {
                let mut picked: Vec<Option<&mut Active>> = self.seqs.iter_mut().map(Some).collect();
                let mut steps: Vec<SeqStep<'_>> = Vec::with_capacity(rows.len());
                for &row in &rows {
                    let (i, tokens) = &plan[row];
                    let s = picked[*i].take().expect("each sequence planned once");
                    steps.push(SeqStep {
                        tokens,
                        cache: &mut s.cache,
                    });
                }
                model.forward_batch_stage(&mut steps)?
            };
            let Some(logits) = logits else { continue };
            for (k, &row) in rows.iter().enumerate() {
                out[row] = Some(logits.i(k)?);
            }
        }
        if !model.has_logits() {
            return Ok(None);
        }
        Ok(Some(
            out.into_iter()
                .map(|t| t.expect("every planned row runs in one group"))
                .collect(),
        ))
    }

    /// Runs the step's forward passes and returns the tokens they generated (none when no
    /// sequence is active). Finished sequences leave the batch.
    ///
    /// On a pipeline ([`CausalLm::pipeline`]) every rank of every stage calls it: the last
    /// stage draws the tokens (and their log-probabilities) and hands them to the other
    /// stages, so that every stage's batch moves on alike.
    pub fn step(&mut self, model: &mut CausalLm) -> Result<Vec<TokenEvent>> {
        let plan = self.plan();
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        let logits = self.forward_groups(model, &plan)?;
        let limit = self.seq_limit(model);
        // The sequences whose prompt is complete draw their next token: (plan row, sequence).
        let mut ready: Vec<(usize, usize)> = Vec::new();
        for (row, (i, tokens)) in plan.iter().enumerate() {
            let s = &mut self.seqs[*i];
            if s.next.is_none() {
                s.fed += tokens.len();
                if s.fed < s.req.prompt.len() {
                    continue; // more prompt to read
                }
            }
            ready.push((row, *i));
        }
        let masks = match &logits {
            Some(_) => self.grammar_masks(model, &mut ready)?,
            None => vec![None; ready.len()],
        };
        let (tokens, logprobs, mut why) = match &logits {
            Some(logits) => self.draw(model, logits, &ready, &masks)?,
            None => (vec![0; ready.len()], vec![None; ready.len()], Vec::new()),
        };
        let (tokens, logprobs) = self.share_draws(model, &ready, tokens, logprobs)?;
        let mut events = Vec::new();
        let mut done = Vec::new();
        for (r, ((&(_, i), token), logprobs)) in ready.iter().zip(tokens).zip(logprobs).enumerate()
        {
            let s = &mut self.seqs[i];
            if token == FAILED_DRAW {
                // This row alone leaves the batch; on a stage other than the last, without
                // the last stage's reason.
                let why = match why.iter().position(|(row, _)| *row == r) {
                    Some(at) => why.swap_remove(at).1,
                    None => "sampling failed on the pipeline's last stage".to_string(),
                };
                self.failed.push((s.req.id, why));
                continue;
            }
            s.generated += 1;
            s.history.push(token);
            if let Some(f) = s.filter.as_mut() {
                // A failure shows at the sequence's next mask, which fails it alone.
                let _ = f.commit(token);
            }
            let finish = if s.req.stop_ids.contains(&token) {
                Some(FinishReason::Stop)
            } else if s.generated >= s.req.max_tokens || s.cache.len() >= limit {
                Some(FinishReason::Length)
            } else {
                None
            };
            s.next = Some(token);
            if finish.is_some() {
                done.push(s.req.id);
            }
            events.push(TokenEvent {
                id: s.req.id,
                token,
                finish,
                logprobs,
            });
        }
        // The sequences whose grammar failed leave too (they drew nothing this step).
        let failed = &self.failed;
        self.seqs
            .retain(|s| !done.contains(&s.req.id) && !failed.iter().any(|(id, _)| *id == s.req.id));
        Ok(events)
    }

    /// Rank 0's allowed sets for the constrained rows of `ready` (plan row, sequence), shared
    /// with every rank of the LM head's group: `Some(bits)` per row, `None` for the rows
    /// without a grammar. The rows whose grammar failed leave `ready` (into `failed`).
    fn grammar_masks(
        &mut self,
        model: &CausalLm,
        ready: &mut Vec<(usize, usize)>,
    ) -> Result<Vec<Option<Vec<u32>>>> {
        if !ready
            .iter()
            .any(|&(_, i)| self.seqs[i].req.options.constrained)
        {
            return Ok(vec![None; ready.len()]);
        }
        let head = model.head("BatchDecoder::step")?;
        let mut requests: Vec<MaskRequest<'_>> = Vec::new();
        // `ready` is in batch order: walk the sequences once, picking the ready ones.
        let mut pending = ready.iter().map(|r| r.1).peekable();
        for (i, s) in self.seqs.iter_mut().enumerate() {
            if pending.next_if(|&r| r == i).is_none() || !s.req.options.constrained {
                continue;
            }
            let hold = s.generated < s.req.min_tokens;
            requests.push(MaskRequest {
                filter: s.filter.as_deref_mut(),
                hold_back: if hold { &s.req.stop_ids[..] } else { &[] },
            });
        }
        let mut shared =
            share_masks(&mut requests, head.partition().total(), head.pg())?.into_iter();
        let mut masks = Vec::with_capacity(ready.len());
        let mut kept = Vec::with_capacity(ready.len());
        for &(row, i) in ready.iter() {
            let s = &self.seqs[i];
            let mask: Option<RowMask> = s.req.options.constrained.then(|| shared.next()).flatten();
            match mask {
                Some(Err(why)) => self
                    .failed
                    .push((s.req.id, format!("the grammar failed: {why}"))),
                Some(Ok(bits)) => {
                    kept.push((row, i));
                    masks.push(Some(bits));
                }
                None => {
                    kept.push((row, i));
                    masks.push(None);
                }
            }
        }
        *ready = kept;
        Ok(masks)
    }
}

/// The rows of one decoding pass, for `n` decoding sequences: at most
/// [`SMALL_M_MAX_ROWS`](crate::quant::SMALL_M_MAX_ROWS); on a pipeline of `p` stages the rows
/// go in `p` micro-batches when each gets two rows or more, so that stage `s` runs micro-batch
/// `k` while stage `s + 1` runs `k - 1` (the step's bubble is then `(p - 1) / (2p - 1)` of it
/// instead of `(p - 1) / p`). Measured on 2 ranks x 1 thread, SmolLM2 Q4_1, pp 2: +32 % tokens/s
/// at 16 streams, +11 % at 8; four micro-batches were slower than two (docs/PIPELINE.md).
fn decode_pass_rows(n: usize, p: usize) -> usize {
    let rows = if p > 1 && n >= 2 * p {
        n.div_ceil(p)
    } else {
        n
    };
    rows.clamp(1, crate::quant::SMALL_M_MAX_ROWS)
}

#[cfg(test)]
mod pass_tests {
    use super::decode_pass_rows;

    #[test]
    fn decode_passes_split_into_micro_batches_on_a_pipeline() {
        // Without a pipeline: one pass, at most 16 rows.
        assert_eq!(decode_pass_rows(5, 1), 5);
        assert_eq!(decode_pass_rows(40, 1), 16);
        assert_eq!(decode_pass_rows(0, 1), 1);
        // p stages: p micro-batches once each has two rows.
        assert_eq!(decode_pass_rows(3, 2), 3);
        assert_eq!(decode_pass_rows(4, 2), 2);
        assert_eq!(decode_pass_rows(9, 2), 5);
        assert_eq!(decode_pass_rows(16, 2), 8);
        assert_eq!(decode_pass_rows(5, 3), 5);
        assert_eq!(decode_pass_rows(7, 3), 3);
        assert_eq!(decode_pass_rows(64, 2), 16);
    }
}
