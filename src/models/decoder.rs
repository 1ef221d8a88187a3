//! The decoder every causal-LM family shares: vocabulary-parallel embedding, decoder layers
//! (replicated RmsNorms, head-parallel [`ParallelAttention`], a gated MLP or a sparse MoE
//! split across the ranks), final norm and vocabulary-parallel LM head. A family is a
//! [`DecoderConfig`] (its `config.json` resolved into these hooks) and nothing else.

use std::path::Path;

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor};
use candle_nn::Activation;

use crate::nn::RmsNorm;

mod batch;
mod stage;

pub use batch::SeqStep;

use crate::comm::ProcessGroup;
use crate::loader::{LoadProgress, ShardedVarBuilder};
use crate::models::checkpoint::FromCheckpoint;
use crate::nn::{
    load_rms_norm, AttentionConfig, GatedMlp, MoeConfig, ParallelAttention, ParallelLmHead,
    RmsNormSpec, RotaryEmbedding, SparseMoe, VocabParallelEmbedding,
};
use crate::stage::{PipelineStage, StagePart};

/// The feed-forward block of a decoder layer.
#[derive(Debug, Clone, PartialEq)]
pub enum FeedForward {
    /// A gated MLP split over the intermediate features: `gate_proj`, `up_proj`, `down_proj`,
    /// or with `fused` one `gate_up_proj` (Phi-3) and `down_proj`.
    Gated {
        /// Intermediate width.
        intermediate_size: usize,
        /// Activation of the gate.
        act: Activation,
        /// Gate and up projections fused in one `gate_up_proj` tensor.
        fused: bool,
    },
    /// A sparse mixture of experts (Mixtral, Qwen3-MoE).
    Moe(MoeConfig),
}

/// One decoder layer's settings (families whose layers differ, such as Gemma's alternating
/// local and global attention or Qwen3-MoE's dense layers, give each its own).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerConfig {
    /// The attention block.
    pub attention: AttentionConfig,
    /// The feed-forward block.
    pub feed_forward: FeedForward,
}

/// A decoder-only model's settings, resolved from a family's `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderConfig {
    /// The `architectures` entry (e.g. `Qwen3ForCausalLM`).
    pub architecture: String,
    /// Model width.
    pub hidden_size: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// Every RmsNorm of the model (Gemma: `1 + w`).
    pub norm: RmsNormSpec,
    /// The layers, in order.
    pub layers: Vec<LayerConfig>,
    /// Whether the LM head shares the embedding table.
    pub tie_word_embeddings: bool,
    /// Factor applied to the embeddings (Gemma: `sqrt(hidden_size)`).
    pub embedding_multiplier: Option<f64>,
    /// Final-logit soft-capping `c` (Gemma 2): logits become `c * tanh(logits / c)`.
    pub final_logit_softcapping: Option<f64>,
    /// Gemma's sandwich norms: `post_attention_layernorm` normalises the attention output,
    /// `pre_feedforward_layernorm` and `post_feedforward_layernorm` surround the MLP.
    pub sandwich_norms: bool,
    /// Name of the feed-forward block under a layer (`mlp`, Mixtral's `block_sparse_moe`).
    pub feed_forward_name: String,
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (one or several).
    pub eos_token_ids: Vec<u32>,
}

impl DecoderConfig {
    /// A decoder with every layer's settings in `layers` and RmsNorms `norm`, and none of the
    /// families' hooks: an untied LM head, no embedding multiplier, no soft-capping, no
    /// sandwich norms, the feed-forward block under `mlp`, no special token ids. Families set
    /// the rest on top of it.
    pub fn new(
        architecture: impl Into<String>,
        hidden_size: usize,
        vocab_size: usize,
        max_position_embeddings: usize,
        norm: RmsNormSpec,
        layers: Vec<LayerConfig>,
    ) -> Self {
        Self {
            architecture: architecture.into(),
            hidden_size,
            vocab_size,
            max_position_embeddings,
            norm,
            layers,
            tie_word_embeddings: false,
            embedding_multiplier: None,
            final_logit_softcapping: None,
            sandwich_norms: false,
            feed_forward_name: "mlp".into(),
            bos_token_id: None,
            eos_token_ids: Vec::new(),
        }
    }
}

#[derive(Debug, Clone)]
enum FeedForwardLayer {
    Gated(Box<GatedMlp>),
    Moe(SparseMoe),
}

