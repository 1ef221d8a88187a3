//! Mixture-of-experts GGUF files (issue 45, item 3): Mixtral (`llama` with `expert_count`)
//! and Qwen3-MoE (`qwen3moe`), their experts stacked in 3-D tensors (`ffn_gate_exps`) or,
//! for Mixtral, one matrix per expert (`ffn_gate.N`), written from random Hugging Face
//! checkpoints by `convert::hf_to_gguf` and read back block by block.
//!
//! - F32 files against candle-transformers' `mixtral` / `qwen3_moe` on the safetensors they
//!   were written from, at worlds 1-2 tensor-parallel and 2-4 expert-parallel.
//! - Q8_0 files on the crate's quantized kernels: tensor-parallel at 2 and expert-parallel at
//!   2 and 4 against world 1 (the same greedy ids, logits within 1e-4).
//! - The Q8_0 Mixtral with one matrix per expert against candle-transformers'
//!   `quantized_llama` on the same file (an independent reader of the names, the rotary
//!   permutation and the per-expert layout), and the stacked file bit for bit against it.
//! - An expert-parallel rank holds only its own experts.
//!
//! `gguf_moe_dequantized.rs` checks the quantized files against candle-transformers on their
//! dequantized weights, with the products in f32.

mod common;

use anyhow::{bail, Result};
use candle_core::quantized::gguf_file;
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor, D};
use candle_tp::convert::ExpertLayout;
use candle_tp::models::FromCheckpoint;
use candle_transformers::models::quantized_llama;
use common::families::{write_checkpoint, PROMPT};
use common::max_abs_diff;
use common::moe_gguf::*;

#[test]
fn mixtral_f32_gguf_matches_candle_transformers() -> Result<()> {
    let dir = write_checkpoint(&mixtral_config(), &mixtral_weights()?)?;
    let gguf = write_gguf(dir.path(), "m.gguf", GgmlDType::F32, ExpertLayout::Stacked)?;
    let expected = mixtral_reference(dir.path())?;
    common::families::check_worlds_with(&gguf, &expected, &[1, 2], 1e-4, None)?;
    common::families::check_worlds_with(&gguf, &expected, &[2, 4], 1e-4, Some(0))?;
    // ep 2 x tp 2: two groups of two ranks, each expert split over its group's two.
    common::families::check_worlds_with(&gguf, &expected, &[4], 1e-4, Some(2))?;
    Ok(())
}

#[test]
fn qwen3_moe_f32_gguf_matches_candle_transformers() -> Result<()> {
    let dir = write_checkpoint(&qwen_config(), &qwen_weights()?)?;
    let gguf = write_gguf(dir.path(), "q.gguf", GgmlDType::F32, ExpertLayout::Stacked)?;
    let expected = qwen_reference(dir.path())?;
    common::families::check_worlds_with(&gguf, &expected, &[1, 2], 1e-4, None)?;
    common::families::check_worlds_with(&gguf, &expected, &[2, 4], 1e-4, Some(0))?;
    // ep 2 x tp 2: two groups of two ranks, each expert split over its group's two.
    common::families::check_worlds_with(&gguf, &expected, &[4], 1e-4, Some(2))?;
    Ok(())
}

/// The largest difference from candle-transformers' `quantized_llama`, as a fraction of its
/// largest logit: both round the activations to 8 bits before each Q8_0 product, but not at
/// the same values (f64 sums here, the rotary embedding on rows put back in Hugging Face
/// order there interleaved), and a token whose top-2 experts are close can take another
/// expert. Measured 2.96e-2 on logits up to 4.5 (Zen 5).
const Q8_TOL: f32 = 0.04;

#[test]
fn qwen3_moe_q8_0_gguf_in_parallel_matches_world_1() -> Result<()> {
    let dir = write_checkpoint(&qwen_config(), &qwen_weights()?)?;
    let gguf = write_gguf(
        dir.path(),
        "q8.gguf",
        GgmlDType::Q8_0,
        ExpertLayout::Stacked,
    )?;
    let one = run(&gguf, 1, None)?;
    common::families::assert_finite(&one.all, "qwen3moe Q8_0 world 1")?;
    parallel_against_world1(&gguf, &one, "qwen3moe Q8_0")
}

