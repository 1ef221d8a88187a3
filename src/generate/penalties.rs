//! Logit adjustments from a sequence's history, applied to each rank's shard of the
//! vocabulary (no collective: a token's adjustment depends only on that token): OpenAI's
//! `logit_bias`, `presence_penalty` and `frequency_penalty`, and the `repetition_penalty` of
//! Hugging Face and vLLM.
//!
//! In vLLM's order, on the logits before the temperature:
//! 1. `logit_bias`: `logit[id] += bias`;
//! 2. `repetition_penalty` `r` on every token of the prompt or the output so far:
//!    `logit / r` where the logit is positive, `logit * r` otherwise;
//! 3. `frequency_penalty` `f` and `presence_penalty` `p` on the output so far:
//!    `logit -= f * count + p * (count > 0)`.
//!
//! Only the tokens named (biased, or seen) are touched, so the cost is the history's length,
//! not the vocabulary's.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

/// A sequence's penalties; the default changes nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct Penalties {
    /// Subtracted once from the logit of every token already generated (OpenAI: -2 to 2).
    pub presence: f32,
    /// Subtracted per occurrence from the logit of every token already generated (OpenAI: -2
    /// to 2).
    pub frequency: f32,
    /// Divides positive logits and multiplies the others, of every token in the prompt or
    /// generated (Hugging Face, vLLM: above 0; 1 is none).
    pub repetition: f32,
    /// Added to the logits of these ids (OpenAI: -100 to 100).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for Penalties {
    fn default() -> Self {
        Self {
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

impl Penalties {
    /// Whether these penalties change no logit.
    pub fn is_neutral(&self) -> bool {
        self.presence == 0.0
            && self.frequency == 0.0
            && self.repetition == 1.0
            && self.logit_bias.is_empty()
    }

    /// Checks the values: finite, `repetition` above 0.
    pub fn validate(&self) -> candle_core::Result<()> {
        for (name, v) in [
            ("presence_penalty", self.presence),
            ("frequency_penalty", self.frequency),
            ("repetition_penalty", self.repetition),
        ] {
            if !v.is_finite() {
                candle_core::bail!("penalties: {name} = {v} must be finite");
            }
        }
        if self.repetition <= 0.0 {
            candle_core::bail!(
                "penalties: repetition_penalty = {} must be above 0",
                self.repetition
            );
        }
        if let Some((id, b)) = self.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            candle_core::bail!("penalties: logit_bias of token {id} = {b} must be finite");
        }
        Ok(())
    }
}

/// What a sequence has seen, for its penalties: the prompt's distinct tokens (kept only when
/// the repetition penalty needs them) and how often each token was generated.
#[derive(Debug, Clone, Default)]
pub struct History {
    prompt: HashSet<u32>,
    output: HashMap<u32, u32>,
}

impl History {
    /// The history of a sequence with `prompt` under `penalties` (empty when they are neutral).
    pub fn new(prompt: &[u32], penalties: &Penalties) -> Self {
        let prompt = if penalties.repetition != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Self {
            prompt,
            output: HashMap::new(),
        }
    }

    /// Notes a generated token.
    pub fn push(&mut self, token: u32) {
        *self.output.entry(token).or_insert(0) += 1;
    }
}

/// Applies `p` to `local`, this rank's logits of the global ids `range`.
pub fn apply_penalties(local: &mut [f32], range: Range<usize>, p: &Penalties, h: &History) {
    let slot = |id: u32| {
        let id = id as usize;
        range.contains(&id).then(|| id - range.start)
    };
    for &(id, bias) in &p.logit_bias {
        if let Some(i) = slot(id) {
            local[i] += bias;
        }
    }
    if p.repetition != 1.0 {
        let seen = h
            .prompt
            .iter()
            .chain(h.output.keys().filter(|id| !h.prompt.contains(id)));
        for &id in seen {
            if let Some(i) = slot(id) {
                let v = local[i];
                local[i] = if v > 0.0 {
                    v / p.repetition
                } else {
                    v * p.repetition
                };
            }
        }
    }
    if p.presence != 0.0 || p.frequency != 0.0 {
        for (&id, &count) in &h.output {
            if let Some(i) = slot(id) {
                local[i] -= p.frequency * count as f32 + p.presence;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neutral_penalties_change_nothing() {
        let p = Penalties::default();
        assert!(p.is_neutral());
        let mut h = History::new(&[1, 2], &p);
        h.push(3);
        let mut v = vec![0.5f32, -1.0, 2.0, 3.0];
        apply_penalties(&mut v, 0..4, &p, &h);
        assert_eq!(v, [0.5, -1.0, 2.0, 3.0]);
    }

    #[test]
    fn bad_values_are_refused() {
        let bad = |p: Penalties| p.validate().unwrap_err().to_string();
        let d = Penalties::default();
        assert!(bad(Penalties {
            repetition: 0.0,
            ..d.clone()
        })
        .contains("repetition_penalty"));
        assert!(bad(Penalties {
            presence: f32::NAN,
            ..d.clone()
        })
        .contains("presence_penalty"));
        assert!(bad(Penalties {
            logit_bias: vec![(4, f32::INFINITY)],
            ..d
        })
        .contains("token 4"));
    }
}
