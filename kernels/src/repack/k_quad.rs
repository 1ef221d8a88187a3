//! The 512-bit engine of the k-quants laid out as Q4_K (Q4_K and Q5_K): sixteen weight rows
//! (four groups) against one to eight activation rows, each `vpdpbusd` on a whole zmm, as
//! [`super::avx512`] does for the 32-wide types.
//!
//! The four-row kernel ([`crate::q4_kx4`]'s `k4_group_dot` with VNNI) multiplies 32-byte
//! vectors (8 values of four rows) and reduces each super-block's sums of four rows with two
//! `hadd`s, an extract and an unpack per activation row, and its minimums with three more
//! `hadd`s and a permute. Here two groups' runs of 8 values share one zmm (eight rows, two
//! i32 lanes each), joined once per super-block for every activation row, so one `vpdpbusd`
//! with an 8-byte broadcast of the activations does 64 products; each sub-block's sums are
//! scaled by the rows' 6-bit scales (`vpmulld`), the sixteen rows' lanes paired by two
//! `vpermt2d` and an add, in row order. The minimums are transposed once per super-block
//! (one `vpermt2w` gives two of the sixteen rows' four pairs of minimums), so that each
//! activation row takes them in four `vpdpwssd` with its pairs of 32-value sums.
//!
//! The integers are those of the four-row kernel (`Σ_j sc_j Σ q·q'` and `Σ_j mn_j·bsums_j`,
//! exact in i32), and so is the f64 step (`d'·(d·dots − dmin·mins)`, both products exact,
//! then added to the row's sum): every value is bit for bit the scalar sum (tested with each
//! type).

use super::avx512::QUAD_ROWS;
const AHEAD_STEPS: usize = 8;
use super::ActRow;
use crate::q4_kx4::avx2::{join32, K4Group};
use crate::q8_k::BlockQ8K;
use std::arch::x86_64::*;

/// `shuffle_epi8` controls, in each 128-bit lane (two rows of eight scale bytes): sub-block
/// `s`'s scale of the lane's first row in i32 lanes 0 and 1, of its second row in 2 and 3
/// (one i32 per `vpdpbusd` sum of the row).
const fn scale_controls() -> [[i8; 16]; 8] {
    let mut c = [[-128i8; 16]; 8];
    let mut s = 0;
    while s < 8 {
        let mut i = 0;
        while i < 16 {
            if i % 4 == 0 {
                c[s][i] = (8 * (i / 8) + s) as i8;
            }
            i += 1;
        }
        s += 1;
    }
    c
}
const SCALE_CONTROLS: [[i8; 16]; 8] = scale_controls();

/// `vpermt2w` indices gathering two of the sixteen rows' four 16-bit words of minimums
/// (`word w` = minimums `2w`, `2w + 1`) from rows 0..8 (the table's first zmm, row `r` in its
/// 64-bit lane `r`) and rows 8..16 (the second): output word `o` is word `2p + o / 16` of row
/// `o % 16`.
const fn min_words(p: usize) -> [i16; 32] {
    let mut c = [0i16; 32];
    let mut o = 0;
    while o < 32 {
        let (row, w) = (o % 16, 2 * p + o / 16);
        c[o] = if row < 8 {
            (4 * row + w) as i16
        } else {
            (32 + 4 * (row - 8) + w) as i16
        };
        o += 1;
    }
    c
}
const MIN_WORDS: [[i16; 32]; 2] = [min_words(0), min_words(1)];

