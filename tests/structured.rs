//! Constrained decoding on vocabulary shards, without a model (random logits stand for one):
//!
//! - grammar masks on shards against a dense reference: a test filter allows a pseudo-random
//!   set of ids per step (sometimes one id, sometimes only the stop id); rank 0 shares its
//!   masks, every rank masks its shard, and the sampled ids at worlds 1, 2 and 3 equal those
//!   of the whole vocabulary masked by the test itself (greedy, temperature, top-k, top-p,
//!   penalties, `logit_bias` +100 on a masked id, `min_tokens`), and are always allowed;
//! - llguidance on SmolLM2's tokenizer: JSON schemas at temperature 1 over many seeds give
//!   text that parses and validates (checked by the test's own validator), the same ids at
//!   worlds 1 and 2; forced tool calls (`required`, a named function, Hermes and Llama 3
//!   formats) parse back into calls of the tools, with arguments valid against their schemas.
#![cfg(feature = "server")]

use candle_core::{Device, Result, Tensor};
use candle_tp::generate::{
    apply_penalties, mask_shard, sample_batch, share_masks, DistributedSampler, History,
    MaskRequest, Penalties, SamplingParams, TokenFilter,
};
use candle_tp::rng::{mix64, SplitMix64};
use candle_tp::serve::grammar::{GrammarSpec, Grammars};
use candle_tp::serve::tool_calls::parse_calls;
use candle_tp::serve::tools::{Function, ToolChoice, ToolFormat, Tools};
use candle_tp::serve::ModelText;
use candle_tp::{run_threads, Partition};
use serde_json::{json, Value};

mod common;

use common::json_schema::validate;

/// The allowed set of the test filter at `step`: every id whose hash is 0 mod 7; at every 5th
/// step one id alone; at every 7th step only the stop id.
fn allowed_rule(seed: u64, step: u64, id: usize, stop: u32) -> bool {
    match step % 35 {
        s if s % 7 == 6 => id == stop as usize,
        s if s % 5 == 4 => id as u64 == mix64(seed ^ step) % 1000,
        _ => mix64(seed.wrapping_mul(31) ^ (step << 20) ^ id as u64).is_multiple_of(7),
    }
}

/// A grammar whose allowed ids are [`allowed_rule`]'s; it fails the test if a token it did
/// not allow is committed.
#[derive(Debug)]
struct RuleFilter {
    seed: u64,
    step: u64,
    vocab: usize,
    stop: u32,
}

