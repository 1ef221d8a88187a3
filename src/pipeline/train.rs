//! One training step of a pipeline stage: the steps of a [`schedule`] (GPipe or 1F1B) run on a
//! [`TrainLlama`] built for the stage, micro-batches flowing forward and their gradients
//! back, gradients accumulated over the micro-batches.
//!
//! A backward that starts from a gradient computed by another process: the stage's output `y`
//! and the received `∂L/∂y` give the scalar `Σ y · ∂L/∂y`, whose backward is the stage's
//! backward (Candle has no `backward(grad)`). The received input is a fresh [`Var`], so the
//! backward leaves `∂L/∂x` in the gradient store, and the `SendGrad` step sends it when the
//! schedule says (not inside the backward, which would break the schedule's order of messages
//! with the previous stage).

use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};

use super::schedule::{schedule, Kind, Step};
use crate::train::{activation_bytes, all_reduce_grads, Dropout, TrainLlama};

/// One micro-batch: token ids `[batch, seq]` and their targets `[batch * seq]`.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    /// Token ids `[batch, seq]`.
    pub ids: Tensor,
    /// The next token of every position, `[batch * seq]`.
    pub targets: Tensor,
}

/// What [`train_step`] did on this rank.
#[derive(Debug)]
pub struct StepReport {
    /// The mean of the micro-batches' losses, every stage's MoE load-balancing loss included
    /// (every stage gets it).
    pub loss: f32,
    /// The part of [`loss`](Self::loss) that is the MoE layers' load-balancing loss
    /// (`TrainLlama::take_aux_loss`, weighed by `router_aux_loss_coef`); 0 without.
    pub aux_loss: f32,
    /// The gradients of this stage's parameters: of the mean loss over the micro-batches (each
    /// micro-batch's loss divided by their number, summed), the tied embedding's summed
    /// between the first and the last stage.
    pub grads: GradStore,
    /// The most micro-batches whose activations the stage held at once.
    pub peak_micro_batches: usize,
    /// The most bytes of activations (the autograd graphs' tensors that are not parameters)
    /// the stage held at once.
    pub peak_activation_bytes: usize,
    /// Seconds spent computing (forwards and backwards).
    pub busy_s: f64,
    /// Seconds the whole step took.
    pub wall_s: f64,
}

impl StepReport {
    /// The fraction of the step this stage waited: `1 - busy / wall` (the pipeline bubble
    /// plus communication), to set against GPipe's and 1F1B's `(p - 1) / (m + p - 1)`.
    pub fn idle_fraction(&self) -> f64 {
        if self.wall_s > 0.0 {
            (1.0 - self.busy_s / self.wall_s).max(0.0)
        } else {
            0.0
        }
    }
}

/// Per micro-batch state of a stage.
#[derive(Default)]
struct Slot {
    /// The received input (not on the first stage).
    input: Option<Var>,
    /// The output: the scaled loss on the last stage, the residual stream elsewhere.
    output: Option<Tensor>,
    /// The received gradient of the output.
    out_grad: Option<Tensor>,
    /// The gradient of the input, to send back.
    in_grad: Option<Tensor>,
    /// Bytes of the activations the forward kept.
    bytes: usize,
    /// Not on the last stage: this stage's load-balancing loss (`TrainLlama::take_aux_loss`),
    /// scaled as the micro-batch's loss, added to its backward.
    aux: Option<Tensor>,
}