#[test]
fn mixtral_q8_0_gguf_matches_quantized_llama_in_both_layouts() -> Result<()> {
    let dir = write_checkpoint(&mixtral_config(), &mixtral_weights()?)?;
    let stacked = write_gguf(dir.path(), "s.gguf", GgmlDType::Q8_0, ExpertLayout::Stacked)?;
    let split = write_gguf(
        dir.path(),
        "p.gguf",
        GgmlDType::Q8_0,
        ExpertLayout::PerExpert,
    )?;
    let one = run(&stacked, 1, None)?;
    common::families::assert_finite(&one.all, "Mixtral Q8_0 world 1")?;
    // The two layouts hold the same blocks: the same logits, bit for bit.
    let per_expert = run(&split, 1, None)?;
    let diff = max_abs_diff(&per_expert.all, &one.all)?;
    if diff != 0.0 {
        bail!("one matrix per expert against stacked experts: logits differ by {diff}");
    }
    // candle-transformers' quantized_llama reads the per-expert file on its own.
    let mut f = std::fs::File::open(&split)?;
    let content = gguf_file::Content::read(&mut f)?;
    let mut theirs = quantized_llama::ModelWeights::from_gguf(content, &mut f, &Device::Cpu)?;
    let x = Tensor::new(&PROMPT[..], &Device::Cpu)?.unsqueeze(0)?;
    let last = theirs.forward(&x, 0)?.squeeze(0)?;
    let ours = one.all.get(PROMPT.len() - 1)?;
    let err = max_abs_diff(&ours, &last)?;
    let tol = Q8_TOL * max_abs_diff(&last, &last.zeros_like()?)?;
    eprintln!("Mixtral Q8_0: max |last logits - quantized_llama| {err:.2e} (tolerance {tol:.2e})");
    if err > tol {
        bail!("Mixtral Q8_0: last logits differ from quantized_llama by {err} (> {tol})");
    }
    if ours.argmax(D::Minus1)?.to_scalar::<u32>()? != last.argmax(D::Minus1)?.to_scalar::<u32>()? {
        bail!("Mixtral Q8_0: a different next token from quantized_llama");
    }
    parallel_against_world1(&stacked, &one, "Mixtral Q8_0")
}

/// An expert-parallel rank holds only its own experts (5 over 2 ranks: 3 and 2), each whole,
/// read from the stacked tensors.
#[test]
fn expert_parallel_ranks_hold_only_their_experts() -> Result<()> {
    let dir = write_checkpoint(&mixtral_config(), &mixtral_weights()?)?;
    let gguf = write_gguf(dir.path(), "s.gguf", GgmlDType::Q8_0, ExpertLayout::Stacked)?;
    let held = candle_tp::run_threads(2, move |pg| {
        let options = candle_tp::models::LoadOptions {
            expert_parallel: Some(0),
            ..Default::default()
        };
        let m = candle_tp::models::CausalLm::from_path_with(
            &gguf,
            candle_core::DType::F32,
            &Device::Cpu,
            pg,
            options,
        )?;
        let moe = m.moe(0).expect("a mixture-of-experts layer");
        Ok((moe.experts().len(), moe.expert_owners().map(|o| o.range(0))))
    })?;
    assert_eq!(held, vec![(3, Some(0..3)), (2, Some(0..3))]);
    Ok(())
}

/// `path` rewritten with metadata `key` set to `value`.
fn with_metadata(path: &std::path::Path, key: &str, value: u32) -> Result<std::path::PathBuf> {
    let mut f = std::fs::File::open(path)?;
    let content = gguf_file::Content::read(&mut f)?;
    let mut md = content.metadata.clone();
    md.insert(key.to_string(), gguf_file::Value::U32(value));
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort_by_key(|n| content.tensor_infos[*n].offset);
    let tensors = names
        .into_iter()
        .map(|n| Ok((n.clone(), content.tensor(&mut f, n, &Device::Cpu)?)))
        .collect::<Result<Vec<_>>>()?;
    let out = path.with_extension(format!("{value}.gguf"));
    let mut w = std::io::BufWriter::new(std::fs::File::create(&out)?);
    let md: Vec<_> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<_> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut w, &md, &ts)?;
    Ok(out)
}

