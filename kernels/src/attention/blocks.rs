//! A prompt's causal attention in blocks of query rows, in AVX2 and FMA: for each KV head,
//! its keys are packed once as `Kᵀ` panels of 16 positions; then for each query head of its
//! group and each block of [`ROWS`] query rows, the scores of the block against the keys it
//! may see come from a 6 × 16 register tile (a gemm's micro-kernel: per component, one panel
//! row loaded and each query's component broadcast), the causal softmax runs on each row,
//! and the output rows come from a second 6 × 16 tile over the value rows. Key panels past
//! the block's last position are never computed (about half of a prompt's scores), nor
//! those before its first row's window.
//!
//! Candle's path computes every score of `q · kᵀ` with its gemm, then `p · v` over all
//! positions, zeros included, through two tensors of `queries × positions` per head; here a
//! block's scores (`ROWS × positions`) stay in the first cache levels.

use super::parts::{softmax_in_place, Lanes, Rows, Strided};
use std::arch::x86_64::*;

/// Query rows per block: six rows of two eight-lane accumulators (twelve registers of the
/// sixteen, leaving the panel's two and one broadcast).
pub(super) const ROWS: usize = 6;

/// Positions per packed key panel (two eight-lane registers).
const PANEL: usize = 16;

/// [`super::causal_attention`]'s task for one KV head: `q` and `out` hold its group's `g`
/// heads of `queries` rows each (`g · queries · d` values, head-major), `k` and `v` its
/// `positions` rows.
///
/// # Safety
/// The CPU must support avx2 and fma. `k` and `v` must hold every row they are read at
/// (checked by the caller).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn group_blocks(
    q: &[f32],
    k: Strided<'_>,
    v: Strided<'_>,
    rows: Rows,
    out: &mut [f32],
) {
    blocks::<false>(q, k, v, rows, out)
}

/// [`group_blocks`] with 512-bit tiles: the scores of two key panels (32 positions) per tile,
/// the weighted sums 32 components at a time. Each output is summed in the same order as the
/// 256-bit tiles sum it (over the components for a score, over the positions for an output),
/// so the values are [`group_blocks`]'s, bit for bit (tested).
///
/// # Safety
/// The CPU must support avx2, fma and avx512f. `k` and `v` must hold every row they are read
/// at (checked by the caller).
#[target_feature(enable = "avx2,fma,avx512f")]
pub(super) unsafe fn group_blocks_avx512(
    q: &[f32],
    k: Strided<'_>,
    v: Strided<'_>,
    rows: Rows,
    out: &mut [f32],
) {
    blocks::<true>(q, k, v, rows, out)
}

