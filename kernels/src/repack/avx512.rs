//! The 512-bit engine of the 32-wide types (Q4_0, Q4_1, Q5_0, Q5_1, and Q8_0 as `q + 128`):
//! sixteen weight rows (four groups) against one to eight activation rows, each `vpdpbusd` on
//! a whole zmm. [`quad_dot`] is the engine; each type gives it its block's values as runs of
//! 8 bytes per row ([`unsigned_quad_dot`] from the four-row kernels' unpacking, Q8_0 by two
//! `vpermt2q` per run).
//!
//! The four-row kernel ([`super::avx2::unsigned_group_dot`], with VNNI) multiplies 32-byte
//! vectors and reduces each block's sums to four rows with a `hadd`, an extract and an unpack,
//! then scales four f64 lanes, for each activation row again. Here two groups' runs of 8
//! values share one zmm (eight rows, two i32 lanes each), joined once per block for every
//! activation row, so one `vpdpbusd` with an 8-byte broadcast of the activations does 64
//! products; the sixteen rows' lanes are paired by two `vpermt2d` and an add, in row order,
//! and scaled as two f64x8.
//!
//! Measured with `bench_repacked` on a Zen 5 core (AMD EPYC, family 26), one thread, against
//! the four-row VNNI kernel in the same run, on SmolLM2's 1536 x 576 and a 1 B Llama's
//! 5632 x 2048: 1.05-1.4x at one activation row (decode; not Q8_0, even there), 1.7-2.5x at 2
//! and 1.5-2x at 4
//! (docs/PERFORMANCE.md has the table). The four streams must be prefetched far ahead, both
//! lines a block crosses: 512 bytes ahead left one row slower than the four-row kernel
//! (0.65-0.95x) and cost 1.1-1.6x at 2 and 4 rows; 2 KiB did better, 8 KiB better still
//! ([`QUAD_PREFETCH`]). Tiles of 8 rows
//! (sixteen f64x8 accumulators beside the eight weight vectors) ran 1.2-1.7x the eight-row
//! kernel ([`super::avx2::pair_dot_words`]) at 8 rows and 1.05-1.55x at 64.

//! The integers and the f64 steps are those of the four-row kernel (the block's `Σ u·q'` exact
//! in i32, minus `o·Σ q'`, times `d'`, then an FMA with `d` into the row's sum, or with `m·s'`
//! first), so every value is bit for bit the scalar sum (tested with each type).

use super::f64_step::{f64_step8, i32x16_pd};
use super::{Act8, ActRow};
use std::arch::x86_64::*;

/// Bytes ahead in each of the four streams that [`unsigned_quad_dot`] prefetches (see the
/// module's documentation). 8 KiB since 2026-11-28 (it was 2 KiB): on a Zen 5 core, one
/// thread, 1 B Llama's 5632 x 2048 at one activation row, Q4_0 and Q4_1 1.39x, Q5_0 1.28x,
/// Q5_1 1.20x, at 2 rows 1.06-1.28x, at 4 and 8 rows 0.97-1.16x (`bench_repacked`); 4 KiB
/// gained about half as much.
pub const QUAD_PREFETCH: usize = 8192;

/// Weight rows per call of [`quad_dot`] (four groups).
pub const QUAD_ROWS: usize = 16;

/// The sixteen rows of four groups (`groups[0]`'s four rows first) against `M` activation
/// rows, for a type whose rows unpack as [`super::avx2::unsigned_group_dot`] takes them
/// (`unpack(g)`: the group's values in runs of 8, vector `t` holding values `8t .. 8t + 8` of
/// rows 0, 1, 2, 3 in turn, and their `d` and `m` as f32; `HAS_M`: whether `m` is used):
/// `out[i][r]`, bit for bit the scalar f64 sum. Two groups' runs share a zmm ([`quad_dot`]).
///
/// # Safety
/// As [`quad_dot`]. (The target features on this function and on [`unsigned_words`] are what
/// let the closures in them inline their intrinsics: a closure takes the features of the
/// function it is written in.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn unsigned_quad_dot<G, A: Act8, const M: usize, const HAS_M: bool>(
    groups: [&[G]; 4],
    xs: &[ActRow<'_, A>; M],
    unpack: impl Fn(&G) -> ([__m256i; 4], __m128, __m128),
) -> [[f64; QUAD_ROWS]; M] {
    quad_dot::<_, _, M, HAS_M, QUAD_PREFETCH>(groups, xs, |g| unsigned_words(g, &unpack))
}

