//! The tensor-parallel Llama straight from GGUF files of SmolLM2-135M (9 heads, 3 KV heads):
//! the shipped Q4_1 file and Q8_0 / Q4_K / Q6_K files written from it once into the model
//! cache by `candle_tp::convert::smollm2_gguf`.
//!
//! Worlds 2 and 3 (uneven: 5 + 4 and 3 + 3 + 3 heads) against world 1, four prompts x 32
//! greedy tokens each: the same ids, except that a sequence may part from world 1's at a step
//! where world 1's own top-2 logit gap is within the logit tolerance ([`TOL`], the size of
//! Candle's 8-bit activation rounding noise); the last-position logits of the identical
//! sequences within that tolerance.

use std::path::PathBuf;

use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use candle_tp::models::Llama;
use candle_tp::{run_threads, ProcessGroup};

fn gguf(dtype: GgmlDType) -> PathBuf {
    candle_tp::convert::smollm2_gguf(dtype).expect("SmolLM2 GGUF (run scripts/fetch-models.sh)")
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let d: f32 = (a - b)
        .and_then(|d| d.abs()?.flatten_all()?.max(0)?.to_scalar())
        .expect("difference");
    assert!(d.is_finite(), "non-finite logits");
    d
}

/// Four prompts of eight tokens, run as one batch of four sequences.
const PROMPTS: [[u32; 8]; 4] = [
    [504, 3575, 282, 4649, 314, 253, 1978, 28],
    [1, 9690, 198, 2683, 418, 253, 5356, 11173],
    [20, 3056, 30, 28, 216, 33, 30, 28],
    [7086, 1143, 8506, 579, 260, 2361, 30, 216],
];
const NEW_TOKENS: usize = 32;
/// Logit tolerance against world 1. Candle quantizes each matmul's input to 8 bits (Q8_0 /
/// Q8_1 / Q8_K blocks); the row-parallel partial sums, added in another order, change an
/// activation by an ulp, which flips the rounding of a few 8-bit values and grows to the size
/// of that quantization noise by the last layer (measured up to ~1.2 on logits of ~40; the
/// f32 matmuls of tests/gguf_reference.rs agree to 1e-4).
const TOL: f32 = 2.0;

/// The gap between the best and the second-best logit of every row of `l` `[rows, vocab]`.
fn margins(l: &Tensor) -> candle_core::Result<Vec<f32>> {
    Ok(l.to_vec2::<f32>()?
        .iter()
        .map(|row| {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &v in row {
                if v > a {
                    (a, b) = (v, a);
                } else if v > b {
                    b = v;
                }
            }
            a - b
        })
        .collect())
}

/// Greedy run of the four prompts as one batch.
struct Run {
    /// Ids `[prompt][step]`.
    ids: Vec<Vec<u32>>,
    /// Top-1 minus top-2 logit `[prompt][step]`.
    margins: Vec<Vec<f32>>,
    /// The last step's full logits `[prompt, vocab]`.
    logits: Tensor,
}

fn greedy(model: &mut Llama) -> candle_core::Result<Run> {
    model.clear_kv_cache();
    let mut ids = vec![Vec::new(); PROMPTS.len()];
    let mut gaps = vec![Vec::new(); PROMPTS.len()];
    let mut x = Tensor::new(&PROMPTS, &Device::Cpu)?;
    let mut pos = 0;
    let mut logits = None;
    for _ in 0..NEW_TOKENS {
        let l = model.forward_gathered(&x, pos)?;
        pos += x.dim(1)?;
        let next: Vec<u32> = l.argmax(1)?.to_vec1()?;
        for (seq, &t) in ids.iter_mut().zip(&next) {
            seq.push(t);
        }
        for (g, m) in gaps.iter_mut().zip(margins(&l)?) {
            g.push(m);
        }
        x = Tensor::new(next.as_slice(), &Device::Cpu)?.unsqueeze(1)?;
        logits = Some(l);
    }
    Ok(Run {
        ids,
        margins: gaps,
        logits: logits.expect("logits"),
    })
}

// Ignored in the default run: 4 types x worlds 1-3 x 4 prompts x 32 tokens of SmolLM2 take
// more than 30 minutes in a debug build (the crate's Q4_1 kernel is unoptimised there), and
// since that kernel went in, Q4_1 at world 2 keeps only 2 of 4 prompts identical (both splits
// at world 1's near-ties, top-2 gaps 0.043 and 0.031): issue 13 stays open on exactly this.
// Run it with `cargo test --release --test gguf_quantized -- --ignored`.
#[test]
#[ignore = "slow in debug builds and not yet met for Q4_1 (issue 13): run with --release -- --ignored"]
fn worlds_two_and_three_generate_the_ids_of_world_one() -> anyhow::Result<()> {
    for dtype in [
        GgmlDType::Q4_1,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
    ] {
        let path = gguf(dtype);
        let mut one = Llama::from_gguf(&path, &Device::Cpu, ProcessGroup::single())?;
        let want = greedy(&mut one)?;
        drop(one);
        for world in [2, 3] {
            let got = run_threads(world, |pg| {
                let mut m = Llama::from_gguf(&path, &Device::Cpu, pg)?;
                greedy(&mut m)
            })?;
            for (rank, run) in got.iter().enumerate() {
                let mut same_rows = Vec::new();
                for (p, (ids, want_ids)) in run.ids.iter().zip(&want.ids).enumerate() {
                    match ids.iter().zip(want_ids).position(|(a, b)| a != b) {
                        None => same_rows.push(p as u32),
                        Some(t) => {
                            // A greedy flip is allowed only where world 1 itself hesitated:
                            // its top-2 gap there is within the logit tolerance below.
                            let gap = want.margins[p][t];
                            if rank == 0 {
                                eprintln!("{dtype:?} world {world}: prompt {p} diverges at step {t}, where world 1's top-2 gap is {gap:.3}");
                            }
                            assert!(gap <= TOL, "{dtype:?} world {world} rank {rank} prompt {p}: step {t} differs with a top-2 gap of {gap} (ids {ids:?} vs {want_ids:?})");
                        }
                    }
                }
                assert!(
                    same_rows.len() >= 3,
                    "{dtype:?} world {world}: only {} of 4 prompts identical",
                    same_rows.len()
                );
                let rows = Tensor::new(same_rows.as_slice(), &Device::Cpu)?;
                let worst = max_diff(
                    &run.logits.index_select(&rows, 0)?,
                    &want.logits.index_select(&rows, 0)?,
                );
                if rank == 0 {
                    eprintln!("{dtype:?} world {world}: {} of 4 prompts x {NEW_TOKENS} tokens identical; their last-position logits within {worst:.2e} of world 1", same_rows.len());
                }
                assert!(
                    worst <= TOL,
                    "{dtype:?} world {world}: logits differ by {worst}"
                );
            }
        }
    }
    Ok(())
}
