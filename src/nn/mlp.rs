//! Tensor-parallel MLPs: a column-parallel layer, the activation on the split hidden features,
//! a row-parallel layer. One all-reduce forward and one backward per MLP (Megatron).

use candle_core::{Module, Result, Tensor};
use candle_nn::Activation;

use super::linear::{ColumnParallelLinear, RowParallelLinear};
use crate::loader::ShardedVarBuilder;
use crate::ops::{copy_to_tp, reduce_from_tp};

/// The two-layer MLP `fc2(act(fc1(x)))` over any two layers: the 1D [`Mlp`], the 2D
/// [`Mlp2d`](crate::Mlp2d) and the 3D [`Mlp3d`](crate::Mlp3d). Each has its own `new` and
/// `load` (what makes two layers fit differs); the rest is shared.
#[derive(Debug, Clone)]
pub struct TwoLayerMlp<A, B> {
    pub(crate) fc1: A,
    pub(crate) fc2: B,
    pub(crate) act: Activation,
}

impl<A, B> TwoLayerMlp<A, B> {
    /// The first layer.
    pub fn fc1(&self) -> &A {
        &self.fc1
    }

    /// The second layer.
    pub fn fc2(&self) -> &B {
        &self.fc2
    }
}

impl<A: Module, B: Module> Module for TwoLayerMlp<A, B> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.forward(&self.act.forward(&self.fc1.forward(x)?)?)
    }
}

/// The tensor-parallel two-layer MLP (the seeds' d → 4d → d block with GELU, BERT's
/// feed-forward, GPT-2's MLP): a column-parallel `fc1` that leaves its output split, a
/// row-parallel `fc2`.
pub type Mlp = TwoLayerMlp<ColumnParallelLinear, RowParallelLinear>;

impl Mlp {
    /// From built layers (`fc1` must leave its output split, `fc2` take a split input).
    pub fn new(fc1: ColumnParallelLinear, fc2: RowParallelLinear, act: Activation) -> Self {
        Self { fc1, fc2, act }
    }

    /// Loads `fc1` (`[d_ff, d_model]`) and `fc2` (`[d_model, d_ff]`), both with bias, under
    /// the names `fc1_name` and `fc2_name` of `vb` (e.g. `"fc1"`, `"fc2"`).
    pub fn load(
        d_model: usize,
        d_ff: usize,
        act: Activation,
        fc1_name: &str,
        fc2_name: &str,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let fc1 = ColumnParallelLinear::load(d_model, d_ff, true, 1, vb.pp(fc1_name))?;
        let fc2 = RowParallelLinear::load(d_ff, d_model, true, 1, vb.pp(fc2_name))?;
        Ok(Self::new(fc1, fc2, act))
    }
}

/// `mlp(d_model, d_ff, act, vb)`: the two-layer MLP with tensors `fc1.*` and `fc2.*`.
pub fn mlp(d_model: usize, d_ff: usize, act: Activation, vb: ShardedVarBuilder) -> Result<Mlp> {
    Mlp::load(d_model, d_ff, act, "fc1", "fc2", vb)
}

/// The gated MLP of Llama, Mistral and Qwen2: `down_proj(act(gate_proj(x)) * up_proj(x))`,
/// with one `copy_to_tp` shared by the gate and up projections (one all-reduce backward).
#[derive(Debug, Clone)]
pub struct GatedMlp {
    gate_proj: ColumnParallelLinear,
    up_proj: ColumnParallelLinear,
    down_proj: RowParallelLinear,
    act: Activation,
}

impl GatedMlp {
    /// Whether the MLP's product rows do not depend on the row count (all three weights
    /// [`ParallelWeight::rows_invariant`](crate::nn::ParallelWeight::rows_invariant)).
    pub fn rows_invariant(&self) -> bool {
        self.gate_proj.parallel_weight().rows_invariant()
            && self.up_proj.parallel_weight().rows_invariant()
            && self.down_proj.parallel_weight().rows_invariant()
    }

    /// From built layers; `gate_proj` and `up_proj` must be split the same way.
    pub fn new(
        gate_proj: ColumnParallelLinear,
        up_proj: ColumnParallelLinear,
        down_proj: RowParallelLinear,
        act: Activation,
    ) -> Result<Self> {
        if gate_proj.out_partition() != up_proj.out_partition()
            || up_proj.out_partition() != down_proj.in_partition()
        {
            candle_core::bail!(
                "GatedMlp: gate_proj, up_proj and down_proj must split the intermediate size alike ({:?}, {:?}, {:?})",
                gate_proj.out_partition().sizes(),
                up_proj.out_partition().sizes(),
                down_proj.in_partition().sizes()
            );
        }
        Ok(Self {
            gate_proj,
            up_proj,
            down_proj,
            act,
        })
    }

    /// Loads `gate_proj`, `up_proj` (`[intermediate, hidden]`) and `down_proj`
    /// (`[hidden, intermediate]`), without bias, as Llama checkpoints name them.
    pub fn load(
        hidden: usize,
        intermediate: usize,
        act: Activation,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        Self::load_named(
            hidden,
            intermediate,
            act,
            ["gate_proj", "up_proj", "down_proj"],
            vb,
        )
    }

