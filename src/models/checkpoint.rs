//! Opening a checkpoint, for every model: a Hugging Face directory (`config.json` and
//! safetensors) or a llama.cpp GGUF file (its metadata written as a Hugging Face
//! `config.json`), each rank reading only its slices. A model says how it is built from the
//! configuration text and a [`ShardedVarBuilder`] ([`FromCheckpoint::from_config_json`]) and
//! gets `from_dir`, `from_gguf`, `from_path` and `from_path_with_progress` from the trait:
//! [`CausalLm`](crate::models::CausalLm), [`Llama`](crate::models::Llama) and
//! [`BertModel`](crate::models::bert::BertModel).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Result};

use crate::comm::ProcessGroup;
use crate::loader::{LoadProgress, ShardedVarBuilder};
use crate::stage::PipelineStage;

/// A model built from a checkpoint's configuration and weights: it says how
/// ([`FromCheckpoint::from_config_json`]); the loaders come with the trait.
pub trait FromCheckpoint: Sized {
    /// Parses the `config.json` text (`origin` names it in errors) and builds the model from
    /// `vb` (the checkpoint root), splitting over `vb.pg()`.
    fn from_config_json(text: &str, origin: &str, vb: ShardedVarBuilder) -> Result<Self>;

    /// Loads a Hugging Face model directory (`config.json` and `model.safetensors` or its
    /// index and shards); each rank reads only its slices.
    fn from_dir(
        dir: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
    ) -> Result<Self> {
        load(
            dir.as_ref(),
            false,
            dtype,
            device,
            pg,
            LoadOptions::default(),
        )
    }

    /// Loads a llama.cpp GGUF file (configuration from its metadata, as a Hugging Face
    /// `config.json`): each rank copies only the quantized blocks of its shards out of the
    /// memory-mapped file and keeps them quantized; norms are dequantized to f32.
    /// Activations are f32.
    fn from_gguf(path: impl AsRef<Path>, device: &Device, pg: ProcessGroup) -> Result<Self> {
        load(
            path.as_ref(),
            true,
            DType::F32,
            device,
            pg,
            LoadOptions::default(),
        )
    }

    /// [`FromCheckpoint::from_gguf`] for a `.gguf` file, [`FromCheckpoint::from_dir`] (in
    /// `dtype`) otherwise.
    fn from_path(
        path: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
    ) -> Result<Self> {
        Self::from_path_with(path, dtype, device, pg, LoadOptions::default())
    }

    /// [`FromCheckpoint::from_path`], reporting every tensor this rank reads to `progress`
    /// (for a progress bar: `examples/generate.rs` draws one on a terminal).
    fn from_path_with_progress(
        path: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
        progress: LoadProgress,
    ) -> Result<Self> {
        let options = LoadOptions {
            progress: Some(progress),
            ..LoadOptions::default()
        };
        Self::from_path_with(path, dtype, device, pg, options)
    }

    /// [`FromCheckpoint::from_path`] with `options`: a progress callback, and a pipeline
    /// stage to load (then `pg` is the stage's tensor-parallel group; see
    /// [`PipelineStage::split`]).
    fn from_path_with(
        path: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
        options: LoadOptions,
    ) -> Result<Self> {
        let path = path.as_ref();
        load(path, is_gguf(path), dtype, device, pg, options)
    }
}

/// How [`FromCheckpoint::from_path_with`] loads a checkpoint beyond its path, dtype, device
/// and group.
#[derive(Clone, Default)]
pub struct LoadOptions {
    /// Called for every tensor this rank reads (a progress bar).
    pub progress: Option<LoadProgress>,
    /// Load only this pipeline stage's part of the model (models that know stages:
    /// [`CausalLm`](crate::models::CausalLm)).
    pub pipeline: Option<PipelineStage>,
    /// Mixture-of-experts layers expert-parallel over the model's group, in this many expert
    /// groups of consecutive ranks: each group holds whole experts, split over its ranks
    /// (`Some(group size)` or `Some(0)`: whole experts on each rank). `None`: every expert
    /// split across every rank.
    pub expert_parallel: Option<usize>,
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("progress", &self.progress.is_some())
            .field("pipeline", &self.pipeline)
            .field("expert_parallel", &self.expert_parallel)
            .finish()
    }
}

/// The one loader: the GGUF file (`gguf`; `dtype` unused) or the model directory `path`,
/// with `options`.
fn load<M: FromCheckpoint>(
    path: &Path,
    gguf: bool,
    dtype: DType,
    device: &Device,
    pg: ProcessGroup,
    options: LoadOptions,
) -> Result<M> {
    let model = if gguf {
        let (config, vb) = open_gguf(path, device, pg)?;
        M::from_config_json(&config, &path.display().to_string(), with(vb, options)?)?
    } else {
        let (config, vb) = open_dir(path, dtype, device, pg)?;
        let text = std::fs::read_to_string(&config).map_err(|e| {
            candle_core::Error::msg(format!(
                "cannot read model config {}: {e}",
                config.display()
            ))
        })?;
        M::from_config_json(&text, &config.display().to_string(), with(vb, options)?)?
    };
    // The loading's freed copies back to the kernel (see the function).
    crate::trim_freed_memory();
    Ok(model)
}

fn with(vb: ShardedVarBuilder, options: LoadOptions) -> Result<ShardedVarBuilder> {
    let vb = vb.with_expert_parallel(options.expert_parallel)?;
    let vb = match options.progress {
        Some(p) => vb.with_progress(p),
        None => vb,
    };
    Ok(match options.pipeline {
        Some(stage) => vb.with_pipeline(stage),
        None => vb,
    })
}

/// A model directory's `config.json` path (an error naming the directory when it is
/// missing) and a builder over its safetensors.
fn open_dir(
    dir: &Path,
    dtype: DType,
    device: &Device,
    pg: ProcessGroup,
) -> Result<(PathBuf, ShardedVarBuilder)> {
    let path = dir.join("config.json");
    if !path.is_file() {
        candle_core::bail!(
            "model directory {}: config.json is missing ({})",
            dir.display(),
            path.display()
        );
    }
    Ok((
        path,
        ShardedVarBuilder::from_safetensors_dir(dir, dtype, device, pg)?,
    ))
}

/// Whether `path` names a GGUF file (by its extension).
pub(crate) fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// A GGUF file's configuration, written as a Hugging Face `config.json` text from its
/// metadata, and a builder over its memory-mapped blocks.
fn open_gguf(
    path: &Path,
    device: &Device,
    pg: ProcessGroup,
) -> Result<(String, ShardedVarBuilder)> {
    let source = crate::loader::GgufSource::open(path)?;
    let config = source
        .config()
        .to_hf_config(source.tokenizer())?
        .to_string();
    let vb = ShardedVarBuilder::new(std::sync::Arc::new(source), DType::F32, device, pg);
    Ok((config, vb))
}
