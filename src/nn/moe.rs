//! Sparse mixture of experts (Mixtral, Qwen3-MoE) on a group of ranks, in one of two layouts:
//!
//! - tensor-parallel ([`SparseMoe::load`], Megatron style): the router is replicated, every
//!   expert's gated MLP is split column/row across the ranks like a dense [`GatedMlp`], and
//!   the layer all-reduces once, not once per expert;
//! - expert-parallel ([`SparseMoe::load_expert_parallel`]): each rank holds whole experts
//!   (a [`Partition`] of the expert index) and reads only their tensors. Hidden states that
//!   are the same on every rank (a tensor-parallel attention) go through this rank's experts
//!   and one all-reduce sums the ranks' parts, as above; each rank's own tokens (a
//!   data-parallel attention, [`SparseMoe::forward_local`]) go to their experts' ranks and
//!   come back by all-to-all (`expert_parallel.rs`);
//! - both ([`SparseMoe::load_expert_tensor_parallel`], Megatron-core's expert-tensor
//!   parallelism): the ranks form `ep` runs of `tp` consecutive ranks; each run holds whole
//!   experts, and each expert is split column/row over its run's ranks. The one all-reduce
//!   over every rank sums both the runs' experts and the slices.
//!
//! Routing must pick the same experts on every rank, or the ranks would compute partial sums
//! of different experts: it is computed from the replicated hidden state with the replicated
//! router weight, and that hidden state is bit-identical on every rank (the all-reduces every
//! rank runs reduce in rank order). Each rank then runs its slice of every selected expert on
//! the tokens routed to it, scales by the routing weight, sums into one partial output, and
//! the ranks reduce that once.

use candle_core::{Module, Result, Tensor};
use candle_nn::Activation;

use super::expert_parallel::forward_local;
use super::routing::Routing;
use crate::comm::ProcessGroup;
use crate::loader::ShardedVarBuilder;
use crate::nn::{GatedMlp, ReplicatedLinear};
use crate::ops::{copy_to_tp, reduce_from_tp};
use crate::Partition;

/// Shape and routing of a sparse MoE layer, and the checkpoint's tensor names.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Model width.
    pub hidden_size: usize,
    /// Width of one expert's gated MLP.
    pub intermediate_size: usize,
    /// Experts in the layer.
    pub num_experts: usize,
    /// Experts each token is routed to (top-k).
    pub num_experts_per_tok: usize,
    /// Whether the top-k routing weights are renormalised to sum to 1 (Mixtral always,
    /// Qwen3-MoE's `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// The experts' activation.
    pub act: Activation,
    /// The router's name under the layer (`gate`).
    pub router: String,
    /// The names of an expert's gate, up and down projections (`w1`, `w3`, `w2` in Mixtral;
    /// `gate_proj`, `up_proj`, `down_proj` in Qwen3-MoE), under `experts.N`.
    pub expert_names: [String; 3],
}

/// A sparse MoE layer over the ranks of a group: every expert split across them
/// ([`SparseMoe::load`]) or whole experts on each ([`SparseMoe::load_expert_parallel`]).
#[derive(Debug, Clone)]
pub struct SparseMoe {
    router: ReplicatedLinear,
    /// Every expert's slice (tensor-parallel), or this rank's whole experts (expert-parallel).
    experts: Vec<GatedMlp>,
    top_k: usize,
    norm_topk_prob: bool,
    pg: ProcessGroup,
    /// Expert-parallel: the experts of each expert group (each rank of `pg` when the experts
    /// are whole, each run of `expert_tp` ranks when they are split).
    owners: Option<Partition>,
    /// Expert-parallel: this rank's expert group, and its ranks (1 when experts are whole).
    ep_rank: usize,
    expert_tp: usize,
}

impl SparseMoe {
    /// Loads the router (replicated) and this rank's slice of every expert from `vb` (the
    /// layer's prefix, e.g. `model.layers.0.block_sparse_moe`).
    pub fn load(cfg: &MoeConfig, vb: ShardedVarBuilder) -> Result<Self> {
        let pg = vb.pg().clone();
        Self::load_experts(cfg, &vb, &vb, 0..cfg.num_experts, pg, None)
    }

