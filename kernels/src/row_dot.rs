//! The row drivers the block types share: [`RowDot`], a weight block type with f32 kernels over
//! whole rows (what column-parallel and dense layers run), and the loops that run one kernel
//! over rows, tiles and activation rows ([`dot_rows_by`], [`rows_dot_by`]). Above the
//! f64-summing dot products (`f64_dot.rs`, the reference) and the kernel choice (`kernel.rs`).

use crate::kernel::{by_kernel, Kernel};

/// A weight block type with f32 kernels over whole rows (what column-parallel and dense layers
/// run): a scalar reference, one row's blocks added one after the other, and an AVX2 kernel
/// over `R` rows at once that loads each activation block once for all of them.
pub(crate) trait RowDot: crate::f64_dot::F64Dot {
    /// One row, in f32, block after block (ggml's generic `vec_dot`).
    fn dot_scalar(w: &[Self], x: &[Self::Act]) -> f32;

    /// `R` rows.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every row must have `xs.len()` blocks.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_rows_avx2<const R: usize>(ws: [&[Self]; R], xs: &[Self::Act]) -> [f32; R];

    /// `R` weight rows against `M` activation rows (prefill): `out[i][r]` is row `r` against
    /// activation row `i`, bit for bit what [`Self::dot_rows_avx2`] gives for that pair. This
    /// default calls it once per activation row; a block type whose weight decoding is worth
    /// sharing overrides it to decode each weight block once for all `M` activation rows.
    ///
    /// # Safety
    /// As [`Self::dot_rows_avx2`]: avx2, fma and f16c; every row of `ws` and `xs` has the same
    /// number of blocks.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_tile_avx2<const R: usize, const M: usize>(
        ws: [&[Self]; R],
        xs: [&[Self::Act]; M],
    ) -> [[f32; R]; M] {
        xs.map(|x| Self::dot_rows_avx2(ws, x))
    }
}

/// Dot products of `R` weight rows with one activation row in f32, with the chosen kernel.
///
/// # Panics
/// If a row's length differs from `xs`'s, or `kernel` is not available on this CPU.
pub(crate) fn dot_rows_by<B: RowDot, const R: usize>(
    kernel: Kernel,
    ws: [&[B]; R],
    xs: &[B::Act],
    out: &mut [f32; R],
) {
    for w in ws {
        assert_eq!(
            w.len(),
            xs.len(),
            "{} row of {} blocks against {} activation blocks",
            B::NAME,
            w.len(),
            xs.len()
        );
    }
    by_kernel!(kernel,
        scalar => for (o, w) in out.iter_mut().zip(ws) {
            *o = B::dot_scalar(w, xs);
        },
        // The rows' lengths were checked above.
        avx2 => *out = B::dot_rows_avx2(ws, xs))
}

/// Dot products of `R` weight rows with `M` activation rows in f32 (`out[i][r]`: row `r`
/// against activation row `i`), each bit for bit what [`dot_rows_by`] gives for that pair.
///
/// # Panics
/// If a row's length differs from the first activation row's, or `kernel` is not available.
pub(crate) fn dot_tile_by<B: RowDot, const R: usize, const M: usize>(
    kernel: Kernel,
    ws: [&[B]; R],
    xs: [&[B::Act]; M],
    out: &mut [[f32; R]; M],
) {
    let kb = xs.first().map_or(0, |x| x.len());
    let lens = ws.iter().map(|w| w.len()).chain(xs.iter().map(|x| x.len()));
    for len in lens {
        assert_eq!(len, kb, "{} tile: rows of {len} and {kb} blocks", B::NAME);
    }
    by_kernel!(kernel,
        scalar => for (o, x) in out.iter_mut().zip(xs) {
            for (o, w) in o.iter_mut().zip(ws) {
                *o = B::dot_scalar(w, x);
            }
        },
        // The rows' lengths were checked above.
        avx2 => *out = B::dot_tile_avx2(ws, xs))
}

