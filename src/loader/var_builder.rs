//! [`ShardedVarBuilder`]: a `VarBuilder`-style handle that carries the process group and
//! loads each rank's slice of a tensor, under the tensor names of the dense model.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Shape, Tensor};

use super::gguf::GgufSource;
use super::progress::{LoadProgress, ProgressSource};
use super::safetensors::SafetensorsSource;
use super::source::{RangeRequest, TensorMapSource, TensorSource, VarBuilderSource, WeightShard};
use crate::comm::ProcessGroup;
use crate::stage::PipelineStage;
use crate::Partition;

/// Loads weights for parallel layers: whole (replicated) or the rank's slice along one
/// dimension, with the dense checkpoint's names.
///
/// ```
/// # use std::collections::HashMap;
/// # use candle_core::{DType, Device, Tensor};
/// use candle_tp::{ProcessGroup, ShardedVarBuilder};
/// let w = Tensor::zeros((8, 4), DType::F32, &Device::Cpu)?;
/// let vb = ShardedVarBuilder::from_tensors(
///     HashMap::from([("up.weight".to_string(), w)]), DType::F32, &Device::Cpu, ProcessGroup::single());
/// let up = candle_tp::column_linear_no_bias(4, 8, vb.pp("up"))?;
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone)]
pub struct ShardedVarBuilder {
    source: Arc<dyn TensorSource>,
    path: Vec<String>,
    dtype: DType,
    device: Device,
    pg: ProcessGroup,
    pipeline: Option<PipelineStage>,
    expert_parallel: Option<ExpertParallel>,
}

/// How a model's mixture-of-experts layers are laid out over the builder's group: in `ep`
/// expert groups of consecutive ranks, each holding whole experts split over its ranks
/// ([`SparseMoe::load_expert_tensor_parallel`](crate::nn::SparseMoe::load_expert_tensor_parallel)).
#[derive(Debug, Clone)]
pub struct ExpertParallel {
    /// Expert groups.
    pub ep: usize,
    /// This rank's expert group: the ranks its experts are split over (one rank: whole
    /// experts).
    pub expert_tp: ProcessGroup,
}

impl ShardedVarBuilder {
    /// A builder over any [`TensorSource`].
    pub fn new(
        source: Arc<dyn TensorSource>,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
    ) -> Self {
        Self {
            source,
            path: Vec::new(),
            dtype,
            device: device.clone(),
            pg,
            pipeline: None,
            expert_parallel: None,
        }
    }

    /// A builder over full tensors held in memory (every rank slices its part).
    pub fn from_tensors(
        tensors: std::collections::HashMap<String, Tensor>,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
    ) -> Self {
        Self::new(Arc::new(TensorMapSource::new(tensors)), dtype, device, pg)
    }

    /// A builder over a `candle_nn::VarBuilder` (its dtype and device are kept).
    pub fn from_var_builder(vb: candle_nn::VarBuilder<'static>, pg: ProcessGroup) -> Self {
        let (dtype, device) = (vb.dtype(), vb.device().clone());
        Self::new(Arc::new(VarBuilderSource::new(vb)), dtype, &device, pg)
    }

    /// A builder over the safetensors weights of a Hugging Face model directory
    /// (`model.safetensors` or `model.safetensors.index.json` and its shards), memory-mapped:
    /// each rank copies only the bytes of its slices.
    pub fn from_safetensors_dir(
        dir: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
    ) -> Result<Self> {
        Ok(Self::new(
            Arc::new(SafetensorsSource::from_dir(dir)?),
            dtype,
            device,
            pg,
        ))
    }

    /// A builder over a GGUF file, memory-mapped: 2-D weights are served quantized (each rank
    /// copies only the blocks of its shard), vectors dequantized to `dtype`.
    pub fn from_gguf(
        path: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        pg: ProcessGroup,
    ) -> Result<Self> {
        Ok(Self::new(
            Arc::new(GgufSource::open(path)?),
            dtype,
            device,
            pg,
        ))
    }

    /// This builder with every tensor read reported to `progress` (see [`LoadProgress`]);
    /// the total is the number of tensors in the source, when it knows.
    pub fn with_progress(self, progress: LoadProgress) -> Self {
        let total = self.source.num_tensors().unwrap_or(0);
        Self {
            source: Arc::new(ProgressSource::new(self.source, total, progress)),
            ..self
        }
    }

    /// The builder for the sub-module `name` (`vb.pp("mlp").pp("up_proj")`).
    pub fn pp(&self, name: impl ToString) -> Self {
        let mut out = self.clone();
        out.path.push(name.to_string());
        out
    }

    /// The process group that layers built from this builder use.
    pub fn pg(&self) -> &ProcessGroup {
        &self.pg
    }

