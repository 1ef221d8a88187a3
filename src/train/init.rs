//! Megatron's CPU initialisation for training: every rank draws each FULL weight from the same
//! seeded generator (the seed mixed with a hash of the tensor's name) and keeps only its slice
//! as a trainable [`Var`], so a model built at TP = N starts from exactly the TP = 1 weights.
//!
//! [`TrainInit`] is a [`TensorSource`]: give it to [`ShardedVarBuilder::new`] and the layer
//! constructors used for inference (`ColumnParallelLinear::load`, `VocabParallelEmbedding::load`,
//! …) build trainable layers. [`TrainInit::save_safetensors_dir`] gathers the shards back into
//! one Hugging Face-layout `model.safetensors` that `ShardedVarBuilder::from_safetensors_dir`
//! reads at any world size.

use std::collections::{BTreeMap, HashMap};
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
    pub fn gather_full(&self, pg: &ProcessGroup) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for p in self.params()? {
            let t = p.var.as_tensor().clone();
            let full = match &p.split {
                None => t,
                Some((dim, range)) => {
                    let total = p.full_shape.dims()[*dim];
                    // Every rank's range, to check that the slices tile the dimension.
                    let mine = [range.start as i64, range.end as i64];
                    let mut all = vec![0i64; 2 * pg.size()];
                    pg.all_gather_slice(&mine, &mut all)?;
                    let mut at = 0i64;
                    let mut sizes = Vec::with_capacity(pg.size());
                    for (r, c) in all.chunks(2).enumerate() {
                        if c[0] != at {
                            candle_core::bail!(
                                "saving '{}': rank {r} holds {}..{} along dim {dim}, expected a slice starting at {at} (overlapping or replicated slices cannot be merged)",
                                p.name, c[0], c[1]
                            );
                        }
                        sizes.push((c[1] - c[0]) as usize);
                        at = c[1];
                    }
                    if at as usize != total {
                        candle_core::bail!(
                            "saving '{}': the slices cover {at} of {total} along dim {dim}",
                            p.name
                        );
                    }
                    pg.all_gather_with_sizes(&t.contiguous()?, *dim, &sizes)?
                }
            };
            out.insert(p.name.clone(), full);
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
