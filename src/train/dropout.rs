//! Dropout with Megatron's seeding rules for tensor- and sequence-parallel training.
//!
//! - **Outside tensor-parallel regions** (the residual stream, replicated or sequence-split):
//!   one shared seed. The mask is drawn for the FULL `[batch, seq, hidden]` tensor and each
//!   rank keeps its sequence rows, so TP = N with or without sequence parallelism drops
//!   exactly what TP = 1 drops.
//! - **Inside tensor-parallel regions** (attention probabilities of this rank's heads): a
//!   per-rank seed (Megatron's `model-parallel-rng`), so different heads get independent
//!   masks. (These masks differ from TP = 1's, as in Megatron.)

use std::ops::Range;

use candle_core::{Result, Tensor};

use super::init::SplitMix64;

/// Where in the model a mask is applied (part of its seed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Site {
    /// Attention probabilities of layer `l` (inside the TP region).
    Attention(usize),
    /// Output of the attention block of layer `l`, before the residual add.
    AttentionOut(usize),
    /// Output of the MLP of layer `l`, before the residual add.
    MlpOut(usize),
}

impl Site {
    fn code(self) -> u64 {
        match self {
            Site::Attention(l) => 3 * l as u64,
            Site::AttentionOut(l) => 3 * l as u64 + 1,
            Site::MlpOut(l) => 3 * l as u64 + 2,
        }
    }
}

/// Dropout probabilities and the seed of one training step (`Dropout::off()` for none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    /// Shared seed (the same on every rank).
    pub seed: u64,
    /// Training step (masks change every step).
    pub step: u64,
    /// Probability on the residual branches (outside TP regions).
    pub hidden: f64,
    /// Probability on the attention probabilities (inside TP regions).
    pub attention: f64,
}

fn mix(a: u64, b: u64) -> u64 {
    SplitMix64::new(a ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15)).next_u64()
}

fn mask(seed: u64, n: usize, p: f64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    let keep = (1.0 / (1.0 - p)) as f32;
    (0..n)
        .map(|_| if rng.next_f64() < p { 0.0 } else { keep })
        .collect()
}

impl Dropout {
    /// No dropout.
    pub fn off() -> Self {
        Self {
            seed: 0,
            step: 0,
            hidden: 0.0,
            attention: 0.0,
        }
    }

    fn check(p: f64) -> Result<()> {
        if !(0.0..1.0).contains(&p) {
            candle_core::bail!("dropout probability {p} is not in [0, 1)");
        }
        Ok(())
    }

    fn site_seed(&self, site: Site) -> u64 {
        mix(mix(self.seed, self.step), site.code())
    }

    /// Residual-branch dropout on `x` `[batch, rows.len(), hidden]`, the rows `rows` of a
    /// sequence of `seq`: the mask of the full sequence from the shared seed, sliced.
    pub fn apply_shared(
        &self,
        x: &Tensor,
        site: Site,
        seq: usize,
        rows: &Range<usize>,
    ) -> Result<Tensor> {
        if self.hidden == 0.0 {
            return Ok(x.clone());
        }
        Self::check(self.hidden)?;
        let (b, s, h) = x.dims3()?;
        if s != rows.len() || rows.end > seq {
            candle_core::bail!(
                "dropout: a tensor of shape {:?} does not hold rows {rows:?} of a sequence of {seq}",
                x.dims()
            );
        }
        let full = mask(self.site_seed(site), b * seq * h, self.hidden);
        let m = Tensor::from_vec(full, (b, seq, h), x.device())?
            .narrow(1, rows.start, rows.len())?
            .to_dtype(x.dtype())?;
        x * m
    }

    /// Dropout inside a TP region: a mask from a seed of its own for every rank.
    pub fn apply_per_rank(&self, x: &Tensor, site: Site, rank: usize) -> Result<Tensor> {
        if self.attention == 0.0 {
            return Ok(x.clone());
        }
        Self::check(self.attention)?;
        let seed = mix(self.site_seed(site), 2718 + rank as u64);
        let m = Tensor::from_vec(
            mask(seed, x.elem_count(), self.attention),
            x.shape(),
            x.device(),
        )?
        .to_dtype(x.dtype())?;
        x * m
    }
}
