//! Column-, row-parallel and replicated linear layers (Megatron-LM `layers.py`).
//!
//! All three wrap `candle_nn::Linear` for the local matmul, so with one rank they give
//! bit-identical results to the dense layer they replace (in f32; after
//! `crate::set_batch_invariant_matmul(true)` small inference products take the batch-invariant
//! small-m kernel and agree to f32 rounding). Weights keep candle's and Hugging
//! Face's `[out_features, in_features]` layout and names (`weight`, `bias`). The column- and
//! row-parallel layers hold a [`ParallelWeight`]: loaded from a GGUF file, their shard is
//! quantized blocks multiplied by `quant::QuantMatMul`, with the same layer code.

use candle_core::{Module, Result, Tensor};

use crate::comm::ProcessGroup;
use crate::loader::ShardedVarBuilder;
use crate::nn::ParallelWeight;
use crate::ops::{copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp};
use crate::Partition;

fn partition(
    layer: &str,
    what: &str,
    total: usize,
    pg: &ProcessGroup,
    unit: usize,
) -> Result<Partition> {
    Partition::with_unit(total, pg.size(), unit).map_err(|e| {
        candle_core::Error::msg(format!(
            "{layer}: cannot split {what} = {total} over the {} ranks of group '{}': {e}",
            pg.size(),
            pg.name()
        ))
    })
}

/// A given split must be over the group's ranks.
fn check_parts(layer: &str, part: &Partition, pg: &ProcessGroup) -> Result<()> {
    if part.parts() != pg.size() {
        candle_core::bail!(
            "{layer}: a split of {} features over {} parts for the {} ranks of group '{}'",
            part.total(),
            part.parts(),
            pg.size(),
            pg.name()
        );
    }
    Ok(())
}

fn check_input(layer: &str, x: &Tensor, expected: usize, pg: &ProcessGroup) -> Result<()> {
    match x.dims().last() {
        Some(&d) if d == expected => Ok(()),
        _ => candle_core::bail!(
            "{layer} on rank {} of {}: the input has shape {:?}, its last dimension must be {expected}",
            pg.rank(),
            pg.size(),
            x.dims()
        ),
    }
}

fn check_dims(
    layer: &str,
    what: &str,
    got: (usize, usize),
    expected: (usize, usize),
) -> Result<()> {
    if got != expected {
        candle_core::bail!("{layer}: {what} has shape {got:?}, expected {expected:?}");
    }
    Ok(())
}

fn check_shape(layer: &str, what: &str, t: &Tensor, expected: &[usize]) -> Result<()> {
    if t.dims() != expected {
        candle_core::bail!(
            "{layer}: {what} has shape {:?}, expected {expected:?}",
            t.dims()
        );
    }
    Ok(())
}

/// `y = x Wᵀ + b` with `W` split by output rows: each rank computes its slice of the output
/// features. The input is replicated; its gradient is all-reduced in the backward pass.
///
/// With `gather_output` (off by default) the slices are all-gathered into the full output;
/// otherwise the output stays split, ready for a [`RowParallelLinear`].
#[derive(Debug, Clone)]
pub struct ColumnParallelLinear {
    inner: ParallelWeight,
    pg: ProcessGroup,
    in_features: usize,
    out_part: Partition,
    gather_output: bool,
}

