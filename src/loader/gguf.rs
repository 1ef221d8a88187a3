//! A memory-mapped GGUF file as a [`TensorSource`] that serves quantized shards.
//!
//! Tensors are served under their Hugging Face names (`model.layers.0.self_attn.q_proj.weight`)
//! with the Hugging Face row order, so the same model code loads a GGUF file or a safetensors
//! checkpoint. A layer's experts, stacked in one 3-D tensor (`ffn_gate_exps`), are served as
//! one matrix per expert (`block_sparse_moe.experts.N.w1.weight`): a byte range of the
//! tensor, so an expert-parallel rank maps only its own experts' blocks. Each rank copies only
//! the blocks of its shard out of the mapping ([`super::quant_shard`]): whole rows for a
//! column-parallel split, a range of blocks of every row for a row-parallel split. The q/k rows that llama.cpp stores in its rotary order are put
//! back by copying rows, never by dequantizing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Result, Shape, Tensor};
use memmap2::Mmap;

use super::quant_shard::{self, RowOrder};
use super::source::{RangeRequest, TensorSource, WeightShard};
use crate::gguf::{checked_hf_target, rotary_heads, scan, GgufTensorEntry, HfTarget};
use crate::gguf::{GgufTokenizer, LlamaGgufConfig, Metadata};
use crate::quant::QuantType;

/// Where a Hugging Face tensor lives in the GGUF file.
#[derive(Debug, Clone)]
struct Entry {
    tensor: GgufTensorEntry,
    /// Number of heads whose rows llama.cpp permuted (q: attention heads, k: KV heads).
    rotary_heads: Option<usize>,
}

/// A GGUF file, memory-mapped, whose tensors are read by shards under Hugging Face names.
pub struct GgufSource {
    path: PathBuf,
    mmap: Mmap,
    entries: HashMap<String, Entry>,
    config: LlamaGgufConfig,
    tokenizer: GgufTokenizer,
}