impl FeedForwardLayer {
    /// A gated MLP is split evenly, whatever the attention's split: the two all-reduce one
    /// after the other, so a rank with an extra KV group waits at the attention's and a rank
    /// given extra MLP columns to make up for it would wait at the MLP's. Balancing them so
    /// (`GatedMlp::load_balanced`, until 2026-11-28) made SmolLM2 Q4_0 at world 2 3-4 %
    /// slower: decode 450 against 468 tok/s, 16 streams 12.5 against 12.1 ms per step.
    fn load(cfg: &FeedForward, hidden: usize, vb: ShardedVarBuilder) -> Result<Self> {
        Ok(match cfg {
            FeedForward::Gated {
                intermediate_size,
                act,
                fused: false,
            } => Self::Gated(Box::new(GatedMlp::load_named(
                hidden,
                *intermediate_size,
                *act,
                ["gate_proj", "up_proj", "down_proj"],
                vb,
            )?)),
            FeedForward::Gated {
                intermediate_size,
                act,
                fused: true,
            } => Self::Gated(Box::new(GatedMlp::load_fused(
                hidden,
                *intermediate_size,
                *act,
                vb,
            )?)),
            // Expert-parallel: each expert group's experts, split over the group's ranks.
            FeedForward::Moe(m) => match vb.expert_parallel().map(|e| e.expert_tp.clone()) {
                Some(expert_tp) => {
                    let group = vb.pg().clone();
                    Self::Moe(SparseMoe::load_expert_tensor_parallel(
                        m, vb, group, expert_tp,
                    )?)
                }
                None => Self::Moe(SparseMoe::load(m, vb)?),
            },
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Gated(m) => m.forward(x),
            Self::Moe(m) => m.forward(x),
        }
    }

    /// Whether the block's products do not depend on the row count (a MoE's router is a
    /// dense product).
    fn rows_invariant(&self) -> bool {
        match self {
            Self::Gated(m) => m.rows_invariant(),
            Self::Moe(_) => false,
        }
    }
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: ParallelAttention,
    post_attention_layernorm: RmsNorm,
    /// Gemma's `pre_feedforward_layernorm` and `post_feedforward_layernorm`.
    sandwich: Option<(RmsNorm, RmsNorm)>,
    feed_forward: FeedForwardLayer,
    /// Index of this layer's rotary tables in `CausalLm::ropes`.
    rope: usize,
}

impl DecoderLayer {
    fn load(cfg: &DecoderConfig, i: usize, rope: usize, vb: ShardedVarBuilder) -> Result<Self> {
        let (h, spec) = (cfg.hidden_size, cfg.norm);
        let layer = &cfg.layers[i];
        let sandwich = if cfg.sandwich_norms {
            Some((
                load_rms_norm(h, spec, &vb.pp("pre_feedforward_layernorm"))?,
                load_rms_norm(h, spec, &vb.pp("post_feedforward_layernorm"))?,
            ))
        } else {
            None
        };
        Ok(Self {
            input_layernorm: load_rms_norm(h, spec, &vb.pp("input_layernorm"))?,
            self_attn: ParallelAttention::load(&layer.attention, vb.pp("self_attn"))?,
            post_attention_layernorm: load_rms_norm(h, spec, &vb.pp("post_attention_layernorm"))?,
            sandwich,
            feed_forward: FeedForwardLayer::load(
                &layer.feed_forward,
                h,
                vb.pp(&cfg.feed_forward_name),
            )?,
            rope,
        })
    }

