//! The Gumbel-max race over a shard of the vocabulary: each rank's best
//! `logit / T + gumbel(id)` and the winner among the ranks' bests.
//!
//! `argmax(logit_i / T + G_i)` with independent standard Gumbel numbers `G_i` is a draw from
//! the softmax of `logit / T` (the exponential race `argmin E_i / p_i`, `E_i = -ln u_i`). The
//! numbers depend only on (seed, draw, global id) ([`noise`](super::noise)), so the winner is
//! the same however the vocabulary is split.
//!
//! Most tokens cannot win, and the two logarithms of a Gumbel number are most of the cost:
//! a token whose scaled logit is `d` below the best score so far wins only if `G > d`, that
//! is `u > exp(-exp(-d))`, which the uniform `u` alone (a hash) can rule out. Once the best is
//! a few units above the typical logit, few tokens pass: counted over 49152 normal logits
//! (standard deviation 0.6 and 3.75 after the temperature), 8 to 28 tokens per draw reached
//! the logarithms; the rest cost a hash and a comparison (about 4 ns a token,
//! `examples/bench_sampling.rs`).

use crate::generate::noise::{gumbel_of, DrawNoise};

/// The largest whole distance of [`skip_table`] (farther tokens use its threshold): there
/// `1 - exp(-exp(-20))`, about 2e-9, is still held by the f64 threshold to a relative 6e-8,
/// so the Gumbel number it bounds is off by at most about 6e-8, far inside [`MARGIN`].
const SKIP_STEPS: usize = 20;

/// The distance `d` looked up is the real one less this (and less a relative `1e-12` of the
/// best score): it covers the rounding of the thresholds and of `logit / T + G`, so a token
/// ruled out by its uniform could not have won by rounding either.
const MARGIN: f64 = 1e-3;

/// `skip[k] = exp(-exp(-k))`: `G(u) <= k` for every `u <= skip[k]`.
fn skip_table() -> [f64; SKIP_STEPS + 1] {
    std::array::from_fn(|k| (-(-(k as f64)).exp()).exp())
}

/// This rank's entry in the race: the best `logit * inv_t + gumbel(id)` of its shard (whose
/// first global id is `offset`) and its global id, ties to the lowest id; `(-inf, usize::MAX)`
/// when every logit is -inf. A NaN logit enters as (NaN, its id), so that every rank sees it
/// and fails alike.
pub(crate) fn race_best(local: &[f32], offset: usize, inv_t: f64, noise: &DrawNoise) -> [f64; 2] {
    let skip = skip_table();
    let (mut best, mut best_id) = (f64::NEG_INFINITY, usize::MAX);
    // The best score less the margin.
    let mut cut = f64::NEG_INFINITY;
    for (i, &v) in local.iter().enumerate() {
        if v.is_nan() {
            return [f64::NAN, (offset + i) as f64];
        }
        let s = v as f64 * inv_t;
        let id = offset + i;
        // How far below the best the token starts, less the margin (NaN or negative: race it).
        let d = cut - s;
        let score = if d >= 0.0 {
            // Branch-free from here to the rare pass: a branch on how far below the best a
            // token is mispredicts on spread logits (it doubled the cost).
            let u = noise.uniform(id);
            if u <= skip[d.min(SKIP_STEPS as f64) as usize] {
                continue;
            }
            s + gumbel_of(u)
        } else {
            s + noise.gumbel(id)
        };
        if score > best {
            best = score;
            best_id = id;
            cut = best - (MARGIN + best.abs() * 1e-12);
        }
    }
    [best, best_id as f64]
}

/// One row's draw: its token, or why this row (alone) cannot be drawn from. Every rank
/// computes it from the same gathered values, so every rank fails the same rows.
pub(crate) type RowDraw = std::result::Result<u32, String>;

/// Why a row whose every logit is -inf fails.
pub(crate) const ALL_NEG_INF: &str = "sampling: every logit is -inf, no token can be drawn";

/// The winner of the race from every rank's entry (score, id): the best score, ties to the
/// lowest id; an error for this row alone when a logit is NaN or every one is -inf.
pub(crate) fn race_pick(pairs: impl Iterator<Item = (f64, f64)>) -> RowDraw {
    let (mut val, mut id) = (f64::NEG_INFINITY, f64::INFINITY);
    for (v, i) in pairs {
        if v.is_nan() {
            return Err(format!("sampling: the logit of token {i} is NaN"));
        }
        if v > val || (v == val && i < id) {
            val = v;
            id = i;
        }
    }
    if val == f64::NEG_INFINITY {
        return Err(ALL_NEG_INF.to_string());
    }
    Ok(id as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    /// The race without skipping: every token's score computed.
    fn reference(local: &[f32], offset: usize, inv_t: f64, noise: &DrawNoise) -> [f64; 2] {
        let (mut best, mut best_id) = (f64::NEG_INFINITY, usize::MAX);
        for (i, &v) in local.iter().enumerate() {
            let score = v as f64 * inv_t + noise.gumbel(offset + i);
            if score > best {
                best = score;
                best_id = offset + i;
            }
        }
        [best, best_id as f64]
    }

    #[test]
    fn the_thresholds_bound_the_gumbel_numbers() {
        let skip = skip_table();
        for (k, &t) in skip.iter().enumerate() {
            assert!(t > 0.0 && t < 1.0, "{k}: {t}");
            assert!(
                (gumbel_of(t) - k as f64).abs() < 1e-6,
                "{k}: {}",
                gumbel_of(t)
            );
        }
    }

    #[test]
    fn skipping_never_changes_the_winner() {
        // Spreads from flat to far apart, temperatures from 10 to 1e-6, ties and -inf.
        let mut rng = SplitMix64::new(5);
        for case in 0..400u64 {
            let n = 1 + (rng.next_u64() % 3000) as usize;
            let sigma = [0.1, 1.0, 3.0, 10.0, 40.0][case as usize % 5];
            let inv_t = [0.1, 1.0, 1.25, 3.0, 1e6][(case / 5) as usize % 5];
            let mut local: Vec<f32> = (0..n).map(|_| (rng.next_normal() * sigma) as f32).collect();
            if case % 7 == 0 {
                local.iter_mut().step_by(3).for_each(|v| *v = 1.5);
            }
            if case % 11 == 0 {
                local
                    .iter_mut()
                    .step_by(2)
                    .for_each(|v| *v = f32::NEG_INFINITY);
            }
            let offset = (rng.next_u64() % 100_000) as usize;
            let noise = DrawNoise::new(case, rng.next_u64());
            let got = race_best(&local, offset, inv_t, &noise);
            let want = reference(&local, offset, inv_t, &noise);
            assert_eq!(
                got[1], want[1],
                "case {case}: n {n} sigma {sigma} inv_t {inv_t}"
            );
            assert_eq!(got[0].to_bits(), want[0].to_bits(), "case {case}");
        }
        let masked = [f32::NEG_INFINITY; 5];
        let noise = DrawNoise::new(1, 1);
        assert_eq!(race_best(&masked, 7, 1.0, &noise)[0], f64::NEG_INFINITY);
        assert_eq!(race_best(&masked, 7, 1.0, &noise)[1], usize::MAX as f64);
    }
}
