//! Quantized mixture-of-experts GGUF files (issue 45, item 3) with the products in f32:
//! under candle's `CANDLE_DEQUANTIZE_ALL` every quantized weight is dequantized before it
//! multiplies, so a Q8_0 or Q4_0 file must give, to float rounding, what candle-transformers'
//! `mixtral` / `qwen3_moe` give on a checkpoint of the file's blocks dequantized. That checks
//! the block-by-block reading of the 3-D expert tensors (each expert a byte range of them),
//! the row and column shards of quantized experts (tensor-parallel at 2) and whole quantized
//! experts (expert-parallel at 2 and 4), with nothing lost to the rounding of activations.
//!
//! This file holds one test on purpose: the environment variable must not reach other tests
//! (`gguf_moe.rs` runs the same files on the quantized kernels).

mod common;

use anyhow::Result;
use candle_core::quantized::GgmlDType;
use candle_tp::convert::ExpertLayout;
use common::families::{check_worlds_with, write_checkpoint};
use common::moe_gguf::*;

#[test]
fn quantized_moe_gguf_matches_candle_transformers_on_its_dequantized_weights() -> Result<()> {
    // SAFETY: the only test of this binary, before any thread of it reads the environment.
    unsafe { std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1") };
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let w = mixtral_weights()?;
        let dir = write_checkpoint(&mixtral_config(), &w)?;
        let gguf = write_gguf(dir.path(), "m.gguf", dtype, ExpertLayout::Stacked)?;
        let deq = write_checkpoint(&mixtral_config(), &dequantized(&w, dtype)?)?;
        let expected = mixtral_reference(deq.path())?;
        eprintln!("Mixtral {dtype:?}:");
        check_worlds_with(&gguf, &expected, &[1, 2], 1e-4, None)?;
        check_worlds_with(&gguf, &expected, &[2, 4], 1e-4, Some(0))?;
        check_worlds_with(&gguf, &expected, &[4], 1e-4, Some(2))?;

        let w = qwen_weights()?;
        let dir = write_checkpoint(&qwen_config(), &w)?;
        let gguf = write_gguf(dir.path(), "q.gguf", dtype, ExpertLayout::Stacked)?;
        let deq = write_checkpoint(&qwen_config(), &dequantized(&w, dtype)?)?;
        let expected = qwen_reference(deq.path())?;
        eprintln!("Qwen3-MoE {dtype:?}:");
        check_worlds_with(&gguf, &expected, &[1, 2], 1e-4, None)?;
        check_worlds_with(&gguf, &expected, &[2, 4], 1e-4, Some(0))?;
        check_worlds_with(&gguf, &expected, &[4], 1e-4, Some(2))?;
    }
    Ok(())
}