    /// The same weights for another process group (a sub-group of a mesh).
    pub fn with_pg(&self, pg: ProcessGroup) -> Self {
        let mut out = self.clone();
        out.pg = pg;
        out
    }

    /// This builder for a model split into pipeline stages: a model that knows stages (the
    /// decoders: `models::CausalLm`) loads only the layers of `stage`, and
    /// splits them over [`pg`](Self::pg) (the stage's tensor-parallel group).
    pub fn with_pipeline(&self, stage: PipelineStage) -> Self {
        let mut out = self.clone();
        out.pipeline = Some(stage);
        out
    }

    /// This builder for a model whose mixture-of-experts layers are expert-parallel over
    /// [`pg`](Self::pg) in `ep` groups of `pg.size() / ep` consecutive ranks: each group holds
    /// whole experts, split over its ranks (`ep = pg.size()`: whole experts on each rank,
    /// tokens moved by all-to-all in [`SparseMoe::forward_local`](crate::nn::SparseMoe::forward_local)).
    /// `Some(0)` means one group per rank. Other layers stay tensor-parallel over `pg`.
    /// Every rank of `pg` calls it (it creates the groups' process groups); `None` turns it
    /// off.
    pub fn with_expert_parallel(&self, ep: Option<usize>) -> Result<Self> {
        let mut out = self.clone();
        out.expert_parallel = match ep {
            None => None,
            Some(ep) => {
                let (p, r) = (self.pg.size(), self.pg.rank());
                let ep = if ep == 0 { p } else { ep };
                if !p.is_multiple_of(ep) {
                    candle_core::bail!(
                        "expert parallelism: {ep} expert groups do not divide the {p} ranks of \
                         group '{}'",
                        self.pg.name()
                    );
                }
                let tp = p / ep;
                let expert_tp = if tp == 1 {
                    ProcessGroup::single()
                } else {
                    let run: Vec<usize> = (r - r % tp..r - r % tp + tp).collect();
                    self.pg
                        .new_group_named(&run, "etp")
                        .map_err(candle_core::Error::wrap)?
                        .ok_or_else(|| {
                            candle_core::Error::Msg(format!("rank {r} is not in its run {run:?}"))
                        })?
                };
                Some(ExpertParallel { ep, expert_tp })
            }
        };
        Ok(out)
    }

    /// How mixture-of-experts layers are loaded expert-parallel, if they are.
    pub fn expert_parallel(&self) -> Option<&ExpertParallel> {
        self.expert_parallel.as_ref()
    }

    /// The pipeline stage the model is loaded for, if any.
    pub fn pipeline(&self) -> Option<&PipelineStage> {
        self.pipeline.as_ref()
    }

    /// The dtype tensors are converted to.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device tensors are placed on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The dotted prefix of this builder (`model.layers.0.mlp`).
    pub fn prefix(&self) -> String {
        self.path.join(".")
    }

    /// The full name of tensor `name` under this prefix.
    pub fn full_name(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix())
        }
    }

    /// Whether the source holds `name` under this prefix.
    pub fn contains(&self, name: &str) -> bool {
        matches!(self.source.shape(&self.full_name(name)), Ok(Some(_)))
    }

    fn checked_shape(&self, name: &str, expected: &Shape) -> Result<String> {
        let full = self.full_name(name);
        match self.source.shape(&full)? {
            None => candle_core::bail!(
                "tensor '{full}' is not in the checkpoint (rank {} of group '{}')",
                self.pg.rank(),
                self.pg.name()
            ),
            Some(s) if &s != expected => candle_core::bail!(
                "tensor '{full}' has shape {:?} in the checkpoint but the layer expects {:?}",
                s.dims(),
                expected.dims()
            ),
            Some(_) => Ok(full),
        }
    }

    /// Loads the whole tensor `name` (a replicated weight), checking its shape.
    pub fn get<S: Into<Shape>>(&self, shape: S, name: &str) -> Result<Tensor> {
        let shape = shape.into();
        let full = self.checked_shape(name, &shape)?;
        self.source.load(&full, self.dtype, &self.device)
    }

    /// Loads this rank's part of `name` along `dim`, split as `part`; the checkpoint holds the
    /// full tensor of `full_shape`.
    pub fn get_sharded<S: Into<Shape>>(
        &self,
        full_shape: S,
        name: &str,
        dim: usize,
        part: &Partition,
    ) -> Result<Tensor> {
        let (shape, range) = self.rank_range(full_shape.into(), name, dim, part)?;
        self.get_ranges(shape, name, dim, &[range])
    }

    /// Loads the elements of `name` whose index along `dim` lies in `ranges`, concatenated
    /// (the rank's pieces of a fused tensor such as `qkv_proj`).
    pub fn get_ranges<S: Into<Shape>>(
        &self,
        full_shape: S,
        name: &str,
        dim: usize,
        ranges: &[Range<usize>],
    ) -> Result<Tensor> {
        let shape = full_shape.into();
        let full = self.checked_shape(name, &shape)?;
        self.source.load_ranges(&self.request(&full, dim, ranges))
    }
}

