//! The replicated scheduler loop. Every rank holds the same [`BatchDecoder`]; rank 0 decides
//! each step (which queued requests join, which sequences are dropped, whether to shut down),
//! broadcasts that [`StepPlan`] through the process group, and every rank applies it and runs
//! the same batched step, so all ranks stay in lockstep with no other channel.
//!
//! Rank 0's HTTP side talks to the loop through a [`Queue`] (bounded: a full queue is refused
//! at once, the HTTP answer is 503) and gets each sequence's tokens back on its own channel;
//! a request whose channel is closed (the client went away, or a stop string ended it) is
//! dropped before the next step, whether it is in the batch or still queued. When idle, rank 0 waits on the queue and sends an empty plan
//! every `heartbeat` (below the collectives' deadline) while the other ranks sleep in the
//! broadcast.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use candle_core::Result;
use tokio::sync::mpsc::UnboundedSender;

use crate::generate::{BatchDecoder, FinishReason, SeqRequest, TokenFilter, TokenLogprobs};
use crate::models::CausalLm;
use crate::serve::metrics::Metrics;
use crate::serve::step::StepPlan;

/// What the loop sends back for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token; `finish` is set on the last one.
    Token {
        /// The token id.
        token: u32,
        /// Why the sequence ended, on its last token.
        finish: Option<FinishReason>,
        /// Its log-probabilities, when the request asked for them.
        logprobs: Option<TokenLogprobs>,
    },
    /// The request was ended without finishing (shutdown, a failed step, a refused request).
    Error(String),
}

/// A request for the loop: the sequence, its grammar and where its events go.
#[derive(Debug)]
pub struct Submission {
    /// The sequence to decode; the loop sets its `id`, and its `options.constrained` from
    /// `filter`.
    pub seq: SeqRequest,
    /// The grammar its tokens must follow (structured outputs, forced tool calls), if any.
    pub filter: Option<Box<dyn TokenFilter>>,
    /// Where its events go (dropping the receiver cancels the request).
    pub events: UnboundedSender<Event>,
}

/// Why a submission was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// The queue holds its maximum of waiting requests.
    Full,
    /// The server is shutting down (or its loop ended).
    ShuttingDown,
}

enum Msg {
    Submit(Box<Submission>),
    Wake,
}

/// The HTTP side's handle on the loop (cheap to clone).
#[derive(Clone)]
pub struct Queue {
    tx: SyncSender<Msg>,
    shutdown: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    capacity: usize,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("capacity", &self.capacity)
            .field("shutdown", &self.is_shutting_down())
            .finish()
    }
}

/// The loop's end of the queue (rank 0).
pub struct Inbox {
    rx: Receiver<Msg>,
    shutdown: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
}

/// A queue holding at most `capacity` requests that wait for a slot in the batch.
pub fn queue(capacity: usize) -> (Queue, Inbox) {
    let (tx, rx) = mpsc::sync_channel(capacity.max(1));
    let shutdown = Arc::new(AtomicBool::new(false));
    let metrics = Arc::new(Metrics::default());
    (
        Queue {
            tx,
            shutdown: shutdown.clone(),
            metrics: metrics.clone(),
            capacity,
        },
        Inbox {
            rx,
            shutdown,
            metrics,
        },
    )
}

impl Queue {
    /// Queues a request, or refuses it at once.
    pub fn submit(&self, s: Submission) -> std::result::Result<(), SubmitError> {
        self.submit_all(vec![s])
    }

    /// Queues every request of `subs` (a request's choices: `n`, several prompts), or none:
    /// they are refused at once unless the queue has room for them all now, so that a request
    /// never leaves some of its choices queued behind a refusal (they would hold slots that
    /// other clients wait for).
    pub fn submit_all(&self, subs: Vec<Submission>) -> std::result::Result<(), SubmitError> {
        if self.is_shutting_down() {
            return Err(SubmitError::ShuttingDown);
        }
        let k = subs.len();
        let cap = self.capacity.max(1);
        // Room reserved before anything is sent, so that the loop never takes one out before
        // it is counted, and two requests never both take the last slots.
        self.metrics
            .waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
                (w + k <= cap).then_some(w + k)
            })
            .map_err(|_| SubmitError::Full)?;
        for (sent, s) in subs.into_iter().enumerate() {
            if let Err(e) = self.tx.try_send(Msg::Submit(Box::new(s))) {
                // Those sent are the loop's to count down; the rest were never queued.
                self.metrics.waiting.fetch_sub(k - sent, Ordering::SeqCst);
                return Err(match e {
                    TrySendError::Full(_) => SubmitError::Full,
                    TrySendError::Disconnected(_) => SubmitError::ShuttingDown,
                });
            }
        }
        Ok(())
    }

    /// Sequences in the batch after the last step.
    pub fn active(&self) -> usize {
        self.metrics.running.load(Ordering::SeqCst)
    }

    /// The server's metrics (the loop sets the gauges, the HTTP side the rest).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The most requests that wait.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Asks the loop to end: every rank leaves, in-flight requests end with an error.
    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        let _ = self.tx.try_send(Msg::Wake);
    }

    /// Whether the loop is ending or has ended.
    pub fn is_shutting_down(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst)
    }
}

