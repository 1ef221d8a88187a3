//! A Llama-style causal LM for training with tensor and sequence parallelism.
//!
//! Same tensor names and layout as Hugging Face's `LlamaForCausalLM` (so a saved checkpoint
//! loads with the inference loaders), built from the crate's layers
//! ([`ColumnParallelLinear`], [`RowParallelLinear`], vocabulary-parallel embedding), with
//! every op differentiable (RMSNorm, RoPE and softmax are composed of Candle ops). The
//! inference attention keeps a KV cache and does its own `copy_to_tp`; training needs the
//! pieces separately to put Megatron-SP's all-gather / reduce-scatter around them.
//!
//! Sequence parallelism (`sequence_parallel = true`): the residual stream is split along the
//! sequence (dim 1) across the TP group; norms and hidden dropout run on the local rows;
//! [`gather_from_sp`] enters each column-parallel block and [`reduce_scatter_to_sp`] leaves
//! each row-parallel one. The norm weights then get partial gradients: see
//! [`TrainLlama::sequence_parallel_params`] and [`crate::train::grads`].

use candle_core::{DType, Device, Module, Result, Tensor, D};

pub use super::config::TrainConfig;
use super::dropout::{Dropout, Site};
use crate::comm::ProcessGroup;
use crate::loader::ShardedVarBuilder;
use crate::nn::{GatedMlp, SparseMoe};
use crate::ops::{copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp};
use crate::stage::{PipelineStage, StagePart};
use crate::{ColumnParallelLinear, Partition, RowParallelLinear};
use candle_nn::Activation;

/// RMSNorm of composed ops (differentiable), as Hugging Face's `LlamaRMSNorm` in f32.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let norm = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?;
    x.broadcast_div(&norm)?.broadcast_mul(w)
}

/// RoPE tables `[max_pos, head_dim]` (cos and sin repeated over both halves).
fn rope_tables(cfg: &TrainConfig, dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
    let hd = cfg.head_dim();
    let inv: Vec<f32> = (0..hd / 2)
        .map(|i| 1.0 / (cfg.rope_theta as f32).powf(2.0 * i as f32 / hd as f32))
        .collect();
    let inv = Tensor::from_vec(inv, (1, hd / 2), dev)?;
    let pos = Tensor::arange(0u32, cfg.max_position_embeddings as u32, dev)?
        .to_dtype(DType::F32)?
        .unsqueeze(1)?;
    let f = pos.broadcast_mul(&inv)?;
    let f = Tensor::cat(&[&f, &f], 1)?;
    Ok((f.cos()?.to_dtype(dtype)?, f.sin()?.to_dtype(dtype)?))
}

/// `x·cos + rotate_half(x)·sin` on `[b, heads, seq, head_dim]` (Hugging Face's layout).
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let hd = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, hd / 2)?;
    let x2 = x.narrow(D::Minus1, hd / 2, hd / 2)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rot.broadcast_mul(sin)?
}

/// A layer's feed-forward block.
enum FeedForward {
    /// A gated MLP split column/row: the inference decoders' [`GatedMlp`].
    Dense(Box<GatedMlp>),
    /// A sparse MoE, every expert split column/row over the group or whole experts on each
    /// of its expert groups ([`ShardedVarBuilder::with_expert_parallel`]).
    Moe(SparseMoe),
}

struct Layer {
    input_norm: Tensor,
    post_norm: Tensor,
    q: ColumnParallelLinear,
    k: ColumnParallelLinear,
    v: ColumnParallelLinear,
    o: RowParallelLinear,
    ffn: FeedForward,
}

