//! A small seedable generator that gives the same stream on every rank, and deterministic
//! tensors built from it (the "same full weights on every rank" of tests, examples and
//! benchmarks).

use candle_core::{Device, Result, Tensor};

/// SplitMix64's increment (the golden ratio in 64-bit fixed point): its state after `n` draws
/// is `seed + n * GOLDEN_GAMMA`.
pub const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function: 64 well-mixed bits from a state. `mix64(seed + n *
/// GOLDEN_GAMMA)` is the `n`-th draw of [`SplitMix64::new(seed)`](SplitMix64) (counting from
/// 1), so it is also a counter-based generator: any draw computed directly, in any order.
///
/// ```
/// use candle_tp::rng::{mix64, SplitMix64, GOLDEN_GAMMA};
/// let mut g = SplitMix64::new(7);
/// g.next_u64();
/// assert_eq!(g.next_u64(), mix64(7u64.wrapping_add(GOLDEN_GAMMA.wrapping_mul(2))));
/// ```
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64: a small, fast, seedable generator (the same stream on every rank).
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA);
        mix64(self.0)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn next_normal(&mut self) -> f64 {
        let u1 = self.next_f64().max(f64::MIN_POSITIVE);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// An f32 tensor of values uniform in `[-scale, scale)`, the same for the same `seed` on
/// every rank and every run.
///
/// ```
/// use candle_core::Device;
/// let a = candle_tp::rng::seeded_uniform(&[2, 3], 7, 1.0, &Device::Cpu)?;
/// let b = candle_tp::rng::seeded_uniform(&[2, 3], 7, 1.0, &Device::Cpu)?;
/// assert_eq!(a.to_vec2::<f32>()?, b.to_vec2::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn seeded_uniform(shape: &[usize], seed: u64, scale: f32, device: &Device) -> Result<Tensor> {
    let mut rng = SplitMix64::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x1234_5678);
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| ((rng.next_f64() * 2.0 - 1.0) as f32) * scale)
        .collect();
    Tensor::from_vec(data, shape, device)
}
