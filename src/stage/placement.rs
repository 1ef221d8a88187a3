//! [`PipelineStage`]: where a rank sits in a pipeline (its stage, the ranks of the other
//! stages it talks to, the layers it holds), and the transfers between neighbouring stages.

use std::ops::Range;

use candle_core::{DType, Device, Result, Tensor};

use super::stage_layers;
use crate::comm::{CommError, CommResult, DeviceMesh, Element, ProcessGroup};

/// This rank's place in a pipeline of stages: `group` holds one rank per stage (rank `s` of
/// it is stage `s`: the ranks with this rank's data- and tensor-parallel index), and the layers
/// per stage are even by default or given (`--pp-layers 10,10,10`).
///
/// A model loaded with a stage ([`ShardedVarBuilder::with_pipeline`](crate::ShardedVarBuilder::with_pipeline))
/// holds only its layers (the first stage also the embedding, the last the final norm and the
/// LM head); activations go forward with [`send_next`](Self::send_next) /
/// [`recv_prev`](Self::recv_prev), and the last stage hands the sampled tokens back to every
/// stage with [`share_from_last`](Self::share_from_last).
///
/// ```
/// use candle_tp::comm::run_threads;
/// use candle_tp::pipeline::PipelineStage;
/// let layers = run_threads(4, |world| {
///     // 2 stages x 2 tensor-parallel ranks: ranks 0, 1 are stage 0; ranks 2, 3 stage 1.
///     let (stage, tp) = PipelineStage::split(&world, 2, None)?;
///     assert_eq!(tp.size(), 2);
///     Ok(stage.layers(30)?)
/// })
/// .unwrap();
/// assert_eq!(layers, vec![0..15, 0..15, 15..30, 15..30]);
/// ```
#[derive(Debug, Clone)]
pub struct PipelineStage {
    world: ProcessGroup,
    group: ProcessGroup,
    sizes: Option<Vec<usize>>,
}

impl PipelineStage {
    /// The stage of this rank in `group` (one rank per stage, in stage order; a sub-group of
    /// `world`, every rank of every stage), with `sizes` layers per stage when given (else
    /// even).
    pub fn new(world: ProcessGroup, group: ProcessGroup, sizes: Option<Vec<usize>>) -> Self {
        Self {
            world,
            group,
            sizes,
        }
    }

    /// The stage along the `pp` axis (axis 0) of a [`DeviceMesh::pp_dp_tp`] mesh.
    pub fn from_mesh(mesh: &DeviceMesh, sizes: Option<Vec<usize>>) -> CommResult<Self> {
        match (mesh.names().first(), mesh.group_along(0)) {
            (Some(n), Some(g)) if n == "pp" => {
                Ok(Self::new(mesh.world().clone(), g.clone(), sizes))
            }
            _ => Err(CommError::invalid(
                format!("pipeline stage on mesh {:?}", mesh.names()),
                "the mesh has no `pp` axis first (build it with DeviceMesh::pp_dp_tp)",
            )),
        }
    }

    /// Splits `world` into `pp` stages of `world.size() / pp` tensor-parallel ranks each
    /// (consecutive ranks share a stage, so a stage stays inside a host), and returns this
    /// rank's stage and its stage's tensor-parallel group. Collective over `world`. An error
    /// when `pp` does not divide the world size.
    pub fn split(
        world: &ProcessGroup,
        pp: usize,
        sizes: Option<Vec<usize>>,
    ) -> CommResult<(Self, ProcessGroup)> {
        if pp == 0 || !world.size().is_multiple_of(pp) {
            return Err(CommError::invalid(
                format!("pipeline of {pp} stages on group '{}'", world.name()),
                format!(
                    "the {} ranks do not split into {pp} stages of equal size",
                    world.size()
                ),
            ));
        }
        let mesh = DeviceMesh::pp_dp_tp(world, pp, world.size() / pp)?;
        let tp = mesh.group_along(2).cloned().ok_or_else(|| {
            CommError::invalid("pipeline split", "the PP x DP x TP mesh has no tp axis")
        })?;
        Ok((Self::from_mesh(&mesh, sizes)?, tp))
    }

    /// What a `--pp N` / `--pp-layers` option asks for: [`split`](Self::split) when `pp > 1`
    /// or `sizes` are given, else no pipeline and the whole `world` tensor-parallel. Returns
    /// the stage (if any) and the tensor-parallel group to load the model over.
    pub fn from_option(
        world: &ProcessGroup,
        pp: usize,
        sizes: Option<Vec<usize>>,
    ) -> CommResult<(Option<Self>, ProcessGroup)> {
        if pp > 1 || sizes.is_some() {
            let (stage, tp) = Self::split(world, pp, sizes)?;
            Ok((Some(stage), tp))
        } else {
            Ok((None, world.clone()))
        }
    }

