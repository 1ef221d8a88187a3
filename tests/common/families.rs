//! Helpers of the model-family tests: random checkpoints in Hugging Face layout, the
//! tensor-parallel `CausalLm` at several worlds, and the comparison with a single-process
//! reference (candle-transformers' implementation of the family).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use candle_tp::models::{CausalLm, FromCheckpoint};
use candle_tp::run_threads;

use super::{max_abs_diff, seeded};

/// The prompt of every family test (7 tokens).
pub const PROMPT: [u32; 7] = [3, 17, 42, 90, 5, 64, 23];

/// Llama's MLP projection names.
pub const MLP: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// The two norms of every decoder layer.
pub const NORMS: [&str; 2] = ["input_layernorm", "post_attention_layernorm"];

/// Greedy tokens generated after the prompt.
pub const NEW_TOKENS: usize = 16;

/// Deterministic random weights under Hugging Face names.
pub struct Weights {
    seed: u64,
    pub map: HashMap<String, Tensor>,
}

impl Weights {
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            map: HashMap::new(),
        }
    }

    /// `offset + scale * uniform[-1, 1)` of `shape` under `name`.
    pub fn add(&mut self, name: &str, shape: &[usize], scale: f64, offset: f64) -> Result<()> {
        self.seed += 1;
        let t = ((seeded(shape, self.seed) * scale)? + offset)?;
        self.map.insert(name.to_string(), t);
        Ok(())
    }

    /// A `[out, in]` projection scaled by `2 / sqrt(in)`.
    pub fn linear(&mut self, name: &str, out: usize, inp: usize) -> Result<()> {
        self.add(
            &format!("{name}.weight"),
            &[out, inp],
            2.0 / (inp as f64).sqrt(),
            0.0,
        )
    }

    /// A norm weight around `offset`.
    pub fn norm(&mut self, name: &str, size: usize, offset: f64) -> Result<()> {
        self.add(&format!("{name}.weight"), &[size], 0.1, offset)
    }

    /// `model.embed_tokens`, `model.norm` (around `norm_offset`) and, unless tied, `lm_head`.
    pub fn embeddings(
        &mut self,
        vocab: usize,
        hidden: usize,
        norm_offset: f64,
        tied: bool,
    ) -> Result<()> {
        self.add("model.embed_tokens.weight", &[vocab, hidden], 0.5, 0.0)?;
        self.add("model.norm.weight", &[hidden], 0.3, norm_offset)?;
        if !tied {
            self.add("lm_head.weight", &[vocab, hidden], 0.2, 0.0)?;
        }
        Ok(())
    }

    /// Separate `q_proj`, `k_proj`, `v_proj`, `o_proj` under `{layer}.self_attn`.
    pub fn attention(&mut self, layer: &str, s: Shape) -> Result<()> {
        let a = format!("{layer}.self_attn");
        self.linear(&format!("{a}.q_proj"), s.heads * s.head_dim, s.hidden)?;
        self.linear(&format!("{a}.k_proj"), s.kv_heads * s.head_dim, s.hidden)?;
        self.linear(&format!("{a}.v_proj"), s.kv_heads * s.head_dim, s.hidden)?;
        self.linear(&format!("{a}.o_proj"), s.hidden, s.heads * s.head_dim)
    }

    /// Per-head `q_norm`, `k_norm` (`[head_dim]`, far from uniform around `offset`).
    pub fn qk_norms(&mut self, layer: &str, head_dim: usize, offset: f64) -> Result<()> {
        for n in ["q_norm", "k_norm"] {
            self.add(
                &format!("{layer}.self_attn.{n}.weight"),
                &[head_dim],
                0.8,
                offset,
            )?;
        }
        Ok(())
    }

    /// A gated MLP `[gate, up, down]` named under `prefix`.
    pub fn gated_mlp(
        &mut self,
        prefix: &str,
        [gate, up, down]: [&str; 3],
        inter: usize,
        hidden: usize,
    ) -> Result<()> {
        self.linear(&format!("{prefix}.{gate}"), inter, hidden)?;
        self.linear(&format!("{prefix}.{up}"), inter, hidden)?;
        self.linear(&format!("{prefix}.{down}"), hidden, inter)
    }

    /// A sparse MoE block under `prefix`: a router `gate` `[experts, hidden]` (uniform of
    /// `router_scale`) and `experts` gated MLPs of width `inter`, named `names`, under
    /// `experts.N`.
    pub fn moe(
        &mut self,
        prefix: &str,
        (hidden, inter, experts): (usize, usize, usize),
        names: [&str; 3],
        router_scale: f64,
    ) -> Result<()> {
        self.add(
            &format!("{prefix}.gate.weight"),
            &[experts, hidden],
            router_scale,
            0.0,
        )?;
        for e in 0..experts {
            self.gated_mlp(&format!("{prefix}.experts.{e}"), names, inter, hidden)?;
        }
        Ok(())
    }

    /// RmsNorm weights `{layer}.{name}` around `offset`.
    pub fn layer_norms(
        &mut self,
        layer: &str,
        names: &[&str],
        size: usize,
        offset: f64,
    ) -> Result<()> {
        for n in names {
            self.norm(&format!("{layer}.{n}"), size, offset)?;
        }
        Ok(())
    }
}