/// [`group_blocks`], with the 512-bit tiles where `WIDE`.
///
/// # Safety
/// As [`group_blocks`], and avx512f where `WIDE` (inline this into a function that enables
/// them).
#[inline(always)]
unsafe fn blocks<const WIDE: bool>(
    q: &[f32],
    (k, k0, k_pos): Strided<'_>,
    v: Strided<'_>,
    rows: Rows,
    out: &mut [f32],
) {
    let Rows {
        queries,
        positions,
        window,
        d,
        scale,
    } = rows;
    let g = q.len() / (queries * d);
    let first = positions - queries;
    // Keys any row of the task sees: from the first row's window on.
    let klo = (first + 1).saturating_sub(window);
    let panels = (positions - klo).div_ceil(PANEL);
    // `kt[(p · d + c) · 16 + l]` = component `c` of key `klo + 16 p + l` (0 past the last).
    let mut kt = vec![0f32; panels * d * PANEL];
    for t in klo..positions {
        let (p, l) = ((t - klo) / PANEL, (t - klo) % PANEL);
        let key = &k[k0 + t * k_pos..k0 + t * k_pos + d];
        for (c, &x) in key.iter().enumerate() {
            kt[(p * d + c) * PANEL + l] = x;
        }
    }
    let ld = panels * PANEL;
    let mut scores = vec![0f32; ROWS * ld];
    let (mut q_block, mut o_block) = (vec![0f32; ROWS * d], vec![0f32; ROWS * d]);
    for j in 0..g {
        for i0 in (0..queries).step_by(ROWS) {
            let r = ROWS.min(queries - i0);
            let at = (j * queries + i0) * d;
            // A short last block is padded with zero rows, whose outputs are dropped.
            q_block[..r * d].copy_from_slice(&q[at..at + r * d]);
            q_block[r * d..].fill(0.0);
            // Absolute positions: the block's rows see keys `lo..hi` between them.
            let hi = first + i0 + r;
            let lo = (first + i0 + 1).saturating_sub(window);
            let (p_lo, p_hi) = ((lo - klo) / PANEL, (hi - klo).div_ceil(PANEL));
            let mut p = p_lo;
            while p < p_hi {
                let col = p * PANEL;
                if WIDE && p + 1 < p_hi {
                    // Two panels: the second register is the next panel's row.
                    let kt = &kt[p * d * PANEL..(p + 2) * d * PANEL];
                    scores_tile::<__m512>(&q_block, kt, d * PANEL, d, &mut scores, (ld, col));
                    p += 2;
                } else {
                    // One panel: the second register is the row's other half.
                    let kt = &kt[p * d * PANEL..(p + 1) * d * PANEL];
                    scores_tile::<__m256>(&q_block, kt, 8, d, &mut scores, (ld, col));
                    p += 1;
                }
            }
            for (row, s) in scores.chunks_mut(ld).take(r).enumerate() {
                let pos = first + i0 + row;
                let row_lo = (pos + 1).saturating_sub(window);
                // Positions in the block's range that this row must not see weigh 0.
                s[lo - klo..row_lo - klo].fill(0.0);
                s[pos + 1 - klo..hi - klo].fill(0.0);
                let seen = &mut s[row_lo - klo..=pos - klo];
                seen.iter_mut().for_each(|x| *x *= scale);
                softmax_in_place(seen, Lanes::Avx2);
            }
            // Rows of the padding: weights 0, so that their sums stay finite.
            for s in scores.chunks_mut(ld).skip(r) {
                s[lo - klo..hi - klo].fill(0.0);
            }
            values_tiles::<WIDE>(&scores[lo - klo..], ld, v, lo..hi, d, &mut o_block);
            out[at..at + r * d].copy_from_slice(&o_block[..r * d]);
        }
    }
}

/// A register of f32 lanes that the tiles run on: eight (AVX2) or sixteen (AVX-512).
trait Reg: Copy {
    /// Lanes per register.
    const LANES: usize;
    /// Zero in every lane.
    unsafe fn zero() -> Self;
    /// `LANES` values at `p`.
    unsafe fn load(p: *const f32) -> Self;
    /// The value at `p` in every lane.
    unsafe fn splat(p: *const f32) -> Self;
    /// `a · b + c`, fused.
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self;
    /// Stores the lanes at `p`.
    unsafe fn store(self, p: *mut f32);
}

impl Reg for __m256 {
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn splat(p: *const f32) -> Self {
        _mm256_broadcast_ss(&*p)
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm256_storeu_ps(p, self)
    }
}

impl Reg for __m512 {
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn splat(p: *const f32) -> Self {
        _mm512_set1_ps(*p)
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm512_storeu_ps(p, self)
    }
}

/// `scores[r · ld + col + l] = q_block[r] · kᵀ` for the `2 · R::LANES` keys of a tile, the
/// [`ROWS`] query rows of `q_block` (rows of `d`): per component one load of two key
/// registers (lanes `0..LANES` at `kt[c · 16]`, the next `LANES` at `kt[c · 16 + second]`)
/// and one broadcast per query row. With eight lanes a tile is one packed panel (`second` =
/// 8, its row's other half), with sixteen two adjacent panels (`second` = `d · 16`, the next
/// panel's row). Each score sums over the components in order, whatever the width.
///
/// # Safety
/// The CPU must support avx2 and fma, and avx512f for 512-bit registers (inline this into a
/// function that enables them); `q_block` holds `ROWS · d` values, `kt` reaches `(d − 1) ·
/// 16 + second + LANES`, and `scores` reaches `(ROWS − 1) · ld + col + 2 · LANES` (checked in
/// debug builds).
#[inline(always)]
unsafe fn scores_tile<R: Reg>(
    q_block: &[f32],
    kt: &[f32],
    second: usize,
    d: usize,
    scores: &mut [f32],
    (ld, col): (usize, usize),
) {
    debug_assert!(q_block.len() >= ROWS * d && kt.len() >= (d - 1) * PANEL + second + R::LANES);
    debug_assert!(scores.len() >= (ROWS - 1) * ld + col + 2 * R::LANES);
    let mut acc = [[R::zero(); 2]; ROWS];
    let (q, kt) = (q_block.as_ptr(), kt.as_ptr());
    for c in 0..d {
        let b0 = R::load(kt.add(c * PANEL));
        let b1 = R::load(kt.add(c * PANEL + second));
        for (r, acc) in acc.iter_mut().enumerate() {
            let a = R::splat(q.add(r * d + c));
            acc[0] = R::fmadd(a, b0, acc[0]);
            acc[1] = R::fmadd(a, b1, acc[1]);
        }
    }
    let s = scores.as_mut_ptr();
    for (r, acc) in acc.iter().enumerate() {
        acc[0].store(s.add(r * ld + col));
        acc[1].store(s.add(r * ld + col + R::LANES));
    }
}