impl TokenFilter for RuleFilter {
    fn allowed(&mut self, bits: &mut [u32]) -> Result<()> {
        for id in 0..self.vocab {
            if allowed_rule(self.seed, self.step, id, self.stop) {
                bits[id / 32] |= 1 << (id % 32);
            }
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<()> {
        assert!(
            allowed_rule(self.seed, self.step, token as usize, self.stop),
            "step {}: token {token} was not allowed",
            self.step
        );
        self.step += 1;
        Ok(())
    }
}

/// Normal logits of `vocab` ids, the same for every rank.
fn logits(seed: u64, step: u64, vocab: usize, sigma: f64) -> Vec<f32> {
    let mut rng = SplitMix64::new(mix64(seed) ^ step);
    (0..vocab)
        .map(|_| (rng.next_normal() * sigma) as f32)
        .collect()
}

/// How a step's logits are masked.
enum Masking<'a> {
    /// By rank 0's filter (made by this function), shared with every rank: the code under test.
    Shared(&'a (dyn Fn() -> Box<dyn TokenFilter> + Sync)),
    /// By [`allowed_rule`] with this seed, applied by the test to the whole vocabulary (world
    /// 1): the reference.
    Dense(u64),
}

/// One row drawn per step for at most `steps` steps at `world` ranks, masked after the
/// penalties, until the stop id (once `min_tokens` are drawn); every rank's ids, checked equal.
#[allow(clippy::too_many_arguments)]
fn generate(
    world: usize,
    vocab: usize,
    steps: usize,
    params: SamplingParams,
    penalties: &Penalties,
    stop: u32,
    min_tokens: usize,
    masking: &Masking<'_>,
) -> Vec<u32> {
    let all = run_threads(world, |pg| {
        let part = Partition::new(vocab, pg.size())?;
        let range = part.range(pg.rank());
        let mut filter = match masking {
            Masking::Shared(make) if pg.rank() == 0 => Some(make()),
            _ => None,
        };
        let mut sampler = DistributedSampler::new(params);
        let mut history = History::new(&[1, 2, 3], penalties);
        let mut out = Vec::new();
        for step in 0..steps {
            let mut local = logits(params.seed, step as u64, vocab, 3.0)[range.clone()].to_vec();
            apply_penalties(&mut local, range.clone(), penalties, &history);
            let held = out.len() < min_tokens;
            match masking {
                Masking::Shared(_) => {
                    let hold = if held { vec![stop] } else { vec![] };
                    let mut req = [MaskRequest {
                        filter: filter.as_deref_mut(),
                        hold_back: &hold,
                    }];
                    let bits = share_masks(&mut req, vocab, &pg)?
                        .remove(0)
                        .map_err(candle_core::Error::msg)?;
                    mask_shard(&mut local, range.clone(), &bits);
                }
                Masking::Dense(seed) => {
                    assert_eq!(world, 1, "the reference is dense");
                    let allowed: Vec<bool> = (0..vocab)
                        .map(|id| allowed_rule(*seed, step as u64, id, stop))
                        .collect();
                    let others = (0..vocab).any(|id| allowed[id] && id != stop as usize);
                    for (id, x) in local.iter_mut().enumerate() {
                        if !allowed[id] || (held && others && id == stop as usize) {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
            }
            let t = Tensor::new(local, &Device::Cpu)?;
            let id = sample_batch(&mut [(&mut sampler, &t)], &part, &pg)?[0];
            if let Some(f) = filter.as_mut() {
                f.commit(id)?;
            }
            history.push(id);
            out.push(id);
            if id == stop && out.len() >= min_tokens {
                break;
            }
        }
        Ok(out)
    })
    .unwrap();
    assert!(
        all.windows(2).all(|w| w[0] == w[1]),
        "ranks disagree: {all:?}"
    );
    all.into_iter().next().unwrap()
}

#[test]
fn masks_on_shards_equal_the_dense_reference() {
    let vocab = 1000; // not a multiple of 32: the last word is partial
    let stop = 17;
    let sampling = |temperature, top_k, top_p, seed| SamplingParams {
        temperature,
        top_k,
        top_p,
        seed,
    };
    let biased = Penalties {
        presence: 0.5,
        frequency: 0.3,
        repetition: 1.3,
        // +100 on ids the rule mostly masks: the mask must still win.
        logit_bias: (0..40).map(|i| (i * 25, 100.0)).collect(),
    };
    let cases = [
        (sampling(0.0, None, None, 1), Penalties::default(), 0),
        (sampling(1.0, None, None, 2), Penalties::default(), 0),
        (sampling(0.7, Some(5), None, 3), Penalties::default(), 0),
        (sampling(1.3, None, Some(0.8), 4), Penalties::default(), 0),
        (sampling(1.0, Some(50), Some(0.9), 5), biased.clone(), 0),
        (sampling(1.0, None, None, 6), biased, 10),
        (sampling(0.0, None, None, 7), Penalties::default(), 10),
    ];
    for (params, penalties, min_tokens) in cases {
        let steps = 30;
        let dense = Masking::Dense(params.seed);
        let want = generate(
            1, vocab, steps, params, &penalties, stop, min_tokens, &dense,
        );
        assert!(want.len() > 5, "{params:?}: {want:?}");
        for world in 1..=3 {
            let make = || -> Box<dyn TokenFilter> {
                Box::new(RuleFilter {
                    seed: params.seed,
                    step: 0,
                    vocab,
                    stop,
                })
            };
            let shared = Masking::Shared(&make);
            let got = generate(
                world, vocab, steps, params, &penalties, stop, min_tokens, &shared,
            );
            assert_eq!(
                got, want,
                "world {world}, {params:?}, min_tokens {min_tokens}"
            );
        }
    }
}

/// SmolLM2's tokenizer (the test data) as a checkpoint folder.
fn smollm2_text() -> ModelText {
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        data.join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    ModelText::load(dir.path()).unwrap()
}

const VOCAB: usize = 49152;
/// `<|im_end|>`.
const EOS: u32 = 2;

/// The text of `spec` drawn from random logits at temperature 1 with `seed` at `world`
/// ranks; whether it ended with the end-of-sequence token.
fn sample_grammar(
    g: &Grammars,
    text: &ModelText,
    spec: &GrammarSpec,
    world: usize,
    seed: u64,
) -> (Vec<u32>, String, bool) {
    let params = SamplingParams {
        temperature: 1.0,
        top_k: None,
        top_p: None,
        seed,
    };
    let make = || -> Box<dyn TokenFilter> { Box::new(g.compile(spec).expect("compiles")) };
    let shared = Masking::Shared(&make);
    let ids = generate(
        world,
        VOCAB,
        400,
        params,
        &Penalties::default(),
        EOS,
        0,
        &shared,
    );
    let ended = ids.last() == Some(&EOS);
    let out = text.decode(&ids).unwrap();
    (ids, out, ended)
}

#[test]
fn json_schemas_at_temperature_one_parse_and_validate() {
    let text = smollm2_text();
    let g = Grammars::new(&text, VOCAB, &[EOS, 0]).unwrap();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
            "score": {"anyOf": [{"type": "null"}, {"type": "number", "minimum": -1, "maximum": 1}]}
        },
        "required": ["name", "age", "tags", "ok", "score"],
        "additionalProperties": false
    });
    let spec = GrammarSpec::JsonSchema(schema.clone());
    for seed in 0..24u64 {
        let (ids, out, ended) = sample_grammar(&g, &text, &spec, 1, seed);
        assert!(ended, "seed {seed}: no end-of-sequence: {out:?}");
        let v: Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("seed {seed}: {e}: {out:?}"));
        validate(&schema, &v).unwrap_or_else(|e| panic!("seed {seed}: {e}: {out}"));
        if seed < 6 {
            let (ids2, _, _) = sample_grammar(&g, &text, &spec, 2, seed);
            assert_eq!(ids2, ids, "seed {seed}: world 2 differs from world 1");
        }
    }
    // json_object: any object, bounded here by max tokens only (not checked to end).
    let any = GrammarSpec::JsonSchema(json!({"type": "object"}));
    let (_, out, ended) = sample_grammar(&g, &text, &any, 2, 99);
    if ended {
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out:?}"));
        assert!(v.is_object(), "{out}");
    } else {
        assert!(out.starts_with('{'), "{out:?}");
    }
    // Local references (pydantic's nested models) are followed.
    let nested = json!({
        "$defs": {"Point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"],
            "additionalProperties": false}},
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}},
        "required": ["p"], "additionalProperties": false
    });
    for seed in 0..4 {
        let spec = GrammarSpec::JsonSchema(nested.clone());
        let (_, out, ended) = sample_grammar(&g, &text, &spec, 1, seed);
        assert!(ended, "{out:?}");
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out:?}"));
        let x = v["p"]["x"].as_f64().unwrap_or_else(|| panic!("{out}"));
        assert!(x.fract() == 0.0 && (0.0..=9.0).contains(&x), "{out}");
        assert_eq!(v.as_object().unwrap().len(), 1, "{out}");
    }
    // A schema llguidance cannot compile (an unknown type, a remote reference) is an error,
    // not a panic.
    assert!(g
        .compile(&GrammarSpec::JsonSchema(json!({"type": "frobnicate"})))
        .is_err());
    let remote = json!({"$ref": "https://example.com/schema.json"});
    assert!(g.compile(&GrammarSpec::JsonSchema(remote)).is_err());
}

