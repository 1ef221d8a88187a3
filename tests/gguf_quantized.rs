//! The tensor-parallel Llama straight from GGUF files of SmolLM2-135M (9 heads, 3 KV heads):
//! the shipped Q4_1 file and Q4_0 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q6_K files written from it once
//! into the model cache by `common::smollm2_gguf`.
//!
//! Worlds 2 and 3 (uneven: 6 + 3 heads, 2 + 1 KV groups, and 3 + 3 + 3; the MLP's 1536
//! columns 768 + 768 and 512 + 512 + 512, in whole blocks of 32, Q5_0 / Q5_1's pairs of blocks
//! and the k-quants' super-blocks) against world 1, four prompts x 32 greedy tokens each:
//! the same ids, and the same last-position logits within [`TOL`] (measured: 0, bit for
//! bit). Row-parallel layers sum quantized products in f64 and all-reduce them in f64
//! (`candle_tp_kernels::f64_dot`); with candle's f32 sums, worlds 2 and 3 kept only 2 of 4
//! prompts identical (8-bit activation rounding turns an ulp into logit noise of ~1).

use std::path::PathBuf;

use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use candle_tp::models::FromCheckpoint;
use candle_tp::models::Llama;
use candle_tp::{run_threads, ProcessGroup};

fn gguf(dtype: GgmlDType) -> PathBuf {
    common::smollm2_gguf(dtype).expect("SmolLM2 GGUF (run scripts/fetch-models.sh)")
}

mod common;

/// Max |a - b|, after checking every value of both is finite (candle's `max` skips NaN).
fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    common::max_abs_diff(a, b).expect("finite logits of the same shape")
}

/// Four prompts of eight tokens, run as one batch of four sequences.
const PROMPTS: [[u32; 8]; 4] = [
    [504, 3575, 282, 4649, 314, 253, 1978, 28],
    [1, 9690, 198, 2683, 418, 253, 5356, 11173],
    [20, 3056, 30, 28, 216, 33, 30, 28],
    [7086, 1143, 8506, 579, 260, 2361, 30, 216],
];
const NEW_TOKENS: usize = 32;
/// Logit tolerance against world 1: the f64 sums round to the same f32 values at every
/// world except where a sum lies within ~1e-16 of an f32 rounding boundary.
const TOL: f32 = 1e-3;

/// Greedy run of the four prompts as one batch.
struct Run {
    /// Ids `[prompt][step]`.
    ids: Vec<Vec<u32>>,
    /// The last step's full logits `[prompt, vocab]`.
    logits: Tensor,
}

fn greedy(model: &mut Llama) -> candle_core::Result<Run> {
    model.clear_kv_cache();
    let mut ids = vec![Vec::new(); PROMPTS.len()];
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
        x = Tensor::new(next.as_slice(), &Device::Cpu)?.unsqueeze(1)?;
        logits = Some(l);
    }
    Ok(Run {
        ids,
        logits: logits.expect("logits"),
    })
}

#[test]
fn worlds_two_and_three_generate_the_ids_of_world_one() -> anyhow::Result<()> {
    for dtype in common::quantized::LLAMA_GGUF_TYPES {
        let path = gguf(dtype);
        let mut one = Llama::from_gguf(&path, &Device::Cpu, ProcessGroup::single())?;
        let want = greedy(&mut one)?;
        drop(one);
        for world in [2, 3] {
            let got = run_threads(world, |pg| {
                let mut m = Llama::from_gguf(&path, &Device::Cpu, pg)?;
                // The layout these worlds are meant to test: the attention's split by whole
                // KV groups, the MLP's even (see `an_uneven_quantized_mlp_split_...`).
                let q_heads = m.attention(0).expect("layer 0").heads().q_heads.len();
                let mlp = m
                    .decoder()
                    .mlp(0)
                    .expect("a gated MLP")
                    .down_proj()
                    .in_partition();
                let columns: &[usize] = if world == 3 {
                    &[512, 512, 512]
                } else {
                    &[768, 768]
                };
                let heads: &[usize] = if world == 2 { &[6, 3] } else { &[3, 3, 3] };
                assert_eq!(q_heads, heads[m.pg().rank()], "{dtype:?} world {world}");
                assert_eq!(mlp.sizes(), columns, "{dtype:?} world {world}");
                greedy(&mut m)
            })?;
            for (rank, run) in got.iter().enumerate() {
                for (p, (ids, want_ids)) in run.ids.iter().zip(&want.ids).enumerate() {
                    assert_eq!(
                        ids, want_ids,
                        "{dtype:?} world {world} rank {rank} prompt {p}: greedy ids differ from world 1's"
                    );
                }
                let worst = max_diff(&run.logits, &want.logits);
                if rank == 0 {
                    eprintln!("{dtype:?} world {world}: 4 of 4 prompts x {NEW_TOKENS} tokens identical; last-position logits within {worst:.2e} of world 1");
                }
                assert!(
                    worst <= TOL,
                    "{dtype:?} world {world} rank {rank}: logits differ by {worst}"
                );
            }
        }
    }
    Ok(())
}

/// An uneven split of a quantized MLP sums the bits of one rank: layer 0's gated MLP of every
/// file, loaded at world 2 with 384 intermediate columns' worth of other work on rank 0
/// (`GatedMlp::load_balanced`: 576 + 960 columns in blocks of 32 and in pairs of blocks,
/// 512 + 1024 in super-blocks), against the same MLP on one rank, on 3 rows. The
/// row-parallel down projection sums each rank's blocks in f64 and all-reduces in f64, so an
/// uneven cut changes no bit (tolerance [`TOL`] all the same).
#[test]
fn an_uneven_quantized_mlp_split_sums_the_bits_of_one_rank() -> anyhow::Result<()> {
    use candle_core::DType;
    use candle_nn::{Activation, Module};
    use candle_tp::loader::ShardedVarBuilder;
    use candle_tp::nn::GatedMlp;
    let (hidden, inter) = (576, 1536);
    let names = ["gate_proj", "up_proj", "down_proj"];
    let x = Tensor::randn(0f32, 1.0, (1, 3, hidden), &Device::Cpu)?;
    for dtype in common::quantized::LLAMA_GGUF_TYPES {
        let path = gguf(dtype);
        let mlp = |pg: ProcessGroup, balance| -> candle_core::Result<GatedMlp> {
            let vb = ShardedVarBuilder::from_gguf(&path, DType::F32, &Device::Cpu, pg)?;
            let vb = vb.pp("model.layers.0.mlp");
            GatedMlp::load_balanced(hidden, inter, Activation::Silu, names, balance, vb)
        };
        let want = mlp(ProcessGroup::single(), (0, 0.0))?.forward(&x)?;
        let columns: &[usize] = match dtype {
            GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K => &[512, 1024],
            _ => &[576, 960],
        };
        let got = run_threads(2, |pg| {
            let m = mlp(pg, (1, 384.0))?;
            assert_eq!(m.down_proj().in_partition().sizes(), columns, "{dtype:?}");
            m.forward(&x)
        })?;
        for (rank, y) in got.iter().enumerate() {
            let worst = max_diff(y, &want);
            assert!(
                worst <= TOL,
                "{dtype:?} rank {rank}: the uneven MLP differs from one rank's by {worst}"
            );
        }
    }
    Ok(())
}