    /// The layer over `x`, its attention run by `attend(attention, normed x, rope)`: on the
    /// layer's own cache (one sequence) or on per-sequence caches (a batch).
    fn forward_with(
        &mut self,
        x: &Tensor,
        ropes: &[RotaryEmbedding],
        attend: impl FnOnce(&mut ParallelAttention, &Tensor, &RotaryEmbedding) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let a = attend(&mut self.self_attn, &h, &ropes[self.rope])?;
        match &self.sandwich {
            None => {
                let x = (a + x)?;
                let h = self.post_attention_layernorm.forward(&x)?;
                self.feed_forward.forward(&h)? + x
            }
            Some((pre, post)) => {
                let x = (self.post_attention_layernorm.forward(&a)? + x)?;
                let h = pre.forward(&x)?;
                post.forward(&self.feed_forward.forward(&h)?)? + x
            }
        }
    }
}

/// Whether two layers can share rotary tables.
fn same_rope(a: &AttentionConfig, b: &AttentionConfig) -> bool {
    a.head_dim == b.head_dim
        && a.rotary_dim == b.rotary_dim
        && a.rope_theta == b.rope_theta
        && a.rope_scaling == b.rope_scaling
        && a.max_position_embeddings == b.max_position_embeddings
}

/// A decoder-only causal LM of any supported family, its weights split across the ranks of
/// a group.
///
/// Every rank calls the forward methods with the same ids; each gets its slice of the
/// vocabulary's logits (or, with the `_gathered` methods, the full logits).
///
/// Loaded for a pipeline stage ([`ShardedVarBuilder::with_pipeline`]), it holds only that
/// stage's layers (the first stage also the embedding, the last the final norm and the LM
/// head, both when the embeddings are tied), split over the stage's tensor-parallel group.
/// Every rank of every stage then calls [`forward_stage`](Self::forward_stage) (or
/// [`forward_batch_stage`](Self::forward_batch_stage)) with the same ids: activations go from
/// stage to stage and the last stage gets the logits.
#[derive(Debug, Clone)]
pub struct CausalLm {
    /// The first stage's (and with tied embeddings the last's).
    embed_tokens: Option<VocabParallelEmbedding>,
    /// This stage's layers: `layer_range` of the model's.
    layers: Vec<DecoderLayer>,
    layer_range: std::ops::Range<usize>,
    /// The last stage's final norm and LM head.
    norm: Option<RmsNorm>,
    lm_head: Option<ParallelLmHead>,
    ropes: Vec<RotaryEmbedding>,
    config: DecoderConfig,
    pg: ProcessGroup,
    stage: Option<PipelineStage>,
    /// The activations' dtype (the builder's).
    dtype: DType,
    /// The precision of the KV caches [`CausalLm::new_kv_cache`] makes (`None`: the
    /// activations').
    kv_cache_dtype: Option<DType>,
}

impl CausalLm {
    /// Builds the model from `vb` (the checkpoint root: `model.embed_tokens`,
    /// `model.layers.N`, `model.norm`, `lm_head`), splitting over `vb.pg()`; with
    /// [`vb.pipeline()`](ShardedVarBuilder::pipeline) only that stage's part (an error names
    /// the sizes when the stages do not fit the layers).
    pub fn load(cfg: &DecoderConfig, vb: ShardedVarBuilder) -> Result<Self> {
        let pg = vb.pg().clone();
        if cfg.layers.is_empty() {
            candle_core::bail!("{}: the model has no layers", cfg.architecture);
        }
        for a in cfg.layers.iter().map(|l| &l.attention) {
            if pg.size() > a.num_heads {
                candle_core::bail!(
                    "{}: world size {} is larger than num_attention_heads = {} (num_key_value_heads = {}): at most {} ranks",
                    cfg.architecture,
                    pg.size(),
                    a.num_heads,
                    a.num_kv_heads,
                    a.num_heads
                );
            }
        }
        let stage = vb.pipeline().cloned();
        let part = StagePart::of(stage.as_ref(), &cfg.architecture, cfg.layers.len())?;
        let (first, last, layer_range) = (part.first, part.last, part.layers.clone());
        let m = vb.pp("model");
        let embed_tokens = if part.holds_embedding(cfg.tie_word_embeddings) {
            Some(VocabParallelEmbedding::load(
                cfg.vocab_size,
                cfg.hidden_size,
                m.pp("embed_tokens"),
            )?)
        } else {
            None
        };
        let mut ropes: Vec<RotaryEmbedding> = Vec::new();
        let mut rope_cfgs: Vec<&AttentionConfig> = Vec::new();
        let mut layers = Vec::with_capacity(layer_range.len());
        for (i, l) in cfg.layers.iter().enumerate() {
            if !layer_range.contains(&i) {
                continue;
            }
            let rope = match rope_cfgs.iter().position(|c| same_rope(c, &l.attention)) {
                Some(r) => r,
                None => {
                    ropes.push(RotaryEmbedding::new(&l.attention, vb.dtype(), vb.device())?);
                    rope_cfgs.push(&l.attention);
                    ropes.len() - 1
                }
            };
            layers.push(DecoderLayer::load(cfg, i, rope, m.pp("layers").pp(i))?);
        }
        let (norm, lm_head) = if last {
            let norm = load_rms_norm(cfg.hidden_size, cfg.norm, &m.pp("norm"))?;
            let lm_head = match &embed_tokens {
                Some(e) if cfg.tie_word_embeddings => ParallelLmHead::tied(e),
                _ => ParallelLmHead::load(cfg.hidden_size, cfg.vocab_size, vb.pp("lm_head"))?,
            };
            (Some(norm), Some(lm_head))
        } else {
            (None, None)
        };
        let embed_tokens = embed_tokens.filter(|_| first);
        Ok(Self {
            embed_tokens,
            layers,
            layer_range,
            norm,
            lm_head,
            ropes,
            config: cfg.clone(),
            pg,
            stage,
            dtype: vb.dtype(),
            kv_cache_dtype: None,
        })
    }

