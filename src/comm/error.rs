//! The error type of the communication layer.
//!
//! Library entry points that Candle calls (`Module::forward`, `CustomOp1`) return
//! `candle_core::Result`; a [`CommError`] converts into `candle_core::Error` with its full
//! message, so nothing is lost on the way.

use std::fmt;
use std::time::Duration;

/// What went wrong in a collective, the rendezvous or the environment.
///
/// Every variant names the group and the collective (or the environment variable, or the
/// store address) and the ranks involved, so that a message read in a log of eight ranks says
/// which peer to look at.
#[derive(Debug, Clone, PartialEq)]
pub enum CommError {
    /// A wait ran past its deadline (`CANDLE_TP_TIMEOUT`, default 300 s).
    Timeout {
        /// Name of the process group (e.g. `world`, `world/tp[0,1]`).
        group: String,
        /// The collective or rendezvous step that was waiting.
        op: String,
        /// Ranks (in the group's numbering) that had not arrived.
        missing: Vec<usize>,
        /// How long this rank waited.
        waited: Duration,
    },
    /// A peer process is gone (it exited or was killed) while this rank waited for it.
    PeerDied {
        /// Name of the process group.
        group: String,
        /// The collective that was waiting.
        op: String,
        /// Rank of the dead peer (group numbering).
        rank: usize,
        /// Its operating-system process id.
        pid: u32,
    },
    /// Another rank of the group failed and aborted the group; every later collective fails.
    Aborted {
        /// Name of the process group.
        group: String,
        /// The collective this rank was in (or about to start).
        op: String,
        /// Rank that aborted the group.
        rank: usize,
        /// Its reason, as it wrote it.
        reason: String,
    },
    /// Ranks called the same collective with arguments that do not agree (element count,
    /// dtype, root, collective kind).
    Mismatch {
        /// Name of the process group.
        group: String,
        /// The collective.
        op: String,
        /// What differs, with the sizes of each rank.
        detail: String,
    },
    /// An argument is invalid on this rank alone (a buffer of the wrong length, a root out of
    /// range, a rank list with duplicates).
    InvalidArgument {
        /// The group or component.
        context: String,
        /// What is wrong, with the sizes involved.
        detail: String,
    },
    /// The rendezvous store failed (connect, protocol, closed by the host).
    Store {
        /// `host:port` of the store.
        addr: String,
        /// What happened.
        detail: String,
    },
    /// An operating-system call failed (shared memory, futex, socket).
    Io {
        /// What was being done, with names (segment, path, address).
        context: String,
        /// The OS error text.
        source: String,
    },
    /// An environment variable is missing or inconsistent with the others.
    Env {
        /// The variable, e.g. `RANK`.
        var: String,
        /// What is wrong.
        detail: String,
    },
}

impl CommError {
    /// Builds an [`CommError::Io`] from a context and an `std::io::Error`.
    pub fn io(context: impl Into<String>, err: std::io::Error) -> Self {
        CommError::Io {
            context: context.into(),
            source: err.to_string(),
        }
    }

    /// Builds an [`CommError::Io`] from a context and the current `errno`.
    pub fn last_os_error(context: impl Into<String>) -> Self {
        Self::io(context, std::io::Error::last_os_error())
    }

    /// Builds an [`CommError::InvalidArgument`].
    pub fn invalid(context: impl Into<String>, detail: impl Into<String>) -> Self {
        CommError::InvalidArgument {
            context: context.into(),
            detail: detail.into(),
        }
    }

    /// Builds an [`CommError::Env`].
    pub fn env(var: impl Into<String>, detail: impl Into<String>) -> Self {
        CommError::Env {
            var: var.into(),
            detail: detail.into(),
        }
    }
}

fn ranks(list: &[usize]) -> String {
    let v: Vec<String> = list.iter().map(|r| r.to_string()).collect();
    v.join(", ")
}

impl fmt::Display for CommError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommError::Timeout {
                group,
                op,
                missing,
                waited,
            } => write!(
                f,
                "timeout in {op} on group '{group}': waited {:.1} s for rank(s) {} that never arrived \
                 (set CANDLE_TP_TIMEOUT=<seconds> to change the deadline)",
                waited.as_secs_f64(),
                ranks(missing)
            ),
            CommError::PeerDied {
                group,
                op,
                rank,
                pid,
            } => write!(
                f,
                "{op} on group '{group}': peer rank {rank} (pid {pid}) is gone (exited or killed) \
                 while this rank waited for it"
            ),
            CommError::Aborted {
                group,
                op,
                rank,
                reason,
            } => write!(
                f,
                "{op} on group '{group}': the group was aborted by rank {rank}: {reason}"
            ),
            CommError::Mismatch { group, op, detail } => {
                write!(f, "{op} on group '{group}': ranks disagree: {detail}")
            }
            CommError::InvalidArgument { context, detail } => write!(f, "{context}: {detail}"),
            CommError::Store { addr, detail } => {
                write!(f, "rendezvous store at {addr}: {detail}")
            }
            CommError::Io { context, source } => write!(f, "{context}: {source}"),
            CommError::Env { var, detail } => {
                write!(f, "environment variable {var}: {detail}")
            }
        }
    }
}

impl std::error::Error for CommError {}

impl From<CommError> for candle_core::Error {
    fn from(e: CommError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// Result of the communication layer.
pub type CommResult<T> = std::result::Result<T, CommError>;
