//! Pieces shared by the training tests: the small model, its batch, and one rank's gradients.

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor};
use candle_tp::train::{all_reduce_grads, TrainConfig, TrainInit, TrainLlama};
use candle_tp::ProcessGroup;

/// A 2-layer model that splits unevenly at TP = 2 and 3: vocabulary 37, intermediate 40,
/// 6 heads and 3 KV heads of width 4.
pub fn cfg(tie: bool) -> TrainConfig {
    TrainConfig {
        vocab_size: 37,
        hidden_size: 24,
        intermediate_size: 40,
        num_hidden_layers: 2,
        num_attention_heads: 6,
        num_key_value_heads: 3,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        max_position_embeddings: 32,
        tie_word_embeddings: tie,
        initializer_range: 0.2,
    }
}

/// Token ids and targets, `b * s` of each, in the vocabulary of [`cfg`].
pub fn batch(b: usize, s: usize) -> (Vec<u32>, Vec<u32>) {
    let ids: Vec<u32> = (0..b * s).map(|i| ((i * 7 + 3) % 37) as u32).collect();
    let tg: Vec<u32> = (0..b * s).map(|i| ((i * 11 + 5) % 37) as u32).collect();
    (ids, tg)
}

/// (name, split, gradient) of every parameter a rank holds.
pub type Grads = Vec<(String, Option<(usize, std::ops::Range<usize>)>, Tensor)>;

/// Synchronises `g` as the trainer does (the sequence-parallel norm weights summed over `tp`
/// when `sp`, everything averaged over `dp`) and returns every parameter's gradient; a
/// parameter without one is an error.
pub fn synced_grads(
    init: &TrainInit,
    model: &TrainLlama,
    mut g: GradStore,
    tp: &ProcessGroup,
    dp: Option<&ProcessGroup>,
) -> Result<Grads> {
    let params = init.params()?;
    if model.sequence_parallel() {
        let names = model.sequence_parallel_params();
        let vars: Vec<_> = params
            .iter()
            .filter(|p| names.contains(&p.name))
            .map(|p| p.var.clone())
            .collect();
        all_reduce_grads(&mut g, &vars, tp, false)?;
    }
    if let Some(dp) = dp {
        let vars: Vec<_> = params.iter().map(|p| p.var.clone()).collect();
        all_reduce_grads(&mut g, &vars, dp, true)?;
    }
    let mut out = Vec::new();
    for p in params {
        match g.get(p.var.as_tensor()) {
            Some(t) => out.push((p.name, p.split, t.clone())),
            None => candle_core::bail!("rank {}: no gradient for {}", tp.rank(), p.name),
        }
    }
    Ok(out)
}

/// `examples/train`'s arguments for a tiny model trained for 4 steps (seconds per run).
pub const TINY_ARGS: [&str; 14] = [
    "--steps",
    "4",
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--intermediate",
    "48",
    "--seq",
    "17",
];

/// The losses of `examples/train`'s JSON lines in `stdout` (rank 0's, whose lines start with
/// `prefix` when several ranks print; other ranks' lines are not JSON), checking that steps count up from 0 and report a positive throughput.
pub fn losses_of(stdout: &str, prefix: &str) -> Vec<f64> {
    let mut v = Vec::new();
    for line in stdout.lines() {
        let json = line.strip_prefix(prefix).unwrap_or(line);
        if let Ok(j) = serde_json::from_str::<serde_json::Value>(json) {
            if let Some(l) = j["loss"].as_f64() {
                assert_eq!(j["step"].as_u64(), Some(v.len() as u64), "{line}");
                assert!(
                    j["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0),
                    "{line}"
                );
                v.push(l);
            }
        }
    }
    v
}