/// Applies a plan: drops, then adds, with their grammars on rank 0 (a failure is a
/// desynchronised plan).
fn apply(
    model: &CausalLm,
    dec: &mut BatchDecoder,
    plan: &StepPlan,
    filters: &mut HashMap<u64, Box<dyn TokenFilter>>,
) -> Result<()> {
    for &id in &plan.cancel {
        dec.cancel(id);
    }
    for r in &plan.add {
        dec.add_constrained(model, r.clone(), filters.remove(&r.id))?;
    }
    Ok(())
}

/// The longest step this process has run so far, in microseconds ([`longest_step`]).
static LONGEST_STEP_US: AtomicU64 = AtomicU64::new(0);

/// The longest step (a plan's batched forward and draw) this process has run so far: how long
/// a rank may have to wait for the next plan. A rank other than 0 that is asked to stop waits
/// at least this long for rank 0's shutdown plan.
pub fn longest_step() -> Duration {
    Duration::from_micros(LONGEST_STEP_US.load(Ordering::Relaxed))
}

/// Runs one step, recording its length for [`longest_step`].
fn timed_step(
    model: &mut CausalLm,
    dec: &mut BatchDecoder,
) -> Result<Vec<crate::generate::TokenEvent>> {
    let t0 = std::time::Instant::now();
    let r = dec.step(model);
    let us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
    LONGEST_STEP_US.fetch_max(us, Ordering::Relaxed);
    r
}

/// The idle heartbeat for a job whose collectives wait at most `timeout`: rank 0 sends an
/// empty plan this often while idle, so that the other ranks, waiting for the next plan in a
/// broadcast, never reach their deadline. A quarter of the deadline, at most 10 s (a
/// `CANDLE_TP_TIMEOUT` of 5 s would otherwise end an idle server), at least 1 ms.
///
/// ```
/// use candle_tp::serve::idle_heartbeat;
/// use std::time::Duration;
/// assert_eq!(idle_heartbeat(Duration::from_secs(300)), Duration::from_secs(10));
/// assert_eq!(idle_heartbeat(Duration::from_secs(4)), Duration::from_secs(1));
/// ```
pub fn idle_heartbeat(timeout: Duration) -> Duration {
    (timeout / 4)
        .min(Duration::from_secs(10))
        .max(Duration::from_millis(1))
}

/// A rank other than 0: applies rank 0's plans and runs the steps until a plan says stop.
pub fn run_follower(model: &mut CausalLm, dec: &mut BatchDecoder) -> Result<()> {
    let pg = model.world().clone();
    loop {
        let plan = StepPlan::broadcast(&pg, None)?;
        if plan.shutdown {
            return Ok(());
        }
        apply(model, dec, &plan, &mut HashMap::new()).map_err(|e| {
            candle_core::Error::msg(format!("rank {}: applying rank 0's plan: {e}", pg.rank()))
        })?;
        timed_step(model, dec)?;
        // Rank 0 tells the requests why.
        dec.take_failed();
    }
}

/// Rank 0's loop state.
struct Leader {
    waiting: VecDeque<Submission>,
    active: HashMap<u64, UnboundedSender<Event>>,
    /// The grammars of the sequences of the plan being sent.
    filters: HashMap<u64, Box<dyn TokenFilter>>,
    next_id: u64,
}

impl Leader {
    fn take(&mut self, m: Msg) {
        if let Msg::Submit(s) = m {
            self.waiting.push_back(*s);
        }
    }

    fn fail_all(&mut self, inbox: &Inbox, why: &str) {
        for (_, tx) in self.active.drain() {
            let _ = tx.send(Event::Error(why.to_string()));
        }
        for s in self.waiting.drain(..) {
            inbox.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
            let _ = s.events.send(Event::Error(why.to_string()));
        }
        while let Ok(m) = inbox.rx.try_recv() {
            if let Msg::Submit(s) = m {
                inbox.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
                let _ = s.events.send(Event::Error(why.to_string()));
            }
        }
    }