    /// Loads the layer expert- and tensor-parallel over `group`: its ranks form
    /// `group.size() / expert_tp.size()` runs of consecutive ranks (`expert_tp` is this
    /// rank's run, e.g. ranks 0-1 and 2-3 of 4 for runs of 2); run `g` holds experts
    /// `Partition::new(num_experts, runs).range(g)`, each split column/row over the run's
    /// ranks like a dense [`GatedMlp`]. The forward takes hidden states replicated on `group`
    /// and all-reduces once over it. `expert_tp` of one rank is
    /// [`load_expert_parallel`](Self::load_expert_parallel).
    pub fn load_expert_tensor_parallel(
        cfg: &MoeConfig,
        vb: ShardedVarBuilder,
        group: ProcessGroup,
        expert_tp: ProcessGroup,
    ) -> Result<Self> {
        Self::check(cfg, &vb)?;
        let (p, tp) = (group.size(), expert_tp.size());
        if tp == 0 || !p.is_multiple_of(tp) || expert_tp.rank() != group.rank() % tp {
            candle_core::bail!(
                "'{}': rank {} of {p}: expert tensor-parallel runs of {tp} ranks (this rank {} \
                 of its run) do not tile the group into consecutive runs",
                vb.prefix(),
                group.rank(),
                expert_tp.rank()
            );
        }
        let runs = p / tp;
        let owners = Partition::new(cfg.num_experts, runs).map_err(|e| {
            candle_core::Error::Msg(format!(
                "'{}': {} experts over {runs} expert-parallel groups ({tp} ranks each): {e}",
                vb.prefix(),
                cfg.num_experts,
            ))
        })?;
        let ep_rank = group.rank() / tp;
        let sliced = vb.with_pg(expert_tp);
        let mine = owners.range(ep_rank);
        let mut moe = Self::load_experts(cfg, &vb, &sliced, mine, group, Some(owners))?;
        moe.ep_rank = ep_rank;
        moe.expert_tp = tp;
        Ok(moe)
    }

    /// Loads the layer expert-parallel over `ep`: the router replicated, and this rank's
    /// whole experts, rank `r` holding experts `Partition::new(num_experts, ep.size())
    /// .range(r)` (the first ranks one more when they do not divide evenly); no other
    /// expert's tensor is read. `vb`'s own group is not used.
    ///
    /// The forward takes the hidden states replicated on `ep` (as a tensor-parallel attention
    /// leaves them): every rank routes every token, runs its own experts on the tokens routed
    /// to them, and one all-reduce sums the parts (the tensor-parallel layout's one
    /// collective, with whole experts instead of every expert's slice).
    /// [`forward_local`](Self::forward_local) takes each rank's own tokens instead (a
    /// data-parallel attention) and moves them by all-to-all. Either equals the layer on one
    /// rank with every expert, up to the order of floating-point sums.
    pub fn load_expert_parallel(
        cfg: &MoeConfig,
        vb: ShardedVarBuilder,
        ep: ProcessGroup,
    ) -> Result<Self> {
        Self::load_expert_tensor_parallel(cfg, vb, ep, ProcessGroup::single())
    }