impl ShardedVarBuilder {
    /// Loads the rank's part of the 2-D weight `name` along `dim` as the source holds it:
    /// quantized blocks from a GGUF file, a dense tensor otherwise.
    pub fn get_weight_sharded<S: Into<Shape>>(
        &self,
        full_shape: S,
        name: &str,
        dim: usize,
        part: &Partition,
    ) -> Result<WeightShard> {
        let (shape, range) = self.rank_range(full_shape.into(), name, dim, part)?;
        self.get_weight_ranges(shape, name, dim, &[range])
    }

    /// The request for `ranges` along `dim` of the tensor `full` (a full name), in the
    /// builder's dtype and on its device.
    fn request<'a>(
        &'a self,
        full: &'a str,
        dim: usize,
        ranges: &'a [Range<usize>],
    ) -> RangeRequest<'a> {
        RangeRequest {
            name: full,
            dim,
            ranges,
            dtype: self.dtype,
            device: &self.device,
        }
    }

    /// This rank's range of `part`, checked against dim `dim` of `shape`.
    fn rank_range(
        &self,
        shape: Shape,
        name: &str,
        dim: usize,
        part: &Partition,
    ) -> Result<(Shape, Range<usize>)> {
        if shape.dims().get(dim) != Some(&part.total()) {
            candle_core::bail!(
                "tensor '{}': a partition of {} elements does not fit dim {dim} of shape {:?}",
                self.full_name(name),
                part.total(),
                shape.dims()
            );
        }
        Ok((shape, part.range(self.pg.rank())))
    }

    /// Loads the pieces `ranges` along `dim` of the 2-D weight `name` as the source holds it.
    pub fn get_weight_ranges<S: Into<Shape>>(
        &self,
        full_shape: S,
        name: &str,
        dim: usize,
        ranges: &[Range<usize>],
    ) -> Result<WeightShard> {
        let shape = full_shape.into();
        let full = self.checked_shape(name, &shape)?;
        self.source
            .load_weight(&self.request(&full, dim, ranges))
            .map_err(|e| {
                candle_core::Error::msg(format!(
                    "{e} (rank {} of group '{}')",
                    self.pg.rank(),
                    self.pg.name()
                ))
            })
    }

    /// The number of elements along `dim` that a split of `name` should keep together so
    /// that every shard is whole quantization blocks (1 for dense weights or a missing tensor).
    pub fn split_unit(&self, name: &str, dim: usize) -> usize {
        let full = self.full_name(name);
        match self.source.shape(&full) {
            Ok(Some(_)) => self.source.split_unit(&full, dim).unwrap_or(1),
            _ => 1,
        }
    }
}

impl std::fmt::Debug for ShardedVarBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedVarBuilder")
            .field("prefix", &self.prefix())
            .field("dtype", &self.dtype)
            .field("device", &self.device)
            .field("pg", &self.pg)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use std::sync::Mutex;

    use crate::loader::TensorMapSource;

    #[test]
    fn every_tensor_read_is_reported_once_against_the_source_total() -> Result<()> {
        let cpu = Device::Cpu;
        let tensors = HashMap::from([
            ("a".to_string(), Tensor::zeros((4, 2), DType::F32, &cpu)?),
            ("b".to_string(), Tensor::zeros(3, DType::F32, &cpu)?),
            ("unused".to_string(), Tensor::zeros(1, DType::F32, &cpu)?),
        ]);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let progress: LoadProgress = Arc::new(move |done, total, name: &str| {
            log.lock().unwrap().push((done, total, name.to_string()));
        });
        let vb = ShardedVarBuilder::new(
            Arc::new(TensorMapSource::new(tensors)),
            DType::F32,
            &cpu,
            ProcessGroup::single(),
        )
        .with_progress(progress);
        vb.get((4, 2), "a")?;
        vb.get_sharded((4, 2), "a", 0, &crate::Partition::new(4, 1)?)?;
        vb.get(3, "b")?;
        assert!(vb.get(7, "missing").is_err());
        let seen = seen.lock().unwrap().clone();
        let want = [(1, 3, "a"), (1, 3, "a"), (2, 3, "b")];
        assert_eq!(seen.len(), want.len(), "{seen:?}");
        for ((done, total, name), (d, t, n)) in seen.iter().zip(want) {
            assert_eq!((*done, *total, name.as_str()), (d, t, n), "{seen:?}");
        }
        Ok(())
    }
}