impl ColumnParallelLinear {
    /// A layer from this rank's shard: `weight` is `[out_part.size(rank), in_features]`,
    /// `bias` (if any) `[out_part.size(rank)]`.
    pub fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        in_features: usize,
        out_part: Partition,
        pg: ProcessGroup,
    ) -> Result<Self> {
        // Contiguous shards: a view of a dense weight (`from_dense`, in-memory sources) would
        // keep the whole tensor alive, and Candle's MKL matmul refuses its strides.
        let (weight, bias) = (
            weight.contiguous()?,
            bias.map(|b| b.contiguous()).transpose()?,
        );
        Self::from_weight(
            ParallelWeight::dense(weight, bias),
            in_features,
            out_part,
            pg,
        )
    }

    /// A layer from this rank's shard as a dense or quantized [`ParallelWeight`].
    pub fn from_weight(
        weight: ParallelWeight,
        in_features: usize,
        out_part: Partition,
        pg: ProcessGroup,
    ) -> Result<Self> {
        let name = "ColumnParallelLinear";
        if out_part.parts() != pg.size() {
            candle_core::bail!(
                "{name}: the output partition has {} parts, the group {} ranks",
                out_part.parts(),
                pg.size()
            );
        }
        let local = out_part.size(pg.rank());
        check_dims(
            name,
            "the weight shard",
            weight.dims()?,
            (local, in_features),
        )?;
        if let Some(b) = weight.bias() {
            check_shape(name, "the bias shard", b, &[local])?;
        }
        Ok(Self {
            inner: weight,
            pg,
            in_features,
            out_part,
            gather_output: false,
        })
    }

    /// A layer from the full dense `weight` `[out, in]` and `bias` `[out]`: every rank keeps
    /// its rows (split evenly, or within one row of it).
    pub fn from_dense(weight: &Tensor, bias: Option<&Tensor>, pg: ProcessGroup) -> Result<Self> {
        let (out, inp) = weight.dims2()?;
        let part = partition("ColumnParallelLinear", "out_features", out, &pg, 1)?;
        let r = part.range(pg.rank());
        let w = weight.narrow(0, r.start, r.len())?;
        let b = bias.map(|b| b.narrow(0, r.start, r.len())).transpose()?;
        Self::new(w, b, inp, part, pg)
    }

    /// Loads `weight` (and `bias` if asked) from `vb`, keeping this rank's rows; the rows are
    /// split in units of `unit` (e.g. `head_dim` for attention projections).
    pub fn load(
        in_features: usize,
        out_features: usize,
        bias: bool,
        unit: usize,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let layer = format!("ColumnParallelLinear '{}'", vb.prefix());
        let part = partition(&layer, "out_features", out_features, vb.pg(), unit)?;
        Self::load_partitioned(in_features, part, bias, vb)
    }

    /// [`ColumnParallelLinear::load`] with the split of the output features given (`part`,
    /// over the group's ranks; e.g. [`Partition::balancing`]).
    pub fn load_partitioned(
        in_features: usize,
        part: Partition,
        bias: bool,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let pg = vb.pg().clone();
        check_parts(
            &format!("ColumnParallelLinear '{}'", vb.prefix()),
            &part,
            &pg,
        )?;
        let out_features = part.total();
        let w = vb.get_weight_sharded((out_features, in_features), "weight", 0, &part)?;
        let b = if bias {
            Some(vb.get_sharded(out_features, "bias", 0, &part)?)
        } else {
            None
        };
        Self::from_weight(ParallelWeight::from_shard(w, b)?, in_features, part, pg)
    }

    /// Sets whether the forward pass all-gathers the output features.
    pub fn with_gather_output(mut self, gather_output: bool) -> Self {
        self.gather_output = gather_output;
        self
    }

    /// This rank's dense weight shard, `[local_out, in]` (an error for a quantized weight:
    /// see [`ColumnParallelLinear::parallel_weight`]).
    pub fn weight(&self) -> Result<&Tensor> {
        self.inner.dense_weight()
    }

    /// This rank's weight shard, dense or quantized.
    pub fn parallel_weight(&self) -> &ParallelWeight {
        &self.inner
    }

    /// This rank's bias shard.
    pub fn bias(&self) -> Option<&Tensor> {
        self.inner.bias()
    }

    /// How the output features are split.
    pub fn out_partition(&self) -> &Partition {
        &self.out_part
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// The group the layer runs on.
    pub fn pg(&self) -> &ProcessGroup {
        &self.pg
    }

    /// The local matmul alone, for an input already in the tensor-parallel region (several
    /// column-parallel layers that share one `copy_to_tp`, as the gate and up projections of
    /// a gated MLP).
    pub fn forward_local(&self, x: &Tensor) -> Result<Tensor> {
        check_input("ColumnParallelLinear", x, self.in_features, &self.pg)?;
        self.inner.forward(x)
    }
}

impl Module for ColumnParallelLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_input("ColumnParallelLinear", x, self.in_features, &self.pg)?;
        let y = self.inner.forward(&copy_to_tp(x, &self.pg)?)?;
        if self.gather_output {
            gather_from_tp(&y, &self.pg, &self.out_part)
        } else {
            Ok(y)
        }
    }
}

/// `y = x Wᵀ + b` with `W` split by input columns: each rank multiplies its slice of the
/// input features and the partial results are all-reduced; the bias is added once, after the
/// reduction.
///
/// By default the input is already split (`input_is_parallel`, the output of a
/// [`ColumnParallelLinear`]); otherwise each rank takes its slice of a replicated input.
#[derive(Debug, Clone)]
pub struct RowParallelLinear {
    inner: ParallelWeight,
    bias: Option<Tensor>,
    pg: ProcessGroup,
    in_part: Partition,
    out_features: usize,
    input_is_parallel: bool,
}