/// Attention shapes of a test checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// `ids` as a `[1, len]` tensor.
pub fn ids_tensor(ids: &[u32]) -> candle_core::Result<Tensor> {
    Tensor::new(ids, &Device::Cpu)?.unsqueeze(0)
}

/// The whole comparison of a family: writes `config` and `weights`, runs the reference
/// (`last(&reference_config, var_builder, ids)`: a fresh candle-transformers model's
/// last-position logits over `ids`) and checks the tensor-parallel model at worlds 1-4
/// within `tol`. Returns the largest error.
pub fn compare_family<C: serde::de::DeserializeOwned>(
    config: serde_json::Value,
    weights: &Weights,
    tol: f32,
    last: impl Fn(&C, VarBuilder<'static>, &[u32]) -> candle_core::Result<Tensor>,
) -> Result<f32> {
    compare_family_with(config, weights, tol, None, last)
}

/// [`compare_family`], with the mixture-of-experts layers expert-parallel when
/// `expert_parallel` (`LoadOptions::expert_parallel`).
pub fn compare_family_with<C: serde::de::DeserializeOwned>(
    config: serde_json::Value,
    weights: &Weights,
    tol: f32,
    expert_parallel: Option<usize>,
    last: impl Fn(&C, VarBuilder<'static>, &[u32]) -> candle_core::Result<Tensor>,
) -> Result<f32> {
    let dir = write_checkpoint(&config, weights)?;
    let ref_cfg: C = serde_json::from_value(config)?;
    let expected =
        reference(|ids| Ok(last(&ref_cfg, reference_vb(dir.path())?, ids)?.flatten_all()?))?;
    check_worlds_with(dir.path(), &expected, &[1, 2, 3, 4], tol, expert_parallel)
}

/// Writes `config.json` and `model.safetensors` into a new temporary directory.
pub fn write_checkpoint(config: &serde_json::Value, w: &Weights) -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_vec_pretty(config)?,
    )?;
    candle_core::safetensors::save(&w.map, dir.path().join("model.safetensors"))?;
    Ok(dir)
}

/// A candle-nn `VarBuilder` over the checkpoint (for the reference model).
pub fn reference_vb(dir: &Path) -> Result<VarBuilder<'static>> {
    Ok(unsafe {
        VarBuilder::from_mmaped_safetensors(
            &[dir.join("model.safetensors")],
            DType::F32,
            &Device::Cpu,
        )?
    })
}

/// Fails unless every value of `t` is finite (a NaN passes any `max |a - b| <= tol`).
pub fn assert_finite(t: &Tensor, what: &str) -> Result<()> {
    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    if let Some((i, x)) = v.iter().enumerate().find(|(_, x)| !x.is_finite()) {
        bail!("{what}: value {i} is {x}");
    }
    Ok(())
}

/// What the reference computed: the logits of every prompt position `[prompt, vocab]` and
/// the greedy continuation.
pub struct Expected {
    pub logits: Tensor,
    pub ids: Vec<u32>,
}

/// Runs the reference: `last(ids)` must return the last position's logits `[vocab]` of a
/// fresh forward pass over `ids` from position 0 (no cache carried between calls), so that
/// the KV-cache path of the model under test is compared with a cache-free computation.
pub fn reference(mut last: impl FnMut(&[u32]) -> Result<Tensor>) -> Result<Expected> {
    let rows = (1..=PROMPT.len())
        .map(|n| last(&PROMPT[..n]))
        .collect::<Result<Vec<_>>>()?;
    let logits = Tensor::stack(&rows, 0)?;
    assert_finite(&logits, "reference logits")?;
    let mut seq = PROMPT.to_vec();
    let mut ids = Vec::new();
    let mut l = rows[rows.len() - 1].clone();
    while ids.len() < NEW_TOKENS {
        let next = l.argmax(D::Minus1)?.to_scalar::<u32>()?;
        ids.push(next);
        seq.push(next);
        if ids.len() < NEW_TOKENS {
            l = last(&seq)?;
        }
    }
    Ok(Expected { logits, ids })
}

/// One rank's results: every prompt position's full logits, the last position's local and
/// gathered logits, and the greedy continuation (decoded with the KV cache).
pub struct RankRun {
    pub all: Tensor,
    pub last_local: Tensor,
    pub last: Tensor,
    pub ids: Vec<u32>,
}

/// The tensor-parallel model loaded by `CausalLm::from_dir` (dispatch on `architectures`)
/// on `world` threads.
pub fn parallel_run(dir: &Path, world: usize) -> Result<Vec<RankRun>> {
    parallel_run_with(dir, world, None)
}

