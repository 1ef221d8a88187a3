//! Running every stage's schedule on paper: the checks Megatron's and DeepSpeed's schedule
//! tests make (each micro-batch forward then backward once per stage, messages that meet, no
//! deadlock), and the time it takes with given step costs, for the bubble.

use super::schedule::Step;

/// The outcome of [`replay`]: when the last step ended and how long each stage computed.
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    /// Time at which the last stage finished.
    pub makespan: f64,
    /// Compute time (forwards and backwards) of each stage.
    pub busy: Vec<f64>,
}

impl Replay {
    /// The fraction of stage-time spent idle: `1 - Σ busy / (stages · makespan)`.
    pub fn bubble(&self) -> f64 {
        let total: f64 = self.busy.iter().sum();
        1.0 - total / (self.busy.len() as f64 * self.makespan)
    }
}

/// Checks that every stage runs each of `micro_batches` forward once and backward once, the
/// backward after the forward.
pub fn check(schedules: &[Vec<Step>], micro_batches: usize) -> Result<(), String> {
    for (s, steps) in schedules.iter().enumerate() {
        let mut fwd = vec![0usize; micro_batches];
        let mut bwd = vec![0usize; micro_batches];
        for step in steps {
            match *step {
                Step::Forward(mb) if mb < micro_batches => fwd[mb] += 1,
                Step::Backward(mb) if mb < micro_batches => {
                    if fwd[mb] == 0 {
                        return Err(format!(
                            "stage {s}: backward of micro-batch {mb} before its forward"
                        ));
                    }
                    bwd[mb] += 1;
                }
                Step::Forward(mb) | Step::Backward(mb) => {
                    return Err(format!("stage {s}: micro-batch {mb} of {micro_batches}"))
                }
                _ => {}
            }
        }
        for mb in 0..micro_batches {
            if (fwd[mb], bwd[mb]) != (1, 1) {
                return Err(format!(
                    "stage {s}: micro-batch {mb} runs forward {} and backward {} times",
                    fwd[mb], bwd[mb]
                ));
            }
        }
    }
    Ok(())
}

/// The stage a message step talks to, and the step that must meet it there.
fn partner(stage: usize, step: Step) -> Option<(isize, Step)> {
    let s = stage as isize;
    match step {
        Step::SendActivation(mb) => Some((s + 1, Step::RecvActivation(mb))),
        Step::RecvActivation(mb) => Some((s - 1, Step::SendActivation(mb))),
        Step::SendGrad(mb) => Some((s - 1, Step::RecvGrad(mb))),
        Step::RecvGrad(mb) => Some((s + 1, Step::SendGrad(mb))),
        Step::Forward(_) | Step::Backward(_) => None,
    }
}

/// Runs the stages' schedules together as candle-tp's point-to-point runs them: a message
/// step waits until the neighbour's current step is its counterpart (a send waits for its
/// receive; messages between two stages come in one order). Forwards cost `forward`,
/// backwards `backward`, messages nothing. An error names each stage's blocked step when no
/// stage can go on (a deadlock), or a message whose neighbour does not exist.
pub fn replay(schedules: &[Vec<Step>], forward: f64, backward: f64) -> Result<Replay, String> {
    let p = schedules.len();
    let mut pos = vec![0usize; p];
    let mut clock = vec![0f64; p];
    let mut busy = vec![0f64; p];
    loop {
        let mut progress = false;
        for s in 0..p {
            while let Some(&step) = schedules[s].get(pos[s]) {
                let Some((peer, want)) = partner(s, step) else {
                    let cost = if matches!(step, Step::Forward(_)) {
                        forward
                    } else {
                        backward
                    };
                    clock[s] += cost;
                    busy[s] += cost;
                    pos[s] += 1;
                    progress = true;
                    continue;
                };
                if peer < 0 || peer as usize >= p {
                    return Err(format!("stage {s} of {p}: {step:?} has no neighbour"));
                }
                let q = peer as usize;
                if schedules[q].get(pos[q]) != Some(&want) {
                    break;
                }
                let t = clock[s].max(clock[q]);
                clock[s] = t;
                clock[q] = t;
                pos[s] += 1;
                pos[q] += 1;
                progress = true;
            }
        }
        if (0..p).all(|s| pos[s] == schedules[s].len()) {
            let makespan = clock.iter().copied().fold(0.0, f64::max);
            return Ok(Replay { makespan, busy });
        }
        if !progress {
            let blocked: Vec<String> = (0..p)
                .map(|s| match schedules[s].get(pos[s]) {
                    Some(step) => format!("stage {s} waits at {step:?} (step {})", pos[s]),
                    None => format!("stage {s} is done"),
                })
                .collect();
            return Err(format!("deadlock: {}", blocked.join("; ")));
        }
    }
}
