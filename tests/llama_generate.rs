//! `examples/generate` as real processes on the converted SmolLM2: 2 and 3 ranks under
//! `tprun` give the same greedy tokens and prompt logits as 1 rank, and each of 3 ranks holds
//! at most 45 % of the 1-rank anonymous resident memory after loading.

mod common;

use std::path::{Path, PathBuf};

use serde_json::Value;

fn model_dir() -> PathBuf {
    let dir = candle_tp::models::models_dir()
        .expect("models directory")
        .join("smollm2-135m-instruct");
    assert!(
        dir.join("config.json").is_file() && dir.join("model.safetensors").is_file(),
        "the converted SmolLM2 checkpoint is missing from {}: run scripts/fetch-models.sh",
        dir.display()
    );
    dir
}

/// Runs generate on `nproc` ranks (directly for 1) and returns rank 0's final JSON line and
/// the prompt logits it wrote.
fn run(nproc: usize, logits: &Path) -> (Value, Vec<f32>) {
    let args = [
        "--model".to_string(),
        model_dir().display().to_string(),
        "--max-new-tokens".into(),
        "8".into(),
        "--prompt".into(),
        "The capital of France is".into(),
        "--logits-out".into(),
        logits.display().to_string(),
    ];
    let v = common::run_generate(nproc, &args);
    let l: Vec<f32> =
        serde_json::from_slice(&std::fs::read(logits).expect("logits file")).expect("logits JSON");
    (v, l)
}

#[test]
fn generate_under_tprun_matches_one_rank() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let (one, l1) = run(1, &tmp.path().join("l1.json"));
    assert_eq!(one["world_size"], 1);
    assert_eq!(one["generated_tokens"], 8, "{one}");
    assert_eq!(l1.len(), 49152);
    let rss1 = one["rss_bytes"][0].as_f64().expect("rss of rank 0");
    for n in [2, 3] {
        let (v, l) = run(n, &tmp.path().join(format!("l{n}.json")));
        assert_eq!(v["world_size"], n, "{v}");
        assert_eq!(
            v["token_ids"], one["token_ids"],
            "{n} ranks: {v} vs 1 rank: {one}"
        );
        assert_eq!(v["prompt_tokens"], one["prompt_tokens"]);
        let err = l
            .iter()
            .zip(&l1)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err <= 1e-3, "{n} ranks: prompt logits differ by {err}");
        let rss = v["rss_bytes"].as_array().expect("rss_bytes array");
        assert_eq!(rss.len(), n);
        if n == 3 {
            for (r, b) in rss.iter().enumerate() {
                let frac = b.as_f64().expect("rss number") / rss1;
                assert!(
                    frac <= 0.45,
                    "rank {r} of 3 holds {frac:.2} of the 1-rank RSS: {v}"
                );
            }
        }
    }
}
