//! Distributed sampling against the full-vocabulary computation.

use candle_core::{Device, Tensor};
use candle_tp::generate::{sample_batch, DistributedSampler, SamplingParams};
use candle_tp::rng::SplitMix64;
use candle_tp::{run_threads, Partition};

fn shard(logits: &[f32], part: &Partition, rank: usize) -> Tensor {
    Tensor::new(&logits[part.range(rank)], &Device::Cpu).unwrap()
}

/// Draws `n` tokens on `world` ranks; checks every rank drew the same ones.
fn draws(logits: &[f32], world: usize, params: SamplingParams, n: usize) -> Vec<u32> {
    draws_on(
        logits,
        Partition::new(logits.len(), world).unwrap(),
        params,
        n,
    )
}

/// Draws `n` tokens with the vocabulary split as `part`; checks every rank drew the same ones.
fn draws_on(logits: &[f32], part: Partition, params: SamplingParams, n: usize) -> Vec<u32> {
    let all = run_threads(part.parts(), |pg| {
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

/// `n` logits uniform in `[-1, 1)`: a flat-ish distribution whose tail holds most of the mass.
fn flat_logits(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
        .collect()
}

/// The exact softmax of `logits / t`, computed densely in f64, indexed by token id.
fn softmax(logits: &[f32], t: f64) -> Vec<f64> {
    let m = logits
        .iter()
        .map(|&l| l as f64 / t)
        .fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 / t - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|x| x / z).collect()
}

/// The first token of each seed of `seeds` (a fresh sampler per seed) on `world` ranks;
/// checks every rank drew the same ones.
fn first_draws(logits: &[f32], world: usize, t: f64, seeds: std::ops::Range<u64>) -> Vec<u32> {
    let part = Partition::new(logits.len(), world).unwrap();
    let all = run_threads(world, |pg| {
        let local = shard(logits, &part, pg.rank());
        seeds
            .clone()
            .map(|seed| {
                DistributedSampler::new(SamplingParams {
                    temperature: t,
                    top_k: None,
                    top_p: None,
                    seed,
                })
                .sample_shard(&local, &part, &pg)
            })
            .collect::<candle_core::Result<Vec<u32>>>()
    })
    .unwrap();
    for r in &all[1..] {
        assert_eq!(r, &all[0], "ranks disagree");
    }
    all.into_iter().next().unwrap()
}

/// Pearson's chi-square of `draws` against `probs` (indexed by token id), over bins of at least
/// 25 expected draws (tokens pooled from the most to the least likely, so the least likely
/// tokens have bins of their own): (statistic, degrees of freedom).
fn chi_square(draws: &[u32], probs: &[f64]) -> (f64, usize) {
    let n = draws.len() as f64;
    let mut counts = vec![0usize; probs.len()];
    for &d in draws {
        counts[d as usize] += 1;
    }
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    // (expected, observed) per bin.
    let mut bins: Vec<(f64, f64)> = Vec::new();
    let mut cur = (0.0, 0.0);
    for i in order {
        cur.0 += probs[i] * n;
        cur.1 += counts[i] as f64;
        if cur.0 >= 25.0 {
            bins.push(cur);
            cur = (0.0, 0.0);
        }
    }
    match bins.last_mut() {
        Some(last) => {
            last.0 += cur.0;
            last.1 += cur.1;
        }
        None => bins.push(cur),
    }
    assert!(bins.len() > 10, "too few bins: {}", bins.len());
    let stat = bins.iter().map(|(e, o)| (o - e).powi(2) / e).sum();
    (stat, bins.len() - 1)
}

#[test]
fn without_top_k_or_top_p_the_whole_vocabulary_is_drawn_as_the_exact_softmax() {
    // 1000 tokens with logits in [-1, 1): the 200 most likely hold a third of the mass at
    // temperature 1, so a sampler that looks at a few candidates per rank misses the tail.
    let logits = flat_logits(1000, 17);
    let n = 20_000u64;
    for (t, world) in [(1.0, 1), (0.5, 2), (2.0, 3)] {
        let probs = softmax(&logits, t);
        assert!(probs.iter().all(|p| p.is_finite() && *p > 0.0), "t={t}");
        assert!((probs.iter().sum::<f64>() - 1.0).abs() < 1e-9, "t={t}");
        let got = first_draws(&logits, world, t, 0..n);
        assert!(got.iter().all(|&id| (id as usize) < logits.len()));
        let (stat, dof) = chi_square(&got, &probs);
        // Mean `dof`, standard deviation sqrt(2 dof): six of them above.
        let bound = dof as f64 + 6.0 * (2.0 * dof as f64).sqrt();
        assert!(
            stat < bound,
            "t={t} world {world}: chi-square {stat:.0} over {dof} degrees of freedom (bound {bound:.0})"
        );
        // The tail: the tokens after the 200 most likely.
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let tail = &order[200..];
        let tail_mass: f64 = tail.iter().map(|&i| probs[i]).sum();
        let in_tail: Vec<u32> = got
            .iter()
            .copied()
            .filter(|&id| tail.contains(&(id as usize)))
            .collect();
        let tail_freq = in_tail.len() as f64 / n as f64;
        assert!(
            (tail_freq - tail_mass).abs() < 0.02,
            "t={t} world {world}: the tail was drawn {tail_freq:.3} of the time, its probability is {tail_mass:.3}"
        );
        let distinct: std::collections::HashSet<u32> = in_tail.into_iter().collect();
        assert!(
            distinct.len() > tail.len() / 2,
            "t={t} world {world}: {} of the {} tail tokens drawn",
            distinct.len(),
            tail.len()
        );
    }
}

#[test]
fn the_same_seed_draws_the_same_tokens_at_every_world_size_and_split() {
    let logits = flat_logits(1000, 23);
    let parts = [
        Partition::new(1000, 1).unwrap(),
        Partition::new(1000, 2).unwrap(),
        Partition::new(1000, 3).unwrap(), // 334 + 333 + 333
        Partition::with_unit(1000, 3, 100).unwrap(), // 400 + 300 + 300
        Partition::with_unit(1000, 2, 200).unwrap(), // 600 + 400
        Partition::new(1000, 4).unwrap(),
    ];
    for (temperature, top_k, top_p, seed) in [
        (1.0, None, None, 1),
        (0.7, None, None, 2),
        (1.0, Some(50), None, 3),
        (1.0, None, Some(0.6), 4),
        (0.8, Some(300), Some(0.7), 5),
    ] {
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        };
        let one = draws_on(&logits, parts[0], params, 100);
        let distinct: std::collections::HashSet<u32> = one.iter().copied().collect();
        assert!(
            distinct.len() > 30,
            "{params:?}: {} distinct",
            distinct.len()
        );
        for part in &parts[1..] {
            assert_eq!(
                draws_on(&logits, *part, params, 100),
                one,
                "{params:?} split {:?}",
                part.sizes()
            );
        }
    }
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

#[test]
fn top_p_of_one_and_a_top_k_past_the_vocabulary_draw_as_no_filter() {
    let logits = flat_logits(500, 29);
    let free = SamplingParams {
        temperature: 0.9,
        top_k: None,
        top_p: None,
        seed: 31,
    };
    let want = draws(&logits, 2, free, 200);
    for (world, top_k, top_p) in [
        (2, None, Some(1.0)),
        (3, Some(500), None),
        (1, Some(10_000), Some(1.0)),
    ] {
        let params = SamplingParams {
            top_k,
            top_p,
            ..free
        };
        assert_eq!(draws(&logits, world, params, 200), want, "{params:?}");
    }
}

#[test]
fn masked_tokens_are_never_drawn() {
    let mut logits = flat_logits(300, 37);
    for l in logits.iter_mut().skip(1).step_by(2) {
        *l = f32::NEG_INFINITY;
    }
    // All of the last rank's tokens masked but one.
    logits[201..]
        .iter_mut()
        .for_each(|l| *l = f32::NEG_INFINITY);
    for (top_k, top_p) in [(None, None), (Some(20), None), (None, Some(0.9))] {
        let params = SamplingParams {
            temperature: 1.0,
            top_k,
            top_p,
            seed: 41,
        };
        for world in [1, 3] {
            let got = draws(&logits, world, params, 300);
            assert!(
                got.iter().all(|&id| logits[id as usize].is_finite()),
                "{params:?} world {world}: a masked token drawn"
            );
        }
    }
}

/// The error of one draw on `world` ranks.
fn draw_error(logits: &[f32], world: usize, params: SamplingParams) -> String {
    let part = Partition::new(logits.len(), world).unwrap();
    run_threads(world, |pg| {
        DistributedSampler::new(params).sample_shard(&shard(logits, &part, pg.rank()), &part, &pg)
    })
    .unwrap_err()
    .to_string()
}

#[test]
fn a_nan_logit_no_drawable_token_or_bad_parameters_are_clear_errors() {
    let params = SamplingParams {
        temperature: 1.0,
        top_k: None,
        top_p: None,
        seed: 1,
    };
    let mut logits = flat_logits(100, 3);
    logits[70] = f32::NAN;
    for top_k in [None, Some(5)] {
        let e = draw_error(&logits, 2, SamplingParams { top_k, ..params });
        assert!(e.contains("NaN") && e.contains("token 70"), "{e}");
    }
    let e = draw_error(&[f32::NEG_INFINITY; 100], 2, params);
    assert!(e.contains("every logit is -inf"), "{e}");
    let logits = flat_logits(100, 3);
    for (bad, what) in [
        (
            SamplingParams {
                temperature: f64::NAN,
                ..params
            },
            "temperature",
        ),
        (
            SamplingParams {
                top_k: Some(0),
                ..params
            },
            "top_k",
        ),
        (
            SamplingParams {
                top_p: Some(-0.5),
                ..params
            },
            "top_p",
        ),
    ] {
        let e = draw_error(&logits, 2, bad);
        assert!(e.contains(what), "{bad:?}: {e}");
    }
}

#[test]
fn several_rows_sampled_at_once_draw_what_each_draws_alone() {
    // Greedy, temperature-only and top-k / top-p rows mixed, 40 steps, one call per step.
    let rows: Vec<Vec<f32>> = (0..5).map(|r| flat_logits(400, 50 + r)).collect();
    let params = [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 0.9,
            top_k: None,
            top_p: None,
            seed: 1,
        },
        SamplingParams {
            temperature: 1.0,
            top_k: Some(30),
            top_p: None,
            seed: 2,
        },
        SamplingParams {
            temperature: 1.2,
            top_k: None,
            top_p: None,
            seed: 3,
        },
        SamplingParams {
            temperature: 0.8,
            top_k: None,
            top_p: Some(0.5),
            seed: 4,
        },
    ];
    let steps = 40;
    let alone: Vec<Vec<u32>> = rows
        .iter()
        .zip(params)
        .map(|(l, p)| draws(l, 1, p, steps))
        .collect();
    for world in 1..=3 {
        let part = Partition::new(400, world).unwrap();
        let all = run_threads(world, |pg| {
            let local: Vec<Tensor> = rows.iter().map(|l| shard(l, &part, pg.rank())).collect();
            let mut samplers: Vec<DistributedSampler> =
                params.iter().map(|&p| DistributedSampler::new(p)).collect();
            let mut out = vec![Vec::new(); rows.len()];
            for _ in 0..steps {
                let mut batch: Vec<(&mut DistributedSampler, &Tensor)> =
                    samplers.iter_mut().zip(&local).collect();
                let ids = sample_batch(&mut batch, &part, &pg)?;
                ids.into_iter().zip(&mut out).for_each(|(id, o)| o.push(id));
            }
            Ok(out)
        })
        .unwrap();
        for (r, got) in all.iter().enumerate() {
            assert_eq!(got, &alone, "world {world} rank {r}");
        }
    }
}
