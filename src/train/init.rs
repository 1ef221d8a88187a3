//! Megatron's CPU initialisation for training: every rank draws each FULL weight from the same
//! seeded generator (the seed mixed with a hash of the tensor's name) and keeps only its slice
//! as a trainable [`Var`], so a model built at TP = N starts from exactly the TP = 1 weights.
//!
//! [`TrainInit`] is a [`TensorSource`]: give it to [`ShardedVarBuilder::new`] and the layer
//! constructors used for inference (`ColumnParallelLinear::load`, `VocabParallelEmbedding::load`,
//! …) build trainable layers. [`TrainInit::save_safetensors_dir`] gathers the shards back into
//! one Hugging Face-layout `model.safetensors` that `ShardedVarBuilder::from_safetensors_dir`
//! reads at any world size.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Shape, Tensor, Var};

use crate::comm::ProcessGroup;
use crate::loader::{RangeRequest, TensorSource};
use crate::ShardedVarBuilder;

/// How a tensor is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Normal distribution with mean 0 and this standard deviation.
    Normal(f64),
    /// Every element equal to this value (`Const(1.0)` for norm weights).
    Const(f64),
}

/// One declared parameter: full shape and initialiser.
#[derive(Debug, Clone)]
struct Decl {
    shape: Shape,
    init: Init,
}

/// A trainable parameter as this rank holds it.
#[derive(Debug, Clone)]
pub struct Param {
    /// The checkpoint name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// The full (unsharded) shape.
    pub full_shape: Shape,
    /// `None` for a replicated parameter; otherwise the dimension it is split along and the
    /// range of it this rank holds.
    pub split: Option<(usize, Range<usize>)>,
    /// This rank's values.
    pub var: Var,
}

#[derive(Default)]
struct State {
    decls: HashMap<String, Decl>,
    /// Keyed by (name, split) so that a tied weight loaded twice is one parameter.
    params: BTreeMap<String, Param>,
}

/// Seeded, sharded initialisation of a model's parameters (a `VarMap` whose variables are
/// this rank's slices of deterministically drawn full tensors).
#[derive(Clone)]
pub struct TrainInit {
    seed: u64,
    state: Arc<Mutex<State>>,
}

/// FNV-1a of a name: the per-tensor part of the seed.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

pub use crate::rng::SplitMix64;