/// The training model. See the [module docs](self).
///
/// Built for a pipeline stage ([`ShardedVarBuilder::with_pipeline`]), it holds that stage's
/// layers (the first stage the embedding, the last the final norm and the head, both the
/// embedding matrix when tied) and runs them with [`embed_input`](Self::embed_input),
/// [`forward_layers`](Self::forward_layers) and [`forward_head`](Self::forward_head); the
/// schedules of [`crate::pipeline`] drive them ([`crate::pipeline::train_step`]).
pub struct TrainLlama {
    cfg: TrainConfig,
    /// The first stage's embedding (every rank's without a pipeline).
    embed: Option<Tensor>,
    vocab: Partition,
    /// This stage's layers, `layer_start..` of the model's.
    layers: Vec<Layer>,
    layer_start: usize,
    /// The last stage's final norm and head.
    norm: Option<Tensor>,
    head: Option<Tensor>,
    stage: Option<PipelineStage>,
    /// With tied embeddings on two stages: the first and the last stage (Megatron's embedding
    /// group), which sum the matrix's gradients.
    embed_group: Option<ProcessGroup>,
    cos: Tensor,
    sin: Tensor,
    pg: ProcessGroup,
    sequence_parallel: bool,
    norm_names: Vec<String>,
    router_names: Vec<String>,
    /// The load-balancing loss of the last `forward_layers`, for `take_aux_loss`.
    aux_loss: std::sync::Mutex<Option<Tensor>>,
}

