//! Top-k routing of a sparse mixture of experts (Mixtral's and Qwen3-MoE's router): softmax
//! over the router logits, the k most probable experts per token, their probabilities
//! renormalised or not.
//!
//! The choice of experts is made on plain f32 values (ties to the lower expert index), so that
//! every rank of a group, given the same logits, picks the same experts. The weights are one
//! tensor `[tokens * k]`; when the logits track gradients (training), the weights carry the
//! gradient of the routing probabilities with respect to the logits, so the router and the
//! hidden states that feed it are trained through Candle's `backward()` as Hugging Face's
//! `MixtralSparseMoeBlock` trains them.

use candle_core::{DType, Result, Tensor, D};

/// The experts of a batch of tokens and their weights.
#[derive(Debug, Clone)]
pub(crate) struct Routing {
    /// Per expert: the token rows routed to it and the positions of their weights in
    /// [`weights`](Self::weights), in token order.
    pub(crate) experts: Vec<(Vec<u32>, Vec<u32>)>,
    /// Every token's k weights, `[tokens * k]` (token-major), f32 (f64 for f64 logits, the
    /// values still f32's).
    pub(crate) weights: Tensor,
}

impl Routing {
    /// The top-`k` routing of `logits` `[tokens, experts]`; `who` names the layer and rank in
    /// errors (a non-finite probability comes from a non-finite hidden state).
    pub(crate) fn top_k(logits: &Tensor, k: usize, renormalise: bool, who: &str) -> Result<Self> {
        // The weights' dtype: f64 for f64 logits, f32 otherwise (the values are f32's).
        let wide = match logits.dtype() {
            DType::F64 => DType::F64,
            _ => DType::F32,
        };
        let logits = logits.to_dtype(wide)?;
        let (tokens, n_experts) = logits.dims2()?;
        let device = logits.device();
        let probs: Vec<Vec<f32>> =
            candle_nn::ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?.to_vec2()?;
        let mut experts = vec![(Vec::new(), Vec::new()); n_experts];
        let mut chosen: Vec<u32> = Vec::with_capacity(tokens * k);
        let mut values: Vec<f32> = Vec::with_capacity(tokens * k);
        let mut order: Vec<usize> = Vec::with_capacity(n_experts);
        for (row, p) in probs.iter().enumerate() {
            if let Some(bad) = p.iter().find(|v| !v.is_finite()) {
                candle_core::bail!(
                    "{who}: router probability {bad} for token {row} (non-finite hidden state)"
                );
            }
            order.clear();
            order.extend(0..p.len());
            // Stable: equal probabilities keep the lower expert first.
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
            let top = &order[..k];
            let sum: f32 = top.iter().map(|&e| p[e]).sum();
            for (slot, &e) in top.iter().enumerate() {
                values.push(if renormalise { p[e] / sum } else { p[e] });
                chosen.push(e as u32);
                experts[e].0.push(row as u32);
                experts[e].1.push((row * k + slot) as u32);
            }
        }
        let mut weights = Tensor::from_vec(values, tokens * k, device)?.to_dtype(wide)?;
        if logits.track_op() && tokens > 0 {
            // The same values (`w + (d - d) = w` exactly for finite `d`), with the gradient of
            // the composed softmax `d` (candle's fused softmax has no backward).
            let idx = Tensor::from_vec(chosen, (tokens, k), device)?;
            let d = if renormalise {
                candle_nn::ops::softmax(&logits.gather(&idx, 1)?, D::Minus1)?
            } else {
                candle_nn::ops::softmax(&logits, D::Minus1)?.gather(&idx, 1)?
            }
            .flatten_all()?;
            weights = (weights + (&d - d.detach())?)?;
        }
        Ok(Self { experts, weights })
    }

    /// The weights of expert `e`'s tokens, `[n, 1]`.
    pub(crate) fn weights_of(&self, e: usize) -> Result<Tensor> {
        self.select(&self.experts[e].1)
    }

    /// The weights at `slots`, `[slots.len(), 1]`.
    pub(crate) fn select(&self, slots: &[u32]) -> Result<Tensor> {
        let n = slots.len();
        let idx = Tensor::from_vec(slots.to_vec(), n, self.weights.device())?;
        self.weights.index_select(&idx, 0)?.reshape((n, 1))
    }

    /// Megatron-core's load-balancing loss of this routing (Switch Transformer's, for top-k):
    /// `E · Σ_e f_e · P_e`, with `f_e` the share of the tokens' `k` choices that went to
    /// expert `e` (the shares sum to 1) and `P_e` the mean router probability of `e`; 1 when
    /// both are uniform. `logits` are those the routing was made from; the loss is
    /// differentiable through `P` (the counts are not). 0 for no token.
    pub(crate) fn load_balancing_loss(&self, logits: &Tensor) -> Result<Tensor> {
        let wide = self.weights.dtype();
        let (tokens, n_experts) = logits.dims2()?;
        let device = logits.device();
        if tokens == 0 {
            return Tensor::zeros((), wide, device);
        }
        let choices = self.weights.dim(0)? as f64;
        let shares: Vec<f64> = self
            .experts
            .iter()
            .map(|(rows, _)| rows.len() as f64 / choices)
            .collect();
        let shares = Tensor::from_vec(shares, n_experts, device)?.to_dtype(wide)?;
        let mean = candle_nn::ops::softmax(&logits.to_dtype(wide)?, D::Minus1)?.mean(0)?;
        (mean * shares)?.sum_all()? * n_experts as f64
    }

    /// Per expert: (token rows, weights as plain values).
    pub(crate) fn to_vecs(&self) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
        let w: Vec<f32> = self.weights.to_dtype(DType::F32)?.to_vec1()?;
        Ok(self
            .experts
            .iter()
            .map(|(rows, slots)| (rows.clone(), slots.iter().map(|&s| w[s as usize]).collect()))
            .collect())
    }
}