    /// The router (replicated, from `vb`) and the experts `which` (from `experts_vb`).
    fn load_experts(
        cfg: &MoeConfig,
        vb: &ShardedVarBuilder,
        experts_vb: &ShardedVarBuilder,
        which: std::ops::Range<usize>,
        pg: ProcessGroup,
        owners: Option<Partition>,
    ) -> Result<Self> {
        Self::check(cfg, vb)?;
        let router =
            ReplicatedLinear::load(cfg.hidden_size, cfg.num_experts, false, vb.pp(&cfg.router))?;
        let experts = which
            .map(|e| Self::load_expert(cfg, experts_vb, e))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            router,
            experts,
            top_k: cfg.num_experts_per_tok,
            norm_topk_prob: cfg.norm_topk_prob,
            pg,
            owners,
            ep_rank: 0,
            expert_tp: 1,
        })
    }

    fn load_expert(cfg: &MoeConfig, vb: &ShardedVarBuilder, e: usize) -> Result<GatedMlp> {
        let [g, u, d] = &cfg.expert_names;
        GatedMlp::load_named(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.act,
            [g.as_str(), u.as_str(), d.as_str()],
            vb.pp("experts").pp(e),
        )
    }

    fn check(cfg: &MoeConfig, vb: &ShardedVarBuilder) -> Result<()> {
        if cfg.num_experts == 0 || cfg.num_experts_per_tok == 0 {
            candle_core::bail!(
                "'{}': a MoE layer needs experts and top-k > 0 (num_experts = {}, num_experts_per_tok = {})",
                vb.prefix(),
                cfg.num_experts,
                cfg.num_experts_per_tok
            );
        }
        if cfg.num_experts_per_tok > cfg.num_experts {
            candle_core::bail!(
                "'{}': num_experts_per_tok = {} is more than num_experts = {}",
                vb.prefix(),
                cfg.num_experts_per_tok,
                cfg.num_experts
            );
        }
        Ok(())
    }

    /// The experts this rank holds: every expert's slice (tensor-parallel), or its whole
    /// experts (expert-parallel), in expert order.
    pub fn experts(&self) -> &[GatedMlp] {
        &self.experts
    }

    /// The experts of each expert group, when the layer is expert-parallel: of each rank of
    /// [`pg`](Self::pg), or of each run of [`expert_tp`](Self::expert_tp) ranks.
    pub fn expert_owners(&self) -> Option<Partition> {
        self.owners
    }

    /// This rank's expert group (its index in [`expert_owners`](Self::expert_owners)); 0
    /// when the layer is tensor-parallel.
    pub fn ep_rank(&self) -> usize {
        self.ep_rank
    }

    /// The ranks each expert is split over: 1 when experts are whole on a rank, the group
    /// size when the layer is tensor-parallel.
    pub fn expert_tp(&self) -> usize {
        if self.owners.is_some() {
            self.expert_tp
        } else {
            self.pg.size()
        }
    }

    /// The group the experts are split over.
    pub fn pg(&self) -> &ProcessGroup {
        &self.pg
    }

    /// For every token (row of `x` `[tokens, hidden]`), its top-k experts and their weights:
    /// softmax over the router logits in f32, the k largest (ties to the lower expert index),
    /// renormalised if `norm_topk_prob`. Per expert: (token rows, weights).
    pub fn route(&self, x: &Tensor) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
        self.routing(x)?.to_vecs()
    }

    /// [`route`](Self::route) with the weights as one tensor, differentiable with respect to
    /// the router and `x` when they track gradients.
    fn routing(&self, x: &Tensor) -> Result<Routing> {
        self.routing_of(&self.router.forward(x)?)
    }

    /// The routing of the router's `logits`.
    fn routing_of(&self, logits: &Tensor) -> Result<Routing> {
        let who = format!("SparseMoe on rank {}", self.pg.rank());
        Routing::top_k(logits, self.top_k, self.norm_topk_prob, &who)
    }
}

impl SparseMoe {
    /// Expert-parallel: this rank's own tokens `x` `[tokens, hidden]` (each rank its own, as a
    /// data-parallel attention leaves them) through their experts, wherever they live; every
    /// rank of the group calls it, with any number of tokens (none included).
    pub fn forward_local(&self, x: &Tensor) -> Result<Tensor> {
        let Some(owners) = &self.owners else {
            candle_core::bail!(
                "SparseMoe::forward_local on rank {}: the layer is tensor-parallel (load it with load_expert_parallel)",
                self.pg.rank()
            );
        };
        if self.expert_tp != 1 {
            candle_core::bail!(
                "SparseMoe::forward_local on rank {}: experts split over {} ranks take replicated \
                 hidden states (forward); each rank's own tokens need whole experts",
                self.pg.rank(),
                self.expert_tp
            );
        }
        let routing = self.routing(x)?;
        forward_local(&self.pg, owners, &self.experts, x, &routing)
    }
}