/// The engines' `words` of a type whose four-row kernel unpacks a group as `unpack` gives it
/// ([`unsigned_quad_dot`]): block `b` of the four groups (`g`), two groups' runs of 8 joined
/// per zmm, their `d` and `m` in order.
///
/// # Safety
/// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn unsigned_words<G>(
    g: [&G; 4],
    unpack: &impl Fn(&G) -> ([__m256i; 4], __m128, __m128),
) -> ([__m512i; 8], __m512, __m512) {
    let (u0, d0, m0) = unpack(g[0]);
    let (u1, d1, m1) = unpack(g[1]);
    let (u2, d2, m2) = unpack(g[2]);
    let (u3, d3, m3) = unpack(g[3]);
    let w = std::array::from_fn(|j| {
        let t = j % 4;
        if j < 4 {
            join_si(u0[t], u1[t])
        } else {
            join_si(u2[t], u3[t])
        }
    });
    let f = |a: __m128, b: __m128, c: __m128, d: __m128| {
        join_ps(_mm256_set_m128(b, a), _mm256_set_m128(d, c))
    };
    (w, f(d0, d1, d2, d3), f(m0, m1, m2, m3))
}

/// The engine: the sixteen rows of four groups against `M` activation rows, for a 32-wide
/// type whose block `b` of row `r` is `d·(u − o) + m` with unsigned byte values `u`.
/// `words(g)` gives block `b` of the four groups as `w[t]` (rows 0..8) and `w[4 + t]` (rows
/// 8..16), values `8t .. 8t + 8` of each row in its 64-bit lane, and the sixteen rows' `d`
/// and `m` (0 where the type has none; `HAS_M`: whether it has one) as f32; `xs[i].1` holds
/// `o·Σ q'` per activation block and `xs[i].2` its scales `[d', s']` in f64. `out[i][r]`,
/// bit for bit the scalar f64 sum. `AHEAD`: the prefetch distance of each group's stream.
///
/// # Safety
/// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni (inline
/// this into a function that enables them); the four groups and every slice of `xs` have the
/// same number of blocks.
#[inline(always)]
pub unsafe fn quad_dot<G, A: Act8, const M: usize, const HAS_M: bool, const AHEAD: usize>(
    groups: [&[G]; 4],
    xs: &[ActRow<'_, A>; M],
    words: impl Fn([&G; 4]) -> ([__m512i; 8], __m512, __m512),
) -> [[f64; QUAD_ROWS]; M] {
    super::frame::realign_frame!();
    let mut acc = [[_mm512_setzero_pd(); 2]; M];
    let blocks = groups[0].len();
    let group = std::mem::size_of_val(groups[0]);
    for b in 0..blocks {
        let g = groups.map(|s| s.get_unchecked(b));
        prefetch_quad::<G, AHEAD>(g, b, group);
        let (w, wd, wm) = words(g);
        // Shared by the activation rows: the weight scales in f64.
        let (wd, wm) = scales_pd::<HAS_M>(wd, wm);
        super::unrolled!(M, |i| {
            let a = xs[i].0.get_unchecked(b).qs().as_ptr() as *const i64;
            let q = |t: usize| _mm512_set1_epi64(std::ptr::read_unaligned(a.add(t)));
            let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for t in 0..4 {
                s0 = _mm512_dpbusd_epi32(s0, w[t], q(t));
                s1 = _mm512_dpbusd_epi32(s1, w[4 + t], q(t));
            }
            scale_quad_row::<A, HAS_M>(&mut acc[i], pair_lanes(s0, s1), xs[i], b, wd, wm);
        });
    }
    store_rows(&acc)
}

/// The sixteen rows' `d` and `m` (f32, from `words`) as two f64x8 each; `m` zeros without
/// `HAS_M`.
///
/// # Safety
/// The CPU must support avx512f (inline this into a function that enables it).
#[inline(always)]
pub unsafe fn scales_pd<const HAS_M: bool>(wd: __m512, wm: __m512) -> ([__m512d; 2], [__m512d; 2]) {
    let pd = |v: __m512| {
        [
            _mm512_cvtps_pd(_mm512_castps512_ps256(v)),
            _mm512_cvtps_pd(high_ps(v)),
        ]
    };
    let wm = if HAS_M {
        pd(wm)
    } else {
        [_mm512_setzero_pd(); 2]
    };
    (pd(wd), wm)
}

/// Prefetches `AHEAD` bytes ahead in each of the four groups' streams at block `b` (`g`: the
/// groups' blocks `b`; `group`: a group's bytes), or, where that passes the group's end, as
/// far into the same group of the next quad, which no stream reaches before the next call
/// (the four groups' next blocks are read meanwhile). Hints: no fault past the end of the
/// weight.
///
/// # Safety
/// The CPU must support sse (every x86-64 does).
#[inline(always)]
pub unsafe fn prefetch_quad<G, const AHEAD: usize>(g: [&G; 4], b: usize, group: usize) {
    let ahead = if b * std::mem::size_of::<G>() + AHEAD < group {
        AHEAD
    } else {
        AHEAD + 4 * group
    };
    for g in g {
        let p = (g as *const G as *const i8).wrapping_add(ahead);
        _mm_prefetch(p, _MM_HINT_T0);
        // Records over a line long (Q8_0's 136 bytes) cross two or three lines a block.
        if std::mem::size_of::<G>() > 64 {
            _mm_prefetch(p.wrapping_add(64), _MM_HINT_T0);
        }
    }
}

/// One activation row's step of block `b` in the quads: its sixteen integer sums `Σ u·q'`
/// (weight rows in order) less the activation block's offset, in f64, scaled by `d'` and
/// the rows' `d` (and `m·s'` with `HAS_M`: [`f64_step8`]) into the row's two f64x8 sums.
///
/// # Safety
/// The CPU must support avx512f (inline this into a function that enables it); block `b`
/// is in `x`'s slices.
#[inline(always)]
pub unsafe fn scale_quad_row<A, const HAS_M: bool>(
    acc: &mut [__m512d; 2],
    sums: __m512i,
    x: ActRow<'_, A>,
    b: usize,
    wd: [__m512d; 2],
    wm: [__m512d; 2],
) {
    let (_, offsets, scales) = x;
    let [xd, xs] = *scales.get_unchecked(b);
    let sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(*offsets.get_unchecked(b)));
    let xd = _mm512_set1_pd(xd);
    let halves = i32x16_pd(sums);
    for h in 0..2 {
        acc[h] = f64_step8::<HAS_M>(acc[h], halves[h], xd, wd[h], wm[h], xs);
    }
}

