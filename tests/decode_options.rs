//! The continuous-batching decoder's log-probabilities and penalties on SmolLM2-135M at
//! worlds 1 and 2, against a dense computation written here: the test runs the same model one
//! token at a time (`CausalLm::forward`, the path `examples/generate` takes), gathers every
//! rank's logits into the whole vocabulary with its own all-gather, and computes the
//! log-softmax (f64) and the penalised greedy choice itself. Needs `scripts/fetch-models.sh`.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_tp::generate::{BatchDecoder, Penalties, SamplingParams, SeqOptions, SeqRequest};
use candle_tp::models::CausalLm;
use candle_tp::run_threads;

const PROMPT: [u32; 6] = [504, 3575, 282, 4649, 314, 1155];
const NEW_TOKENS: usize = 12;
const TOP_N: usize = 5;

/// Penalties as their definitions read, on the whole vocabulary.
fn penalise(v: &mut [f32], p: &Penalties, prompt: &[u32], out: &[u32]) {
    for &(id, b) in &p.logit_bias {
        v[id as usize] += b;
    }
    for (id, x) in v.iter_mut().enumerate() {
        let id = id as u32;
        if prompt.contains(&id) || out.contains(&id) {
            *x = if *x > 0.0 {
                *x / p.repetition
            } else {
                *x * p.repetition
            };
        }
        let n = out.iter().filter(|&&t| t == id).count();
        if n > 0 {
            *x -= p.frequency * n as f32 + p.presence;
        }
    }
}

/// The first index of the largest value.
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// At each position: (token, its logprob, the top ids and logprobs); the decoder's, or the
/// dense reference's (the penalised argmax, the dense logprob of the decoder's token).
type Dense = Vec<(u32, f64, Vec<(u32, f64)>)>;

fn run(world: usize, penalties: Penalties) -> (Dense, Dense) {
    let dir = common::smollm2_dir();
    let mut results = run_threads(world, |pg| {
        candle_tp::set_batch_invariant_matmul(true);
        let mut model = CausalLm::from_path(&dir, DType::F32, &Device::Cpu, pg.clone())?;
        // The decoder under test: one sequence, the whole prompt in one chunk.
        let mut dec = BatchDecoder::new(2, 256, 64)?;
        dec.add(
            &model,
            SeqRequest {
                id: 9,
                prompt: PROMPT.to_vec(),
                max_tokens: NEW_TOKENS,
                min_tokens: 0,
                params: SamplingParams::greedy(),
                stop_ids: Vec::new(),
                options: SeqOptions {
                    logprobs: Some(TOP_N),
                    penalties: penalties.clone(),
                    constrained: false,
                },
            },
        )?;
        let mut got = Vec::new();
        while !dec.is_empty() {
            for e in dec.step(&mut model)? {
                let lp = e.logprobs.expect("logprobs asked for");
                assert_eq!(lp.token, e.token);
                got.push((e.token, lp.logprob, lp.top));
            }
        }
        // The dense reference, teacher-forced with the decoder's tokens.
        model.clear_kv_cache();
        let vocab = model.config().vocab_size;
        assert_eq!(vocab % world, 0, "the test gathers equal shards");
        let mut dense = Vec::new();
        let mut x = Tensor::new(&PROMPT, &Device::Cpu)?.unsqueeze(0)?;
        let mut pos = 0;
        let mut out: Vec<u32> = Vec::new();
        for (token, _, _) in &got {
            let local: Vec<f32> = model.forward(&x, pos)?.flatten_all()?.to_vec1()?;
            let mut full = vec![0f32; vocab];
            pg.all_gather_slice(&local, &mut full)
                .map_err(|e| candle_core::Error::msg(e.to_string()))?;
            let m = full.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
            let lse = m + full.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
            let lp: Vec<f64> = full.iter().map(|&v| v as f64 - lse).collect();
            let mut idx: Vec<usize> = (0..vocab).collect();
            idx.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
            let top = idx[..TOP_N].iter().map(|&i| (i as u32, lp[i])).collect();
            let mut pen = full.clone();
            penalise(&mut pen, &penalties, &PROMPT, &out);
            let want = argmax(&pen);
            dense.push((want, lp[*token as usize], top));
            out.push(*token);
            pos += x.dims()[1];
            x = Tensor::new(&[*token], &Device::Cpu)?.unsqueeze(0)?;
        }
        Ok((got, dense))
    })
    .unwrap();
    results.swap_remove(0)
}

fn compare(world: usize, penalties: Penalties) -> Vec<u32> {
    let (got, dense) = run(world, penalties.clone());
    assert_eq!(got.len(), NEW_TOKENS, "world {world}");
    for (i, ((token, lp, top), (want, dlp, dtop))) in got.iter().zip(&dense).enumerate() {
        let what = format!("world {world}, {penalties:?}, token {i}");
        assert_eq!(token, want, "{what}: the penalised argmax");
        assert!(lp.is_finite(), "{what}: logprob {lp}");
        assert!((lp - dlp).abs() <= 1e-5, "{what}: logprob {lp} vs {dlp}");
        assert_eq!(top.len(), TOP_N, "{what}");
        for ((gi, gv), (di, dv)) in top.iter().zip(dtop) {
            assert!(gv.is_finite(), "{what}: {gv}");
            assert_eq!(gi, di, "{what}: top {top:?} vs {dtop:?}");
            assert!((gv - dv).abs() <= 1e-5, "{what}: top {gi}: {gv} vs {dv}");
        }
    }
    got.into_iter().map(|g| g.0).collect()
}

#[test]
fn logprobs_and_penalties_through_the_decoder_equal_dense_ones() {
    let plain = compare(1, Penalties::default());
    let penalties = Penalties {
        presence: 0.8,
        frequency: 0.6,
        repetition: 1.4,
        logit_bias: vec![(plain[2], -100.0), (28, 4.0)],
    };
    let world1 = compare(1, penalties.clone());
    assert_ne!(
        world1, plain,
        "the penalties change nothing: the test cannot fail"
    );
    let world2 = compare(2, penalties);
    assert_eq!(world2, world1, "worlds 1 and 2");
    compare(2, Penalties::default());
}