fn tool_set(choice: ToolChoice, parallel: bool) -> Tools {
    let functions = vec![
        Function {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": false}),
        },
        Function {
            name: "add".into(),
            parameters: json!({"type": "object", "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                "required": ["a", "b"], "additionalProperties": false}),
        },
    ];
    Tools {
        definitions: Vec::new(),
        functions,
        choice,
        parallel,
    }
}

#[test]
fn forced_tool_calls_parse_into_valid_calls() {
    let text = smollm2_text();
    let g = Grammars::new(&text, VOCAB, &[EOS]).unwrap();
    for (format, choice, parallel) in [
        (ToolFormat::Hermes, ToolChoice::Required, true),
        (ToolFormat::Hermes, ToolChoice::Required, false),
        (ToolFormat::Hermes, ToolChoice::Named("add".into()), true),
        (ToolFormat::Llama3Json, ToolChoice::Required, true),
        (
            ToolFormat::Llama3Json,
            ToolChoice::Named("get_weather".into()),
            true,
        ),
    ] {
        let tools = tool_set(choice.clone(), parallel);
        let spec = tools.forcing_grammar(format).expect("forced");
        let mut several = false;
        for seed in 0..10u64 {
            let (_, out, ended) = sample_grammar(&g, &text, &spec, 1 + (seed % 2) as usize, seed);
            let what = format!("{format:?} {choice:?} parallel {parallel} seed {seed}: {out:?}");
            assert!(ended, "{what}");
            let calls = parse_calls(format, &out).unwrap_or_else(|| panic!("no calls: {what}"));
            several |= calls.len() > 1;
            if !parallel || matches!(choice, ToolChoice::Named(_)) {
                assert_eq!(calls.len(), 1, "{what}");
            }
            for c in &calls {
                let f = tools.functions.iter().find(|f| f.name == c.name);
                let f = f.unwrap_or_else(|| panic!("unknown function {}: {what}", c.name));
                if let ToolChoice::Named(n) = &choice {
                    assert_eq!(&c.name, n, "{what}");
                }
                let args: Value = serde_json::from_str(&c.arguments).unwrap();
                validate(&f.parameters, &args).unwrap_or_else(|e| panic!("{e}: {what}"));
            }
        }
        if format == ToolFormat::Hermes && choice == ToolChoice::Required && parallel {
            assert!(several, "parallel calls were never drawn in 10 seeds");
        }
    }
    // auto and none force nothing.
    assert_eq!(
        tool_set(ToolChoice::Auto, true).forcing_grammar(ToolFormat::Hermes),
        None
    );
    assert_eq!(
        tool_set(ToolChoice::None, true).forcing_grammar(ToolFormat::Hermes),
        None
    );
}
