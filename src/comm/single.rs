//! The backend of a group of one rank: every collective is a copy (after the same size checks
//! a larger group makes), so layers on [`ProcessGroup::single`](super::ProcessGroup::single)
//! behave exactly like candle-nn's.

use std::any::Any;
use std::sync::Arc;

use super::backend::{for_element, typed, typed_mut, Backend, HostBuf, HostBufMut};
use super::context::Context;
use super::element::ReduceOp;
use super::error::{CommError, CommResult};
use super::stats::CommStats;

/// A group of one rank named `name`.
pub(crate) struct Single {
    name: String,
}

impl Single {
    pub(crate) fn new(name: String) -> Self {
        Self { name }
    }

    fn who(&self, op: &str) -> String {
        format!("{op} on group '{}' (rank 0 of 1)", self.name)
    }

    /// `dst = src` for two buffers of one type and length.
    fn copy(&self, op: &str, src: HostBuf<'_>, dst: HostBufMut<'_>) -> CommResult<()> {
        let who = self.who(op);
        for_element!(dst.dtype(), who.clone(), |T| {
            let (s, d) = (typed::<T>(src, &who)?, typed_mut::<T>(dst, &who)?);
            d.copy_from_slice(s);
            Ok(())
        })
    }

    fn sizes_error(&self, op: &str, counts: &[usize], src: usize, dst: usize) -> CommError {
        CommError::invalid(
            self.who(op),
            format!("sizes {counts:?}, input {src} and output {dst} elements"),
        )
    }
}

impl Backend for Single {
    fn all_reduce(
        &self,
        src: Option<HostBuf<'_>>,
        dst: HostBufMut<'_>,
        _op: ReduceOp,
    ) -> CommResult<()> {
        match src {
            Some(src) => self.copy("all_reduce", src, dst),
            None => Ok(()),
        }
    }

    fn all_gather_v(
        &self,
        src: HostBuf<'_>,
        dst: HostBufMut<'_>,
        counts: &[usize],
    ) -> CommResult<()> {
        if counts != [src.len()] || dst.len() != src.len() {
            return Err(self.sizes_error("all_gather", counts, src.len(), dst.len()));
        }
        self.copy("all_gather", src, dst)
    }

    fn reduce_scatter_v(
        &self,
        src: HostBuf<'_>,
        dst: HostBufMut<'_>,
        counts: &[usize],
        _op: ReduceOp,
    ) -> CommResult<()> {
        if counts != [dst.len()] || dst.len() != src.len() {
            return Err(self.sizes_error("reduce_scatter", counts, src.len(), dst.len()));
        }
        self.copy("reduce_scatter", src, dst)
    }

    fn broadcast(&self, _buf: HostBufMut<'_>, root: usize) -> CommResult<()> {
        if root == 0 {
            Ok(())
        } else {
            Err(CommError::invalid(
                self.who("broadcast"),
                format!("root {root} is not a rank of a 1-rank group"),
            ))
        }
    }

    fn barrier(&self) -> CommResult<()> {
        Ok(())
    }

    fn abort(&self, _reason: &str) {}

    fn stats(&self) -> CommStats {
        CommStats::default()
    }

    fn reset_stats(&self) {}

    fn subgroup(
        &self,
        _ctx: &Arc<Context>,
        name: String,
        _rank: usize,
        _members: &[usize],
    ) -> CommResult<Arc<dyn Backend>> {
        Ok(Arc::new(Single::new(name)))
    }

    fn kind(&self) -> &'static str {
        "single"
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
