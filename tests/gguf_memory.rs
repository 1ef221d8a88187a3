//! Resident memory of `examples/generate` on SmolLM2 straight from its Q4_1 GGUF, measured as
//! the existing f32 test does (`RssAnon` of every rank after loading, reported by generate):
//! at 2 ranks each rank holds at most 60 % of the 1-rank memory, and at most a third of what a
//! rank of the f32 checkpoint holds at 2 ranks. The GGUF mapping itself is file-backed (not
//! counted): what counts is the quantized blocks each rank copied out of it.

mod common;

use std::path::Path;

fn rss(nproc: usize, model: &Path) -> Vec<f64> {
    let model = model.display().to_string();
    common::rss_of(nproc, &["--model", &model, "--max-new-tokens", "2"])
}

#[test]
fn quantized_ranks_hold_their_share_and_a_third_of_f32() {
    let models = candle_tp::models::models_dir().expect("models dir");
    let q = models.join("smollm2-135m-instruct.Q4_1.gguf");
    let f32_dir = models.join("smollm2-135m-instruct");
    let one = rss(1, &q)[0];
    let two = rss(2, &q);
    let f32_two = rss(2, &f32_dir);
    let mb = |b: f64| b / (1 << 20) as f64;
    eprintln!(
        "RssAnon MiB: Q4_1 world 1 {:.1}; world 2 {:?}; f32 world 2 {:?}",
        mb(one),
        two.iter()
            .map(|&b| format!("{:.1}", mb(b)))
            .collect::<Vec<_>>(),
        f32_two
            .iter()
            .map(|&b| format!("{:.1}", mb(b)))
            .collect::<Vec<_>>()
    );
    for (r, (&b, &f)) in two.iter().zip(&f32_two).enumerate() {
        assert!(
            b <= 0.6 * one,
            "rank {r}: {:.1} MiB at 2 ranks vs {:.1} MiB at 1",
            mb(b),
            mb(one)
        );
        assert!(
            b <= f / 3.0,
            "rank {r}: Q4_1 {:.1} MiB vs f32 {:.1} MiB at 2 ranks",
            mb(b),
            mb(f)
        );
    }
}