/// The sixteen rows' sums in order, from two products whose lanes `2c` and `2c + 1` hold row
/// `c`'s two partial sums (`s0`: rows 0..8, `s1`: rows 8..16): the even lanes of both, then
/// the odd ones, added.
///
/// # Safety
/// The CPU must support avx512f (inline this into a function that enables it).
#[inline(always)]
pub unsafe fn pair_lanes(s0: __m512i, s1: __m512i) -> __m512i {
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    _mm512_add_epi32(
        _mm512_permutex2var_epi32(s0, even, s1),
        _mm512_permutex2var_epi32(s0, odd, s1),
    )
}

/// The quads' output: activation row `i`'s sixteen sums from its two f64x8 halves.
///
/// # Safety
/// The CPU must support avx512f (inline this into a function that enables it).
#[inline(always)]
pub unsafe fn store_rows<const M: usize>(acc: &[[__m512d; 2]; M]) -> [[f64; QUAD_ROWS]; M] {
    let mut out = [[0f64; QUAD_ROWS]; M];
    for i in 0..M {
        _mm512_storeu_pd(out[i].as_mut_ptr(), acc[i][0]);
        _mm512_storeu_pd(out[i].as_mut_ptr().add(8), acc[i][1]);
    }
    out
}

/// `[a | b]` (AVX-512 F only).
#[inline(always)]
pub unsafe fn join_si(a: __m256i, b: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
}

/// `[a | b]` (AVX-512 F only: no DQ).
#[inline(always)]
pub unsafe fn join_ps(a: __m256, b: __m256) -> __m512 {
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castpd256_pd512(_mm256_castps_pd(a)),
        _mm256_castps_pd(b),
    ))
}

/// The high eight lanes of `v` (AVX-512 F only: no DQ).
#[inline(always)]
pub unsafe fn high_ps(v: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
}

/// 32 bytes of `a`, then 32 of `b`.
///
/// # Safety
/// The CPU must support avx512f (inline this into a function that enables it).
#[inline(always)]
pub(crate) unsafe fn join32<T>(a: &T, b: &T) -> __m512i {
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_loadu_si256(a as *const T as *const __m256i)),
        _mm256_loadu_si256(b as *const T as *const __m256i),
    )
}