    /// This rank's stage index (0 holds the embedding).
    pub fn index(&self) -> usize {
        self.group.rank()
    }

    /// The number of stages.
    pub fn count(&self) -> usize {
        self.group.size()
    }

    /// Whether this is the first stage (it embeds the tokens).
    pub fn is_first(&self) -> bool {
        self.index() == 0
    }

    /// Whether this is the last stage (it holds the final norm and the LM head).
    pub fn is_last(&self) -> bool {
        self.index() + 1 == self.count()
    }

    /// Every rank of every stage (the group the pipeline was split from).
    pub fn world(&self) -> &ProcessGroup {
        &self.world
    }

    /// The group of the stages (rank `s` is stage `s`).
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The layers given per stage, if any.
    pub fn sizes(&self) -> Option<&[usize]> {
        self.sizes.as_deref()
    }

    /// The layers of this stage in a model of `total` layers (see [`stage_layers`]: an error
    /// names the sizes when there are more stages than layers or the given sizes do not add
    /// up).
    pub fn layers(&self, total: usize) -> CommResult<Range<usize>> {
        let all = stage_layers(total, self.count(), self.sizes())?;
        Ok(all[self.index()].clone())
    }

    /// Sends this stage's activations to the next stage (which calls
    /// [`recv_prev`](Self::recv_prev) with their shape).
    pub fn send_next(&self, x: &Tensor) -> Result<()> {
        self.send_next_tagged(x, 0)
    }

    /// [`send_next`](Self::send_next) tagged `tag` (a micro-batch's index): the next stage must
    /// receive it with the same tag, or both fail naming the two tags.
    pub fn send_next_tagged(&self, x: &Tensor, tag: u64) -> Result<()> {
        crate::ops::send_tagged(x, &self.group, self.index() + 1, tag).map(|_| ())
    }

    /// Receives the previous stage's activations, `shape` and `dtype`, on `device`.
    pub fn recv_prev(&self, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        self.recv_prev_tagged(shape, dtype, device, 0)
    }

    /// [`recv_prev`](Self::recv_prev) of the transfer tagged `tag`.
    pub fn recv_prev_tagged(
        &self,
        shape: &[usize],
        dtype: DType,
        device: &Device,
        tag: u64,
    ) -> Result<Tensor> {
        crate::ops::recv_tagged(
            shape,
            dtype,
            device,
            &self.group,
            self.index() - 1,
            false,
            tag,
        )
    }

    /// Hands `values` from the last stage to every stage (a broadcast over the stages): the
    /// tokens it sampled, so that every stage knows what comes next.
    pub fn share_from_last<T: Element>(&self, values: &mut [T]) -> CommResult<()> {
        self.group.broadcast_slice(values, self.count() - 1)
    }
}

/// What a model loaded for a stage holds: its layers, whether it embeds the tokens (the first
/// stage), whether it ends in the final norm and the LM head (the last stage). Without a
/// pipeline, the whole model. One place for the decoders' and the trainer's loading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePart {
    /// Whether this part embeds the tokens (the first stage, or no pipeline).
    pub first: bool,
    /// Whether this part holds the final norm and the LM head (the last stage, or no
    /// pipeline).
    pub last: bool,
    /// The model's layers this part holds (the model's numbering).
    pub layers: Range<usize>,
}

impl StagePart {
    /// The part of a model of `total` layers that `stage` holds (the whole model when `None`);
    /// an error names `model`, the stage and the sizes when the stages do not fit the layers.
    pub fn of(stage: Option<&PipelineStage>, model: &str, total: usize) -> Result<Self> {
        let Some(s) = stage else {
            return Ok(Self {
                first: true,
                last: true,
                layers: 0..total,
            });
        };
        let layers = s.layers(total).map_err(|e| {
            candle_core::Error::msg(format!(
                "{model}: pipeline stage {} of {}: {e}",
                s.index(),
                s.count()
            ))
        })?;
        Ok(Self {
            first: s.is_first(),
            last: s.is_last(),
            layers,
        })
    }

    /// Whether this part loads the token embedding: the first stage uses it, and the last one
    /// too when the LM head is tied to it.
    pub fn holds_embedding(&self, tied: bool) -> bool {
        self.first || (self.last && tied)
    }
}