    /// Loads a Hugging Face model directory (`config.json`, whose `architectures` picks the
    /// family, and `model.safetensors` or its index and shards); each rank reads only its
    /// slices.
    pub fn from_dir(
        dir: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
    ) -> Result<Self> {
        <Self as FromCheckpoint>::from_dir(dir, dtype, device, pg)
    }

    /// Loads a llama.cpp GGUF file: the configuration comes from its metadata (as a Hugging
    /// Face `config.json`, so the family dispatch is the same), and each rank copies only the
    /// quantized blocks of its shards out of the memory-mapped file and keeps them quantized.
    /// Activations are f32.
    pub fn from_gguf(path: impl AsRef<Path>, device: &Device, pg: ProcessGroup) -> Result<Self> {
        <Self as FromCheckpoint>::from_gguf(path, device, pg)
    }

    /// [`CausalLm::from_gguf`] for a `.gguf` file, [`CausalLm::from_dir`] (in `dtype`)
    /// otherwise.
    pub fn from_path(
        path: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
    ) -> Result<Self> {
        <Self as FromCheckpoint>::from_path(path, dtype, device, pg)
    }

    /// [`CausalLm::from_path`], reporting every tensor this rank reads to `progress` (for a
    /// progress bar: `examples/generate.rs` draws one on a terminal).
    pub fn from_path_with_progress(
        path: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
        progress: LoadProgress,
    ) -> Result<Self> {
        <Self as FromCheckpoint>::from_path_with_progress(path, dtype, device, pg, progress)
    }

    /// The hidden states after the final norm, `[batch, seq, hidden]`, running `ids`
    /// `[batch, seq]` at positions `index_pos..` and extending the KV caches. On a pipeline
    /// stage other than the last, an error after the activations went on (use
    /// [`forward_stage`](Self::forward_stage)).
    pub fn forward_hidden_all(&mut self, ids: &Tensor, index_pos: usize) -> Result<Tensor> {
        let h = self.forward_hidden_stage(ids, index_pos)?;
        self.on_last_stage(h, "forward_hidden_all")
    }

    /// This stage's part of a forward pass (the whole pass without a pipeline): runs `ids`
    /// `[batch, seq]` at positions `index_pos..` through this stage's layers, taking the
    /// activations from the previous stage (the first embeds `ids`) and handing them to the
    /// next; the last stage returns the hidden states after the final norm, the others
    /// `None`.
    fn forward_hidden_stage(&mut self, ids: &Tensor, index_pos: usize) -> Result<Option<Tensor>> {
        let (batch, seq_len) = ids.dims2()?;
        if seq_len == 0 {
            candle_core::bail!("{}: empty input (no tokens)", self.config.architecture);
        }
        // One hand-off to rayon's pool for the whole pass (see `crate::pool`).
        crate::pool::on_worker(|| {
            let mut x = self.stage_input(ids, &[batch, seq_len, self.config.hidden_size])?;
            for layer in &mut self.layers {
                x = layer
                    .forward_with(&x, &self.ropes, |a, h, rope| a.forward(h, index_pos, rope))?;
            }
            self.stage_output(x)
        })
    }

    /// The hidden state after the final norm at the last position, `[batch, hidden]`.
    pub fn forward_hidden(&mut self, ids: &Tensor, index_pos: usize) -> Result<Tensor> {
        let h = self.forward_hidden_all(ids, index_pos)?;
        let seq_len = h.dims()[1];
        h.i((.., seq_len - 1, ..))?.contiguous()
    }

    fn logits(&self, h: &Tensor, gathered: bool) -> Result<Tensor> {
        crate::pool::on_worker(|| self.logits_here(h, gathered))
    }

    fn logits_here(&self, h: &Tensor, gathered: bool) -> Result<Tensor> {
        let head = self.head("the logits")?;
        let logits = if gathered {
            head.forward_gathered(h)?
        } else {
            head.forward(h)?
        }
        .to_dtype(DType::F32)?;
        match self.config.final_logit_softcapping {
            None => Ok(logits),
            Some(c) => (logits / c)?.tanh()? * c,
        }
    }

