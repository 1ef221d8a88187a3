//! [`Context`]: what every group of one rank shares (the rendezvous store, the kind of shared
//! memory, the job id, the deadline), whatever its backend.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::engine::default_slot_bytes;
use super::region::RegionKind;
use super::store::Store;
use super::wait::default_timeout;

/// Settings of a job's groups. `Default` reads `CANDLE_TP_TIMEOUT` (seconds, default 300)
/// and `CANDLE_TP_SLOT_BYTES` (default 4 MiB).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupOptions {
    /// Deadline of every wait (collectives and rendezvous).
    pub timeout: Duration,
    /// Bytes of one shared data slot per rank (two per rank per group); larger messages are
    /// cut into chunks of this size.
    pub slot_bytes: usize,
}

impl Default for GroupOptions {
    fn default() -> Self {
        Self {
            timeout: default_timeout(),
            slot_bytes: default_slot_bytes(),
        }
    }
}

/// What every group of one rank shares: the rendezvous store and naming state.
pub(crate) struct Context {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) region: RegionKind,
    pub(crate) job: String,
    pub(crate) timeout: Duration,
    pub(crate) slot_bytes: usize,
    /// Ranks of the job on this host: a sub-group of 2 on a 4-rank host still shares the
    /// cores with the other ranks, so its wait policy looks at this, not its own size.
    pub(crate) local_ranks: usize,
    /// How many groups of each name this rank created (sub-group keys stay unique).
    created: Mutex<HashMap<String, usize>>,
    /// Things that must live as long as the groups (the store server on rank 0).
    _keep: Mutex<Vec<Box<dyn std::any::Any + Send + Sync>>>,
}

impl Context {
    pub(crate) fn new(
        store: Arc<dyn Store>,
        region: RegionKind,
        job: String,
        options: &GroupOptions,
        local_ranks: usize,
        keep: Vec<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            region,
            job,
            timeout: options.timeout,
            slot_bytes: options.slot_bytes,
            local_ranks,
            created: Mutex::new(HashMap::new()),
            _keep: Mutex::new(keep),
        })
    }
}

impl Context {
    /// `base`, or `base#n` for the n-th group of that name this rank creates: every rank
    /// creates its groups in the same order, so the names (store keys, segment names) agree.
    pub(crate) fn unique_name(&self, base: String) -> String {
        let n = {
            let mut created = self.created.lock().unwrap_or_else(|e| e.into_inner());
            let n = created.entry(base.clone()).or_insert(0);
            *n += 1;
            *n
        };
        if n == 1 {
            base
        } else {
            format!("{base}#{n}")
        }
    }
}
