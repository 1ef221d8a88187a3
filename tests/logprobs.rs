//! Log-probabilities and penalties on vocabulary shards against dense computations written
//! here (f64 over the whole vocabulary, not the code under test), at worlds 1 to 4 with even
//! and uneven splits; at world 2 and more the ranks must have exchanged their records.

use candle_tp::comm::CollectiveKind;
use candle_tp::generate::{
    apply_penalties, shard_logprobs, History, LogprobRow, Penalties, TokenLogprobs,
};
use candle_tp::rng::SplitMix64;
use candle_tp::{run_threads, Partition};

/// Dense log-softmax in f64: `x - max - ln Σ exp(x - max)`.
fn dense_log_softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits
        .iter()
        .fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
    let z: f64 = logits.iter().map(|&v| (v as f64 - m).exp()).sum();
    logits.iter().map(|&v| v as f64 - m - z.ln()).collect()
}

/// The `n` most likely ids, ties to the lowest id.
fn dense_top(lp: &[f64], n: usize) -> Vec<(u32, f64)> {
    let mut idx: Vec<usize> = (0..lp.len()).collect();
    idx.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    idx.into_iter().take(n).map(|i| (i as u32, lp[i])).collect()
}

/// Rows of logits: spread normal, a wide range (|x| up to 1e3, where a naive exp overflows),
/// ties, and -inf entries.
fn rows(vocab: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = SplitMix64::new(seed);
    let mut out = Vec::new();
    for (sigma, kind) in [(1.0, 0), (4.0, 0), (300.0, 0), (2.0, 1), (2.0, 2)] {
        let mut v: Vec<f32> = (0..vocab)
            .map(|_| (rng.next_normal() * sigma) as f32)
            .collect();
        match kind {
            1 => v.iter_mut().step_by(5).for_each(|x| *x = 3.25), // ties at the top
            2 => v.iter_mut().step_by(3).for_each(|x| *x = f32::NEG_INFINITY),
            _ => {}
        }
        out.push(v);
    }
    out
}

fn check(got: &TokenLogprobs, lp: &[f64], n: usize, what: &str) {
    assert!(
        got.logprob.is_finite(),
        "{what}: logprob {} not finite",
        got.logprob
    );
    let want = lp[got.token as usize];
    assert!(
        (got.logprob - want).abs() <= 1e-5,
        "{what}: token {} logprob {} vs dense {want}",
        got.token,
        got.logprob
    );
    let top = dense_top(lp, n);
    assert_eq!(got.top.len(), top.len(), "{what}");
    for ((gi, gv), (wi, wv)) in got.top.iter().zip(&top) {
        assert!(gv.is_finite(), "{what}: top logprob {gv}");
        assert_eq!(gi, wi, "{what}: top ids {:?} vs {top:?}", got.top);
        assert!((gv - wv).abs() <= 1e-5, "{what}: top {gi}: {gv} vs {wv}");
    }
}

#[test]
fn logprobs_on_shards_equal_the_dense_log_softmax() {
    let vocab = 1013; // prime: uneven at every world
    let logits = rows(vocab, 7);
    let dense: Vec<Vec<f64>> = logits.iter().map(|r| dense_log_softmax(r)).collect();
    let mut rng = SplitMix64::new(3);
    let tokens: Vec<u32> = logits
        .iter()
        .map(|r| loop {
            let t = (rng.next_u64() % vocab as u64) as u32;
            if r[t as usize].is_finite() {
                break t;
            }
        })
        .collect();
    let top_ns = [0, 1, 5, 20, 7];
    for world in 1..=4 {
        let part = Partition::new(vocab, world).unwrap();
        let all = run_threads(world, |pg| {
            let range = part.range(pg.rank());
            let rows: Vec<LogprobRow<'_>> = logits
                .iter()
                .zip(&tokens)
                .zip(top_ns)
                .map(|((l, &token), top_n)| LogprobRow {
                    local: &l[range.clone()],
                    token,
                    top_n,
                })
                .collect();
            pg.reset_stats();
            let got = shard_logprobs(&rows, &part, &pg)?;
            Ok((got, pg.stats().get(CollectiveKind::AllGather).calls))
        })
        .unwrap();
        for (rank, (got, gathers)) in all.iter().enumerate() {
            if world > 1 {
                assert_eq!(
                    *gathers, 1,
                    "world {world} rank {rank}: one all-gather per step"
                );
            }
            assert_eq!(
                got, &all[0].0,
                "world {world}: rank {rank} differs from rank 0"
            );
            for (i, g) in got.iter().enumerate() {
                assert_eq!(g.token, tokens[i]);
                check(g, &dense[i], top_ns[i], &format!("world {world} row {i}"));
            }
        }
    }
}