/// Metadata that disagrees with the expert tensors is an error naming the file, the key or
/// the tensor, and the sizes.
#[test]
fn bad_expert_metadata_gives_clear_errors() -> Result<()> {
    let dir = write_checkpoint(&mixtral_config(), &mixtral_weights()?)?;
    let gguf = write_gguf(dir.path(), "s.gguf", GgmlDType::Q8_0, ExpertLayout::Stacked)?;
    let err = |p: &std::path::Path| match candle_tp::loader::GgufSource::open(p) {
        Ok(_) => String::from("<opened without error>"),
        Err(e) => e.to_string(),
    };
    let e = err(&with_metadata(&gguf, "llama.expert_count", 4)?);
    assert!(
        e.contains("s.4.gguf")
            && e.contains("blk.")
            && e.contains("[5, 128]")
            && e.contains("[4, 128]"),
        "{e}"
    );
    let e = err(&with_metadata(&gguf, "llama.expert_used_count", 9)?);
    assert!(
        e.contains("llama.expert_used_count = 9") && e.contains("1..=5"),
        "{e}"
    );
    let e = err(&with_metadata(&gguf, "llama.expert_count", 0)?);
    assert!(
        e.contains(
            "blk.0.ffn_gate_inp.weight (shape [5, 128]) has no Hugging Face LlamaForCausalLM"
        ),
        "{e}"
    );
    Ok(())
}

/// The command line: `examples/generate --model FILE.gguf --ep 2` on 4 ranks under tprun
/// (ep 2 x tp 2) and `--ep` on 2 ranks give world 1's greedy tokens and prompt logits.
#[test]
fn generate_cli_with_ep_gives_world_1_tokens() -> Result<()> {
    let dir = write_checkpoint(&mixtral_config(), &mixtral_weights()?)?;
    let gguf = write_gguf(dir.path(), "m.gguf", GgmlDType::Q8_0, ExpertLayout::Stacked)?;
    let run = |nproc: usize, ep: &[&str], logits: &str| {
        let mut args: Vec<String> = [
            "--model",
            &gguf.display().to_string(),
            "--max-new-tokens",
            "8",
            "--prompt",
            "ab a b ab",
            "--logits-out",
            &dir.path().join(logits).display().to_string(),
        ]
        .map(String::from)
        .to_vec();
        args.extend(ep.iter().map(|s| s.to_string()));
        let v = common::run_generate(nproc, &args);
        let l: Vec<f32> = serde_json::from_slice(&std::fs::read(dir.path().join(logits))?)?;
        anyhow::Ok((v, l))
    };
    let (one, l1) = run(1, &[], "l1.json")?;
    assert_eq!(one["generated_tokens"], 8, "{one}");
    assert!(l1.len() == VOCAB && l1.iter().all(|v| v.is_finite()));
    for (nproc, ep) in [(4, &["--ep", "2"][..]), (2, &["--ep"][..])] {
        let (v, l) = run(nproc, ep, "l.json")?;
        assert_eq!(v["world_size"], nproc, "{v}");
        assert_eq!(
            v["token_ids"], one["token_ids"],
            "{nproc} ranks {ep:?}: {v}"
        );
        let d = l
            .iter()
            .zip(&l1)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            d <= 1e-4,
            "{nproc} ranks {ep:?}: prompt logits differ by {d}"
        );
    }
    Ok(())
}

/// Per token, its experts and routing weights, from `SparseMoe::route`'s per-expert lists.
fn by_token(route: &[(Vec<u32>, Vec<f32>)], tokens: usize) -> Vec<Vec<(usize, f32)>> {
    let mut out = vec![Vec::new(); tokens];
    for (e, (rows, weights)) in route.iter().enumerate() {
        for (&r, &w) in rows.iter().zip(weights) {
            out[r as usize].push((e, w));
        }
    }
    out
}