impl TrainInit {
    /// An empty initialiser; `seed` is the model seed.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            state: Arc::new(Mutex::new(State::default())),
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| candle_core::Error::msg("TrainInit: the parameter registry is poisoned"))
    }

    /// Declares parameter `name` with its full shape and initialiser (before building the
    /// model: layer constructors ask the source for shapes).
    pub fn declare(
        &self,
        name: impl Into<String>,
        shape: impl Into<Shape>,
        init: Init,
    ) -> Result<()> {
        let mut st = self.lock()?;
        st.decls.insert(
            name.into(),
            Decl {
                shape: shape.into(),
                init,
            },
        );
        Ok(())
    }

    /// A [`ShardedVarBuilder`] over this initialiser for group `pg`.
    pub fn var_builder(
        &self,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
    ) -> ShardedVarBuilder {
        ShardedVarBuilder::new(Arc::new(self.clone()), dtype, device, pg)
    }

    /// The full tensor `name` as every rank draws it (f32 on the CPU, then converted).
    pub fn full_tensor(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let decl = self.decl(name)?;
        let n = decl.shape.elem_count();
        let data: Vec<f32> = match decl.init {
            Init::Const(c) => vec![c as f32; n],
            Init::Normal(std) => {
                let mut rng = SplitMix64::new(self.seed ^ name_hash(name));
                (0..n).map(|_| (rng.next_normal() * std) as f32).collect()
            }
        };
        Tensor::from_vec(data, decl.shape.clone(), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)
    }

    fn decl(&self, name: &str) -> Result<Decl> {
        match self.lock()?.decls.get(name) {
            Some(d) => Ok(d.clone()),
            None => candle_core::bail!("TrainInit: parameter '{name}' was not declared"),
        }
    }

    fn register(
        &self,
        name: &str,
        split: Option<(usize, Range<usize>)>,
        make: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Tensor> {
        let decl = self.decl(name)?;
        if let Some(p) = self.lock()?.params.get(name) {
            if p.split != split {
                candle_core::bail!(
                    "TrainInit: parameter '{name}' is loaded twice with different slices ({:?} and {:?})",
                    p.split,
                    split
                );
            }
            return Ok(p.var.as_tensor().clone());
        }
        let var = Var::from_tensor(&make()?)?;
        let t = var.as_tensor().clone();
        self.lock()?.params.insert(
            name.to_string(),
            Param {
                name: name.to_string(),
                full_shape: decl.shape,
                split,
                var,
            },
        );
        Ok(t)
    }

    /// Every parameter this rank holds, ordered by name.
    pub fn params(&self) -> Result<Vec<Param>> {
        Ok(self.lock()?.params.values().cloned().collect())
    }

    /// The variables, ordered by name (for the optimizer).
    pub fn vars(&self) -> Result<Vec<Var>> {
        Ok(self.params()?.into_iter().map(|p| p.var).collect())
    }

    /// The parameter `name`.
    pub fn param(&self, name: &str) -> Result<Param> {
        match self.lock()?.params.get(name) {
            Some(p) => Ok(p.clone()),
            None => candle_core::bail!("TrainInit: no parameter '{name}' was built"),
        }
    }

    /// The full tensors, the shards gathered over `pg` (the tensor-parallel group the model
    /// was built with). Collective over `pg`: every rank calls it.
    ///
    /// A parameter may be held by every rank whole (replicated: this rank's copy), by every
    /// rank or some ranks in slices that tile one dimension (gathered), or whole by some ranks
    /// only (an expert-parallel layer's experts: taken from the lowest rank that holds it).
    pub fn gather_full(&self, pg: &ProcessGroup) -> Result<BTreeMap<String, Tensor>> {
        let params: BTreeMap<String, Param> = self
            .params()?
            .into_iter()
            .map(|p| (p.name.clone(), p))
            .collect();
        let (dtype, device) = match params.values().next() {
            Some(p) => (p.var.dtype(), p.var.device().clone()),
            None => (DType::F32, Device::Cpu),
        };
        let mut out = BTreeMap::new();
        for name in all_names(pg, &params)? {
            let local = params.get(&name);
            // [held, dim (-1: whole), start, end, dtype] of every rank.
            let mine: [i64; 5] = match local {
                None => [0, -1, 0, 0, dtype_code(dtype)],
                Some(p) => {
                    let code = dtype_code(p.var.dtype());
                    match &p.split {
                        None => [1, -1, 0, 0, code],
                        Some((dim, r)) => [1, *dim as i64, r.start as i64, r.end as i64, code],
                    }
                }
            };
            let mut all = vec![0i64; 5 * pg.size()];
            pg.all_gather_slice(&mine, &mut all)?;
            let ranks: Vec<&[i64]> = all.chunks(5).collect();
            let holders: Vec<usize> = (0..ranks.len()).filter(|&r| ranks[r][0] == 1).collect();
            let whole = holders.iter().all(|&r| ranks[r][1] == -1);
            if whole && holders.len() == pg.size() {
                if let Some(p) = local {
                    out.insert(name, p.var.as_tensor().clone());
                }
                continue;
            }
            let full_shape = self.decl(&name)?.shape;
            let dims = full_shape.dims();
            // Whole on some ranks: the lowest holder's copy, as one slice along dim 0.
            let (dim, slices): (usize, Vec<(usize, usize)>) = if whole {
                let first = holders[0];
                let n = dims.first().copied().unwrap_or(1);
                let slices = (0..ranks.len())
                    .map(|r| if r == first { (0, n) } else { (0, 0) })
                    .collect();
                (0, slices)
            } else {
                let dim = holders.iter().map(|&r| ranks[r][1]).max().unwrap_or(-1);
                if let Some(&r) = holders.iter().find(|&&r| ranks[r][1] != dim) {
                    candle_core::bail!(
                        "saving '{name}': rank {r} holds it along dim {}, rank {} along dim {dim} (a parameter is split along one dimension)",
                        ranks[r][1],
                        holders[0]
                    );
                }
                let slices = ranks
                    .iter()
                    .map(|c| {
                        if c[0] == 1 {
                            (c[2] as usize, c[3] as usize)
                        } else {
                            (0, 0)
                        }
                    })
                    .collect();
                (dim as usize, slices)
            };
            let total = dims.get(dim).copied().unwrap_or(1);
            // The holders' slices, in rank order, must tile the dimension.
            let mut at = 0usize;
            for &r in &holders {
                let (start, end) = slices[r];
                if (start, end) == (0, 0) && whole {
                    continue;
                }
                if start != at {
                    candle_core::bail!(
                        "saving '{name}': rank {r} holds {start}..{end} along dim {dim}, expected a slice starting at {at} (overlapping or replicated slices cannot be merged)"
                    );
                }
                at = end;
            }
            if at != total {
                candle_core::bail!(
                    "saving '{name}': the slices cover {at} of {total} along dim {dim}"
                );
            }
            let sizes: Vec<usize> = slices.iter().map(|&(s, e)| e - s).collect();
            let part = match local {
                Some(p) if sizes[pg.rank()] > 0 => p.var.as_tensor().contiguous()?,
                _ => {
                    let mut empty = dims.to_vec();
                    empty[dim] = 0;
                    let code = ranks[holders[0]][4];
                    Tensor::zeros(empty, dtype_of(code, &name)?, &device)?
                }
            };
            out.insert(name, pg.all_gather_with_sizes(&part, dim, &sizes)?);
        }
        Ok(out)
    }

    /// Gathers the shards over `pg` and, on rank 0 of `pg` when `write` is true, writes
    /// `dir/model.safetensors` (Hugging Face layout and names) and `dir/config.json`
    /// (`config_json`). Collective over `pg`.
    pub fn save_safetensors_dir(
        &self,
        dir: impl AsRef<Path>,
        config_json: &str,
        pg: &ProcessGroup,
        write: bool,
    ) -> Result<()> {
        let full = self.gather_full(pg)?;
        if !write || pg.rank() != 0 {
            return Ok(());
        }
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| {
            candle_core::Error::msg(format!(
                "cannot create checkpoint dir {}: {e}",
                dir.display()
            ))
        })?;
        let map: HashMap<String, Tensor> = full.into_iter().collect();
        let path = dir.join("model.safetensors");
        candle_core::safetensors::save(&map, &path)
            .map_err(|e| candle_core::Error::msg(format!("writing {}: {e}", path.display())))?;
        let cfg = dir.join("config.json");
        std::fs::write(&cfg, config_json)
            .map_err(|e| candle_core::Error::msg(format!("writing {}: {e}", cfg.display())))?;
        Ok(())
    }
}