/// [`values_tiles`]' run of `2 · R::LANES` components: `o[r · d ..]` gets `Σₜ w[r · ld + t] ·
/// v[t · v_pos ..]` for the [`ROWS`] rows, each component summed over `t < n` in order.
///
/// # Safety
/// As [`values_tiles`], and avx512f for 512-bit registers; `2 · LANES` components readable
/// at every `v + t · v_pos` and writable at every `o + r · d`.
#[inline(always)]
unsafe fn values_run<R: Reg>(
    w: *const f32,
    ld: usize,
    (v, v_pos): (*const f32, usize),
    n: usize,
    o: *mut f32,
    d: usize,
) {
    let mut acc = [[R::zero(); 2]; ROWS];
    for t in 0..n {
        let row = v.add(t * v_pos);
        let (b0, b1) = (R::load(row), R::load(row.add(R::LANES)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let a = R::splat(w.add(r * ld + t));
            acc[0] = R::fmadd(a, b0, acc[0]);
            acc[1] = R::fmadd(a, b1, acc[1]);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        acc[0].store(o.add(r * d));
        acc[1].store(o.add(r * d + R::LANES));
    }
}

/// `out[r] = Σₜ weights[r · ld + t − lo] · v[t]` over the value rows `t` in `range` (`lo` its
/// start), for the [`ROWS`] rows of weights; `out` holds [`ROWS`] rows of `d`. With `WIDE`
/// 32 components at a time in 512-bit registers first; then sixteen, eight, and one by one.
/// Each component is summed over the positions in the same order whatever the width.
///
/// # Safety
/// The CPU must support avx2 and fma (inline this into a function that enables them);
/// `weights` reaches `(ROWS − 1) · ld + range.len()`, `out` holds `ROWS · d` values, and `v`
/// holds `d` values at every row `t` of `range` (checked in debug builds); avx512f where
/// `WIDE`.
#[inline(always)]
unsafe fn values_tiles<const WIDE: bool>(
    weights: &[f32],
    ld: usize,
    (v, v0, v_pos): Strided<'_>,
    range: std::ops::Range<usize>,
    d: usize,
    out: &mut [f32],
) {
    let n = range.len();
    debug_assert!(weights.len() >= (ROWS - 1) * ld + n && out.len() >= ROWS * d);
    debug_assert!(n == 0 || v.len() >= v0 + (range.end - 1) * v_pos + d);
    let (w, vp, o) = (
        weights.as_ptr(),
        v.as_ptr().add(v0 + range.start * v_pos),
        out.as_mut_ptr(),
    );
    let mut c = 0;
    while WIDE && c + 32 <= d {
        values_run::<__m512>(w, ld, (vp.add(c), v_pos), n, o.add(c), d);
        c += 32;
    }
    while c + 16 <= d {
        values_run::<__m256>(w, ld, (vp.add(c), v_pos), n, o.add(c), d);
        c += 16;
    }
    if c + 8 <= d {
        let mut acc = [_mm256_setzero_ps(); ROWS];
        for t in 0..n {
            let b = _mm256_loadu_ps(vp.add(t * v_pos + c));
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&*w.add(r * ld + t)), b, *acc);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(r * d + c), *acc);
        }
        c += 8;
    }
    for c in c..d {
        for r in 0..ROWS {
            let mut s = 0f32;
            for t in 0..n {
                s = (*w.add(r * ld + t)).mul_add(*vp.add(t * v_pos + c), s);
            }
            *o.add(r * d + c) = s;
        }
    }
}
