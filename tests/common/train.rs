//! Pieces shared by the training tests: the small model, its batch, and one rank's gradients.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor};
use candle_tp::train::{
    all_reduce_grads, vocab_parallel_cross_entropy, Dropout, TrainConfig, TrainInit, TrainLlama,
};
use candle_tp::{run_threads, ProcessGroup};

use super::max_abs_diff;

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
        num_local_experts: 0,
        num_experts_per_tok: 2,
        router_aux_loss_coef: 0.0,
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

/// Synchronises `g` as the trainer does (the partial gradients of
/// [`TrainLlama::partial_gradient_params`] summed over `tp`, everything averaged over `dp`) and returns every parameter's gradient; a
/// parameter without one is an error.
pub fn synced_grads(
    init: &TrainInit,
    model: &TrainLlama,
    mut g: GradStore,
    tp: &ProcessGroup,
    dp: Option<&ProcessGroup>,
) -> Result<Grads> {
    let params = init.params()?;
    // The routers' gradients always, the norms' with sequence parallelism.
    let names = model.partial_gradient_params();
    let vars: Vec<_> = params
        .iter()
        .filter(|p| names.contains(&p.name))
        .map(|p| p.var.clone())
        .collect();
    all_reduce_grads(&mut g, &vars, tp, false)?;
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

/// How a test lays the model out over its TP group: sequence parallelism, and the MoE layers'
/// expert groups (`ShardedVarBuilder::with_expert_parallel`; `None`: every expert split).
#[derive(Debug, Clone, Copy, Default)]
pub struct Layout {
    /// Sequence parallelism.
    pub sp: bool,
    /// Expert groups.
    pub ep: Option<usize>,
}

/// (name, split, gradient) of every parameter after one forward/backward of rows `rows` of
/// [`batch`]`(4, 7)`, the model laid out as `layout` over `tp`, with the gradients
/// synchronised as the trainer does.
pub fn grads(
    cfg: &TrainConfig,
    tp: &ProcessGroup,
    dp: Option<&ProcessGroup>,
    layout: Layout,
    drop: Dropout,
    rows: std::ops::Range<usize>,
) -> Result<(f32, Grads)> {
    let (b, s) = (4, 7);
    let init = TrainInit::new(42);
    cfg.declare(&init)?;
    let vb = init
        .var_builder(DType::F32, &Device::Cpu, tp.clone())
        .with_expert_parallel(layout.ep)?;
    let model = TrainLlama::load(cfg, vb, layout.sp)?;
    let (ids, tg) = batch(b, s);
    let ids = Tensor::from_vec(ids, (b, s), &Device::Cpu)?.narrow(0, rows.start, rows.len())?;
    let tg = Tensor::from_vec(tg, (b, s), &Device::Cpu)?
        .narrow(0, rows.start, rows.len())?
        .flatten_all()?;
    let logits = model.forward(&ids, &drop)?;
    let loss = vocab_parallel_cross_entropy(&logits, &tg, model.vocab_partition(), tp, 0.0, None)?;
    // The MoE layers' load-balancing loss, as the trainer adds it.
    let loss = match model.take_aux_loss() {
        Some(aux) => (loss + aux)?,
        None => loss,
    };
    let out = synced_grads(&init, &model, loss.backward()?, tp, dp)?;
    Ok((loss.to_scalar()?, out))
}

/// The loss and every parameter's gradient of one process (the whole batch, every expert).
pub fn reference(cfg: &TrainConfig, drop: Dropout) -> Result<(f32, HashMap<String, Tensor>)> {
    let mut r = run_threads(1, |pg| grads(cfg, &pg, None, Layout::default(), drop, 0..4))?;
    let (loss, g) = r.remove(0);
    Ok((loss, g.into_iter().map(|(n, _, t)| (n, t)).collect()))
}

/// Checks every rank's loss and gradients (its slices, or its whole parameters) against the
/// reference within 1e-5 (finite: [`max_abs_diff`] checks). Every parameter but an expert's must be on every
/// rank; an expert's on at least one.
pub fn compare(
    what: &str,
    reference: &(f32, HashMap<String, Tensor>),
    got: Vec<(f32, Grads)>,
) -> Result<()> {
    let (ref_loss, ref_g) = reference;
    let mut seen = std::collections::BTreeSet::new();
    for (rank, (loss, g)) in got.into_iter().enumerate() {
        assert!(
            (loss - ref_loss).abs() < 1e-5,
            "{what} rank {rank}: loss {loss} vs {ref_loss}"
        );
        let names: Vec<&String> = g.iter().map(|(n, _, _)| n).collect();
        for name in ref_g.keys().filter(|n| !n.contains(".experts.")) {
            assert!(
                names.contains(&name),
                "{what} rank {rank}: no parameter {name}"
            );
        }
        for (name, split, grad) in g {
            let Some(full) = ref_g.get(&name) else {
                panic!("{what} rank {rank}: parameter {name} is not the reference's");
            };
            let want = match &split {
                None => full.clone(),
                Some((dim, r)) => full.narrow(*dim, r.start, r.len())?,
            };
            let d = max_abs_diff(&grad, &want)?;
            assert!(
                d <= 1e-5,
                "{what} rank {rank}: gradient of {name} ({split:?}) differs by {d}"
            );
            seen.insert(name);
        }
    }
    for name in ref_g.keys() {
        assert!(seen.contains(name), "{what}: no rank holds {name}");
    }
    Ok(())
}

/// Each rank's logits from `logits(pg)` at every world of `worlds` within `tol` of `want`
/// (an inference model reading a checkpoint the trainer saved; finite: [`max_abs_diff`]).
pub fn logits_at_worlds(
    what: &str,
    worlds: &[usize],
    want: &Tensor,
    tol: f32,
    logits: impl Fn(ProcessGroup) -> Result<Tensor> + Sync,
) -> Result<()> {
    for &world in worlds {
        let got = run_threads(world, &logits)?;
        for (rank, l) in got.iter().enumerate() {
            let d = max_abs_diff(l, want)?;
            assert!(
                d <= tol,
                "{what} at world {world} rank {rank}: logits differ by {d}"
            );
        }
    }
    Ok(())
}

/// `examples/train`'s arguments for a tiny model trained for 4 steps (seconds per run).
pub const TINY_ARGS: [&str; 16] = [
    // A fixed corpus (the docs as they stood on 2026-11-28), so that editing the docs does
    // not change the tests' batches: the MoE layouts' curves part from one process's where a
    // top-2 choice is near a tie, which one doc edit moved into the fourth step.
    "--corpus",
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/train-corpus.txt"),
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
