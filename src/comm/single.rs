//! The backend of a group of one rank: every collective is a copy (after the same size checks
//! a larger group makes), so layers on [`ProcessGroup::single`](super::ProcessGroup::single)
//! behave exactly like candle-nn's.

use std::sync::Arc;

use super::backend::{erased_collectives, Backend, World};
use super::context::Context;
use super::element::{Element, ReduceOp};
use super::error::{CommError, CommResult};

/// A group of one rank named `name`.
pub(crate) struct Single {
    name: String,
}

impl Single {
    pub(crate) fn new(name: String) -> Self {
        Self { name }
    }

    /// The world of a job of one rank (named `single`): what a program gets without a
    /// launcher.
    pub(crate) fn world() -> World {
        World {
            name: "single".into(),
            rank: 0,
            members: vec![0],
            backend: Arc::new(Single::new("single".into())),
            ctx: None,
        }
    }

    fn who(&self, op: &str) -> String {
        format!("{op} on group '{}' (rank 0 of 1)", self.name)
    }

    fn sizes_error(&self, op: &str, counts: &[usize], src: usize, dst: usize) -> CommError {
        CommError::invalid(
            self.who(op),
            format!("sizes {counts:?}, input {src} and output {dst} elements"),
        )
    }

    fn typed_all_reduce<T: Element>(
        &self,
        src: Option<&[T]>,
        dst: &mut [T],
        _op: ReduceOp,
    ) -> CommResult<()> {
        if let Some(src) = src {
            dst.copy_from_slice(src);
        }
        Ok(())
    }

    fn typed_all_gather<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
    ) -> CommResult<()> {
        if counts != [src.len()] || dst.len() != src.len() {
            return Err(self.sizes_error("all_gather", counts, src.len(), dst.len()));
        }
        dst.copy_from_slice(src);
        Ok(())
    }

    fn typed_reduce_scatter<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
        _op: ReduceOp,
    ) -> CommResult<()> {
        if counts != [dst.len()] || dst.len() != src.len() {
            return Err(self.sizes_error("reduce_scatter", counts, src.len(), dst.len()));
        }
        dst.copy_from_slice(src);
        Ok(())
    }

    fn typed_broadcast<T: Element>(&self, _buf: &mut [T], root: usize) -> CommResult<()> {
        if root == 0 {
            Ok(())
        } else {
            Err(CommError::invalid(
                self.who("broadcast"),
                format!("root {root} is not a rank of a 1-rank group"),
            ))
        }
    }
}

impl Backend for Single {
    erased_collectives!();

    fn barrier(&self) -> CommResult<()> {
        Ok(())
    }

    fn abort(&self, _reason: &str) {}

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
}