impl TrainLlama {
    /// Builds the model from `vb` (a [`TrainInit`](super::TrainInit) builder to train from scratch, or a
    /// checkpoint) on the TP group `vb.pg()`. KV heads are split whole: the TP size must not
    /// exceed `num_key_value_heads`. MoE layers split every expert column/row over the group,
    /// or, when `vb` was made with [`ShardedVarBuilder::with_expert_parallel`]`(Some(ep))`
    /// (as the inference models' `--ep`), hold whole experts in `ep` groups of consecutive
    /// ranks, each expert split over its group's ranks (Megatron-core's EP × expert-TP; one
    /// rank per group: whole experts on each rank).
    pub fn load(cfg: &TrainConfig, vb: ShardedVarBuilder, sequence_parallel: bool) -> Result<Self> {
        cfg.check()?;
        let pg = vb.pg().clone();
        let tp = pg.size();
        let (h, hd, nh, nkv) = (
            cfg.hidden_size,
            cfg.head_dim(),
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        );
        if tp > nkv {
            candle_core::bail!(
                "TrainLlama: tensor-parallel size {tp} exceeds num_key_value_heads {nkv} (training splits whole KV heads)"
            );
        }
        let vocab = Partition::new(cfg.vocab_size, tp).map_err(|e| {
            candle_core::Error::msg(format!(
                "TrainLlama: cannot split a vocabulary of {} over {tp} ranks: {e}",
                cfg.vocab_size
            ))
        })?;
        let stage = vb.pipeline().cloned();
        let part = StagePart::of(stage.as_ref(), "TrainLlama", cfg.num_hidden_layers)?;
        let (first, last, range) = (part.first, part.last, part.layers.clone());
        let m = vb.pp("model");
        let embed = if part.holds_embedding(cfg.tie_word_embeddings) {
            Some(
                m.pp("embed_tokens")
                    .get_sharded((cfg.vocab_size, h), "weight", 0, &vocab)?,
            )
        } else {
            None
        };
        let moe = cfg.moe();
        let expert_tp = vb.expert_parallel().map(|e| e.expert_tp.clone());
        if let (Some(e), None) = (vb.expert_parallel(), &moe) {
            candle_core::bail!(
                "TrainLlama: expert parallelism ({} expert groups) asked for a model without experts (num_local_experts = 0)",
                e.ep
            );
        }
        let n_rep = nh / nkv;
        let mut layers = Vec::with_capacity(range.len());
        let mut norm_names = Vec::new();
        let mut router_names = Vec::new();
        for l in range.clone() {
            let lv = m.pp("layers").pp(l);
            let a = lv.pp("self_attn");
            let ffn = match &moe {
                None => {
                    let i = cfg.intermediate_size;
                    FeedForward::Dense(Box::new(GatedMlp::load(
                        h,
                        i,
                        Activation::Silu,
                        lv.pp("mlp"),
                    )?))
                }
                Some(moe) => {
                    let vb = lv.pp("block_sparse_moe");
                    router_names.push(vb.pp(&moe.router).full_name("weight"));
                    FeedForward::Moe(match &expert_tp {
                        Some(etp) => SparseMoe::load_expert_tensor_parallel(
                            moe,
                            vb,
                            pg.clone(),
                            etp.clone(),
                        )?,
                        None => SparseMoe::load(moe, vb)?,
                    })
                }
            };
            norm_names.push(lv.pp("input_layernorm").full_name("weight"));
            norm_names.push(lv.pp("post_attention_layernorm").full_name("weight"));
            layers.push(Layer {
                input_norm: lv.pp("input_layernorm").get(h, "weight")?,
                post_norm: lv.pp("post_attention_layernorm").get(h, "weight")?,
                q: ColumnParallelLinear::load(h, nh * hd, false, n_rep * hd, a.pp("q_proj"))?,
                k: ColumnParallelLinear::load(h, nkv * hd, false, hd, a.pp("k_proj"))?,
                v: ColumnParallelLinear::load(h, nkv * hd, false, hd, a.pp("v_proj"))?,
                o: RowParallelLinear::load(nh * hd, h, false, n_rep * hd, a.pp("o_proj"))?,
                ffn,
            });
        }
        let (norm, head) = if last {
            norm_names.push(m.pp("norm").full_name("weight"));
            let head = match &embed {
                Some(e) if cfg.tie_word_embeddings => e.clone(),
                _ => vb
                    .pp("lm_head")
                    .get_sharded((cfg.vocab_size, h), "weight", 0, &vocab)?,
            };
            (Some(m.pp("norm").get(h, "weight")?), Some(head))
        } else {
            (None, None)
        };
        let embed_group = match &stage {
            Some(s) if cfg.tie_word_embeddings && s.count() > 1 && (first || last) => s
                .group()
                .new_group_named(&[0, s.count() - 1], "embedding")
                .map_err(candle_core::Error::wrap)?,
            _ => None,
        };
        let embed = embed.filter(|_| first);
        let (cos, sin) = rope_tables(cfg, vb.dtype(), vb.device())?;
        Ok(Self {
            cfg: cfg.clone(),
            embed,
            vocab,
            layers,
            layer_start: range.start,
            norm,
            head,
            stage,
            embed_group,
            cos,
            sin,
            pg,
            sequence_parallel,
            norm_names,
            router_names,
            aux_loss: std::sync::Mutex::new(None),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// How the vocabulary (embedding rows, logits) is split.
    pub fn vocab_partition(&self) -> &Partition {
        &self.vocab
    }

    /// The tensor-parallel group.
    pub fn pg(&self) -> &ProcessGroup {
        &self.pg
    }

    /// Whether the residual stream is sequence-parallel.
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// Switches sequence parallelism on or off (same weights; only the forward's
    /// communication pattern and the activations' layout change).
    pub fn set_sequence_parallel(&mut self, on: bool) {
        self.sequence_parallel = on;
    }

    /// Names of the parameters that live in the sequence-parallel region (the RMSNorm
    /// weights). With sequence parallelism each rank's gradient of them covers only its
    /// sequence rows, so they must be summed over the TP group after backward.
    pub fn sequence_parallel_params(&self) -> &[String] {
        &self.norm_names
    }

    /// Names of every parameter whose gradient each rank of the TP group holds only in part,
    /// to be summed over the group after backward
    /// ([`crate::train::all_reduce_grads`] with `average = false`): the MoE routers (each
    /// rank's gradient reaches them only through its own experts or expert slices), and with
    /// sequence parallelism the [`sequence_parallel_params`](Self::sequence_parallel_params).
    pub fn partial_gradient_params(&self) -> Vec<String> {
        let mut names = self.router_names.clone();
        if self.sequence_parallel {
            names.extend(self.norm_names.iter().cloned());
        }
        names
    }

    /// The MoE layers' load-balancing loss of the last [`forward_layers`](Self::forward_layers)
    /// (or [`forward`](Self::forward)) on this rank, taken: `router_aux_loss_coef` times the sum
    /// over this stage's MoE layers of Megatron-core's per-layer loss `E · Σ_e f_e · P_e`
    /// (`f_e`: the share of the tokens' top-k choices that went to expert `e`, summing to 1;
    /// `P_e`: the mean router probability of `e`; 1 per layer when balanced). Add it to the
    /// loss before backward ([`crate::pipeline::train_step`] does). `None` without MoE layers
    /// or with a coefficient of 0.
    ///
    /// Every rank of the TP group computes the same value from the same routing and adds it,
    /// and the router's and the hidden states' gradients are summed over the group, so its
    /// gradient is divided by the group's size (its value is not).
    pub fn take_aux_loss(&self) -> Option<Tensor> {
        self.aux_loss.lock().ok().and_then(|mut a| a.take())
    }

    fn seq_partition(&self, seq: usize) -> Result<Partition> {
        Partition::new(seq, self.pg.size()).map_err(|e| {
            candle_core::Error::msg(format!(
                "sequence parallelism: cannot split a sequence of {seq} over {} ranks: {e}",
                self.pg.size()
            ))
        })
    }

    /// Enters a TP region from the residual stream: all-gather (SP) or copy.
    fn enter(&self, x: &Tensor, sp: &Partition) -> Result<Tensor> {
        if self.sequence_parallel {
            gather_from_sp(x, &self.pg, sp, 1)
        } else {
            copy_to_tp(x, &self.pg)
        }
    }

    /// Leaves a TP region with partial sums: reduce-scatter (SP) or all-reduce.
    fn leave(&self, y: &Tensor, sp: &Partition) -> Result<Tensor> {
        if self.sequence_parallel {
            reduce_scatter_to_sp(y, &self.pg, sp, 1)
        } else {
            reduce_from_tp(y, &self.pg)
        }
    }

    /// Vocabulary-parallel lookup: this rank's rows, zeros elsewhere (partial sums).
    fn embed_partial(&self, embed: &Tensor, ids: &Tensor) -> Result<Tensor> {
        let flat: Vec<u32> = ids.flatten_all()?.to_dtype(DType::U32)?.to_vec1()?;
        let r = self.vocab.range(self.pg.rank());
        if let Some(bad) = flat.iter().find(|&&i| i as usize >= self.vocab.total()) {
            candle_core::bail!(
                "TrainLlama: token id {bad} is outside the vocabulary of {}",
                self.vocab.total()
            );
        }
        let (idx, mask): (Vec<u32>, Vec<u8>) = flat
            .iter()
            .map(|&i| match r.contains(&(i as usize)) {
                true => (i - r.start as u32, 1),
                false => (0, 0),
            })
            .unzip();
        let n = idx.len();
        let dev = embed.device();
        let idx = Tensor::from_vec(idx, n, dev)?;
        let mut dims = ids.dims().to_vec();
        dims.push(self.cfg.hidden_size);
        // Zero foreign ids by selection: multiplying row 0 by zero turns an Inf into NaN,
        // which the all-reduce then spreads to every rank.
        let rows = embed.index_select(&idx, 0)?;
        let keep = Tensor::from_vec(mask, (n, 1), dev)?.broadcast_as(rows.shape())?;
        keep.where_cond(&rows, &rows.zeros_like()?)?.reshape(dims)
    }

    fn attention(&self, layer: &Layer, x: &Tensor, drop: &Dropout, l: usize) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let hd = self.cfg.head_dim();
        let nq = layer.q.out_partition().size(self.pg.rank()) / hd;
        let nkv = layer.k.out_partition().size(self.pg.rank()) / hd;
        let heads = |t: Tensor, n: usize| -> Result<Tensor> {
            t.reshape((b, s, n, hd))?.transpose(1, 2)?.contiguous()
        };
        let cos = self.cos.narrow(0, 0, s)?;
        let sin = self.sin.narrow(0, 0, s)?;
        let q = apply_rope(&heads(layer.q.forward_local(x)?, nq)?, &cos, &sin)?;
        let k = apply_rope(&heads(layer.k.forward_local(x)?, nkv)?, &cos, &sin)?;
        let v = heads(layer.v.forward_local(x)?, nkv)?;
        let rep = nq / nkv;
        let expand = |t: Tensor| -> Result<Tensor> {
            if rep == 1 {
                return Ok(t);
            }
            t.unsqueeze(2)?
                .broadcast_as((b, nkv, rep, s, hd))?
                .reshape((b, nq, s, hd))
        };
        let (k, v) = (expand(k)?, expand(v)?);
        let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
        let mask: Vec<f32> = (0..s)
            .flat_map(|i| (0..s).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (s, s), x.device())?.to_dtype(att.dtype())?;
        let att = candle_nn::ops::softmax(&att.broadcast_add(&mask)?, D::Minus1)?;
        // Attention dropout acts on this rank's heads: a per-rank seed (Megatron's
        // model-parallel RNG).
        let att = drop.apply_per_rank(&att, Site::Attention(l), self.pg.rank())?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, s, nq * hd))?;
        layer.o.forward_partial(&y)
    }

