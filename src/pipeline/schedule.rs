//! Pipeline-parallel training schedules as data: per stage, the list of forward, backward,
//! send and receive steps, so that a schedule can be checked (every backward after its
//! forward, the activations a stage holds, no deadlock) without running a model.
//!
//! Point-to-point messages in candle-tp meet like collectives (`ProcessGroup::send_slice`: a
//! send waits for its receive, and between two ranks messages come in one order). Where
//! Megatron batches a send and a receive with the same neighbour (`send_forward_recv_backward`),
//! a schedule here lists the two one after the other, activation first, and the neighbour
//! lists them in the same order: [`replay`](super::replay) checks that this never deadlocks.

/// What one step moves or computes; `mb` is the micro-batch index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// Receives micro-batch `mb`'s input activation from the previous stage.
    RecvActivation(usize),
    /// Runs micro-batch `mb` forward through this stage's layers, keeping what its backward
    /// needs.
    Forward(usize),
    /// Sends micro-batch `mb`'s output activation to the next stage.
    SendActivation(usize),
    /// Receives the gradient of micro-batch `mb`'s output from the next stage.
    RecvGrad(usize),
    /// Runs micro-batch `mb` backward, releasing what its forward kept.
    Backward(usize),
    /// Sends the gradient of micro-batch `mb`'s input to the previous stage.
    SendGrad(usize),
}

/// Which schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// GPipe: every micro-batch forward, then every one backward. A stage holds the
    /// activations of all `m` micro-batches.
    GPipe,
    /// 1F1B (PipeDream-Flush, Megatron's default): `p - s - 1` warm-up forwards on stage `s`,
    /// then one forward and one backward in turn, then the remaining backwards. A stage holds
    /// at most `p - s` micro-batches' activations; same bubble as GPipe.
    OneFOneB,
}

fn forward(stage: usize, stages: usize, mb: usize, out: &mut Vec<Step>) {
    if stage > 0 {
        out.push(Step::RecvActivation(mb));
    }
    out.push(Step::Forward(mb));
    if stage + 1 < stages {
        out.push(Step::SendActivation(mb));
    }
}

fn backward(stage: usize, stages: usize, mb: usize, out: &mut Vec<Step>) {
    if stage + 1 < stages {
        out.push(Step::RecvGrad(mb));
    }
    out.push(Step::Backward(mb));
    if stage > 0 {
        out.push(Step::SendGrad(mb));
    }
}

/// The steps of stage `stage` (0-based) of `stages` for `micro_batches` micro-batches.
///
/// ```
/// use candle_tp::pipeline::{schedule, Kind, Step};
/// // The last of 2 stages, 2 micro-batches, 1F1B: no warm-up; the next input is received
/// // before the gradient goes back, the order in which the first stage sends them.
/// assert_eq!(
///     schedule(Kind::OneFOneB, 1, 2, 2),
///     vec![
///         Step::RecvActivation(0), Step::Forward(0), Step::Backward(0),
///         Step::RecvActivation(1), Step::SendGrad(0),
///         Step::Forward(1), Step::Backward(1), Step::SendGrad(1),
///     ]
/// );
/// ```
pub fn schedule(kind: Kind, stage: usize, stages: usize, micro_batches: usize) -> Vec<Step> {
    assert!(stage < stages, "stage {stage} of {stages}");
    let mut out = Vec::new();
    match kind {
        Kind::GPipe => {
            for mb in 0..micro_batches {
                forward(stage, stages, mb, &mut out);
            }
            for mb in 0..micro_batches {
                backward(stage, stages, mb, &mut out);
            }
        }
        Kind::OneFOneB => {
            // Megatron's order, its batched pairs (send_forward_recv_backward,
            // send_backward_recv_forward) listed activation first on both sides.
            let (first, last) = (stage == 0, stage + 1 == stages);
            let warmup = (stages - stage - 1).min(micro_batches);
            let steady = micro_batches - warmup;
            for mb in 0..warmup {
                forward(stage, stages, mb, &mut out);
            }
            if steady > 0 && !first {
                out.push(Step::RecvActivation(warmup));
            }
            for i in 0..steady {
                out.push(Step::Forward(warmup + i));
                if !last {
                    out.push(Step::SendActivation(warmup + i));
                    out.push(Step::RecvGrad(i));
                }
                out.push(Step::Backward(i));
                if i + 1 < steady && !first {
                    out.push(Step::RecvActivation(warmup + i + 1));
                }
                if !first {
                    out.push(Step::SendGrad(i));
                }
            }
            for mb in steady..micro_batches {
                backward(stage, stages, mb, &mut out);
            }
        }
    }
    out
}

/// The most micro-batches whose activations a stage holds at once (forwards whose backward
/// has not run yet).
pub fn peak_activations(steps: &[Step]) -> usize {
    let (mut live, mut peak) = (0usize, 0usize);
    for s in steps {
        match s {
            Step::Forward(_) => {
                live += 1;
                peak = peak.max(live);
            }
            Step::Backward(_) => live = live.saturating_sub(1),
            _ => {}
        }
    }
    peak
}
