//! `y = x · Wᵀ` accumulated in f64 for quantized weights, over rayon: the driver of
//! [`crate::f64_dot`], here (not in candle-tp) so that its generic code is compiled with this
//! crate's optimisations in every profile.

use crate::f64_dot::{blocks_from_bytes, dot_f64, F64Dot};
use crate::q4_1::Kernel;
use candle_core::Result;
use rayon::prelude::*;

/// Weight rows per rayon task at least: below this the task costs more than its work.
const MIN_ROWS_PER_TASK: usize = 16;

/// Fills `dst` (`[m, n]`, activation-row major) by calls `fill(row0, out)`, `out` the
/// weight-row-major block `[rows, m]` of weight rows `row0..row0 + rows`, over the current
/// rayon pool in ranges of whole rows, multiples of 4 (on the caller with one thread). Each
/// task owns one contiguous slice: for `m == 1` that is `dst` itself, otherwise a buffer
/// transposed into `dst` at the end.
pub fn fill_by_weight_rows<T: Send + Copy + Default>(
    n: usize,
    m: usize,
    dst: &mut [T],
    fill: impl Fn(usize, &mut [T]) + Sync,
) {
    if m == 1 {
        return for_row_ranges(n, 1, dst, fill);
    }
    let mut yt = vec![T::default(); n * m];
    for_row_ranges(n, m, &mut yt, fill);
    for (j, col) in yt.chunks_exact(m).enumerate() {
        for (i, &v) in col.iter().enumerate() {
            dst[i * n + j] = v;
        }
    }
}

/// `fill(row0, out)` over ranges of the `n` weight rows of a `[n, m]` output.
fn for_row_ranges<T: Send>(
    n: usize,
    m: usize,
    out: &mut [T],
    fill: impl Fn(usize, &mut [T]) + Sync,
) {
    let threads = rayon::current_num_threads();
    let rows_per_task = if threads == 1 {
        n
    } else {
        n.div_ceil(4 * threads)
            .max(MIN_ROWS_PER_TASK)
            .next_multiple_of(4)
    };
    if n <= rows_per_task {
        fill(0, out);
    } else {
        out.par_chunks_mut(rows_per_task * m)
            .enumerate()
            .for_each(|(t, o)| fill(t * rows_per_task, o));
    }
}

/// Checks the arguments of a quantized matmul `(m, k, n)` with blocks of `block` values:
/// `k` whole blocks, `(x, w, dst)` lengths of `m·k` values, `n·k/block` blocks and `m·n`
/// values, `kernel` runnable here. Returns the blocks per row; the errors start with `what`.
pub fn check_matmul(
    what: &str,
    kernel: Kernel,
    (m, k, n): (usize, usize, usize),
    block: usize,
    (x_len, w_len, dst_len): (usize, usize, usize),
) -> Result<usize> {
    if k % block != 0 {
        candle_core::bail!("{what}: k = {k} is not a multiple of the block size {block}")
    }
    let kb = k / block;
    if x_len != m * k || w_len != n * kb || dst_len != m * n {
        candle_core::bail!(
            "{what} (m, k, n) = ({m}, {k}, {n}): x has {x_len} values (expected {}), W {w_len} \
             blocks (expected {}), dst {dst_len} values (expected {})",
            m * k,
            n * kb,
            m * n
        )
    }
    if !kernel.is_available() {
        candle_core::bail!("{what}: kernel {kernel:?} is not supported by this CPU")
    }
    Ok(kb)
}

/// `dst[i * n + j] = Σ_t x[i, t] · W[j, t]` in f64, for `m` activation rows of `k` values and a
/// weight of `n` rows of `k / block` blocks. Each activation row is quantized once to the
/// type's activation blocks (candle's rounding), so the result is candle's quantized product
/// up to the order and precision of the sum; every output is one [`dot_f64`], so a row's
/// result does not depend on `m` or on the thread count.
pub fn matmul_f64<B: F64Dot>(
    kernel: Kernel,
    (m, k, n): (usize, usize, usize),
    x: &[f32],
    w: &[B],
    dst: &mut [f64],
) -> Result<()> {
    let kb = check_matmul(
        &format!("{} f64 matmul", B::NAME),
        kernel,
        (m, k, n),
        B::BLOCK,
        (x.len(), w.len(), dst.len()),
    )?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        dst.fill(0.0); // empty sums
        return Ok(());
    }
    let mut xq = vec![B::ACT_ZERO; m * kb];
    B::quantize(x, &mut xq);
    let fill = |row0: usize, out: &mut [f64]| {
        for (r, o) in out.chunks_exact_mut(m).enumerate() {
            let wr = &w[(row0 + r) * kb..(row0 + r + 1) * kb];
            for (v, xr) in o.iter_mut().zip(xq.chunks_exact(kb)) {
                *v = dot_f64(kernel, wr, xr);
            }
        }
    };
    fill_by_weight_rows(n, m, dst, fill);
    Ok(())
}

/// [`matmul_f64`] of a weight given as GGUF bytes (a `QTensor`'s data), viewed as blocks of
/// `B` without copying: one function per block type, which a caller can pick from a table.
pub fn matmul_f64_bytes<B: F64Dot>(
    kernel: Kernel,
    dims: (usize, usize, usize),
    x: &[f32],
    w: &[u8],
    dst: &mut [f64],
) -> Result<()> {
    matmul_f64(kernel, dims, x, blocks_from_bytes::<B>(w)?, dst)
}

/// The signature of [`matmul_f64_bytes`] for one block type.
pub type F64MatMulFn = fn(Kernel, (usize, usize, usize), &[f32], &[u8], &mut [f64]) -> Result<()>;
