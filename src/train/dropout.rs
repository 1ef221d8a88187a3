//! Dropout with Megatron's seeding rules for tensor- and sequence-parallel training.
//!
//! - **Outside tensor-parallel regions** (the residual stream, replicated or sequence-split):
//!   one shared seed. The mask of each sequence of the global batch is drawn from a seed of its
//!   own (the shared seed, the step, the site and the sequence's row in the global batch,
//!   [`Dropout::first_row`]) over its whole `[seq, hidden]`, and each rank keeps its sequence
//!   rows: TP = N with or without sequence parallelism, data-parallel ranks and pipeline
//!   micro-batches drop exactly what one process running the whole batch drops (a mask drawn
//!   per call would repeat itself on every micro-batch and every data-parallel rank).
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
    /// The row in the global batch of the first sequence this applies to: a data-parallel
    /// rank's first row, plus the rows of the micro-batches before this one (the pipeline's
    /// `train_step` adds those).
    pub first_row: u64,
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
            first_row: 0,
        }
    }

    /// The same dropout for a batch whose first sequence is `rows` further into the global
    /// batch (a later micro-batch).
    pub fn skip_rows(&self, rows: usize) -> Self {
        Self {
            first_row: self.first_row + rows as u64,
            ..*self
        }
    }

    /// The masks of `b` sequences of `per_row` values each, sequence `i` from its own seed
    /// (`seed` mixed with its global row).
    fn row_masks(&self, seed: u64, b: usize, per_row: usize, p: f64) -> Vec<f32> {
        let mut out = Vec::with_capacity(b * per_row);
        for i in 0..b {
            out.extend(mask(mix(seed, self.first_row + i as u64), per_row, p));
        }
        out
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
        let full = self.row_masks(self.site_seed(site), b, seq * h, self.hidden);
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
        let b = x.dims().first().copied().unwrap_or(1).max(1);
        let m = Tensor::from_vec(
            self.row_masks(seed, b, x.elem_count() / b, self.attention),
            x.shape(),
            x.device(),
        )?
        .to_dtype(x.dtype())?;
        x * m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A batch in two parts (micro-batches, data-parallel ranks), each with its first row,
    /// gets the masks of the whole batch at once: the parts' masks are not the same.
    #[test]
    fn parts_of_a_batch_get_the_whole_batchs_masks() -> Result<()> {
        let (b, s, h) = (4, 3, 5);
        let x = Tensor::ones((b, s, h), candle_core::DType::F32, &Device::Cpu)?;
        let d = Dropout {
            seed: 9,
            step: 2,
            hidden: 0.5,
            attention: 0.5,
            first_row: 0,
        };
        let whole = d.apply_shared(&x, Site::MlpOut(1), s, &(0..s))?;
        let top = d.apply_shared(&x.narrow(0, 0, 2)?, Site::MlpOut(1), s, &(0..s))?;
        let bottom =
            d.skip_rows(2)
                .apply_shared(&x.narrow(0, 2, 2)?, Site::MlpOut(1), s, &(0..s))?;
        let parts = Tensor::cat(&[&top, &bottom], 0)?;
        assert_eq!(parts.to_vec3::<f32>()?, whole.to_vec3::<f32>()?);
        assert_ne!(
            top.to_vec3::<f32>()?,
            bottom.to_vec3::<f32>()?,
            "repeated masks"
        );
        let a = Tensor::ones((b, 2, s, s), candle_core::DType::F32, &Device::Cpu)?;
        let whole = d.apply_per_rank(&a, Site::Attention(0), 1)?;
        let bottom = d
            .skip_rows(2)
            .apply_per_rank(&a.narrow(0, 2, 2)?, Site::Attention(0), 1)?;
        assert_eq!(
            whole.narrow(0, 2, 2)?.flatten_all()?.to_vec1::<f32>()?,
            bottom.flatten_all()?.to_vec1::<f32>()?
        );
        Ok(())
    }
}