impl RowParallelLinear {
    /// A layer from this rank's shard: `weight` is `[out_features, in_part.size(rank)]`;
    /// `bias` is the full `[out_features]` (replicated).
    pub fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        in_part: Partition,
        out_features: usize,
        pg: ProcessGroup,
    ) -> Result<Self> {
        // Contiguous shard: a column slice of a dense weight (`from_dense`, in-memory sources)
        // is a strided view, which Candle's MKL matmul refuses and which keeps the whole
        // tensor alive.
        let weight = weight.contiguous()?;
        Self::from_weight(
            ParallelWeight::dense(weight, None),
            bias,
            in_part,
            out_features,
            pg,
        )
    }

    /// A layer from this rank's shard as a dense or quantized [`ParallelWeight`] (without
    /// bias) and the full, replicated `bias`.
    pub fn from_weight(
        weight: ParallelWeight,
        bias: Option<Tensor>,
        in_part: Partition,
        out_features: usize,
        pg: ProcessGroup,
    ) -> Result<Self> {
        let name = "RowParallelLinear";
        if in_part.parts() != pg.size() {
            candle_core::bail!(
                "{name}: the input partition has {} parts, the group {} ranks",
                in_part.parts(),
                pg.size()
            );
        }
        check_dims(
            name,
            "the weight shard",
            weight.dims()?,
            (out_features, in_part.size(pg.rank())),
        )?;
        if let Some(b) = &bias {
            check_shape(name, "the bias", b, &[out_features])?;
        }
        Ok(Self {
            inner: weight.without_bias(),
            bias,
            pg,
            in_part,
            out_features,
            input_is_parallel: true,
        })
    }

    /// A layer from the full dense `weight` `[out, in]` and `bias` `[out]`: every rank keeps
    /// its columns and the whole bias.
    pub fn from_dense(weight: &Tensor, bias: Option<&Tensor>, pg: ProcessGroup) -> Result<Self> {
        let (out, inp) = weight.dims2()?;
        let part = partition("RowParallelLinear", "in_features", inp, &pg, 1)?;
        let r = part.range(pg.rank());
        let w = weight.narrow(1, r.start, r.len())?;
        Self::new(w, bias.cloned(), part, out, pg)
    }

    /// Loads `weight` (this rank's columns, in units of `unit`) and the whole `bias` from
    /// `vb`.
    pub fn load(
        in_features: usize,
        out_features: usize,
        bias: bool,
        unit: usize,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let layer = format!("RowParallelLinear '{}'", vb.prefix());
        let part = partition(&layer, "in_features", in_features, vb.pg(), unit)?;
        Self::load_partitioned(part, out_features, bias, vb)
    }

    /// [`RowParallelLinear::load`] with the split of the input features given (`part`, over
    /// the group's ranks; e.g. [`Partition::balancing`]).
    pub fn load_partitioned(
        part: Partition,
        out_features: usize,
        bias: bool,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let pg = vb.pg().clone();
        check_parts(&format!("RowParallelLinear '{}'", vb.prefix()), &part, &pg)?;
        let in_features = part.total();
        let w = vb.get_weight_sharded((out_features, in_features), "weight", 1, &part)?;
        let b = if bias {
            Some(vb.get(out_features, "bias")?)
        } else {
            None
        };
        Self::from_weight(
            ParallelWeight::from_shard(w, None)?,
            b,
            part,
            out_features,
            pg,
        )
    }

    /// Sets whether the input is already split across ranks (default) or replicated.
    pub fn with_input_is_parallel(mut self, input_is_parallel: bool) -> Self {
        self.input_is_parallel = input_is_parallel;
        self
    }

    /// This rank's dense weight shard, `[out, local_in]` (an error for a quantized weight:
    /// see [`RowParallelLinear::parallel_weight`]).
    pub fn weight(&self) -> Result<&Tensor> {
        self.inner.dense_weight()
    }

    /// This rank's weight shard, dense or quantized.
    pub fn parallel_weight(&self) -> &ParallelWeight {
        &self.inner
    }

    /// The (replicated) bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// How the input features are split.
    pub fn in_partition(&self) -> &Partition {
        &self.in_part
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// The local matmul alone, without the all-reduce and without the bias: a partial sum,
    /// for callers that reduce differently (reduce-scatter in sequence parallelism, a
    /// mixture of experts summing its experts first).
    ///
    /// In the input's dtype, except for quantized weights with an f64 kernel on the CPU
    /// ([`ParallelWeight::forward_f64`]): there the partial is f64, to be reduced in f64 and
    /// then converted to the input's dtype, so that the sum is the same at every world size
    /// (`candle_tp_kernels::f64_dot` says why quantized models need that).
    pub fn forward_partial(&self, x: &Tensor) -> Result<Tensor> {
        check_input(
            "RowParallelLinear",
            x,
            self.in_part.size(self.pg.rank()),
            &self.pg,
        )?;
        match self.inner.forward_f64(x)? {
            Some(partial) => Ok(partial),
            None => self.inner.forward(x),
        }
    }

    /// Adds the bias (if any) to a reduced output.
    ///
    /// On the sequence-parallel path (after a reduce-scatter, each rank holding its rows) the
    /// replicated bias sees only this rank's rows, so its gradient is partial: sum it over
    /// the group with [`crate::train::all_reduce_grads`] before the optimizer step, as the
    /// trainer does for every parameter listed by `TrainLlama::partial_gradient_params`.
    pub fn add_bias(&self, y: &Tensor) -> Result<Tensor> {
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y.clone()),
        }
    }
}

