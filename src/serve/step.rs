//! The scheduler's decision for one step, as rank 0 broadcasts it to every rank through the
//! process group: whether to shut down, which sequences to drop, which to add (prompt ids and
//! sampling parameters). Encoded as `u32` words; a broadcast of the length, then one of the
//! words.

use candle_core::Result;

use crate::comm::ProcessGroup;
use crate::generate::{Penalties, SamplingParams, SeqOptions, SeqRequest};

/// One step's decision.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    /// Stop serving: every rank leaves its loop.
    pub shutdown: bool,
    /// Sequences to drop before the step (cancelled, disconnected or stopped by a stop
    /// string).
    pub cancel: Vec<u64>,
    /// Sequences joining at this step.
    pub add: Vec<SeqRequest>,
}

fn push_u64(w: &mut Vec<u32>, v: u64) {
    w.push(v as u32);
    w.push((v >> 32) as u32);
}

fn push_f64(w: &mut Vec<u32>, v: f64) {
    push_u64(w, v.to_bits());
}

fn push_len(w: &mut Vec<u32>, n: usize, what: &str) -> Result<()> {
    let n = u32::try_from(n)
        .map_err(|_| candle_core::Error::msg(format!("step plan: {n} {what} do not fit a u32")))?;
    w.push(n);
    Ok(())
}

/// Reads words in order; running off the end is an error naming the field.
struct Reader<'a> {
    words: &'a [u32],
    at: usize,
}

impl Reader<'_> {
    fn u32(&mut self, what: &str) -> Result<u32> {
        let v = self.words.get(self.at).copied().ok_or_else(|| {
            candle_core::Error::msg(format!(
                "step plan: truncated at word {} of {} reading {what}",
                self.at,
                self.words.len()
            ))
        })?;
        self.at += 1;
        Ok(v)
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let lo = self.u32(what)? as u64;
        Ok(lo | ((self.u32(what)? as u64) << 32))
    }

    fn f64(&mut self, what: &str) -> Result<f64> {
        Ok(f64::from_bits(self.u64(what)?))
    }

    fn ids(&mut self, what: &str) -> Result<Vec<u32>> {
        let n = self.u32(what)? as usize;
        let end = self.at.checked_add(n).filter(|&e| e <= self.words.len());
        let Some(end) = end else {
            candle_core::bail!(
                "step plan: {what} has {n} ids but only {} words remain",
                self.words.len() - self.at
            );
        };
        let v = self.words[self.at..end].to_vec();
        self.at = end;
        Ok(v)
    }
}

/// A sequence's options: `logprobs` (0: none, else top entries + 1), whether a grammar
/// constrains it, the penalties as f32 bits, then `logit_bias` as (id, bias bits) pairs.
fn encode_options(w: &mut Vec<u32>, o: &SeqOptions) -> Result<()> {
    push_len(w, o.logprobs.map_or(0, |n| n.saturating_add(1)), "logprobs")?;
    w.push(u32::from(o.constrained));
    let p = &o.penalties;
    w.extend_from_slice(&[
        p.presence.to_bits(),
        p.frequency.to_bits(),
        p.repetition.to_bits(),
    ]);
    push_len(w, p.logit_bias.len(), "logit_bias entries")?;
    for &(id, bias) in &p.logit_bias {
        w.extend_from_slice(&[id, bias.to_bits()]);
    }
    Ok(())
}

fn decode_options(r: &mut Reader<'_>) -> Result<SeqOptions> {
    let logprobs = match r.u32("logprobs")? {
        0 => None,
        n => Some(n as usize - 1),
    };
    let constrained = r.u32("the constrained flag")? != 0;
    let presence = f32::from_bits(r.u32("presence_penalty")?);
    let frequency = f32::from_bits(r.u32("frequency_penalty")?);
    let repetition = f32::from_bits(r.u32("repetition_penalty")?);
    let n = r.u32("the logit_bias count")? as usize;
    let mut logit_bias = Vec::with_capacity(n.min(1024));
    for _ in 0..n {
        let id = r.u32("a logit_bias id")?;
        logit_bias.push((id, f32::from_bits(r.u32("a logit_bias value")?)));
    }
    Ok(SeqOptions {
        logprobs,
        penalties: Penalties {
            presence,
            frequency,
            repetition,
            logit_bias,
        },
        constrained,
    })
}

impl StepPlan {
    /// Whether the plan changes nothing (an idle heartbeat).
    pub fn is_empty(&self) -> bool {
        !self.shutdown && self.cancel.is_empty() && self.add.is_empty()
    }

