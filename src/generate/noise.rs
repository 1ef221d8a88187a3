//! The random numbers of a draw: one per token, a pure function of (seed, draw, global token id).
//!
//! A sampler that consumed a stateful generator in shard order would give the same token only
//! at the same world size. Here the number of token `id` at the `step`-th draw of a sampler
//! seeded `seed` is computed directly, on whichever rank holds the token, so every split of
//! the vocabulary (1, 2 or 3 ranks, even or uneven) gives every token the same number.
//!
//! The generator is SplitMix64 used as a counter-based one: each (seed, step) has a key (two
//! rounds of [`mix64`]), and token `id`'s 64 bits are draw `id + 1` of the SplitMix64 stream
//! started at that key, `mix64(key + (id + 1) * GOLDEN_GAMMA)`.

use crate::rng::{mix64, GOLDEN_GAMMA};

/// Separates this use of the seed from the crate's other seeded streams.
const SALT: u64 = 0x5DEE_CE66_D1CE_4E5B;

/// The per-token random numbers of one draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DrawNoise {
    key: u64,
}

impl DrawNoise {
    /// The numbers of draw `step` (counted from 0) of a sampler seeded `seed`.
    pub(crate) fn new(seed: u64, step: u64) -> Self {
        let key = mix64(mix64(seed ^ SALT) ^ step.wrapping_mul(GOLDEN_GAMMA));
        Self { key }
    }

    /// Token `id`'s uniform number, in the open interval (0, 1).
    pub(crate) fn uniform(&self, id: usize) -> f64 {
        open_unit(mix64(self.key.wrapping_add(
            (id as u64).wrapping_add(1).wrapping_mul(GOLDEN_GAMMA),
        )))
    }

    /// Token `id`'s standard Gumbel number, `-ln(-ln u)`: `argmax(logit / T + gumbel)` over any
    /// set of tokens is a draw from the softmax of `logit / T` over that set (the Gumbel-max
    /// trick, or the exponential race `argmin E / p` with `E = -ln u`). Always in
    /// `[-3.7, 36.8]` (the uniforms run from `2^-53` to `1 - 2^-53`).
    pub(crate) fn gumbel(&self, id: usize) -> f64 {
        gumbel_of(self.uniform(id))
    }
}

/// The standard Gumbel number of a uniform `u` in (0, 1), `-ln(-ln u)` (increasing in `u`).
pub(crate) fn gumbel_of(u: f64) -> f64 {
    -(-u.ln()).ln()
}

/// A uniform number in the open interval (0, 1) from 64 random bits: the top 52 bits,
/// centred in their cell, `(m + 1/2) / 2^52`, exact in an f64 (53 significant bits), so never
/// 0 nor 1 (with 53 bits the largest would round to 1).
fn open_unit(bits: u64) -> f64 {
    ((bits >> 12) as f64 + 0.5) * (1.0 / (1u64 << 52) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gumbel_bound_holds_at_the_extreme_uniforms() {
        let (lowest, highest) = (open_unit(0), open_unit(u64::MAX));
        assert!(lowest > 0.0 && highest < 1.0, "{lowest} {highest}");
        assert_eq!(highest, 1.0 - f64::EPSILON / 2.0);
        let g = gumbel_of;
        assert!(g(highest) < 36.8 && g(highest) > 36.0, "{}", g(highest));
        assert!(g(lowest) > -3.7 && g(lowest).is_finite(), "{}", g(lowest));
    }

    #[test]
    fn numbers_depend_on_seed_step_and_token_only() {
        let a = DrawNoise::new(3, 5);
        assert_eq!(a, DrawNoise::new(3, 5));
        assert_ne!(a, DrawNoise::new(3, 6));
        assert_ne!(a, DrawNoise::new(4, 5));
        assert_eq!(a.uniform(1000), DrawNoise::new(3, 5).uniform(1000));
        assert_ne!(a.uniform(1000), a.uniform(1001));
    }

    #[test]
    fn uniforms_are_uniform_and_gumbels_have_the_gumbel_mean() {
        // Over tokens of one draw and over draws of one token: mean 1/2, variance 1/12; the
        // Gumbel mean is the Euler–Mascheroni constant 0.5772.
        let n = 200_000;
        let over_tokens: Vec<f64> = (0..n).map(|i| DrawNoise::new(1, 0).uniform(i)).collect();
        let over_steps: Vec<f64> = (0..n as u64)
            .map(|s| DrawNoise::new(1, s).uniform(42))
            .collect();
        for u in [&over_tokens, &over_steps] {
            assert!(u.iter().all(|&x| x > 0.0 && x < 1.0));
            let mean = u.iter().sum::<f64>() / n as f64;
            let var = u.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
            // Standard errors: 6.5e-4 for the mean, 1.5e-4 for the variance.
            assert!((mean - 0.5).abs() < 4e-3, "mean {mean}");
            assert!((var - 1.0 / 12.0).abs() < 1e-3, "variance {var}");
            // Ten equal bins, each within 5 standard deviations of n / 10.
            let mut bins = [0usize; 10];
            u.iter().for_each(|&x| bins[(x * 10.0) as usize] += 1);
            for b in bins {
                assert!((b as f64 - 20_000.0).abs() < 5.0 * 134.0, "{bins:?}");
            }
        }
        let g = DrawNoise::new(9, 9);
        let mean = (0..n).map(|i| g.gumbel(i)).sum::<f64>() / n as f64;
        assert!((mean - 0.5772).abs() < 0.02, "Gumbel mean {mean}");
    }
}