impl Module for RowParallelLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = if self.input_is_parallel {
            x.clone()
        } else {
            check_input("RowParallelLinear", x, self.in_part.total(), &self.pg)?;
            scatter_to_tp(x, &self.pg, &self.in_part)?
        };
        let y = reduce_from_tp(&self.forward_partial(&x)?, &self.pg)?.to_dtype(x.dtype())?;
        self.add_bias(&y)
    }
}

/// A linear layer whose full weight lives on every rank (small projections, heads that must
/// not be split, a mixture of experts' router); `candle_nn::Linear` with the loading
/// conventions of this crate. Loaded from a GGUF file, a quantized weight stays quantized and
/// multiplies through the crate's kernels, as llama.cpp multiplies it; a dense weight is
/// exactly `candle_nn::Linear`.
#[derive(Debug, Clone)]
pub struct ReplicatedLinear {
    weight: ParallelWeight,
}

impl ReplicatedLinear {
    /// Wraps full weights.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self::from_weight(ParallelWeight::dense(weight, bias))
    }

    /// Wraps a full weight, dense or quantized.
    pub fn from_weight(weight: ParallelWeight) -> Self {
        Self { weight }
    }

    /// Loads the full `weight` `[out, in]` and `bias` from `vb`, as the source holds the
    /// weight (quantized blocks from a GGUF file, dense otherwise).
    pub fn load(
        in_features: usize,
        out_features: usize,
        bias: bool,
        vb: ShardedVarBuilder,
    ) -> Result<Self> {
        let whole = 0..out_features;
        let w = vb.get_weight_ranges(
            (out_features, in_features),
            "weight",
            0,
            std::slice::from_ref(&whole),
        )?;
        let b = if bias {
            Some(vb.get(out_features, "bias")?)
        } else {
            None
        };
        Ok(Self::from_weight(ParallelWeight::from_shard(w, b)?))
    }

    /// The dense weight, or an error naming the type of a quantized one.
    pub fn weight(&self) -> Result<&Tensor> {
        self.weight.dense_weight()
    }

    /// The weight, dense or quantized.
    pub fn parallel_weight(&self) -> &ParallelWeight {
        &self.weight
    }

    /// The bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.weight.bias()
    }
}

impl Module for ReplicatedLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.weight {
            // Exactly candle_nn::Linear (ParallelWeight's dense path picks kernels by rows).
            ParallelWeight::Dense(l) => l.forward(x),
            q => q.forward(x),
        }
    }
}

/// `candle_nn::linear` for a column-parallel layer with bias (output left split).
pub fn column_linear(
    in_features: usize,
    out_features: usize,
    vb: ShardedVarBuilder,
) -> Result<ColumnParallelLinear> {
    ColumnParallelLinear::load(in_features, out_features, true, 1, vb)
}

/// `candle_nn::linear_no_bias` for a column-parallel layer (output left split).
pub fn column_linear_no_bias(
    in_features: usize,
    out_features: usize,
    vb: ShardedVarBuilder,
) -> Result<ColumnParallelLinear> {
    ColumnParallelLinear::load(in_features, out_features, false, 1, vb)
}

/// `candle_nn::linear` for a row-parallel layer with bias (input already split).
pub fn row_linear(
    in_features: usize,
    out_features: usize,
    vb: ShardedVarBuilder,
) -> Result<RowParallelLinear> {
    RowParallelLinear::load(in_features, out_features, true, 1, vb)
}

/// `candle_nn::linear_no_bias` for a row-parallel layer (input already split).
pub fn row_linear_no_bias(
    in_features: usize,
    out_features: usize,
    vb: ShardedVarBuilder,
) -> Result<RowParallelLinear> {
    RowParallelLinear::load(in_features, out_features, false, 1, vb)
}

/// `candle_nn::linear` with the full weight on every rank.
pub fn replicated_linear(
    in_features: usize,
    out_features: usize,
    vb: ShardedVarBuilder,
) -> Result<ReplicatedLinear> {
    ReplicatedLinear::load(in_features, out_features, true, vb)
}

/// `candle_nn::linear_no_bias` with the full weight on every rank.
pub fn replicated_linear_no_bias(
    in_features: usize,
    out_features: usize,
    vb: ShardedVarBuilder,
) -> Result<ReplicatedLinear> {
    ReplicatedLinear::load(in_features, out_features, false, vb)
}