/// [`parallel_run`], with the mixture-of-experts layers expert-parallel in `expert_parallel`
/// groups (`Some(0)`: one per rank; `LoadOptions::expert_parallel`).
pub fn parallel_run_with(
    dir: &Path,
    world: usize,
    expert_parallel: Option<usize>,
) -> Result<Vec<RankRun>> {
    let dir: PathBuf = dir.to_path_buf();
    Ok(run_threads(world, move |pg| {
        let options = candle_tp::models::LoadOptions {
            expert_parallel,
            ..Default::default()
        };
        let mut m = CausalLm::from_path_with(&dir, DType::F32, &Device::Cpu, pg, options)?;
        if let Some(ep) = expert_parallel {
            // The path under test is the expert-parallel one, in the groups asked for.
            let groups = if ep == 0 { world } else { ep };
            let layers: Vec<_> = (0..m.config().layers.len())
                .filter_map(|i| m.moe(i))
                .collect();
            assert!(!layers.is_empty(), "a mixture-of-experts model");
            assert!(
                layers
                    .iter()
                    .all(|l| l.expert_owners().map(|o| o.parts()) == Some(groups)
                        && l.expert_tp() == world / groups),
                "every MoE layer is expert-parallel in {groups} groups of {} ranks",
                world / groups
            );
        }
        let x = Tensor::new(&PROMPT[..], &Device::Cpu)?.unsqueeze(0)?;
        let all = m.forward_all_gathered(&x, 0)?.squeeze(0)?;
        m.clear_kv_cache();
        let last_local = m.forward(&x, 0)?.squeeze(0)?;
        m.clear_kv_cache();
        let last = m.forward_gathered(&x, 0)?.squeeze(0)?;
        let mut ids = vec![last.argmax(D::Minus1)?.to_scalar::<u32>()?];
        let mut pos = PROMPT.len();
        while ids.len() < NEW_TOKENS {
            let x = Tensor::new(&ids[ids.len() - 1..], &Device::Cpu)?.unsqueeze(0)?;
            let l = m.forward_gathered(&x, pos)?;
            pos += 1;
            ids.push(l.argmax(D::Minus1)?.squeeze(0)?.to_scalar::<u32>()?);
        }
        Ok(RankRun {
            all,
            last_local,
            last,
            ids,
        })
    })?)
}

/// Compares the model at each world with the reference: finiteness first, then every
/// prompt position's logits and the last position's (gathered, and the ranks' local slices
/// joined) within `tol`, and the 16 greedy tokens exactly. Returns the largest error seen.
pub fn check_worlds(dir: &Path, expected: &Expected, worlds: &[usize], tol: f32) -> Result<f32> {
    check_worlds_with(dir, expected, worlds, tol, None)
}

/// [`check_worlds`], with the mixture-of-experts layers expert-parallel when
/// `expert_parallel`.
pub fn check_worlds_with(
    dir: &Path,
    expected: &Expected,
    worlds: &[usize],
    tol: f32,
    expert_parallel: Option<usize>,
) -> Result<f32> {
    let n = PROMPT.len();
    let ref_last = expected.logits.get(n - 1)?;
    let mut worst = 0f32;
    for &world in worlds {
        let ranks = parallel_run_with(dir, world, expert_parallel)?;
        let locals: Vec<Tensor> = ranks.iter().map(|r| r.last_local.clone()).collect();
        let joined = Tensor::cat(&locals, 0)?;
        for (rank, r) in ranks.iter().enumerate() {
            let at = format!("world {world} rank {rank}");
            assert_finite(&r.all, &format!("{at}: full-sequence logits"))?;
            assert_finite(&r.last, &format!("{at}: last-position logits"))?;
            let e_all = max_abs_diff(&r.all, &expected.logits)?;
            let e_last = max_abs_diff(&r.last, &ref_last)?;
            let e_join = max_abs_diff(&joined, &r.last)?;
            eprintln!(
                "{at}: max |logits - reference|: all positions {e_all:.2e}, last {e_last:.2e}; local slices joined vs gathered {e_join:.1e}"
            );
            if e_all > tol || e_last > tol {
                bail!("{at}: logits differ from the reference by {e_all} / {e_last} (> {tol})");
            }
            if e_join != 0.0 {
                bail!("{at}: local logits joined differ from the gathered ones by {e_join}");
            }
            if r.ids != expected.ids {
                bail!(
                    "{at}: greedy ids {:?} != reference {:?}",
                    r.ids,
                    expected.ids
                );
            }
            worst = worst.max(e_all).max(e_last);
        }
    }
    eprintln!("largest error over worlds {worlds:?}: {worst:.2e}");
    Ok(worst)
}

/// The error message of loading `dir` at `world` ranks (or a marker when it loads).
pub fn load_err(dir: &Path, world: usize) -> String {
    let dir = dir.to_path_buf();
    match run_threads(world, move |pg| {
        CausalLm::from_dir(&dir, DType::F32, &Device::Cpu, pg).map(|_| ())
    }) {
        Ok(_) => String::from("<loaded without error>"),
        Err(e) => e.to_string(),
    }
}
