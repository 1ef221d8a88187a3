//! A tensor-parallel BERT encoder (Hugging Face `BertModel`) and the sentence-transformers
//! pooling, for sentence embeddings such as all-MiniLM-L6-v2.
//!
//! The split follows Megatron-LM: the word embeddings are vocabulary-parallel; the query, key
//! and value projections are column-parallel by whole heads (uneven head counts allowed, 12
//! heads on 5 ranks are 3 + 3 + 2 + 2 + 2); the attention output projection and the second
//! feed-forward projection are row-parallel, all-reduced before their (replicated) bias, the
//! residual and the LayerNorm. Position and token-type embeddings and every LayerNorm are
//! replicated. Each layer therefore costs two all-reduces of `[batch, seq, hidden]`.
//!
//! With one rank the model computes exactly what candle-transformers'
//! `models::bert::BertModel` computes.

use std::path::Path;

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Embedding, LayerNorm};
use serde::Deserialize;

use crate::comm::ProcessGroup;
use crate::loader::ShardedVarBuilder;
use crate::ops::copy_to_tp;
use crate::{ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding};

/// The feed-forward activation named by `hidden_act` in `config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HiddenAct {
    /// `"gelu"`: the exact GELU, `x Φ(x)` with the error function (as PyTorch's default).
    Gelu,
    /// `"gelu_new"`, `"gelu_pytorch_tanh"` or `"gelu_approximate"`: the tanh approximation.
    GeluApproximate,
    /// `"relu"`.
    Relu,
}

impl HiddenAct {
    /// Parses a `hidden_act` value of a Hugging Face config.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "gelu" => Ok(Self::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_approximate" => Ok(Self::GeluApproximate),
            "relu" => Ok(Self::Relu),
            other => candle_core::bail!(
                "unsupported hidden_act '{other}' (supported: gelu, gelu_new, gelu_pytorch_tanh, gelu_approximate, relu)"
            ),
        }
    }

    /// Applies the activation.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Gelu => x.gelu_erf(),
            Self::GeluApproximate => x.gelu(),
            Self::Relu => x.relu(),
        }
    }
}

/// The fields of a Hugging Face BERT `config.json` that inference needs.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    /// Rows of the word-embedding table.
    pub vocab_size: usize,
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Number of encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Feed-forward activation.
    pub hidden_act: HiddenAct,
    /// Rows of the position-embedding table (the longest input).
    pub max_position_embeddings: usize,
    /// Rows of the token-type (segment) embedding table.
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// Id used to pad a batch.
    pub pad_token_id: u32,
    /// `model_type` (`"bert"`), if the config names it.
    pub model_type: Option<String>,
}

#[derive(Deserialize)]
struct RawConfig {
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    intermediate_size: usize,
    hidden_act: String,
    max_position_embeddings: usize,
    #[serde(default = "default_type_vocab")]
    type_vocab_size: usize,
    #[serde(default = "default_eps")]
    layer_norm_eps: f64,
    #[serde(default)]
    pad_token_id: u32,
    #[serde(default)]
    position_embedding_type: Option<String>,
    #[serde(default)]
    model_type: Option<String>,
}

fn default_type_vocab() -> usize {
    2
}

fn default_eps() -> f64 {
    1e-12
}

impl BertConfig {
    /// Parses the text of a `config.json`; `origin` names it in errors.
    pub fn from_json_str(json: &str, origin: &str) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(json)
            .map_err(|e| candle_core::Error::msg(format!("{origin}: not a BERT config: {e}")))?;
        if let Some(t) = raw.model_type.as_deref() {
            if t != "bert" {
                candle_core::bail!("{origin}: unsupported model_type '{t}' (supported: bert)");
            }
        }
        if let Some(p) = raw.position_embedding_type.as_deref() {
            if p != "absolute" {
                candle_core::bail!(
                    "{origin}: unsupported position_embedding_type '{p}' (supported: absolute)"
                );
            }
        }
        let hidden_act = HiddenAct::parse(&raw.hidden_act)
            .map_err(|e| candle_core::Error::msg(format!("{origin}: {e}")))?;
        if raw.num_attention_heads == 0 || !raw.hidden_size.is_multiple_of(raw.num_attention_heads)
        {
            candle_core::bail!(
                "{origin}: hidden_size {} is not a multiple of num_attention_heads {}",
                raw.hidden_size,
                raw.num_attention_heads
            );
        }
        Ok(Self {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            intermediate_size: raw.intermediate_size,
            hidden_act,
            max_position_embeddings: raw.max_position_embeddings,
            type_vocab_size: raw.type_vocab_size,
            layer_norm_eps: raw.layer_norm_eps,
            pad_token_id: raw.pad_token_id,
            model_type: raw.model_type,
        })
    }

    /// Reads a `config.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| {
            candle_core::Error::msg(format!("cannot read BERT config {}: {e}", path.display()))
        })?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
}

