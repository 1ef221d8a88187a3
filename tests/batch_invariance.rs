//! Batch invariance of the continuous batch (issue 24, defect 5), on the real
//! SmolLM2-135M-Instruct checkpoint with the batch-invariant kernels on (as candle-tp-serve
//! runs): a sequence decoding in the same step as a 64-token prompt chunk (and as another
//! prompt joining at the same time) gets bit-identical logits, hence log-probabilities, at
//! every step to the same sequence decoded alone; and the prompts read beside it get the
//! logits of the same prompts read alone. Worlds 1 and 2 (threads), f32 safetensors (each
//! prompt chunk in a forward pass of its own) and the Q4_1 GGUF (the prompt chunks in the
//! decode's pass: its products give a row the same bits at any row count). Its own test
//! binary:
//! `set_batch_invariant_matmul` is process-wide.

use std::path::PathBuf;

use anyhow::{ensure, Result};
use candle_core::{DType, Device};
use candle_tp::generate::{
    BatchDecoder, SamplingParams, SeqOptions, SeqRequest, TokenEvent, TokenLogprobs,
};
use candle_tp::models::CausalLm;
use candle_tp::run_threads;

/// SmolLM2's converted safetensors directory and its Q4_1 GGUF file.
fn checkpoints() -> [PathBuf; 2] {
    let models = candle_tp::models::models_dir().expect("models directory");
    let paths = [
        models.join("smollm2-135m-instruct"),
        models.join("smollm2-135m-instruct.Q4_1.gguf"),
    ];
    for p in &paths {
        assert!(
            p.exists(),
            "{} is missing: run scripts/fetch-models.sh",
            p.display()
        );
    }
    paths
}

/// `n` token ids of SmolLM2's vocabulary, varied (a fixed pattern, not the code under test).
fn ids(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 200 + (i * 7919 + salt * 104_729) % 40_000)
        .collect()
}

const A_TOKENS: usize = 10;
/// The step (of A's decoding) at which B and C join.
const JOIN_AT: usize = 3;

fn request(id: u64, prompt: Vec<u32>, max_tokens: usize, params: SamplingParams) -> SeqRequest {
    SeqRequest {
        id,
        prompt,
        max_tokens,
        min_tokens: 0,
        params,
        stop_ids: Vec::new(),
        options: SeqOptions {
            logprobs: Some(4),
            ..Default::default()
        },
    }
}

/// A: greedy, a 6-token prompt. B: a 100-token prompt (chunks of 64 and 36), sampled.
/// C: a 20-token prompt, greedy; it joins with B and cannot share B's first chunk's step.
fn requests() -> [SeqRequest; 3] {
    let sampled = SamplingParams {
        temperature: 0.8,
        top_k: None,
        top_p: None,
        seed: 5,
    };
    [
        request(0, ids(6, 1), A_TOKENS, SamplingParams::greedy()),
        request(1, ids(100, 2), 5, sampled),
        request(2, ids(20, 3), 5, SamplingParams::greedy()),
    ]
}

type Run = Vec<Vec<(u32, TokenLogprobs)>>;

fn record(out: &mut Run, events: &[TokenEvent]) -> Result<()> {
    for e in events {
        let lp = e.logprobs.clone().expect("log-probabilities asked for");
        ensure!(
            lp.logprob.is_finite() && lp.top.iter().all(|(_, v)| v.is_finite()),
            "non-finite log-probabilities: {lp:?}"
        );
        out[e.id as usize].push((e.token, lp));
    }
    Ok(())
}

fn until_done(dec: &mut BatchDecoder, model: &mut CausalLm, out: &mut Run) -> Result<()> {
    let mut steps = 0;
    while !dec.is_empty() {
        let events = dec.step(model)?;
        record(out, &events)?;
        steps += 1;
        ensure!(steps < 200, "the batch did not finish");
    }
    Ok(())
}

