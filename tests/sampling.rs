//! Distributed sampling against the full-vocabulary computation.

use candle_core::{Device, Tensor};
use candle_tp::generate::{DistributedSampler, SamplingParams};
use candle_tp::{run_threads, Partition};

fn shard(logits: &[f32], part: &Partition, rank: usize) -> Tensor {
    Tensor::new(&logits[part.range(rank)], &Device::Cpu).unwrap()
}

/// Draws `n` tokens on `world` ranks; checks every rank drew the same ones.
fn draws(logits: &[f32], world: usize, params: SamplingParams, n: usize) -> Vec<u32> {
    let part = Partition::new(logits.len(), world).unwrap();
    let all = run_threads(world, |pg| {
        let mut s = DistributedSampler::new(params);
        let local = shard(logits, &part, pg.rank());
        (0..n)
            .map(|_| s.sample_shard(&local, &part, &pg))
            .collect::<candle_core::Result<Vec<u32>>>()
    })
    .unwrap();
    for r in &all[1..] {
        assert_eq!(r, &all[0], "ranks disagree");
    }
    all.into_iter().next().unwrap()
}

/// The distribution the warpers define, computed on the full logits (f64, sorted).
fn expected(logits: &[f32], t: f64, top_k: Option<usize>, top_p: Option<f64>) -> Vec<(u32, f64)> {
    let mut v: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l as f64 / t))
        .collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if let Some(k) = top_k {
        v.truncate(k);
    }
    let m = v[0].1;
    let z: f64 = v.iter().map(|x| (x.1 - m).exp()).sum();
    let mut p: Vec<(u32, f64)> = v.iter().map(|x| (x.0, (x.1 - m).exp() / z)).collect();
    if let Some(tp) = top_p {
        let mut acc = 0.0;
        let cut = p.iter().position(|x| {
            acc += x.1;
            acc >= tp
        });
        if let Some(c) = cut {
            p.truncate(c + 1);
        }
        let s: f64 = p.iter().map(|x| x.1).sum();
        p.iter_mut().for_each(|x| x.1 /= s);
    }
    p
}

#[test]
fn greedy_is_the_argmax_of_the_full_logits_with_ties_to_the_lowest_id() {
    let logits: Vec<f32> = vec![0.5, -1.0, 3.0, 2.0, 3.0, 0.0, 1.0, 3.0, -2.0, 0.1, 2.9];
    let full = Tensor::new(logits.as_slice(), &Device::Cpu).unwrap();
    let want = full.argmax(0).unwrap().to_scalar::<u32>().unwrap();
    assert_eq!(want, 2);
    for world in 1..=4 {
        assert_eq!(
            draws(&logits, world, SamplingParams::greedy(), 1),
            vec![2],
            "world {world}"
        );
    }
    // The maximum in the last rank's shard.
    let mut l2 = logits.clone();
    l2[10] = 9.0;
    for world in 1..=4 {
        assert_eq!(draws(&l2, world, SamplingParams::greedy(), 1), vec![10]);
    }
}

#[test]
fn sampling_is_the_same_at_every_world_size() {
    let logits: Vec<f32> = (0..37)
        .map(|i| ((i * 7919) % 23) as f32 * 0.3 - 2.0)
        .collect();
    for params in [
        SamplingParams {
            temperature: 0.8,
            top_k: Some(5),
            top_p: None,
            seed: 3,
        },
        SamplingParams {
            temperature: 1.3,
            top_k: None,
            top_p: Some(0.9),
            seed: 4,
        },
        SamplingParams {
            temperature: 0.6,
            top_k: Some(10),
            top_p: Some(0.8),
            seed: 5,
        },
        SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: None,
            seed: 6,
        },
    ] {
        let one = draws(&logits, 1, params, 50);
        for world in 2..=4 {
            assert_eq!(
                draws(&logits, world, params, 50),
                one,
                "{params:?} world {world}"
            );
        }
    }
}

#[test]
fn frequencies_follow_the_warped_softmax() {
    let logits: Vec<f32> = vec![1.0, 2.5, 0.3, 2.0, -1.0, 1.7, 0.0, 2.2, -0.5, 1.2, 0.9];
    let n = 4000;
    for (t, k, p) in [
        (0.7, Some(4), None),
        (1.0, None, Some(0.75)),
        (1.5, Some(6), Some(0.9)),
    ] {
        let want = expected(&logits, t, k, p);
        let got = draws(
            &logits,
            3,
            SamplingParams {
                temperature: t,
                top_k: k,
                top_p: p,
                seed: 11,
            },
            n,
        );
        for &id in &got {
            assert!(
                want.iter().any(|w| w.0 == id),
                "token {id} is outside the kept set {want:?}"
            );
        }
        for (id, prob) in &want {
            let freq = got.iter().filter(|&&g| g == *id).count() as f64 / n as f64;
            assert!(
                (freq - prob).abs() < 0.035,
                "token {id}: frequency {freq} vs probability {prob} (t={t} k={k:?} p={p:?})"
            );
        }
    }
}

#[test]
fn a_large_nucleus_gathers_more_candidates() {
    // 600 equal logits: the 0.9 nucleus holds 540 tokens, far more than the first 64
    // candidates per rank, so the sampler must widen its search.
    let logits = vec![0.0f32; 600];
    let params = SamplingParams {
        temperature: 1.0,
        top_k: None,
        top_p: Some(0.9),
        seed: 9,
    };
    let one = draws(&logits, 1, params, 300);
    let three = draws(&logits, 3, params, 300);
    assert_eq!(one, three);
    let distinct: std::collections::HashSet<u32> = three.iter().copied().collect();
    assert!(
        distinct.len() > 150,
        "only {} distinct tokens",
        distinct.len()
    );
    assert!(
        three.iter().all(|&id| id < 540),
        "a token outside the nucleus"
    );
}

#[test]
fn a_shard_of_the_wrong_size_is_a_clear_error() {
    let e = run_threads(2, |pg| {
        let part = Partition::new(10, 2)?;
        DistributedSampler::new(SamplingParams::greedy()).sample_shard(
            &Tensor::zeros(4, candle_core::DType::F32, &Device::Cpu)?,
            &part,
            &pg,
        )
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("got 4 logits") && e.contains("vocabulary of 10 over 2 ranks is 5"),
        "{e}"
    );
}

#[test]
fn top_p_keeps_the_exact_nucleus_when_the_ranks_best_tokens_are_not_the_global_best() {
    // 150 tokens at 1.0, then 150 at 0.9: the 0.4 nucleus is the first 115 tokens. Each rank's
    // 64 best put together reach 0.4 only by counting tokens at 0.9 that come after tokens at
    // 1.0 that were not gathered.
    let mut logits = vec![1.0f32; 150];
    logits.extend(vec![0.9f32; 150]);
    let want = expected(&logits, 1.0, None, Some(0.4));
    assert_eq!(want.len(), 115);
    assert!(want.iter().all(|w| w.0 < 115));
    let params = SamplingParams {
        temperature: 1.0,
        top_k: None,
        top_p: Some(0.4),
        seed: 13,
    };
    for world in 1..=3 {
        let got = draws(&logits, world, params, 400);
        for id in got {
            assert!(id < 115, "world {world}: token {id} is outside the nucleus");
        }
    }
}