/// The sixteen rows of four groups (`groups[0]`'s four rows first) of a type laid out as
/// Q4_K's ([`K4Group`]) against `M` activation rows: `out[i][r]`, bit for bit the scalar
/// f64 sum (see the module's documentation).
///
/// # Safety
/// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni (inline
/// this into a function that enables them); the four groups and every slice of `xs` have the
/// same number of blocks.
#[inline(always)]
pub unsafe fn k4_quad_dot<G: K4Group, const M: usize>(
    groups: [&[G]; 4],
    xs: &[ActRow<'_, BlockQ8K>; M],
) -> [[f64; QUAD_ROWS]; M] {
    // Lane `2c` and `2c + 1` of a product hold row `c`'s two partial sums (eight rows per
    // zmm): the even lanes of both, then the odd ones, added, give the sixteen rows in order.
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    let min_words = [
        _mm512_loadu_si512(MIN_WORDS[0].as_ptr() as *const _),
        _mm512_loadu_si512(MIN_WORDS[1].as_ptr() as *const _),
    ];
    let mut acc = [[_mm512_setzero_pd(); 2]; M];
    let blocks = groups[0].len();
    let group = std::mem::size_of_val(groups[0]);
    for b in 0..blocks {
        let g = [
            groups[0].get_unchecked(b),
            groups[1].get_unchecked(b),
            groups[2].get_unchecked(b),
            groups[3].get_unchecked(b),
        ];
        // Each group's record `AHEAD_STEPS` super-blocks ahead in time: in the same group,
        // or, past its end, in the same group of the next quad (three groups further on).
        // Hints: no fault past the end of the weight.
        let ahead = if b + AHEAD_STEPS < blocks {
            AHEAD_STEPS * std::mem::size_of::<G>()
        } else {
            AHEAD_STEPS * std::mem::size_of::<G>() + 3 * group
        };
        // Rows 0..8 and 8..16's scale bytes, row `r` in 64-bit lane `r`.
        let sc = [join32(g[0].sc(), g[1].sc()), join32(g[2].sc(), g[3].sc())];
        let mut dots = [[_mm512_setzero_si512(); 2]; M];
        for j in 0..4 {
            // One group's record per step (ten lines or more: all four at once, forty
            // prefetches in a row, ran a decode 1.4x slower).
            let p = (g[j] as *const G as *const i8).wrapping_add(ahead);
            let mut line = 0;
            while line < std::mem::size_of::<G>() {
                _mm_prefetch(p.wrapping_add(line), _MM_HINT_T0);
                line += 64;
            }
            let (lo01, hi01) = G::values_pair(g[0], g[1], j);
            let (lo23, hi23) = G::values_pair(g[2], g[3], j);
            // The low nibbles are sub-block `2j`, the high ones `2j + 1`.
            for half in 0..2 {
                let s = 2 * j + half;
                let w = if half == 0 {
                    [lo01, lo23]
                } else {
                    [hi01, hi23]
                };
                let control = _mm512_broadcast_i32x4(_mm_loadu_si128(
                    SCALE_CONTROLS[s].as_ptr() as *const __m128i
                ));
                let scale = [
                    _mm512_shuffle_epi8(sc[0], control),
                    _mm512_shuffle_epi8(sc[1], control),
                ];
                super::unrolled!(M, |i| {
                    let a = xs[i].0.get_unchecked(b).qs.as_ptr().add(32 * s) as *const i64;
                    let q = |c: usize| _mm512_set1_epi64(std::ptr::read_unaligned(a.add(c)));
                    for h in 0..2 {
                        let mut t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[h][0], q(0));
                        t = _mm512_dpbusd_epi32(t, w[h][1], q(1));
                        t = _mm512_dpbusd_epi32(t, w[h][2], q(2));
                        t = _mm512_dpbusd_epi32(t, w[h][3], q(3));
                        dots[i][h] = _mm512_add_epi32(dots[i][h], _mm512_mullo_epi32(t, scale[h]));
                    }
                });
            }
        }
        // The minimums transposed: `mins[w]` holds, in i32 lane `r`, row `r`'s minimums
        // `2w` and `2w + 1` as a pair of i16.
        let (m01, m23) = (join32(g[0].mn(), g[1].mn()), join32(g[2].mn(), g[3].mn()));
        let words = [
            _mm512_permutex2var_epi16(m01, min_words[0], m23),
            _mm512_permutex2var_epi16(m01, min_words[1], m23),
        ];
        let mins = [
            _mm512_cvtepu8_epi16(_mm512_castsi512_si256(words[0])),
            _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64::<1>(words[0])),
            _mm512_cvtepu8_epi16(_mm512_castsi512_si256(words[1])),
            _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64::<1>(words[1])),
        ];
        let f16s = |d: [&[half::f16; 4]; 4]| {
            let w = |i: usize| std::ptr::read_unaligned(d[i].as_ptr() as *const i64);
            let ps = _mm512_cvtph_ps(_mm256_setr_epi64x(w(0), w(1), w(2), w(3)));
            [
                _mm512_cvtps_pd(_mm512_castps512_ps256(ps)),
                _mm512_cvtps_pd(super::avx512::high_ps(ps)),
            ]
        };
        let wd = f16s([g[0].d(), g[1].d(), g[2].d(), g[3].d()]);
        let wmin = f16s([g[0].dmin(), g[1].dmin(), g[2].dmin(), g[3].dmin()]);
        super::unrolled!(M, |i| {
            let x = xs[i].0.get_unchecked(b);
            // The activations' sums of 32 values in pairs (`p[w]`: sums `2w` and `2w + 1`).
            let bsums = _mm256_loadu_si256(x.bsums.as_ptr() as *const __m256i);
            let h = _mm256_hadd_epi16(bsums, bsums);
            let p = [
                _mm256_extract_epi32::<0>(h),
                _mm256_extract_epi32::<1>(h),
                _mm256_extract_epi32::<4>(h),
                _mm256_extract_epi32::<5>(h),
            ];
            let mut m = _mm512_setzero_si512();
            for w in 0..4 {
                m = _mm512_dpwssd_epi32(m, mins[w], _mm512_set1_epi32(p[w]));
            }
            let d = _mm512_add_epi32(
                _mm512_permutex2var_epi32(dots[i][0], even, dots[i][1]),
                _mm512_permutex2var_epi32(dots[i][0], odd, dots[i][1]),
            );
            let xd = _mm512_set1_pd(x.d as f64);
            let halves = |v: __m512i| {
                [
                    _mm512_cvtepi32_pd(_mm512_castsi512_si256(v)),
                    _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64::<1>(v)),
                ]
            };
            let (d, m) = (halves(d), halves(m));
            for h in 0..2 {
                let t = _mm512_sub_pd(_mm512_mul_pd(wd[h], d[h]), _mm512_mul_pd(wmin[h], m[h]));
                acc[i][h] = _mm512_add_pd(acc[i][h], _mm512_mul_pd(xd, t));
            }
        });
    }
    let mut out = [[0f64; QUAD_ROWS]; M];
    for i in 0..M {
        _mm512_storeu_pd(out[i].as_mut_ptr(), acc[i][0]);
        _mm512_storeu_pd(out[i].as_mut_ptr().add(8), acc[i][1]);
    }
    out
}

/// [`k4_quad_dot`] compiled with the features it needs.
///
/// # Safety
/// As [`k4_quad_dot`]: the CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and
/// avx512vnni.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn k4_quad_dot_vnni<G: K4Group, const M: usize>(
    groups: [&[G]; 4],
    xs: &[ActRow<'_, BlockQ8K>; M],
) -> [[f64; QUAD_ROWS]; M] {
    k4_quad_dot(groups, xs)
}