/// Activation rows per tile in [`rows_dot_by`], with four weight rows: 16 accumulators, as
/// many as AVX2 has ymm registers, so a few spill to L1; measured on a Zen 3 core (one
/// thread, SmolLM2's 1536×576 and 576×1536, 120 activation rows) 4×4 was the fastest of 4×1,
/// 4×2, 4×3, 4×4, 2×4, 2×6, 1×8 and 3×4 for Q4_1 and within noise of the fastest (2×6) for
/// Q4_0: against the one-row kernel 1.6-1.8× for Q4_0, 1.2-1.3× for Q4_1.
pub(crate) const TILE_M: usize = 4;

/// Weight rows `row0..row0 + out.len() / m` of `w` (rows of `kb` blocks) against all `m`
/// activation rows `xq` (rows of `kb` blocks), into `out[(row - row0) * m + i]`: four weight
/// rows at a time against [`TILE_M`] activation rows at a time ([`dot_tile_by`]: each weight
/// block decoded once for them all), the activation rows left over against the four rows
/// ([`dot_rows_by`]: each activation load shared), the weight rows left over one at a time.
/// Every value is the same whichever path computes it, so the result does not depend on `m`.
pub(crate) fn rows_dot_by<B: RowDot>(
    kernel: Kernel,
    (w, kb): (&[B], usize),
    (xq, m): (&[B::Act], usize),
    row0: usize,
    out: &mut [f32],
) {
    let w_row = |r: usize| &w[(row0 + r) * kb..(row0 + r + 1) * kb];
    let x_row = |i: usize| &xq[i * kb..(i + 1) * kb];
    let rows = out.len() / m;
    let quads = rows / 4 * 4;
    let tiled = m / TILE_M * TILE_M;
    for r in (0..quads).step_by(4) {
        let ws = [w_row(r), w_row(r + 1), w_row(r + 2), w_row(r + 3)];
        for i in (0..tiled).step_by(TILE_M) {
            let mut o = [[0f32; 4]; TILE_M];
            dot_tile_by(kernel, ws, std::array::from_fn(|j| x_row(i + j)), &mut o);
            for (j, o) in o.into_iter().enumerate() {
                for (t, v) in o.into_iter().enumerate() {
                    out[(r + t) * m + i + j] = v;
                }
            }
        }
        for i in tiled..m {
            let mut o = [0f32; 4];
            dot_rows_by(kernel, ws, x_row(i), &mut o);
            for (t, v) in o.into_iter().enumerate() {
                out[(r + t) * m + i] = v;
            }
        }
    }
    for r in quads..rows {
        for (i, x) in xq.chunks_exact(kb).enumerate() {
            let mut o = [0f32];
            dot_rows_by(kernel, [w_row(r)], x, &mut o);
            out[r * m + i] = o[0];
        }
    }
}

