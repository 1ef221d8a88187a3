//! [`all_to_all`]: rows of a tensor sent to the ranks that need them, with autograd (what
//! expert parallelism dispatches tokens to their experts' ranks with, and brings them back
//! with; Megatron's `all_to_all` in `tensor_parallel/mappings.py`).

use candle_core::{Result, Tensor};

use super::collective::CollectiveOp;
use super::kind::Kind;
use crate::comm::ProcessGroup;

/// All-to-all along dim 0, with autograd: rows `0..send_rows[0]` of `x` go to rank 0, the next
/// `send_rows[1]` to rank 1, and so on; the result holds `recv_rows[s]` rows from each rank
/// `s`, in rank order (the other dimensions unchanged). Row counts may differ and be zero.
/// Rank `s`'s `send_rows[d]` must equal rank `d`'s `recv_rows[s]` (a disagreement is an error
/// on every rank). The gradient goes back by the reverse all-to-all (`send_rows` and
/// `recv_rows` swapped), so `backward()` through it gives each rank the gradient of the rows
/// it sent.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_tp::comm::run_threads;
/// let rows = run_threads(2, |pg| {
///     // Rank 0 holds 3 rows and keeps 1; rank 1 holds 1 row and sends it to rank 0.
///     let (n, send, recv) = if pg.rank() == 0 { (3, [1, 2], [1, 1]) } else { (1, [1, 0], [2, 0]) };
///     let x = Tensor::arange(0f32, 2.0 * n as f32, &Device::Cpu)?.reshape((n, 2))?;
///     let x = (x + 10.0 * pg.rank() as f64)?;
///     let y = candle_tp::ops::all_to_all(&x, &pg, &send, &recv)?;
///     y.to_vec2::<f32>()
/// })
/// .unwrap();
/// assert_eq!(rows[0], vec![vec![0.0, 1.0], vec![10.0, 11.0]]);
/// assert_eq!(rows[1], vec![vec![2.0, 3.0], vec![4.0, 5.0]]);
/// ```
pub fn all_to_all(
    x: &Tensor,
    pg: &ProcessGroup,
    send_rows: &[usize],
    recv_rows: &[usize],
) -> Result<Tensor> {
    let fwd = Kind::AllToAll {
        send: send_rows.to_vec(),
        recv: recv_rows.to_vec(),
    };
    let bwd = Kind::AllToAll {
        send: recv_rows.to_vec(),
        recv: send_rows.to_vec(),
    };
    CollectiveOp::apply(pg, x, fwd, Some(bwd))
}