    /// [`GatedMlp::load`] with the checkpoint's names of the gate, up and down projections
    /// (Mixtral's experts: `w1`, `w3`, `w2`).
    pub fn load_named(
        hidden: usize,
        intermediate: usize,
        act: Activation,
        [gate, up, down]: [&str; 3],
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        Self::load_balanced(hidden, intermediate, act, [gate, up, down], (0, 0.0), vb)
    }

    /// [`GatedMlp::load_named`] on ranks whose other work differs: the first `lead_parts`
    /// ranks of the group carry `lead_extra` intermediate columns' worth more (one column is
    /// a gate, an up and a down row: `3 · hidden` multiply-adds per token), so they get that
    /// many fewer columns, as whole quantization blocks allow ([`crate::Partition::balancing`]).
    /// It pays only where that other work and the MLP end at one collective: a decoder layer
    /// that all-reduces after its attention and again after its MLP makes each rank wait at
    /// one of the two, so the crate's decoders split evenly (balanced against SmolLM2's uneven
    /// KV groups, decode ran 3-4 % slower). `(0, 0.0)`: the even split.
    pub fn load_balanced(
        hidden: usize,
        intermediate: usize,
        act: Activation,
        [gate, up, down]: [&str; 3],
        (lead_parts, lead_extra): (usize, f64),
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        // Split the intermediate size on down_proj's quantization blocks where it can be
        // (1 for dense weights), so that no rank's shard cuts a block.
        let world = vb.pg().size();
        let unit = vb.pp(down).split_unit("weight", 1);
        let unit = if crate::Partition::with_unit(intermediate, world, unit).is_ok() {
            unit
        } else {
            1
        };
        let part =
            crate::Partition::balancing(intermediate, world, unit, lead_parts, lead_extra)
                .map_err(|e| candle_core::Error::msg(format!("GatedMlp '{}': {e}", vb.prefix())))?;
        let gate = ColumnParallelLinear::load_partitioned(hidden, part, false, vb.pp(gate))?;
        let up = ColumnParallelLinear::load_partitioned(hidden, part, false, vb.pp(up))?;
        let down = RowParallelLinear::load_partitioned(part, hidden, false, vb.pp(down))?;
        Self::new(gate, up, down, act)
    }

    /// Loads the fused `gate_up_proj` (`[2 * intermediate, hidden]`, gate rows first, Phi-3)
    /// and `down_proj`: each rank reads its gate rows and its up rows out of the one tensor.
    pub fn load_fused(
        hidden: usize,
        intermediate: usize,
        act: Activation,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let pg = vb.pg().clone();
        let down = RowParallelLinear::load(intermediate, hidden, false, 1, vb.pp("down_proj"))?;
        let part = *down.in_partition();
        let r = part.range(pg.rank());
        let fused = vb.pp("gate_up_proj");
        let shape = (2 * intermediate, hidden);
        let rows = |off: usize| {
            let range = off + r.start..off + r.end;
            fused.get_ranges(shape, "weight", 0, std::slice::from_ref(&range))
        };
        let gate = ColumnParallelLinear::new(rows(0)?, None, hidden, part, pg.clone())?;
        let up = ColumnParallelLinear::new(rows(intermediate)?, None, hidden, part, pg)?;
        Self::new(gate, up, down, act)
    }

    /// The gate projection.
    pub fn gate_proj(&self) -> &ColumnParallelLinear {
        &self.gate_proj
    }

    /// The up projection.
    pub fn up_proj(&self) -> &ColumnParallelLinear {
        &self.up_proj
    }

    /// The down projection.
    pub fn down_proj(&self) -> &RowParallelLinear {
        &self.down_proj
    }
}

impl GatedMlp {
    /// This rank's partial output, before the all-reduce: `x` is already in the
    /// tensor-parallel region (after a `copy_to_tp`). A mixture-of-experts layer sums its
    /// experts' partial outputs and reduces once. f64 for quantized down projections, as
    /// [`RowParallelLinear::forward_partial`] says.
    pub fn forward_partial(&self, x: &Tensor) -> Result<Tensor> {
        // Gate and up of quantized weights of one type read x quantized once.
        let (gate, up) = crate::quant::share_activations(|| -> Result<_> {
            Ok((
                self.gate_proj.forward_local(x)?,
                self.up_proj.forward_local(x)?,
            ))
        })?;
        let hidden = if matches!(self.act, Activation::Silu) {
            // One pass (on the CPU in f32) instead of `silu`, then the product.
            crate::ops::silu_mul(&gate, &up)?
        } else {
            (self.act.forward(&gate)? * up)?
        };
        self.down_proj.forward_partial(&hidden)
    }
}

impl Module for GatedMlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let pg = self.gate_proj.pg();
        let y =
            reduce_from_tp(&self.forward_partial(&copy_to_tp(x, pg)?)?, pg)?.to_dtype(x.dtype())?;
        self.down_proj.add_bias(&y)
    }
}

/// `GatedMlp::load` with SiLU, Llama's activation.
pub fn gated_mlp(hidden: usize, intermediate: usize, vb: ShardedVarBuilder) -> Result<GatedMlp> {
    GatedMlp::load(hidden, intermediate, Activation::Silu, vb)
}