/// Checks of a block type's f32 row kernels that every block type's tests share.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::f64_dot::testing::pseudo;
    use crate::f64_dot::{dot_f64, F64Dot};

    /// A block type's `rows_dot` (e.g. [`crate::q5_0::rows_dot`]).
    pub type RowsDotFn<B> =
        fn(Kernel, &[B], usize, &[<B as F64Dot>::Act], usize, usize, &mut [f32]);

    /// The f32 row kernels of `B` against the exact f64 sum ([`dot_f64`] with the scalar
    /// kernel) of the same blocks, `block(row, b)` giving block `b` of weight row `row`, for
    /// odd and even block counts, with every kernel under test: four rows at once equal one
    /// at a time bit for bit, both within f32 rounding of the exact sum; and `rows_dot` over 7
    /// weight rows (four, then three one by one) and 3 activation rows gives the same bits.
    /// `magnitude(w, x)` bounds what f32 rounds in one block's product: the sum of its terms'
    /// absolute values (`|d·d'|·Σ|q·q'| + |m·s'|`), not the absolute value of their sum.
    pub fn f32_rows_match_the_f64_sum<B: RowDot>(
        block: impl Fn(usize, usize) -> B,
        magnitude: impl Fn(&B, &B::Act) -> f64,
        rows_dot: RowsDotFn<B>,
    ) {
        const ROWS: usize = 7;
        const M: usize = 3;
        for nb in [1usize, 2, 3, 5, 18, 19] {
            let w: Vec<B> = (0..ROWS)
                .flat_map(|r| (0..nb).map(move |b| (r, b)))
                .map(|(r, b)| block(r, b))
                .collect();
            let row = |r: usize| &w[r * nb..(r + 1) * nb];
            let x: Vec<f32> = (0..M * nb * B::BLOCK)
                .map(|i| pseudo(i + 1000) * 3.0 + if i % 41 == 7 { 9.0 } else { 0.0 })
                .collect();
            let mut xq = vec![B::ACT_ZERO; M * nb];
            B::quantize(&x, &mut xq);
            let act = |i: usize| &xq[i * nb..(i + 1) * nb];
            for kernel in Kernel::under_test() {
                let mut all = vec![0f32; ROWS * M];
                rows_dot(kernel, &w, nb, &xq, M, 0, &mut all);
                for i in 0..M {
                    let mut four = [0f32; 4];
                    dot_rows_by(kernel, [row(0), row(1), row(2), row(3)], act(i), &mut four);
                    for r in 0..ROWS {
                        let exact = dot_f64(row(r), act(i));
                        let mut one = [0f32];
                        dot_rows_by(kernel, [row(r)], act(i), &mut one);
                        let got = one[0];
                        assert!(
                            got.is_finite() && exact.is_finite() && all[r * M + i].is_finite(),
                            "{} {kernel:?}: {got} {exact}",
                            B::NAME
                        );
                        if r < 4 {
                            assert_eq!(
                                four[r].to_bits(),
                                got.to_bits(),
                                "{} {kernel:?} nb={nb}: 4 rows vs 1",
                                B::NAME
                            );
                        }
                        assert_eq!(
                            all[r * M + i].to_bits(),
                            got.to_bits(),
                            "{} {kernel:?} nb={nb} row {r} activation {i}: rows_dot vs dot_rows",
                            B::NAME
                        );
                        let mag: f64 = row(r)
                            .iter()
                            .zip(act(i))
                            .map(|(w, x)| magnitude(w, x))
                            .sum();
                        assert!(
                            mag > 1e-3,
                            "{} nb={nb}: the reference is trivially small",
                            B::NAME
                        );
                        assert!(
                            (got as f64 - exact).abs() <= 4.0 * f32::EPSILON as f64 * mag,
                            "{} {kernel:?} nb={nb} row {r}: f32 {got}, exact {exact}",
                            B::NAME
                        );
                    }
                }
            }
        }
    }

    /// Whether `tile` gives, for every pair, the bits [`dot_rows_by`] gives for one weight row.
    fn check_tile<B: RowDot, const R: usize, const M: usize>(
        kernel: Kernel,
        ws: [&[B]; R],
        xs: [&[B::Act]; M],
    ) {
        let mut tile = [[f32::NAN; R]; M];
        dot_tile_by(kernel, ws, xs, &mut tile);
        for (i, x) in xs.into_iter().enumerate() {
            let mut rows = [0f32; R];
            dot_rows_by(kernel, ws, x, &mut rows);
            for (r, w) in ws.into_iter().enumerate() {
                let mut one = [0f32];
                dot_rows_by(kernel, [w], x, &mut one);
                let (got, want) = (tile[i][r], one[0]);
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{} {kernel:?} tile {R}x{M}, {} blocks, weight row {r}, activation row {i}: \
                     {got} against one row's {want}",
                    B::NAME,
                    x.len()
                );
                assert_eq!(rows[r].to_bits(), want.to_bits(), "{R} rows against 1");
            }
        }
    }

    /// For every kernel under test ([`Kernel::under_test`], named on stderr): tiles of several
    /// shapes ([`dot_tile_by`]) against one row at a time ([`dot_rows_by`]), bit for bit, and
    /// [`rows_dot_by`] over `rows` against 1..=9 activation rows of `xs` (with a weight row
    /// offset, rows left over after the quads and activation rows left over after the tiles),
    /// every value bit for bit the one-row kernel's, finite, and within f32 rounding of the
    /// exact f64 sum: `4 ε · Σ |w·x|`, the sum of the values' products' magnitudes
    /// (`abs_dot` gives it for one block pair; with `|Σ w·x|` instead, a sum that cancels
    /// would fail for lack of the f32 rounding of its partial sums). `rows` must have at least
    /// 5 rows and `xs` at least 9, all of one length.
    fn check_rows_dot<B: RowDot>(
        rows: &[Vec<B>],
        xs: &[Vec<B::Act>],
        abs_dot: fn(&B, &B::Act) -> f64,
    ) {
        let kb = xs[0].len();
        let ws: [&[B]; 4] = std::array::from_fn(|r| &rows[r][..]);
        let x = |i: usize| &xs[i][..];
        for kernel in Kernel::under_test() {
            check_tile(kernel, ws, [x(0), x(1)]);
            check_tile(kernel, ws, [x(2)]);
            check_tile(kernel, ws, [x(3), x(4), x(5)]);
            check_tile(kernel, ws, [x(6), x(7), x(8), x(0)]);
            check_tile(kernel, [ws[1], ws[3]], [x(1), x(5)]);
            check_tile(kernel, [ws[2]], [x(4), x(8), x(3)]);

            let w: Vec<B> = rows.iter().flatten().copied().collect();
            let row0 = 1;
            let n = rows.len() - row0;
            for m in 1..=9 {
                let xq: Vec<B::Act> = xs[..m].iter().flatten().copied().collect();
                let mut out = vec![f32::NAN; n * m];
                rows_dot_by(kernel, (&w, kb), (&xq, m), row0, &mut out);
                for (r, w) in rows[row0..].iter().enumerate() {
                    for (i, x) in xs[..m].iter().enumerate() {
                        let got = out[r * m + i];
                        let mut one = [0f32];
                        dot_rows_by(kernel, [&w[..]], x, &mut one);
                        let exact = dot_f64(w, x);
                        let mag: f64 = w.iter().zip(x).map(|(w, x)| abs_dot(w, x)).sum();
                        let what = format!(
                            "{} {kernel:?} {kb} blocks, m = {m}, weight row {r}, activation row {i}",
                            B::NAME
                        );
                        assert_eq!(
                            got.to_bits(),
                            one[0].to_bits(),
                            "{what}: {got} vs {}",
                            one[0]
                        );
                        assert!(
                            got.is_finite() && exact.is_finite(),
                            "{what}: {got} {exact}"
                        );
                        assert!(
                            (got as f64 - exact).abs() <= 4.0 * f32::EPSILON as f64 * mag,
                            "{what}: f32 {got}, exact {exact}"
                        );
                    }
                }
            }
        }
    }

    /// [`check_rows_dot`] at 1, 2, 3, 5, 18 and 19 blocks per row: 7 weight rows, block `b` of
    /// row `r` being `block(r, b)`, against 9 activation rows of pseudo-random values (scaled
    /// differently per row), quantized as the type's kernels quantize them.
    pub(crate) fn check_rows_dot_sizes<B: RowDot>(
        block: impl Fn(usize, usize) -> B,
        abs_dot: fn(&B, &B::Act) -> f64,
    ) {
        use crate::f64_dot::testing::pseudo;
        for nb in [1usize, 2, 3, 5, 18, 19] {
            let rows: Vec<Vec<B>> = (0..7)
                .map(|r| (0..nb).map(|b| block(r, b)).collect())
                .collect();
            let xs: Vec<Vec<B::Act>> = (0..9)
                .map(|i| {
                    let x: Vec<f32> = (0..nb * B::BLOCK)
                        .map(|j| pseudo(i * 7919 + j + 1000) * (1.0 + i as f32))
                        .collect();
                    let mut xs = vec![B::ACT_ZERO; nb];
                    B::quantize(&x, &mut xs);
                    xs
                })
                .collect();
            check_rows_dot(&rows, &xs, abs_dot);
        }
    }

    /// A NaN or an infinity in the activations gives NaN from the f32 kernels ([`dot_rows_by`])
    /// with every kernel under test, as from the f64 ones.
    pub(crate) fn f32_kernels_propagate_nan<B: RowDot>(w: B) {
        for bad in [f32::NAN, f32::INFINITY] {
            let mut x = vec![0.5f32; B::BLOCK];
            x[3] = bad;
            let mut xs = [B::ACT_ZERO];
            B::quantize(&x, &mut xs);
            for kernel in Kernel::under_test() {
                let mut y = [0f32];
                dot_rows_by(kernel, [&[w][..]], &xs, &mut y);
                assert!(
                    y[0].is_nan(),
                    "{} {kernel:?}: activation {bad} gave {}",
                    B::NAME,
                    y[0]
                );
            }
        }
    }
}
