//! Tensor-parallel Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2), following
//! candle-transformers' `models/llama.rs` with parallel layers: vocabulary-parallel embedding
//! and LM head, head-parallel attention, intermediate-parallel gated MLP; RmsNorms replicated.

use std::path::Path;

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor};
use candle_nn::RmsNorm;

use crate::comm::ProcessGroup;
use crate::loader::ShardedVarBuilder;
use crate::models::LlamaConfig;
use crate::nn::{
    gated_mlp, GatedMlp, ParallelAttention, ParallelLmHead, RotaryEmbedding, VocabParallelEmbedding,
};

fn rms_norm(cfg: &LlamaConfig, vb: &ShardedVarBuilder) -> Result<RmsNorm> {
    Ok(RmsNorm::new(
        vb.get(cfg.hidden_size, "weight")?,
        cfg.rms_norm_eps,
    ))
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: ParallelAttention,
    post_attention_layernorm: RmsNorm,
    mlp: GatedMlp,
}

impl DecoderLayer {
    fn load(cfg: &LlamaConfig, vb: ShardedVarBuilder) -> Result<Self> {
        Ok(Self {
            input_layernorm: rms_norm(cfg, &vb.pp("input_layernorm"))?,
            self_attn: ParallelAttention::load(&cfg.attention(), vb.pp("self_attn"))?,
            post_attention_layernorm: rms_norm(cfg, &vb.pp("post_attention_layernorm"))?,
            mlp: gated_mlp(cfg.hidden_size, cfg.intermediate_size, vb.pp("mlp"))?,
        })
    }

    fn forward(&mut self, x: &Tensor, index_pos: usize, rope: &RotaryEmbedding) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let x = (self.self_attn.forward(&h, index_pos, rope)? + x)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        self.mlp.forward(&h)? + x
    }
}

/// A Llama-family causal LM whose weights are split across the ranks of a group.
///
/// Every rank of the group calls [`Llama::forward`] with the same ids; each gets its slice of
/// the vocabulary's logits (or, with [`Llama::forward_gathered`], the full logits).
#[derive(Debug, Clone)]
pub struct Llama {
    embed_tokens: VocabParallelEmbedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: ParallelLmHead,
    rope: RotaryEmbedding,
    config: LlamaConfig,
    pg: ProcessGroup,
}

impl Llama {
    /// Builds the model from `vb` (the checkpoint root: `model.embed_tokens`, `model.layers.N`,
    /// `model.norm`, `lm_head`), splitting over `vb.pg()`.
    pub fn load(cfg: &LlamaConfig, vb: ShardedVarBuilder) -> Result<Self> {
        let pg = vb.pg().clone();
        if pg.size() > cfg.num_attention_heads {
            candle_core::bail!(
                "{}: world size {} is larger than num_attention_heads = {} (num_key_value_heads = {}): at most {} ranks",
                cfg.architecture,
                pg.size(),
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.num_attention_heads
            );
        }
        let m = vb.pp("model");
        let embed_tokens =
            VocabParallelEmbedding::load(cfg.vocab_size, cfg.hidden_size, m.pp("embed_tokens"))?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::load(cfg, m.pp("layers").pp(i)))
            .collect::<Result<Vec<_>>>()?;
        let norm = rms_norm(cfg, &m.pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            ParallelLmHead::tied(&embed_tokens)
        } else {
            ParallelLmHead::load(cfg.hidden_size, cfg.vocab_size, vb.pp("lm_head"))?
        };
        let rope = RotaryEmbedding::new(&cfg.attention(), vb.dtype(), vb.device())?;
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            config: cfg.clone(),
            pg,
        })
    }

    /// Loads a Hugging Face model directory (`config.json` and `model.safetensors` or its
    /// index and shards); each rank reads only its slices.
    pub fn from_dir(
        dir: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            candle_core::bail!(
                "model directory {}: config.json is missing ({})",
                dir.display(),
                config_path.display()
            );
        }
        let cfg = LlamaConfig::from_file(&config_path)?;
        let vb = ShardedVarBuilder::from_safetensors_dir(dir, dtype, device, pg)?;
        Self::load(&cfg, vb)
    }

    /// Loads a llama.cpp GGUF file (configuration from its metadata): each rank copies only
    /// the quantized blocks of its shards out of the memory-mapped file and keeps them
    /// quantized; norms are dequantized to f32. Activations are f32.
    pub fn from_gguf(path: impl AsRef<Path>, device: &Device, pg: ProcessGroup) -> Result<Self> {
        let path = path.as_ref();
        let source = crate::loader::GgufSource::open(path)?;
        let cfg = source.config().to_hf_config(source.tokenizer())?;
        let cfg = LlamaConfig::from_json(&cfg.to_string(), &path.display().to_string())?;
        let vb = ShardedVarBuilder::new(std::sync::Arc::new(source), DType::F32, device, pg);
        Self::load(&cfg, vb)
    }

    /// [`Llama::from_gguf`] for a `.gguf` file, [`Llama::from_dir`] (in `dtype`) otherwise.
    pub fn from_path(
        path: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
    ) -> Result<Self> {
        let path = path.as_ref();
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            Self::from_gguf(path, device, pg)
        } else {
            Self::from_dir(path, dtype, device, pg)
        }
    }

    /// The hidden state after the final norm at the last position, `[batch, hidden]`,
    /// running `ids` `[batch, seq]` at positions `index_pos..` and extending the KV caches.
    pub fn forward_hidden(&mut self, ids: &Tensor, index_pos: usize) -> Result<Tensor> {
        let (_, seq_len) = ids.dims2()?;
        if seq_len == 0 {
            candle_core::bail!("Llama::forward: empty input (no tokens)");
        }
        let mut x = self.embed_tokens.forward(ids)?;
        for layer in &mut self.layers {
            x = layer.forward(&x, index_pos, &self.rope)?;
        }
        let x = self.norm.forward(&x)?;
        x.i((.., seq_len - 1, ..))?.contiguous()
    }

    /// This rank's slice of the last position's logits, `[batch, vocab_part]`, in f32.
    pub fn forward(&mut self, ids: &Tensor, index_pos: usize) -> Result<Tensor> {
        let h = self.forward_hidden(ids, index_pos)?;
        self.lm_head.forward(&h)?.to_dtype(DType::F32)
    }

    /// The last position's full logits `[batch, vocab]` (all-gathered), in f32.
    pub fn forward_gathered(&mut self, ids: &Tensor, index_pos: usize) -> Result<Tensor> {
        let h = self.forward_hidden(ids, index_pos)?;
        self.lm_head.forward_gathered(&h)?.to_dtype(DType::F32)
    }

    /// Empties every layer's KV cache (a new sequence starts at position 0).
    pub fn clear_kv_cache(&mut self) {
        for l in &mut self.layers {
            l.self_attn.clear_kv_cache();
        }
    }

    /// The LM head (its vocabulary partition is the one of [`Llama::forward`]'s output).
    pub fn lm_head(&self) -> &ParallelLmHead {
        &self.lm_head
    }

    /// The attention layer of decoder layer `i`, if it exists.
    pub fn attention(&self, i: usize) -> Option<&ParallelAttention> {
        self.layers.get(i).map(|l| &l.self_attn)
    }

    /// The model's configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The group the model is split over.
    pub fn pg(&self) -> &ProcessGroup {
        &self.pg
    }
}
