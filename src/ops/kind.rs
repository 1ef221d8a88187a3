//! [`Kind`]: what a collective op does to its input on one rank (the forward of a collective
//! op, or its gradient's), and how errors name it.

use crate::comm::{ProcessGroup, ReduceOp};

/// What a collective op does to its input, on one rank.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Kind {
    /// A copy (identity): the forward of `copy_to_tp`, the backward of `reduce_from_tp`.
    Identity,
    /// All-reduce across the group.
    AllReduce(ReduceOp),
    /// All-gather along `dim`; rank `r` holds `sizes[r]` along it.
    AllGather { dim: usize, sizes: Vec<usize> },
    /// Keep this rank's part along `dim` (local, no communication).
    Split { dim: usize, sizes: Vec<usize> },
    /// Reduce across the group, keep this rank's part along `dim`.
    ReduceScatter {
        dim: usize,
        sizes: Vec<usize>,
        op: ReduceOp,
    },
    /// Copy of the root's tensor.
    Broadcast { root: usize },
    /// All-to-all along dim 0: rows `send[d]` (consecutive, in rank order) go to rank `d`;
    /// `recv[s]` rows come from rank `s`, in rank order. Its gradient is the reverse one.
    AllToAll { send: Vec<usize>, recv: Vec<usize> },
    /// Sum over the group on the root; zeros of the same shape elsewhere (the gradient of a
    /// broadcast: only the root's input reached the outputs).
    Reduce { root: usize },
}

impl Kind {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Kind::Identity => "candle-tp-identity",
            Kind::AllReduce(_) => "candle-tp-all-reduce",
            Kind::AllGather { .. } => "candle-tp-all-gather",
            Kind::Split { .. } => "candle-tp-split",
            Kind::ReduceScatter { .. } => "candle-tp-reduce-scatter",
            Kind::Broadcast { .. } => "candle-tp-broadcast",
            Kind::Reduce { .. } => "candle-tp-reduce",
            Kind::AllToAll { .. } => "candle-tp-all-to-all",
        }
    }
}

/// Names a collective in errors: its kind, the group and this rank.
pub(crate) fn who(pg: &ProcessGroup, kind: &Kind) -> String {
    format!(
        "{} on group '{}' (rank {} of {})",
        kind.name(),
        pg.name(),
        pg.rank(),
        pg.size()
    )
}