    /// The pipeline stage the model was built for (`None`: the whole model).
    pub fn pipeline(&self) -> Option<&PipelineStage> {
        self.stage.as_ref()
    }

    /// With tied embeddings split over pipeline stages: the group of the first and the last
    /// stage, both of which hold the embedding matrix; their gradients of it must be summed
    /// over this group before the optimizer step (see [`crate::pipeline::train_step`]).
    pub fn embedding_group(&self) -> Option<&ProcessGroup> {
        self.embed_group.as_ref()
    }

    /// This rank's share of the tied embedding matrix (`None` when the head is not tied or this
    /// stage holds neither the embedding nor the head).
    pub fn tied_embedding(&self) -> Option<&Tensor> {
        if !self.cfg.tie_word_embeddings {
            return None;
        }
        self.embed.as_ref().or(self.head.as_ref())
    }

    /// The dtype of the weights and activations.
    pub fn dtype(&self) -> DType {
        self.cos.dtype()
    }

    /// The rows of the residual stream this rank holds for a sequence of `seq` tokens: all of
    /// them, or its share with sequence parallelism.
    fn rows(&self, seq: usize) -> Result<std::ops::Range<usize>> {
        Ok(if self.sequence_parallel {
            self.seq_partition(seq)?.range(self.pg.rank())
        } else {
            0..seq
        })
    }