    /// The next plan: closed channels dropped, queued requests added while there is room.
    fn plan(
        &mut self,
        model: &CausalLm,
        dec: &BatchDecoder,
        inbox: &Inbox,
        shutdown: bool,
    ) -> StepPlan {
        let mut plan = StepPlan {
            shutdown,
            ..StepPlan::default()
        };
        if shutdown {
            return plan;
        }
        for (&id, tx) in &self.active {
            if tx.is_closed() {
                plan.cancel.push(id);
            }
        }
        // Requests whose client left while they waited give their places in the queue back
        // now, not when their turn comes (until then they made the queue refuse others).
        while let Ok(m) = inbox.rx.try_recv() {
            self.take(m);
        }
        let queued = self.waiting.len();
        self.waiting.retain(|s| !s.events.is_closed());
        inbox
            .metrics
            .waiting
            .fetch_sub(queued - self.waiting.len(), Ordering::SeqCst);
        let mut room = self.room(dec, plan.cancel.len());
        while room > 0 {
            if self.waiting.is_empty() {
                match inbox.rx.try_recv() {
                    Ok(m) => self.take(m),
                    Err(_) => break,
                }
                continue;
            }
            let s = self.waiting.pop_front().expect("not empty");
            inbox.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
            if s.events.is_closed() {
                continue;
            }
            let mut req = s.seq;
            req.id = self.next_id;
            req.options.constrained = s.filter.is_some();
            self.next_id += 1;
            // What the model cannot run (an id outside its vocabulary, a prompt beyond its
            // context) ends this request here: in the batch it would fail every sequence's step.
            if let Err(e) = dec.check_for(model, &req) {
                let _ = s
                    .events
                    .send(Event::Error(crate::serve::error::client_message(&e)));
                continue;
            }
            self.active.insert(req.id, s.events);
            if let Some(f) = s.filter {
                self.filters.insert(req.id, f);
            }
            plan.add.push(req);
            room -= 1;
        }
        plan
    }

    /// Free slots once `cancelled` sequences are dropped.
    fn room(&self, dec: &BatchDecoder, cancelled: usize) -> usize {
        dec.max_batch()
            .saturating_sub(dec.len().saturating_sub(cancelled))
    }
}

/// Rank 0: takes requests from `inbox`, plans and broadcasts each step, runs it and sends the
/// tokens back, until [`Queue::shutdown`] (or a failed step, which ends every request with
/// an error and is returned).
pub fn run_leader(
    model: &mut CausalLm,
    dec: &mut BatchDecoder,
    inbox: Inbox,
    heartbeat: Duration,
) -> Result<()> {
    let pg = model.world().clone();
    let mut leader = Leader {
        waiting: VecDeque::new(),
        active: HashMap::new(),
        filters: HashMap::new(),
        next_id: 0,
    };
    loop {
        let mut shutdown = inbox.shutdown.load(Ordering::SeqCst);
        if dec.is_empty() && leader.waiting.is_empty() && !shutdown {
            match inbox.rx.recv_timeout(heartbeat) {
                Ok(m) => leader.take(m),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => shutdown = true,
            }
            shutdown |= inbox.shutdown.load(Ordering::SeqCst);
        }
        let plan = leader.plan(model, dec, &inbox, shutdown);
        let result = StepPlan::broadcast(&pg, Some(&plan))
            .and_then(|_| apply(model, dec, &plan, &mut leader.filters))
            .and_then(|_| {
                if plan.shutdown {
                    Ok(Vec::new())
                } else {
                    timed_step(model, dec)
                }
            });
        for id in &plan.cancel {
            leader.active.remove(id);
        }
        let events = match result {
            Ok(ev) => ev,
            Err(e) => {
                inbox.shutdown.store(true, Ordering::SeqCst);
                let why = crate::serve::error::client_message(&e);
                leader.fail_all(&inbox, &format!("the model step failed: {why}"));
                dec.clear();
                return Err(e);
            }
        };
        if plan.shutdown {
            inbox.shutdown.store(true, Ordering::SeqCst);
            leader.fail_all(&inbox, "the server is shutting down");
            dec.clear();
            return Ok(());
        }
        for (id, why) in dec.take_failed() {
            if let Some(tx) = leader.active.remove(&id) {
                let _ = tx.send(Event::Error(why));
            }
        }
        inbox.metrics.running.store(dec.len(), Ordering::SeqCst);
        inbox
            .metrics
            .kv_used
            .store(dec.cached_tokens(), Ordering::SeqCst);
        inbox
            .metrics
            .kv_capacity
            .store(dec.max_batch() * dec.max_seq_len(), Ordering::SeqCst);
        let moved = model.comm_stats().total();
        let m = &inbox.metrics;
        m.comm_payload_bytes
            .store(moved.payload_bytes, Ordering::Relaxed);
        m.comm_cross_host_bytes
            .store(moved.cross_host_bytes, Ordering::Relaxed);
        for e in events {
            let Some(tx) = leader.active.get(&e.id) else {
                continue;
            };
            let _ = tx.send(Event::Token {
                token: e.token,
                finish: e.finish,
                logprobs: e.logprobs,
            });
            if e.finish.is_some() {
                leader.active.remove(&e.id);
            }
        }
    }
}