/// Mixtral's routing of router `logits` `[tokens, experts]`, written out here: softmax, the
/// `k` largest (ties to the lower index), renormalised.
fn reference_routing(logits: &Tensor, k: usize) -> Result<Vec<Vec<(usize, f32)>>> {
    let rows: Vec<Vec<f32>> = logits.to_vec2()?;
    Ok(rows
        .iter()
        .map(|l| {
            let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let p: Vec<f64> = l.iter().map(|&v| ((v - m) as f64).exp()).collect();
            let mut order: Vec<usize> = (0..l.len()).collect();
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            let top = &order[..k];
            let sum: f64 = top.iter().map(|&e| p[e]).sum();
            let mut chosen: Vec<(usize, f32)> =
                top.iter().map(|&e| (e, (p[e] / sum) as f32)).collect();
            chosen.sort_by_key(|&(e, _)| e);
            chosen
        })
        .collect())
}

/// The largest weight difference between two routings, or `None` if any token's experts
/// differ.
fn routing_diff(a: &[Vec<(usize, f32)>], b: &[Vec<(usize, f32)>]) -> Option<f32> {
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(b) {
        if x.len() != y.len() || x.iter().zip(y).any(|(p, q)| p.0 != q.0) {
            return None;
        }
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p.1 - q.1).abs());
        }
    }
    Some(worst)
}

/// A router stored quantized (as some third-party converters leave `ffn_gate_inp`) is
/// multiplied as llama.cpp and candle-transformers' `quantized_llama` multiply it: on 8-bit
/// activations through the quantized kernels. Dequantizing it to an f32 product instead
/// moves every router logit by the activations' rounding, and near a tie picks another
/// expert than those engines do. The reference is candle's `QMatMul` on the file's blocks.
#[test]
fn a_quantized_router_multiplies_as_llama_cpp() -> Result<()> {
    let dir = write_checkpoint(&mixtral_config(), &mixtral_weights()?)?;
    let gguf = write_gguf_router(
        dir.path(),
        "r.gguf",
        GgmlDType::Q8_0,
        ExpertLayout::Stacked,
        true,
    )?;
    let mut f = std::fs::File::open(&gguf)?;
    let content = gguf_file::Content::read(&mut f)?;
    let router = content.tensor(&mut f, "blk.0.ffn_gate_inp.weight", &Device::Cpu)?;
    assert_eq!(router.dtype(), GgmlDType::Q8_0, "the file's router");
    let dense = router.dequantize(&Device::Cpu)?;
    let qmatmul = candle_core::quantized::QMatMul::from_qtensor(router)?;

    let tokens = 64;
    let x = Tensor::randn(0f32, 1f32, (tokens, MIXTRAL_HIDDEN), &Device::Cpu)?;
    let quantized = reference_routing(&candle_core::Module::forward(&qmatmul, &x)?, TOP_K)?;
    let float = reference_routing(&x.matmul(&dense.t()?)?, TOP_K)?;
    // The input must tell the two products apart, or the check below proves nothing.
    let apart = routing_diff(&quantized, &float).is_none_or(|d| d > 1e-4);
    assert!(apart, "the f32 and quantized products route alike to 1e-4");

    let m = candle_tp::models::CausalLm::from_path_with(
        &gguf,
        candle_core::DType::F32,
        &Device::Cpu,
        candle_tp::ProcessGroup::single(),
        Default::default(),
    )?;
    let moe = m.moe(0).expect("a mixture-of-experts layer");
    let ours = by_token(&moe.route(&x)?, tokens);
    // f32::max skips NaN: the weights must be finite before they are compared.
    let finite = ours.iter().flatten().all(|(_, w)| w.is_finite());
    assert!(
        finite,
        "quantized router: non-finite routing weights {ours:?}"
    );
    match routing_diff(&ours, &quantized) {
        Some(d) if d <= 1e-5 => {
            eprintln!("quantized router: routing weights within {d:.2e} of QMatMul's");
            Ok(())
        }
        Some(d) => bail!("quantized router: routing weights differ from QMatMul's by {d}"),
        None => bail!(
            "quantized router: other experts than QMatMul's routing (f32 product: {:?})",
            routing_diff(&ours, &float)
        ),
    }
}