impl GgufSource {
    /// Maps `path`, checks its header and tensor table, and reads the model configuration
    /// (Llama, Mixtral, Qwen3 or Qwen3-MoE) and tokenizer from its metadata. Errors name the file and the tensor or key at fault.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file_name = path.display().to_string();
        let file = std::fs::File::open(&path).map_err(|e| {
            candle_core::Error::msg(format!("cannot open GGUF file {file_name}: {e}"))
        })?;
        // SAFETY: the mapping is read-only; like every loader of memory-mapped checkpoints we
        // rely on the file not being truncated while the model loads.
        let mmap = unsafe { Mmap::map(&file) }
            .map_err(|e| candle_core::Error::msg(format!("cannot map {file_name}: {e}")))?;
        let header = scan(&mmap, &file_name)?;
        let content = Content::read(&mut std::io::Cursor::new(&mmap[..])).map_err(|e| {
            candle_core::Error::msg(format!("{file_name}: not a readable GGUF file: {e}"))
        })?;
        let meta = Metadata::new(&content.metadata, &path);
        let config = LlamaGgufConfig::from_metadata(&meta, &content.tensor_infos)?;
        let tokenizer = GgufTokenizer::from_metadata(&meta)?;
        let mut entries = HashMap::new();
        for t in header.tensors {
            // A 3-D tensor of experts is one matrix per expert, each a contiguous run of its
            // blocks: expert `e`'s bytes follow expert `e - 1`'s.
            let parts = match checked_hf_target(&config, &file_name, &t.name, &t.dims)? {
                HfTarget::One(hf) => vec![(hf, t)],
                HfTarget::Experts(names) => {
                    let each = t.len / names.len();
                    names
                        .into_iter()
                        .enumerate()
                        .map(|(e, hf)| {
                            let part = GgufTensorEntry {
                                // The file's name; the Hugging Face name says which expert.
                                name: t.name.clone(),
                                dims: t.dims[1..].to_vec(),
                                dtype: t.dtype,
                                start: t.start + e * each,
                                len: each,
                            };
                            (hf, part)
                        })
                        .collect()
                }
            };
            for (hf, tensor) in parts {
                let rotary_heads = rotary_heads(&config, &hf);
                let entry = Entry {
                    tensor,
                    rotary_heads,
                };
                if let Some(prev) = entries.insert(hf.clone(), entry) {
                    candle_core::bail!(
                        "{file_name}: tensors {} and {} both map to {hf}",
                        prev.tensor.name,
                        entries[&hf].tensor.name
                    );
                }
            }
        }
        config.check_required(&file_name, |hf| entries.contains_key(hf))?;
        Ok(Self {
            path,
            mmap,
            entries,
            config,
            tokenizer,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model configuration of the metadata.
    pub fn config(&self) -> &LlamaGgufConfig {
        &self.config
    }

    /// The tokenizer (vocabulary, merges, special ids, chat template) of the metadata.
    pub fn tokenizer(&self) -> &GgufTokenizer {
        &self.tokenizer
    }

    /// The ggml type of the Hugging Face tensor `name`.
    pub fn dtype_of(&self, name: &str) -> Option<GgmlDType> {
        self.entries.get(name).map(|e| e.tensor.dtype)
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries.get(name).ok_or_else(|| {
            candle_core::Error::msg(format!(
                "tensor '{name}' is not in the GGUF file {}",
                self.path.display()
            ))
        })
    }

    fn order(&self, e: &Entry, rows: usize) -> Result<RowOrder> {
        match e.rotary_heads {
            Some(heads) => RowOrder::rotary(rows, heads).map_err(|m| {
                candle_core::Error::msg(format!(
                    "{}: tensor {}: {m}",
                    self.path.display(),
                    e.tensor.name
                ))
            }),
            None => Ok(RowOrder::Identity),
        }
    }
}

impl TensorSource for GgufSource {
    fn num_tensors(&self) -> Option<usize> {
        Some(self.entries.len())
    }

    fn shape(&self, name: &str) -> Result<Option<Shape>> {
        Ok(self
            .entries
            .get(name)
            .map(|e| Shape::from(e.tensor.dims.clone())))
    }

    fn load(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let n = self.entry(name)?.tensor.dims[0];
        self.load_ranges(&RangeRequest {
            name,
            dim: 0,
            ranges: std::slice::from_ref(&(0..n)),
            dtype,
            device,
        })
    }

    fn load_ranges(&self, req: &RangeRequest<'_>) -> Result<Tensor> {
        match self.load_weight(req)? {
            WeightShard::Dense(t) => Ok(t),
            WeightShard::Quantized(q) => q.dequantize(req.device)?.to_dtype(req.dtype),
        }
    }

    fn load_weight(&self, req: &RangeRequest<'_>) -> Result<WeightShard> {
        let (name, dim, ranges, dtype, device) =
            (req.name, req.dim, req.ranges, req.dtype, req.device);
        let e = self.entry(name)?;
        let t = &e.tensor;
        // Vectors (norms, biases) are matrices of one row here.
        let (rows, cols, dim) = match t.dims.as_slice() {
            [n] => (1, *n, 1),
            [r, c] => (*r, *c, dim),
            d => candle_core::bail!(
                "{}: tensor {} has shape {d:?}; only vectors and matrices are loaded",
                self.path.display(),
                t.name
            ),
        };
        let bytes = &self.mmap[t.start..t.start + t.len];
        let what = quant_shard::Named {
            file: &self.path,
            tensor: &t.name,
            hf: name,
        };
        let order = self.order(e, rows)?;
        let shard = quant_shard::shard(
            &what,
            bytes,
            t.dtype,
            (rows, cols),
            &order,
            dim,
            ranges,
            device,
        )?;
        let vector = t.dims.len() == 1;
        match shard {
            WeightShard::Quantized(q) if !QuantType::of(q.dtype()).dense && !vector => {
                Ok(WeightShard::Quantized(q))
            }
            WeightShard::Quantized(q) => {
                let d = q.dequantize(device)?.to_dtype(dtype)?;
                Ok(WeightShard::Dense(if vector {
                    d.flatten_all()?
                } else {
                    d
                }))
            }
            WeightShard::Dense(d) => Ok(WeightShard::Dense(if vector {
                d.flatten_all()?.to_dtype(dtype)?
            } else {
                d.to_dtype(dtype)?
            })),
        }
    }

    fn split_unit(&self, name: &str, dim: usize) -> Result<usize> {
        let e = self.entry(name)?;
        if dim == 0 || e.tensor.dims.len() != 2 {
            return Ok(1);
        }
        Ok(quant_shard::kernel_unit(e.tensor.dtype))
    }
}

impl std::fmt::Debug for GgufSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufSource")
            .field("path", &self.path)
            .field("tensors", &self.entries.len())
            .finish()
    }
}