    /// On every stage of a pipeline (or without one): this rank's slice of the last
    /// position's logits, `[batch, vocab_part]`, in f32, on the last stage, and `None` on the
    /// others, which handed their activations on. Every rank of every stage calls it with the
    /// same `ids` (only their shape matters after the first stage).
    pub fn forward_stage(&mut self, ids: &Tensor, index_pos: usize) -> Result<Option<Tensor>> {
        match self.forward_hidden_stage(ids, index_pos)? {
            Some(h) => {
                let seq_len = h.dims()[1];
                let h = h.i((.., seq_len - 1, ..))?.contiguous()?;
                Ok(Some(self.logits(&h, false)?))
            }
            None => Ok(None),
        }
    }

    /// This rank's slice of the last position's logits, `[batch, vocab_part]`, in f32.
    pub fn forward(&mut self, ids: &Tensor, index_pos: usize) -> Result<Tensor> {
        let h = self.forward_hidden(ids, index_pos)?;
        self.logits(&h, false)
    }

    /// The last position's full logits `[batch, vocab]` (all-gathered), in f32.
    pub fn forward_gathered(&mut self, ids: &Tensor, index_pos: usize) -> Result<Tensor> {
        let h = self.forward_hidden(ids, index_pos)?;
        self.logits(&h, true)
    }

    /// This rank's slice of every position's logits, `[batch, seq, vocab_part]`, in f32.
    pub fn forward_all(&mut self, ids: &Tensor, index_pos: usize) -> Result<Tensor> {
        let h = self.forward_hidden_all(ids, index_pos)?;
        self.logits(&h, false)
    }

    /// Every position's full logits `[batch, seq, vocab]` (all-gathered), in f32.
    pub fn forward_all_gathered(&mut self, ids: &Tensor, index_pos: usize) -> Result<Tensor> {
        let h = self.forward_hidden_all(ids, index_pos)?;
        self.logits(&h, true)
    }

    /// Empties every layer's KV cache (a new sequence starts at position 0): this stage's.
    pub fn clear_kv_cache(&mut self) {
        for l in &mut self.layers {
            l.self_attn.clear_kv_cache();
        }
    }

    /// Whether every product of this stage (each layer's projections and MLP, and the LM
    /// head) gives a row the same bits whatever the number of rows it runs with, so that
    /// sequences of any lengths may share a forward pass without changing each other's
    /// logits: true when all of them are the crate's quantized kernels
    /// ([`ParallelWeight::rows_invariant`](crate::nn::ParallelWeight::rows_invariant)). The
    /// norms, rotary embeddings and attention work row by row or sequence by sequence.
    pub fn rows_invariant(&self) -> bool {
        self.layers
            .iter()
            .all(|l| l.self_attn.rows_invariant() && l.feed_forward.rows_invariant())
            && self.lm_head.as_ref().is_none_or(|h| h.rows_invariant())
    }

    /// The LM head (its vocabulary partition is the one of [`CausalLm::forward`]'s output);
    /// `None` on a pipeline stage other than the last.
    pub fn lm_head(&self) -> Option<&ParallelLmHead> {
        self.lm_head.as_ref()
    }

    /// The attention layer of decoder layer `i` (the model's numbering), if this rank holds
    /// it.
    pub fn attention(&self, i: usize) -> Option<&ParallelAttention> {
        self.local_layer(i).map(|l| &l.self_attn)
    }

    /// The gated MLP of decoder layer `i` (the model's numbering), if this rank holds it and
    /// it has one (its partition says how the ranks split the intermediate size: evenly, in
    /// whole quantization blocks).
    pub fn mlp(&self, i: usize) -> Option<&GatedMlp> {
        match self.local_layer(i).map(|l| &l.feed_forward) {
            Some(FeedForwardLayer::Gated(m)) => Some(m),
            _ => None,
        }
    }

    /// The MoE layer of decoder layer `i` (the model's numbering), if this rank holds it and
    /// it has one.
    pub fn moe(&self, i: usize) -> Option<&SparseMoe> {
        match self.local_layer(i).map(|l| &l.feed_forward) {
            Some(FeedForwardLayer::Moe(m)) => Some(m),
            _ => None,
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// The group the model is split over.
    pub fn pg(&self) -> &ProcessGroup {
        &self.pg
    }
}