/// Runs one training step of `model`'s pipeline stage (the whole model without a pipeline) on
/// `batches` with schedule `kind`: every stage calls it with the same micro-batches (only the
/// first stage reads the ids, only the last the targets). `loss(logits, targets)` is the
/// micro-batch's loss from this rank's slice of the logits (e.g.
/// [`vocab_parallel_cross_entropy`](crate::train::vocab_parallel_cross_entropy)); the
/// gradients of `vars` (this rank's parameters) are accumulated.
///
/// The gradients are not yet synchronised over the tensor-parallel group (sequence-parallel
/// norms) or the data-parallel group: do that as without a pipeline, then step the optimizer.
pub fn train_step(
    model: &TrainLlama,
    kind: Kind,
    batches: &[MicroBatch],
    vars: &[Var],
    drop: &Dropout,
    loss: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<StepReport> {
    let start = Instant::now();
    let m = batches.len();
    if m == 0 {
        candle_core::bail!("pipeline train_step: no micro-batch");
    }
    let stage = model.pipeline();
    let (index, count) = stage.map_or((0, 1), |s| (s.index(), s.count()));
    let last = index + 1 == count;
    let dims = |mb: usize| batches[mb].ids.dims2();
    let mut slots: Vec<Slot> = (0..m).map(|_| Slot::default()).collect();
    let mut acc = GradStore::default();
    let (mut loss_sum, mut busy, mut live, mut peak_bytes) = (0f32, 0f64, 0usize, 0usize);
    // This stage's MoE load-balancing losses (in `loss_sum` too on the last stage).
    let mut aux_sum = 0f32;
    let (mut live_mbs, mut peak_mbs) = (0usize, 0usize);
    let device = batches[0].ids.device().clone();
    for step in schedule(kind, index, count, m) {
        let stage = || {
            stage.ok_or_else(|| candle_core::Error::msg("pipeline step on a model without stages"))
        };
        match step {
            Step::RecvActivation(mb) => {
                let (b, s) = dims(mb)?;
                let shape = model.residual_shape(b, s)?;
                // Tags: 2 mb for a micro-batch's activations, 2 mb + 1 for their gradient, so
                // that a schedule that differs between stages is an error, not a swap.
                let x = stage()?.recv_prev_tagged(&shape, model.dtype(), &device, 2 * mb as u64)?;
                slots[mb].input = Some(Var::from_tensor(&x)?);
            }
            Step::Forward(mb) => {
                let t = Instant::now();
                let (b, s) = dims(mb)?;
                let input = match &slots[mb].input {
                    Some(x) => x.as_tensor().clone(),
                    None => model.embed_input(&batches[mb].ids)?,
                };
                // Each micro-batch's masks are those of its rows of the batch.
                let rows_before: usize = batches[..mb]
                    .iter()
                    .map(|b| b.ids.dims2().map_or(0, |d| d.0))
                    .sum();
                let h = model.forward_layers(&input, s, &drop.skip_rows(rows_before))?;
                // This stage's MoE load-balancing loss, a part of the micro-batch's loss.
                let aux = match model.take_aux_loss() {
                    Some(a) => Some((a / m as f64)?),
                    None => None,
                };
                if let Some(a) = &aux {
                    aux_sum += a.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
                }
                let out = if last {
                    let logits = model.forward_head(&h, b, s)?;
                    let mut l = (loss(&logits, &batches[mb].targets)? / m as f64)?;
                    if let Some(a) = aux {
                        l = (&l + a.to_dtype(l.dtype())?)?;
                    }
                    loss_sum += l.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
                    l
                } else {
                    slots[mb].aux = aux;
                    h
                };
                let bytes = activation_bytes(&out);
                slots[mb].bytes = bytes;
                slots[mb].output = Some(out);
                live += bytes;
                peak_bytes = peak_bytes.max(live);
                live_mbs += 1;
                peak_mbs = peak_mbs.max(live_mbs);
                busy += t.elapsed().as_secs_f64();
            }
            Step::SendActivation(mb) => {
                let out = slot_output(&slots[mb], mb)?;
                stage()?.send_next_tagged(&out.detach(), 2 * mb as u64)?;
            }
            Step::RecvGrad(mb) => {
                let out = slot_output(&slots[mb], mb)?;
                let g = crate::ops::recv_tagged(
                    out.dims(),
                    out.dtype(),
                    &device,
                    stage()?.group(),
                    index + 1,
                    false,
                    2 * mb as u64 + 1,
                )?;
                slots[mb].out_grad = Some(g);
            }
            Step::Backward(mb) => {
                let t = Instant::now();
                let slot = &mut slots[mb];
                let out = slot.output.take().ok_or_else(|| {
                    candle_core::Error::msg(format!("micro-batch {mb}: backward before forward"))
                })?;
                let target = match slot.out_grad.take() {
                    Some(g) => {
                        let t = (out * g)?.sum_all()?;
                        match slot.aux.take() {
                            Some(a) => (&t + a.to_dtype(t.dtype())?)?,
                            None => t,
                        }
                    }
                    None if last => out,
                    None => {
                        candle_core::bail!("micro-batch {mb}: backward before its gradient arrived")
                    }
                };
                let grads = target.backward()?;
                for v in vars {
                    if let Some(g) = grads.get(v.as_tensor()) {
                        let sum = match acc.get(v.as_tensor()) {
                            Some(a) => (a + g)?,
                            None => g.clone(),
                        };
                        acc.insert(v.as_tensor(), sum);
                    }
                }
                if let Some(x) = slot.input.take() {
                    slot.in_grad = Some(match grads.get(x.as_tensor()) {
                        Some(g) => g.clone(),
                        None => x.as_tensor().zeros_like()?,
                    });
                }
                live -= slot.bytes;
                live_mbs -= 1;
                busy += t.elapsed().as_secs_f64();
            }
            Step::SendGrad(mb) => {
                let g = slots[mb].in_grad.take().ok_or_else(|| {
                    candle_core::Error::msg(format!("micro-batch {mb}: no input gradient to send"))
                })?;
                crate::ops::send_tagged(&g, stage()?.group(), index - 1, 2 * mb as u64 + 1)?;
            }
        }
    }
    if let (Some(group), Some(tied)) = (model.embedding_group(), model.tied_embedding()) {
        let var: Vec<Var> = vars
            .iter()
            .filter(|v| v.as_tensor().id() == tied.id())
            .cloned()
            .collect();
        all_reduce_grads(&mut acc, &var, group, false)?;
    }
    // The last stage's loss, plus the other stages' load-balancing losses; and all stages'
    // load-balancing losses (0 without MoE).
    let mut sums = [if last { loss_sum } else { aux_sum }, aux_sum];
    if let Some(stage) = stage {
        stage
            .group()
            .all_reduce_slice(&mut sums, crate::comm::ReduceOp::Sum)?;
    }
    Ok(StepReport {
        loss: sums[0],
        aux_loss: sums[1],
        grads: acc,
        peak_micro_batches: peak_mbs,
        peak_activation_bytes: peak_bytes,
        busy_s: busy,
        wall_s: start.elapsed().as_secs_f64(),
    })
}

fn slot_output(slot: &Slot, mb: usize) -> Result<&Tensor> {
    slot.output.as_ref().ok_or_else(|| {
        candle_core::Error::msg(format!(
            "micro-batch {mb}: no output (forward not run or backward done)"
        ))
    })
}