fn layer_norm(size: usize, eps: f64, vb: &ShardedVarBuilder) -> Result<LayerNorm> {
    Ok(LayerNorm::new(
        vb.get(size, "weight")?,
        vb.get(size, "bias")?,
        eps,
    ))
}

/// Word (vocabulary-parallel), position and token-type embeddings, summed and normalised.
#[derive(Debug, Clone)]
struct BertEmbeddings {
    word: VocabParallelEmbedding,
    position: Embedding,
    token_type: Embedding,
    norm: LayerNorm,
    max_positions: usize,
}

impl BertEmbeddings {
    fn load(cfg: &BertConfig, vb: &ShardedVarBuilder) -> Result<Self> {
        let h = cfg.hidden_size;
        let word = VocabParallelEmbedding::load(cfg.vocab_size, h, vb.pp("word_embeddings"))?;
        let position = Embedding::new(
            vb.pp("position_embeddings")
                .get((cfg.max_position_embeddings, h), "weight")?,
            h,
        );
        let token_type = Embedding::new(
            vb.pp("token_type_embeddings")
                .get((cfg.type_vocab_size, h), "weight")?,
            h,
        );
        let norm = layer_norm(h, cfg.layer_norm_eps, &vb.pp("LayerNorm"))?;
        Ok(Self {
            word,
            position,
            token_type,
            norm,
            max_positions: cfg.max_position_embeddings,
        })
    }

    fn forward(&self, input_ids: &Tensor, token_type_ids: &Tensor) -> Result<Tensor> {
        let (_, seq_len) = input_ids.dims2()?;
        if seq_len > self.max_positions {
            candle_core::bail!(
                "BERT input of {seq_len} tokens is longer than max_position_embeddings {}",
                self.max_positions
            );
        }
        // Same order of additions as candle-transformers: (word + type) + position.
        let x = (self.word.forward(input_ids)? + self.token_type.forward(token_type_ids)?)?;
        let positions = Tensor::arange(0u32, seq_len as u32, input_ids.device())?;
        let x = x.broadcast_add(&self.position.forward(&positions)?)?;
        self.norm.forward(&x)
    }
}

/// Self-attention over this rank's heads, the row-parallel output projection, the residual
/// and the LayerNorm (Hugging Face's `BertAttention`).
#[derive(Debug, Clone)]
struct BertAttention {
    query: ColumnParallelLinear,
    key: ColumnParallelLinear,
    value: ColumnParallelLinear,
    dense: RowParallelLinear,
    norm: LayerNorm,
    local_heads: usize,
    head_dim: usize,
    pg: ProcessGroup,
}

impl BertAttention {
    fn load(cfg: &BertConfig, vb: &ShardedVarBuilder) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let sa = vb.pp("self");
        let query = ColumnParallelLinear::load(h, h, true, hd, sa.pp("query"))?;
        let key = ColumnParallelLinear::load(h, h, true, hd, sa.pp("key"))?;
        let value = ColumnParallelLinear::load(h, h, true, hd, sa.pp("value"))?;
        let out = vb.pp("output");
        let dense = RowParallelLinear::load(h, h, true, hd, out.pp("dense"))?;
        let norm = layer_norm(h, cfg.layer_norm_eps, &out.pp("LayerNorm"))?;
        let pg = vb.pg().clone();
        Ok(Self {
            local_heads: query.out_partition().units_of(pg.rank()),
            query,
            key,
            value,
            dense,
            norm,
            head_dim: hd,
            pg,
        })
    }

    fn heads(&self, x: &Tensor) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        x.reshape((b, s, self.local_heads, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()
    }

    /// `mask` is the additive mask `[batch, 1, 1, seq]`.
    fn forward(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let xp = copy_to_tp(x, &self.pg)?;
        let q = self.heads(&self.query.forward_local(&xp)?)?;
        let k = self.heads(&self.key.forward_local(&xp)?)?;
        let v = self.heads(&self.value.forward_local(&xp)?)?;
        let scores = (q.matmul(&k.t()?)? / (self.head_dim as f64).sqrt())?;
        // Softmax in f32 (as Hugging Face's Llama does; a bf16 sum over the keys loses digits).
        let scores = scores.broadcast_add(mask)?;
        let probs = candle_nn::ops::softmax(&scores.to_dtype(DType::F32)?, D::Minus1)?
            .to_dtype(scores.dtype())?;
        let ctx = probs.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((
            b,
            s,
            self.local_heads * self.head_dim,
        ))?;
        let y = self.dense.forward(&ctx)?;
        self.norm.forward(&(y + x)?)
    }
}

