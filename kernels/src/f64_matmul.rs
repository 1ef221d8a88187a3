//! The drivers of the quantized matmuls over rayon (ranges of whole weight rows per task, the
//! output written in place) and their argument checks, here (not in candle-tp) so that their
//! generic code is compiled with this crate's optimisations in every profile.

use crate::kernel::Kernel;
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

/// One task's share of an output `[m, n]` (activation-row major): weight rows `row0 .. row0 +
/// rows`, every activation row. [`fill_in_place`] hands one to each task; the shares are
/// disjoint columns of the same buffer, written in place.
pub struct RowsOut<'a, T> {
    ptr: *mut T,
    n: usize,
    m: usize,
    row0: usize,
    rows: usize,
    _dst: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: a `RowsOut` writes only its own columns of the buffer, which no other `RowsOut` of
// the same call touches; it is a `&mut` to those elements, sendable when `T` is.
unsafe impl<T: Send> Send for RowsOut<'_, T> {}

impl<T> RowsOut<'_, T> {
    /// The first weight row.
    pub fn row0(&self) -> usize {
        self.row0
    }

    /// Weight rows in this share.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The outputs of this share's weight rows for activation row `i` (`rows` values: weight
    /// row `row0 + r` at `r`).
    ///
    /// # Panics
    /// If `i >= m`.
    #[inline]
    pub fn row(&mut self, i: usize) -> &mut [T] {
        assert!(i < self.m, "activation row {i} outside [0, {})", self.m);
        // SAFETY: in bounds (`i < m`, `row0 + rows <= n`, the buffer holds `m · n`), and this
        // share's columns only, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * self.n + self.row0), self.rows) }
    }

    /// Sets the output of weight row `row0 + r` for activation row `i`.
    ///
    /// # Panics
    /// If `r >= rows` or `i >= m`.
    #[inline]
    pub fn set(&mut self, r: usize, i: usize, v: T) {
        assert!(
            r < self.rows && i < self.m,
            "output ({r}, {i}) outside [{}, {}]",
            self.rows,
            self.m
        );
        // SAFETY: in bounds (`i < m`, `row0 + r < n`, the buffer holds `m · n`), and in this
        // share's columns only.
        unsafe { *self.ptr.add(i * self.n + self.row0 + r) = v }
    }
}

/// A pointer that tasks share, each writing its own elements.
struct SharedPtr<T>(*mut T);
// SAFETY: used only to build `RowsOut`s over disjoint columns.
unsafe impl<T: Send> Sync for SharedPtr<T> {}

impl<T> SharedPtr<T> {
    /// The pointer (a method, so that closures capture the `Sync` wrapper, not the field).
    fn get(&self) -> *mut T {
        self.0
    }
}

/// Fills `dst` (`[m, n]`, activation-row major) in place by calls `fill(out)`, each `out` a
/// [`RowsOut`] of a range of whole weight rows, multiples of 4, over the current rayon pool (on
/// the caller with one thread): no buffer and no transpose, which for a prefill of 128 rows
/// cost ~10 % of a product (a fresh `[n, m]` buffer's page faults, then its transpose).
///
/// # Panics
/// If `dst.len() != m · n`.
pub fn fill_in_place<T: Send>(
    n: usize,
    m: usize,
    dst: &mut [T],
    fill: impl Fn(RowsOut<'_, T>) + Sync,
) {
    assert_eq!(
        dst.len(),
        m * n,
        "output of {} values for [{m}, {n}]",
        dst.len()
    );
    let rows_per_task = rows_per_task(n);
    let ptr = SharedPtr(dst.as_mut_ptr());
    let share = |t: usize| {
        let row0 = t * rows_per_task;
        RowsOut {
            ptr: ptr.get(),
            n,
            m,
            row0,
            rows: rows_per_task.min(n - row0),
            _dst: std::marker::PhantomData,
        }
    };
    let tasks = n.div_ceil(rows_per_task.max(1));
    if tasks <= 1 {
        fill(share(0));
    } else {
        (0..tasks).into_par_iter().for_each(|t| fill(share(t)));
    }
}

/// Weight rows per task over the current rayon pool: all of them with one thread, else about
/// four tasks per thread, at least [`MIN_ROWS_PER_TASK`], a multiple of 16 (the repacked
/// kernels' groups of 4 rows and panels of 16).
fn rows_per_task(n: usize) -> usize {
    let threads = rayon::current_num_threads();
    if threads == 1 {
        n.max(1)
    } else {
        n.div_ceil(4 * threads)
            .max(MIN_ROWS_PER_TASK)
            .next_multiple_of(16)
    }
}

/// `fill(row0, out)` over ranges of the `n` weight rows of a `[n, m]` output.
fn for_row_ranges<T: Send>(
    n: usize,
    m: usize,
    out: &mut [T],
    fill: impl Fn(usize, &mut [T]) + Sync,
) {
    let rows_per_task = rows_per_task(n);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every output element is written once, by the share that owns its weight row, with one
    /// thread and with several (tasks of 16+ rows, a last partial one).
    #[test]
    fn fill_in_place_writes_each_element_once_at_its_place() {
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for (n, m) in [(1, 1), (7, 3), (101, 1), (101, 5)] {
                let mut dst = vec![usize::MAX; m * n];
                let shares = std::sync::atomic::AtomicUsize::new(0);
                pool.install(|| {
                    fill_in_place(n, m, &mut dst, |mut o| {
                        shares.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        assert_eq!(o.row0() % 4, 0);
                        for r in 0..o.rows() {
                            for i in 0..m {
                                o.set(r, i, 1000 * i + o.row0() + r);
                            }
                        }
                    })
                });
                let want: Vec<usize> = (0..m * n).map(|e| 1000 * (e / n) + e % n).collect();
                assert_eq!(dst, want, "{threads} threads, n = {n}, m = {m}");
                let tasks = shares.into_inner();
                assert!(
                    if threads == 1 || n < 32 {
                        tasks == 1
                    } else {
                        tasks > 1
                    },
                    "{threads} threads, n = {n}: {tasks} shares"
                );
            }
        }
    }

    /// `row(i)` is the share's own columns of activation row `i`.
    #[test]
    fn a_shares_row_is_its_columns_of_that_row() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let (n, m) = (101, 3);
        let mut dst = vec![usize::MAX; m * n];
        pool.install(|| {
            fill_in_place(n, m, &mut dst, |mut o| {
                for i in 0..m {
                    let (row0, rows) = (o.row0(), o.rows());
                    let row = o.row(i);
                    assert_eq!(row.len(), rows);
                    for (r, v) in row.iter_mut().enumerate() {
                        *v = 1000 * i + row0 + r;
                    }
                }
            })
        });
        let want: Vec<usize> = (0..m * n).map(|e| 1000 * (e / n) + e % n).collect();
        assert_eq!(dst, want);
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn a_share_cannot_write_outside_its_rows() {
        let mut dst = vec![0u8; 8];
        fill_in_place(8, 1, &mut dst, |mut o| o.set(o.rows(), 0, 1));
    }
}