    /// The plan as words.
    pub fn encode(&self) -> Result<Vec<u32>> {
        let mut w = vec![u32::from(self.shutdown)];
        push_len(&mut w, self.cancel.len(), "cancelled sequences")?;
        for &id in &self.cancel {
            push_u64(&mut w, id);
        }
        push_len(&mut w, self.add.len(), "new sequences")?;
        for r in &self.add {
            push_u64(&mut w, r.id);
            push_len(&mut w, r.max_tokens, "max_tokens")?;
            push_len(&mut w, r.min_tokens, "min_tokens")?;
            push_f64(&mut w, r.params.temperature);
            w.push(
                r.params
                    .top_k
                    .map_or(0, |k| k.min(u32::MAX as usize) as u32),
            );
            push_f64(&mut w, r.params.top_p.unwrap_or(f64::NAN));
            push_u64(&mut w, r.params.seed);
            push_len(&mut w, r.stop_ids.len(), "stop ids")?;
            w.extend_from_slice(&r.stop_ids);
            push_len(&mut w, r.prompt.len(), "prompt tokens")?;
            w.extend_from_slice(&r.prompt);
            encode_options(&mut w, &r.options)?;
        }
        Ok(w)
    }

    /// Reads a plan written by [`StepPlan::encode`].
    pub fn decode(words: &[u32]) -> Result<Self> {
        let mut r = Reader { words, at: 0 };
        let shutdown = r.u32("the shutdown flag")? != 0;
        let n = r.u32("the cancelled count")? as usize;
        let cancel = (0..n)
            .map(|_| r.u64("a cancelled id"))
            .collect::<Result<Vec<_>>>()?;
        let n = r.u32("the new count")? as usize;
        let mut add = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let id = r.u64("a sequence id")?;
            let max_tokens = r.u32("max_tokens")? as usize;
            let min_tokens = r.u32("min_tokens")? as usize;
            let temperature = r.f64("temperature")?;
            let top_k = match r.u32("top_k")? {
                0 => None,
                k => Some(k as usize),
            };
            let top_p = Some(r.f64("top_p")?).filter(|p| !p.is_nan());
            let seed = r.u64("seed")?;
            let stop_ids = r.ids("stop ids")?;
            let prompt = r.ids("the prompt")?;
            let options = decode_options(&mut r)?;
            add.push(SeqRequest {
                id,
                prompt,
                max_tokens,
                min_tokens,
                params: SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    seed,
                },
                stop_ids,
                options,
            });
        }
        if r.at != words.len() {
            candle_core::bail!(
                "step plan: {} trailing words after {} of {}",
                words.len() - r.at,
                r.at,
                words.len()
            );
        }
        Ok(Self {
            shutdown,
            cancel,
            add,
        })
    }

    /// Rank 0 sends `plan` (`Some` there, ignored elsewhere); every rank returns it.
    pub fn broadcast(pg: &ProcessGroup, plan: Option<&StepPlan>) -> Result<StepPlan> {
        let mut words = match (pg.rank(), plan) {
            (0, Some(p)) => p.encode()?,
            (0, None) => candle_core::bail!("step plan: rank 0 has no plan to send"),
            _ => Vec::new(),
        };
        let mut len = [u32::try_from(words.len()).map_err(|_| {
            candle_core::Error::msg(format!("step plan: {} words do not fit a u32", words.len()))
        })?];
        pg.broadcast_slice(&mut len, 0)?;
        if pg.rank() != 0 {
            words = vec![0; len[0] as usize];
        }
        pg.broadcast_slice(&mut words, 0)?;
        if pg.rank() == 0 {
            return Ok(plan.cloned().unwrap_or_default());
        }
        Self::decode(&words)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation() -> Result<()> {
        let plan = StepPlan {
            shutdown: false,
            cancel: vec![3, u64::MAX - 1],
            add: vec![SeqRequest {
                id: 1 << 40,
                prompt: vec![1, 2, 3],
                max_tokens: 17,
                min_tokens: 5,
                params: SamplingParams {
                    temperature: 0.7,
                    top_k: Some(40),
                    top_p: None,
                    seed: 99,
                },
                stop_ids: vec![2],
                options: SeqOptions {
                    logprobs: Some(3),
                    penalties: Penalties {
                        presence: 0.5,
                        frequency: -0.25,
                        repetition: 1.3,
                        logit_bias: vec![(7, -100.0), (49151, 2.5)],
                    },
                    constrained: true,
                },
            }],
        };
        let w = plan.encode()?;
        assert_eq!(StepPlan::decode(&w)?, plan);
        for cut in 0..w.len() {
            assert!(StepPlan::decode(&w[..cut]).is_err(), "cut at {cut}");
        }
        Ok(())
    }
}