#[test]
fn a_nan_logit_gives_nan_not_a_finite_answer() {
    let mut l: Vec<f32> = (0..50).map(|i| i as f32 * 0.1).collect();
    l[37] = f32::NAN;
    for world in [1, 2] {
        let part = Partition::new(50, world).unwrap();
        let got = run_threads(world, |pg| {
            let local = &l[part.range(pg.rank())];
            shard_logprobs(
                &[LogprobRow {
                    local,
                    token: 3,
                    top_n: 2,
                }],
                &part,
                &pg,
            )
        })
        .unwrap();
        assert!(got[0][0].logprob.is_nan(), "world {world}: {:?}", got[0][0]);
    }
}

/// The penalties as their definitions read, on the whole vocabulary.
fn dense_penalties(logits: &[f32], p: &Penalties, prompt: &[u32], output: &[u32]) -> Vec<f32> {
    let mut v = logits.to_vec();
    for &(id, b) in &p.logit_bias {
        v[id as usize] += b;
    }
    for (id, x) in v.iter_mut().enumerate() {
        let id = id as u32;
        if prompt.contains(&id) || output.contains(&id) {
            *x = if *x > 0.0 {
                *x / p.repetition
            } else {
                *x * p.repetition
            };
        }
        let count = output.iter().filter(|&&t| t == id).count();
        if count > 0 {
            *x -= p.frequency * count as f32 + p.presence;
        }
    }
    v
}

#[test]
fn penalties_on_shards_equal_the_dense_ones() {
    let vocab = 211;
    let mut rng = SplitMix64::new(11);
    let logits: Vec<f32> = (0..vocab).map(|_| rng.next_normal() as f32 * 3.0).collect();
    let prompt: Vec<u32> = (0..30)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect();
    let output: Vec<u32> = (0..40).map(|_| (rng.next_u64() % 60) as u32).collect();
    let cases = [
        Penalties {
            presence: 0.7,
            ..Penalties::default()
        },
        Penalties {
            frequency: -0.4,
            ..Penalties::default()
        },
        Penalties {
            repetition: 1.7,
            ..Penalties::default()
        },
        Penalties {
            repetition: 0.6,
            presence: -1.0,
            frequency: 1.5,
            logit_bias: vec![(0, -100.0), (5, 30.5), (105, 2.0), (210, -7.0)],
        },
    ];
    for p in &cases {
        let want = dense_penalties(&logits, p, &prompt, &output);
        assert_ne!(want, logits, "{p:?} changes nothing: the case cannot fail");
        for world in 1..=3 {
            let part = Partition::new(vocab, world).unwrap();
            let mut got = Vec::new();
            for rank in 0..world {
                let range = part.range(rank);
                let mut h = History::new(&prompt, p);
                output.iter().for_each(|&t| h.push(t));
                let mut local = logits[range.clone()].to_vec();
                apply_penalties(&mut local, range, p, &h);
                got.extend(local);
            }
            assert!(got.iter().all(|x| x.is_finite()), "{p:?}");
            let diff = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff <= 1e-6, "world {world} {p:?}: max diff {diff}");
        }
    }
}
