//! Vocabulary-parallel cross-entropy against the dense loss on the gathered logits.
mod common;

use candle_core::{DType, Device, Result, Tensor, D};
use candle_tp::train::vocab_parallel_cross_entropy;
use candle_tp::{run_threads, Partition};
use common::{max_abs_diff, seeded, var};

/// Dense reference: mean over non-ignored rows of `-(1-ε)·logp[t] - ε·mean(logp)`, and its
/// gradient with respect to the logits.
fn dense(logits: &Tensor, targets: &[u32], eps: f64, ignore: Option<u32>) -> Result<(f32, Tensor)> {
    let v = var(logits);
    let (n, vocab) = logits.dims2()?;
    let logp = candle_nn::ops::log_softmax(v.as_tensor(), D::Minus1)?;
    let mut onehot = vec![0f32; n * vocab];
    let mut valid = vec![0f32; n];
    for (i, &t) in targets.iter().enumerate() {
        if Some(t) != ignore {
            onehot[i * vocab + t as usize] = 1.0;
            valid[i] = 1.0;
        }
    }
    let count = valid.iter().sum::<f32>().max(1.0) as f64;
    let onehot = Tensor::from_vec(onehot, (n, vocab), &Device::Cpu)?;
    let valid = Tensor::from_vec(valid, n, &Device::Cpu)?;
    let nll = (logp.clone() * onehot)?.sum(1)?.neg()?;
    let smooth = logp.mean(1)?.neg()?;
    let per_row = ((nll * (1.0 - eps))? + (smooth * eps)?)?;
    let loss = ((per_row * valid)?.sum_all()? / count)?;
    let g = loss.backward()?;
    let grad = g
        .get(v.as_tensor())
        .cloned()
        .unwrap_or(logits.zeros_like()?);
    Ok((loss.to_scalar()?, grad))
}

fn check(world: usize, n: usize, vocab: usize, eps: f64, ignore: Option<u32>) -> Result<()> {
    let full = (seeded(&[n, vocab], 7) * 4.0)?;
    let mut targets: Vec<u32> = (0..n).map(|i| ((i * 5 + 3) % vocab) as u32).collect();
    if let Some(ig) = ignore {
        targets[1] = ig;
        targets[n - 1] = ig;
    }
    let (ref_loss, ref_grad) = dense(&full, &targets, eps, ignore)?;
    if eps == 0.0 && ignore.is_none() {
        let t = Tensor::new(targets.as_slice(), &Device::Cpu)?;
        let candle = candle_nn::loss::cross_entropy(&full, &t)?.to_scalar::<f32>()?;
        assert!(
            (candle - ref_loss).abs() < 1e-6,
            "reference {ref_loss} vs candle {candle}"
        );
    }
    let out = run_threads(world, |pg| {
        let part = Partition::new(vocab, pg.size())?;
        let r = part.range(pg.rank());
        let local = var(&full.narrow(1, r.start, r.len())?);
        let t = Tensor::new(targets.as_slice(), &Device::Cpu)?;
        let loss = vocab_parallel_cross_entropy(local.as_tensor(), &t, &part, &pg, eps, ignore)?;
        let grads = loss.backward()?;
        let g = grads
            .get(local.as_tensor())
            .cloned()
            .unwrap_or(local.zeros_like()?);
        Ok((loss.to_scalar::<f32>()?, r, g))
    })?;
    for (rank, (loss, r, g)) in out.into_iter().enumerate() {
        assert!(
            (loss - ref_loss).abs() <= 1e-6 * ref_loss.abs().max(1.0),
            "world {world} rank {rank} eps {eps} ignore {ignore:?}: loss {loss} vs dense {ref_loss}"
        );
        let d = max_abs_diff(&g, &ref_grad.narrow(1, r.start, r.len())?)?;
        assert!(
            d <= 1e-6,
            "world {world} rank {rank}: logit gradient differs by {d}"
        );
    }
    Ok(())
}

#[test]
fn equals_dense_cross_entropy_world_1_to_4() -> Result<()> {
    for world in 1..=4 {
        check(world, 9, 11, 0.0, None)?;
        check(world, 9, 11, 0.1, None)?;
        check(world, 9, 11, 0.0, Some(4))?;
        check(world, 9, 11, 0.2, Some(4))?;
    }
    Ok(())
}

#[test]
fn all_rows_ignored_is_zero_and_bad_input_errors() -> Result<()> {
    let out = run_threads(2, |pg| {
        let part = Partition::new(6, 2)?;
        let local = Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?;
        let t = Tensor::new(&[5u32, 5], &Device::Cpu)?;
        let l = vocab_parallel_cross_entropy(&local, &t, &part, &pg, 0.0, Some(5))?
            .to_scalar::<f32>()?;
        let bad_target = Tensor::new(&[6u32, 0], &Device::Cpu)?;
        let e1 = vocab_parallel_cross_entropy(&local, &bad_target, &part, &pg, 0.0, None)
            .err()
            .map(|e| e.to_string());
        let wrong = Tensor::zeros((2, 4), DType::F32, &Device::Cpu)?;
        let e2 = vocab_parallel_cross_entropy(&wrong, &t, &part, &pg, 0.0, None)
            .err()
            .map(|e| e.to_string());
        Ok((l, e1, e2))
    })?;
    for (l, e1, e2) in out {
        assert_eq!(l, 0.0);
        assert!(e1.is_some_and(|e| e.contains("outside the vocabulary of 6")));
        assert!(e2.is_some_and(|e| e.contains("4 local logits")));
    }
    Ok(())
}