/// The feed-forward block: column-parallel `intermediate.dense` + activation, row-parallel
/// `output.dense`, residual and LayerNorm.
#[derive(Debug, Clone)]
struct BertFeedForward {
    up: ColumnParallelLinear,
    act: HiddenAct,
    down: RowParallelLinear,
    norm: LayerNorm,
}

impl BertFeedForward {
    fn load(cfg: &BertConfig, vb: &ShardedVarBuilder) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let up = ColumnParallelLinear::load(h, i, true, 1, vb.pp("intermediate").pp("dense"))?;
        let out = vb.pp("output");
        let down = RowParallelLinear::load(i, h, true, 1, out.pp("dense"))?;
        let norm = layer_norm(h, cfg.layer_norm_eps, &out.pp("LayerNorm"))?;
        Ok(Self {
            up,
            act: cfg.hidden_act,
            down,
            norm,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.down.forward(&self.act.apply(&self.up.forward(x)?)?)?;
        self.norm.forward(&(y + x)?)
    }
}

#[derive(Debug, Clone)]
struct BertLayer {
    attention: BertAttention,
    ffn: BertFeedForward,
}

/// A tensor-parallel BERT encoder: token ids in, last hidden states `[batch, seq, hidden]`
/// out, replicated on every rank. It loads through
/// [`FromCheckpoint`](crate::models::FromCheckpoint) (`BertModel::from_dir`).
#[derive(Debug, Clone)]
pub struct BertModel {
    embeddings: BertEmbeddings,
    layers: Vec<BertLayer>,
    config: BertConfig,
    pg: ProcessGroup,
    device: Device,
}

impl BertModel {
    /// Loads this rank's share of the weights from `vb`, whose tensors carry the Hugging Face
    /// names, with or without a `bert.` (or `<model_type>.`) prefix.
    ///
    /// Errors when the group has more ranks than the model has attention heads.
    pub fn load(config: &BertConfig, vb: ShardedVarBuilder) -> Result<Self> {
        let pg = vb.pg().clone();
        if pg.size() > config.num_attention_heads {
            candle_core::bail!(
                "BERT: world size {} of group '{}' is larger than num_attention_heads {}: every rank needs at least one head",
                pg.size(),
                pg.name(),
                config.num_attention_heads
            );
        }
        let vb = resolve_prefix(config, vb)?;
        let embeddings = BertEmbeddings::load(config, &vb.pp("embeddings"))?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let lb = vb.pp("encoder").pp("layer").pp(i);
                Ok(BertLayer {
                    attention: BertAttention::load(config, &lb.pp("attention"))?,
                    ffn: BertFeedForward::load(config, &lb)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embeddings,
            layers,
            config: config.clone(),
            pg,
            device: vb.device().clone(),
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// The group the model runs on.
    pub fn pg(&self) -> &ProcessGroup {
        &self.pg
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The last hidden states `[batch, seq, hidden]` for `input_ids` `[batch, seq]` (u32).
    /// `token_type_ids` defaults to zeros; `attention_mask` (`[batch, seq]`, 1 for tokens and
    /// 0 for padding, any dtype) to all ones. Every rank must call it with the same inputs.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        // One hand-off to rayon's pool for the whole pass (see `crate::pool`).
        crate::pool::on_worker(|| self.forward_here(input_ids, token_type_ids, attention_mask))
    }

    fn forward_here(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, s) = input_ids.dims2()?;
        let zeros;
        let token_type_ids = match token_type_ids {
            Some(t) => t,
            None => {
                zeros = input_ids.zeros_like()?;
                &zeros
            }
        };
        let mut x = self.embeddings.forward(input_ids, token_type_ids)?;
        let dtype = x.dtype();
        let mask = match attention_mask {
            Some(m) if m.dims() != [b, s] => candle_core::bail!(
                "BERT: attention_mask has shape {:?}, input_ids {:?}",
                m.dims(),
                [b, s]
            ),
            Some(m) => m.to_dtype(dtype)?,
            None => Tensor::ones((b, s), dtype, &self.device)?,
        };
        // (1 - mask) * finfo(dtype).min, as Hugging Face does. The minimum of the model's
        // dtype, not f32's: f32::MIN rounds to -inf in bf16 and f16, and 0 * -inf is NaN.
        let min = match dtype {
            DType::F16 => half::f16::MIN.to_f32(),
            DType::BF16 => half::bf16::MIN.to_f32(),
            _ => f32::MIN,
        };
        let min = Tensor::new(min, &self.device)?.to_dtype(dtype)?;
        let mask = (mask.ones_like()? - &mask)?
            .broadcast_mul(&min)?
            .reshape((b, 1, 1, s))?;
        for layer in &self.layers {
            x = layer.attention.forward(&x, &mask)?;
            x = layer.ffn.forward(&x)?;
        }
        Ok(x)
    }

    /// Sentence embeddings `[n, hidden]` for `n` tokenised sentences of any lengths: pads
    /// them into one batch with `pad_token_id`, runs the encoder, mean-pools over the real
    /// tokens and, with `normalize`, L2-normalises (sentence-transformers' `Normalize`).
    pub fn embed(&self, sentences: &[Vec<u32>], normalize: bool) -> Result<Tensor> {
        let (ids, mask) = pad_batch(sentences, self.config.pad_token_id, &self.device)?;
        let hidden = self.forward(&ids, None, Some(&mask))?;
        let pooled = mean_pool(&hidden, &mask)?;
        if normalize {
            l2_normalize(&pooled)
        } else {
            Ok(pooled)
        }
    }
}

fn resolve_prefix(cfg: &BertConfig, vb: ShardedVarBuilder) -> Result<ShardedVarBuilder> {
    let probe = "embeddings.word_embeddings.weight";
    let mut tried = vec![vb.full_name(probe)];
    if vb.contains(probe) {
        return Ok(vb);
    }
    let mut prefixes = vec!["bert".to_string()];
    if let Some(t) = &cfg.model_type {
        if t != "bert" {
            prefixes.push(t.clone());
        }
    }
    for p in prefixes {
        let sub = vb.pp(&p);
        if sub.contains(probe) {
            return Ok(sub);
        }
        tried.push(sub.full_name(probe));
    }
    candle_core::bail!(
        "BERT: the checkpoint has no word embeddings (tried tensors {})",
        tried.join(", ")
    )
}

/// Pads token-id sequences to the longest with `pad_id`: ids `[n, max_len]` (u32) and the
/// attention mask `[n, max_len]` (u32, 1 for tokens, 0 for padding).
pub fn pad_batch(sentences: &[Vec<u32>], pad_id: u32, device: &Device) -> Result<(Tensor, Tensor)> {
    if sentences.is_empty() {
        candle_core::bail!("pad_batch: no sentences to embed");
    }
    if let Some(i) = sentences.iter().position(|s| s.is_empty()) {
        candle_core::bail!("pad_batch: sentence {i} has no tokens");
    }
    let n = sentences.len();
    let len = sentences.iter().map(Vec::len).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(n * len);
    let mut mask = Vec::with_capacity(n * len);
    for s in sentences {
        let row_end = ids.len() + len;
        ids.extend_from_slice(s);
        ids.resize(row_end, pad_id);
        mask.resize(mask.len() + s.len(), 1u32);
        mask.resize(row_end, 0u32);
    }
    Ok((
        Tensor::from_vec(ids, (n, len), device)?,
        Tensor::from_vec(mask, (n, len), device)?,
    ))
}

/// sentence-transformers' mean pooling: the average of `hidden` `[batch, seq, h]` over the
/// positions where `mask` `[batch, seq]` is 1 (the count clamped at 1e-9).
pub fn mean_pool(hidden: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let mask = mask.to_dtype(hidden.dtype())?.unsqueeze(D::Minus1)?;
    let sum = hidden.broadcast_mul(&mask)?.sum(1)?;
    let count = mask.sum(1)?.clamp(1e-9, f64::INFINITY)?;
    sum.broadcast_div(&count)
}

/// Divides each row of `x` `[n, h]` by its L2 norm (at least 1e-12), as PyTorch's
/// `F.normalize(p=2, dim=1)`.
pub fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    let norm = x
        .sqr()?
        .sum_keepdim(D::Minus1)?
        .sqrt()?
        .clamp(1e-12, f64::INFINITY)?;
    x.broadcast_div(&norm)
}

impl crate::models::checkpoint::FromCheckpoint for BertModel {
    fn from_config_json(text: &str, origin: &str, vb: ShardedVarBuilder) -> Result<Self> {
        Self::load(&BertConfig::from_json_str(text, origin)?, vb)
    }
}