/// The dtypes a parameter may have, by code (the index), for the ranks that do not hold it.
const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

fn dtype_code(dtype: DType) -> i64 {
    DTYPES
        .iter()
        .position(|&d| d == dtype)
        .map_or(-1, |i| i as i64)
}

fn dtype_of(code: i64, name: &str) -> Result<DType> {
    match usize::try_from(code).ok().and_then(|i| DTYPES.get(i)) {
        Some(&d) => Ok(d),
        None => candle_core::bail!(
            "saving '{name}': its dtype is not one a trained parameter has ({DTYPES:?})"
        ),
    }
}

/// The names of the parameters held by any rank of `pg`, in order (collective over `pg`).
fn all_names(pg: &ProcessGroup, local: &BTreeMap<String, Param>) -> Result<BTreeSet<String>> {
    let mine = local
        .keys()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join("\n")
        .into_bytes();
    let mut lens = vec![0i64; pg.size()];
    pg.all_gather_slice(&[mine.len() as i64], &mut lens)?;
    let counts: Vec<usize> = lens.iter().map(|&n| n as usize).collect();
    let mut all = vec![0u8; counts.iter().sum()];
    pg.all_gather_v_slice(&mine, &mut all, &counts)?;
    let text = String::from_utf8(all)
        .map_err(|e| candle_core::Error::msg(format!("saving: parameter names: {e}")))?;
    // Each rank's names end where the next rank's begin: split rank by rank.
    let mut names = BTreeSet::new();
    let mut at = 0;
    for n in counts {
        names.extend(
            text[at..at + n]
                .split('\n')
                .filter(|s| !s.is_empty())
                .map(String::from),
        );
        at += n;
    }
    Ok(names)
}

impl TensorSource for TrainInit {
    fn shape(&self, name: &str) -> Result<Option<Shape>> {
        Ok(self.lock()?.decls.get(name).map(|d| d.shape.clone()))
    }

    fn load(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        self.register(name, None, || self.full_tensor(name, dtype, device))
    }

    fn load_ranges(&self, req: &RangeRequest<'_>) -> Result<Tensor> {
        let (name, dim, ranges, dtype, device) =
            (req.name, req.dim, req.ranges, req.dtype, req.device);
        let [range] = ranges else {
            candle_core::bail!(
                "TrainInit: parameter '{name}' asked as {} ranges along dim {dim}; training supports one slice per rank",
                ranges.len()
            );
        };
        let decl = self.decl(name)?;
        if dim < decl.shape.rank() && *range == (0..decl.shape.dims()[dim]) {
            // The whole tensor (a group of one rank): a replicated parameter.
            return self.load(name, dtype, device);
        }
        self.register(name, Some((dim, range.clone())), || {
            let full = self.full_tensor(name, dtype, device)?;
            req.slice(&full)?.contiguous()
        })
    }
}