    /// The shape of this rank's residual stream `[batch, rows, hidden]` for `batch` sequences
    /// of `seq` tokens: what one stage hands the next.
    pub fn residual_shape(&self, batch: usize, seq: usize) -> Result<Vec<usize>> {
        Ok(vec![batch, self.rows(seq)?.len(), self.cfg.hidden_size])
    }

    /// The first stage's input: token ids `[batch, seq]` embedded into this rank's residual
    /// stream ([`residual_shape`](Self::residual_shape)).
    pub fn embed_input(&self, ids: &Tensor) -> Result<Tensor> {
        let Some(embed) = &self.embed else {
            candle_core::bail!(
                "TrainLlama: embed_input on pipeline stage {:?}, which has no embedding (the first stage embeds)",
                self.stage.as_ref().map(|s| s.index())
            );
        };
        let (_, s) = ids.dims2()?;
        let part = self.embed_partial(embed, ids)?;
        self.leave(&part, &self.seq_partition(s)?)
    }

    /// This rank's layers over its residual stream `h` (of sequences of `seq` tokens).
    pub fn forward_layers(&self, h: &Tensor, seq: usize, drop: &Dropout) -> Result<Tensor> {
        let sp = self.seq_partition(seq)?;
        let eps = self.cfg.rms_norm_eps;
        let rows = self.rows(seq)?;
        let mut h = h.clone();
        let coef = self.cfg.router_aux_loss_coef;
        let mut aux: Option<Tensor> = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let l = self.layer_start + i;
            let x = self.enter(&rms_norm(&h, &layer.input_norm, eps)?, &sp)?;
            let y = self.leave(&self.attention(layer, &x, drop, l)?, &sp)?;
            let y = drop.apply_shared(&y, Site::AttentionOut(l), seq, &rows)?;
            h = (h + y)?;
            let x = self.enter(&rms_norm(&h, &layer.post_norm, eps)?, &sp)?;
            let (y, balance) = Self::feed_forward(&layer.ffn, &x, coef != 0.0)?;
            if let Some(b) = balance {
                aux = Some(match aux {
                    Some(a) => (a + b)?,
                    None => b,
                });
            }
            let y = self.leave(&y, &sp)?;
            let y = drop.apply_shared(&y, Site::MlpOut(l), seq, &rows)?;
            h = (h + y)?;
        }
        let aux = match aux {
            // `a/p + (a - a/p)`: the value `a`, the gradient `1/p` of `a`'s.
            Some(a) => {
                let a = (a * coef)?;
                let part = (&a / self.pg.size() as f64)?;
                Some((&part + (a - &part)?.detach())?)
            }
            None => None,
        };
        if let Ok(mut slot) = self.aux_loss.lock() {
            *slot = aux;
        }
        Ok(h)
    }

    /// A feed-forward block's partial sums over the entered hidden states `x` `[b, s, h]`,
    /// and, when `balance` is asked of an MoE block, its load-balancing loss.
    fn feed_forward(
        ffn: &FeedForward,
        x: &Tensor,
        balance: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        match ffn {
            FeedForward::Dense(mlp) => Ok((mlp.forward_partial(x)?, None)),
            FeedForward::Moe(moe) => {
                let dims = x.dims().to_vec();
                let x = x.reshape(((), dims[dims.len() - 1]))?;
                if balance {
                    let (y, b) = moe.forward_partial_balanced(&x)?;
                    Ok((y.reshape(dims)?, Some(b)))
                } else {
                    Ok((moe.forward_partial(&x)?.reshape(dims)?, None))
                }
            }
        }
    }

    /// The last stage's output: the final norm and the head over the residual stream `h` of
    /// `batch` sequences of `seq` tokens, this rank's slice of the logits
    /// `[batch * seq, vocab_partition().size(rank)]`.
    pub fn forward_head(&self, h: &Tensor, batch: usize, seq: usize) -> Result<Tensor> {
        let (Some(norm), Some(head)) = (&self.norm, &self.head) else {
            candle_core::bail!(
                "TrainLlama: forward_head on pipeline stage {:?}, which has no head (the last stage has it)",
                self.stage.as_ref().map(|s| s.index())
            );
        };
        let x = self.enter(
            &rms_norm(h, norm, self.cfg.rms_norm_eps)?,
            &self.seq_partition(seq)?,
        )?;
        let logits = candle_nn::Linear::new(head.clone(), None).forward(&x)?;
        logits.reshape((batch * seq, self.vocab.size(self.pg.rank())))
    }

    /// This rank's slice of the logits, `[batch * seq, vocab_partition().size(rank)]`, for
    /// token ids `[batch, seq]`. The logits cover the whole sequence also with sequence
    /// parallelism (gathered before the head, as Megatron does). Without a pipeline only.
    pub fn forward(&self, ids: &Tensor, drop: &Dropout) -> Result<Tensor> {
        let (b, s) = ids.dims2()?;
        let h = self.forward_layers(&self.embed_input(ids)?, s, drop)?;
        self.forward_head(&h, b, s)
    }
}