/// Each request decoded alone.
fn alone(model: &mut CausalLm) -> Result<Run> {
    let mut out: Run = vec![Vec::new(); 3];
    for req in requests() {
        let mut dec = BatchDecoder::new(4, 2048, 64)?;
        dec.add(model, req)?;
        until_done(&mut dec, model, &mut out)?;
    }
    Ok(out)
}

/// A decoding; at its step `JOIN_AT` B and C join: the next step runs A's token beside B's
/// first 64-token chunk (checked: A gets a token from it, B and C none), the one after A's
/// beside B's last 36 and C's 20. Also the forward passes those two steps ran.
fn together(model: &mut CausalLm) -> Result<(Run, [u64; 2])> {
    let [a, b, c] = requests();
    let mut out: Run = vec![Vec::new(); 3];
    let mut dec = BatchDecoder::new(4, 2048, 64)?;
    dec.add(model, a)?;
    for _ in 0..JOIN_AT {
        let events = dec.step(model)?;
        record(&mut out, &events)?;
    }
    dec.add(model, b)?;
    dec.add(model, c)?;
    let before = dec.forward_passes();
    let events = dec.step(model)?;
    let first = dec.forward_passes() - before;
    let who: Vec<u64> = events.iter().map(|e| e.id).collect();
    ensure!(
        who == [0],
        "the step with B's first chunk gave tokens to {who:?}, expected A alone"
    );
    record(&mut out, &events)?;
    let before = dec.forward_passes();
    let events = dec.step(model)?;
    let second = dec.forward_passes() - before;
    let who: Vec<u64> = events.iter().map(|e| e.id).collect();
    ensure!(
        who == [0, 1, 2],
        "the step with B's and C's last chunks gave tokens to {who:?}"
    );
    record(&mut out, &events)?;
    until_done(&mut dec, model, &mut out)?;
    Ok((out, [first, second]))
}

#[test]
fn decode_beside_a_prefill_chunk_is_bit_identical() -> Result<()> {
    candle_tp::set_batch_invariant_matmul(true);
    for (dir, world) in checkpoints()
        .into_iter()
        .flat_map(|p| [(p.clone(), 1), (p, 2)])
    {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let results = run_threads(world, move |pg| {
            let mut model = CausalLm::from_path(&dir, DType::F32, &Device::Cpu, pg)?;
            let e = candle_core::Error::msg;
            let want = alone(&mut model).map_err(e)?;
            let (got, passes) = together(&mut model).map_err(e)?;
            Ok::<_, candle_core::Error>((want, got, passes, model.rows_invariant()))
        })
        .map_err(|e| anyhow::anyhow!("{name}, world {world}: {e}"))?;
        let (want, got, passes, fused) = &results[0];
        // The path meant: the GGUF's products are all the crate's quantized kernels, so the
        // prompt chunks share A's pass (one pass a step); the f32 checkpoint's are not, so
        // each chunk runs alone (A's pass, B's chunk; then A's, B's and C's).
        let gguf = name.ends_with(".gguf");
        assert_eq!(*fused, gguf, "{name}: rows_invariant");
        let want_passes = if gguf { [1, 1] } else { [2, 3] };
        assert_eq!(
            *passes, want_passes,
            "{name}, world {world}: forward passes"
        );
        for (seq, (w, g)) in ["A", "B", "C"].iter().zip(want.iter().zip(got)) {
            assert!(
                !w.is_empty(),
                "{name}, world {world}: {seq} generated nothing"
            );
            assert_eq!(
                w.len(),
                g.len(),
                "{name}, world {world}: {seq}'s token count"
            );
            for (k, (w, g)) in w.iter().zip(g).enumerate() {
                // Bit equality: the f64 log-probabilities come from the f32 logits, so one
                // rounding difference there shows here.
                assert!(
                    w == g,
                    "{name}, world {world}: {seq}'s token {k}: alone {w:?}, in the batch {g:?}"
                );
            }
        }
        for (r, res) in results.iter().enumerate() {
            assert_eq!(
                res, &results[0],
                "{name}, world {world}: rank {r} differs from rank 0"
            );
        }
    }
    Ok(())
}