impl SparseMoe {
    /// This rank's partial sum of the layer over hidden states `xp` `[tokens, hidden]` that
    /// are the same on every rank of [`pg`](Self::pg) and already entered its region
    /// ([`copy_to_tp`], or a sequence-parallel all-gather): its experts' (or expert slices')
    /// outputs weighted by the routing, in the experts' partial dtype (f64 for quantized
    /// experts). Summing it over the group ([`reduce_from_tp`], or a reduce-scatter) gives the
    /// layer's output; [`forward`](Module::forward) does both.
    pub fn forward_partial(&self, xp: &Tensor) -> Result<Tensor> {
        self.routed(xp, &self.routing(xp)?)
    }

    /// [`forward_partial`](Self::forward_partial) and the routing's load-balancing loss
    /// (Megatron-core's: `E · Σ_e f_e · P_e`, 1 when balanced), the same on every rank of
    /// the group, differentiable with respect to the router and `xp`.
    pub fn forward_partial_balanced(&self, xp: &Tensor) -> Result<(Tensor, Tensor)> {
        let logits = self.router.forward(xp)?;
        let routing = self.routing_of(&logits)?;
        Ok((
            self.routed(xp, &routing)?,
            routing.load_balancing_loss(&logits)?,
        ))
    }

    /// The partial sums of `xp`'s tokens routed by `routing`.
    fn routed(&self, xp: &Tensor, routing: &Routing) -> Result<Tensor> {
        // Expert-parallel: this rank's whole experts; tensor-parallel: every expert's slice.
        let mine = match &self.owners {
            Some(owners) => owners.range(self.ep_rank),
            None => 0..routing.experts.len(),
        };
        // Summed in the experts' partial dtype (f64 for quantized experts: see
        // `RowParallelLinear::forward_partial`), reduced by the caller.
        let mut ys: Option<Tensor> = None;
        for (j, expert) in self.experts.iter().enumerate() {
            let e = mine.start + j;
            let rows = &routing.experts[e].0;
            // Tensor-parallel: the same experts are skipped on every rank (the routing is
            // replicated).
            if rows.is_empty() {
                continue;
            }
            let n = rows.len();
            let idx = Tensor::from_vec(rows.clone(), n, xp.device())?;
            let y = expert.forward_partial(&xp.index_select(&idx, 0)?)?;
            let w = routing.weights_of(e)?.to_dtype(y.dtype())?;
            let acc = match ys.take() {
                Some(acc) => acc,
                None => Tensor::zeros(xp.dims(), y.dtype(), xp.device())?,
            };
            ys = Some(acc.index_add(&idx, &y.broadcast_mul(&w)?, 0)?);
        }
        match ys {
            Some(ys) => Ok(ys),
            // Expert-parallel, no token for this rank's experts: zeros in the dtype the other
            // ranks' partial sums have (f64 for quantized experts), from an expert on no rows.
            None if self.owners.is_some() => {
                let dtype = self.experts[0]
                    .forward_partial(&xp.narrow(0, 0, 0)?)?
                    .dtype();
                Tensor::zeros(xp.dims(), dtype, xp.device())
            }
            None => xp.zeros_like(),
        }
    }
}

impl Module for SparseMoe {
    /// `x` `[batch, seq, hidden]` (replicated) → `[batch, seq, hidden]`, all-reduced once.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let hidden = *dims.last().unwrap_or(&0);
        let xp = copy_to_tp(&x.reshape(((), hidden))?, &self.pg)?;
        reduce_from_tp(&self.forward_partial(&xp)?, &self.pg)?
            .to_dtype(x.dtype())?
            .reshape(dims)
    }
}
