//! The 512-bit engines of the k-quants ([`k4_quad_dot`] for the types laid out as Q4_K, Q4_K
//! and Q5_K; [`q6k_quad_dot`] for Q6_K): sixteen weight rows (four groups) against one to
//! eight activation rows, each `vpdpbusd` on a whole zmm, as [`super::avx512`] does for the
//! 32-wide types. The products of 2-39 activation rows run them; one row stays on the
//! four-row kernels, whose single stream reads faster (Q4_K's and Q5_K's with
//! [`k4_row_dots`], two runs of one group to a zmm); 40+ rows run the panels.
//!
//! The four-row kernel (`q4_kx4.rs`'s `k4_group_dot` with VNNI) multiplies 32-byte
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

use super::avx512::{high_ps, join32, pair_lanes, store_rows, QUAD_ROWS};
use super::f64_step::i32x16_pd;
use super::ActRow;
use crate::q8_k::BlockQ8K;
use half::f16;
use std::arch::x86_64::*;

/// Four rows' super-blocks of a type laid out as Q4_K's (`BlockQ4Kx4`: Q4_K, Q5_K):
/// what the four-row kernel (`q4_kx4.rs`) and [`k4_quad_dot`] read of them.
pub(crate) trait K4Group {
    /// The rows' super-scales of the scales.
    fn d(&self) -> &[f16; 4];
    /// The rows' super-scales of the minimums.
    fn dmin(&self) -> &[f16; 4];
    /// The rows' eight 6-bit scales, a byte each.
    fn sc(&self) -> &[[u8; 8]; 4];
    /// The rows' eight 6-bit minimums, a byte each.
    fn mn(&self) -> &[[u8; 8]; 4];
    /// Values `64 j .. 64 j + 32` (`.0`) and `64 j + 32 .. 64 j + 64` (`.1`) of the four
    /// rows as unsigned bytes, in runs of 8: vector `c` holds values `8c .. 8c + 8` (of
    /// the 32) of rows 0, 1, 2, 3 in turn.
    ///
    /// # Safety
    /// The CPU must support avx2.
    unsafe fn values(&self, j: usize) -> ([__m256i; 4], [__m256i; 4]);

    /// [`K4Group::values`] of two groups (`a`'s four rows, then `b`'s), each vector
    /// joined in one zmm: vector `c` holds values `8c .. 8c + 8` (of the 32) of rows
    /// 0..8 in turn.
    ///
    /// # Safety
    /// The CPU must support avx512f and avx512bw.
    unsafe fn values_pair(a: &Self, b: &Self, j: usize) -> ([__m512i; 4], [__m512i; 4]);

    /// [`K4Group::values`] of this group two vectors to a zmm: vector `p` holds vectors
    /// `2p` (low half) and `2p + 1` (high half).
    ///
    /// # Safety
    /// The CPU must support avx512f and avx512bw.
    unsafe fn values_wide(&self, j: usize) -> ([__m512i; 2], [__m512i; 2]);
}

/// Four rows' super-blocks of a type laid out as Q6_K's (`BlockQ6Kx4`): what
/// [`q6k_quad_dot`] reads of them.
pub(crate) trait Q6Group {
    /// The rows' super-scales.
    fn d(&self) -> &[f16; 4];
    /// The rows' sixteen scales (row-major, 64 bytes).
    fn scales(&self) -> &[[i8; 16]; 4];
    /// Run `u` (0..16) of the low 4 bits: values `8u ..` (low nibbles) and `8(u + 16) ..`
    /// (high nibbles) of the four rows, 8 bytes each.
    fn ql(&self, u: usize) -> &[[u8; 8]; 4];
    /// Run `w` (0..8) of the high 2 bits, 8 bytes of each row.
    fn qh(&self, w: usize) -> &[[u8; 8]; 4];
}

/// Super-blocks ahead (in time) that each group's record is prefetched: on a Zen 5 core, one
/// thread, Q4_K 5632 x 2048, 2 to 16 gave the same speed within the noise at 1 and 4
/// activation rows; 8 in the middle.
const AHEAD_STEPS: usize = 8;

/// Block `b`'s record of each group, and how far past each the record to prefetch lies:
/// `AHEAD_STEPS` super-blocks ahead in time, in the same group or, past its end, in the same
/// group of the next quad (three groups further on).
///
/// # Safety
/// `b` is below every group's length.
#[inline(always)]
unsafe fn records<G>(groups: [&[G]; 4], b: usize) -> ([&G; 4], usize) {
    let (blocks, group) = (groups[0].len(), std::mem::size_of_val(groups[0]));
    let step = AHEAD_STEPS * std::mem::size_of::<G>();
    let ahead = if b + AHEAD_STEPS < blocks {
        step
    } else {
        step + 3 * group
    };
    let g = [
        groups[0].get_unchecked(b),
        groups[1].get_unchecked(b),
        groups[2].get_unchecked(b),
        groups[3].get_unchecked(b),
    ];
    (g, ahead)
}

/// Prefetches every line of the record `ahead` bytes past `g`. One group's record per
/// sub-block step: all four groups' at once, forty prefetches in a row, ran a decode 1.4x
/// slower.
///
/// # Safety
/// A hint only: no fault, even past the end of the weight.
#[inline(always)]
unsafe fn prefetch_ahead<G>(g: &G, ahead: usize) {
    let p = (g as *const G as *const i8).wrapping_add(ahead);
    let mut line = 0;
    while line < std::mem::size_of::<G>() {
        _mm_prefetch(p.wrapping_add(line), _MM_HINT_T0);
        line += 64;
    }
}

/// The sixteen rows' f16 scales (four per group) as two f64x8.
///
/// # Safety
/// The CPU must support avx512f (inline this into a function that enables it).
#[inline(always)]
unsafe fn f16x16_pd(d: [&[f16; 4]; 4]) -> [__m512d; 2] {
    let w = |i: usize| std::ptr::read_unaligned(d[i].as_ptr() as *const i64);
    let ps = _mm512_cvtph_ps(_mm256_setr_epi64x(w(0), w(1), w(2), w(3)));
    [
        _mm512_cvtps_pd(_mm512_castps512_ps256(ps)),
        _mm512_cvtps_pd(high_ps(ps)),
    ]
}

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

/// Sub-block `s`'s [`scale_controls`] in every 128-bit lane.
///
/// # Safety
/// The CPU must support avx512f (inline this into a function that enables it).
#[inline(always)]
unsafe fn scale_control(s: usize) -> __m512i {
    _mm512_broadcast_i32x4(_mm_loadu_si128(SCALE_CONTROLS[s].as_ptr() as *const __m128i))
}

/// One activation row's `Σ_j sc_j Σ q·q'` for the four rows of `g` in 512-bit vectors:
/// two runs of 8 values of the four rows to a zmm, each run's activation bytes spread to
/// its half (`vpermq`), one `vpdpbusd` per 64 products; the lanes folded to the four-row
/// kernel's (`q4_kx4.rs`) `[r0, r0, r1, r1 | r2, r2, r3, r3]`, which it finishes.
///
/// # Safety
/// The CPU must support avx2, avx512f, avx512bw and avx512vnni (inline this into a function
/// that enables them); `a` points at an activation block's 256 bytes.
#[inline(always)]
pub(crate) unsafe fn k4_row_dots<G: K4Group>(g: &G, a: *const i8) -> __m256i {
    let scales = _mm512_broadcast_i64x4(_mm256_loadu_si256(g.sc().as_ptr() as *const __m256i));
    let spread = _mm512_setr_epi64(0, 0, 0, 0, 1, 1, 1, 1);
    let mut dots = _mm512_setzero_si512();
    for j in 0..4 {
        let (lo, hi) = g.values_wide(j);
        for half in 0..2 {
            let s = 2 * j + half;
            let w = if half == 0 { lo } else { hi };
            let a = a.add(32 * s);
            let act = |p: usize| {
                let v = _mm_loadu_si128(a.add(16 * p) as *const __m128i);
                _mm512_permutexvar_epi64(spread, _mm512_castsi128_si512(v))
            };
            let t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], act(0));
            let t = _mm512_dpbusd_epi32(t, w[1], act(1));
            let sc = _mm512_shuffle_epi8(scales, scale_control(s));
            dots = _mm512_add_epi32(dots, _mm512_mullo_epi32(t, sc));
        }
    }
    _mm256_add_epi32(
        _mm512_castsi512_si256(dots),
        _mm512_extracti64x4_epi64::<1>(dots),
    )
}

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
    let min_words = [
        _mm512_loadu_si512(MIN_WORDS[0].as_ptr() as *const _),
        _mm512_loadu_si512(MIN_WORDS[1].as_ptr() as *const _),
    ];
    super::frame::realign_frame!();
    let mut acc = [[_mm512_setzero_pd(); 2]; M];
    for b in 0..groups[0].len() {
        let (g, ahead) = records(groups, b);
        // Rows 0..8 and 8..16's scale bytes, row `r` in 64-bit lane `r`.
        let sc = [join32(g[0].sc(), g[1].sc()), join32(g[2].sc(), g[3].sc())];
        let mut dots = [[_mm512_setzero_si512(); 2]; M];
        for j in 0..4 {
            prefetch_ahead(g[j], ahead);
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
                let control = scale_control(s);
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
        let wd = f16x16_pd([g[0].d(), g[1].d(), g[2].d(), g[3].d()]);
        let wmin = f16x16_pd([g[0].dmin(), g[1].dmin(), g[2].dmin(), g[3].dmin()]);
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
            let d = pair_lanes(dots[i][0], dots[i][1]);
            let xd = _mm512_set1_pd(x.d as f64);
            let (d, m) = (i32x16_pd(d), i32x16_pd(m));
            for h in 0..2 {
                let t = _mm512_sub_pd(_mm512_mul_pd(wd[h], d[h]), _mm512_mul_pd(wmin[h], m[h]));
                acc[i][h] = _mm512_add_pd(acc[i][h], _mm512_mul_pd(xd, t));
            }
        });
    }
    store_rows(&acc)
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

/// `vpermt2w` indices taking, for the eight rows of two Q6_K groups (the table's first zmm:
/// the first group's 64 scale bytes, row `r` at bytes `16r ..`; the second zmm: the second
/// group's), scale word `w` (scales `2w` and `2w + 1`) of row `r` into all four words of
/// 64-bit lane `r`.
const fn scale_words(w: usize) -> [i16; 32] {
    let mut c = [0i16; 32];
    let mut o = 0;
    while o < 32 {
        let row = o / 4;
        c[o] = if row < 4 {
            (8 * row + w) as i16
        } else {
            (32 + 8 * (row - 4) + w) as i16
        };
        o += 1;
    }
    c
}
const SCALE_WORDS: [[i16; 32]; 8] = {
    let mut c = [[0i16; 32]; 8];
    let mut w = 0;
    while w < 8 {
        c[w] = scale_words(w);
        w += 1;
    }
    c
};

/// Runs `u` (values `8u .. 8u + 8`, unsigned 0..63) and `u + 16` of the eight rows of two
/// Q6_K groups (`a`'s four rows, then `b`'s), row `r` in 64-bit lane `r`: the four-row
/// kernel's unpacking on both groups' runs joined.
///
/// # Safety
/// The CPU must support avx512f and avx512bw (inline this into a function that enables them).
#[inline(always)]
unsafe fn q6k_runs<G: Q6Group>(a: &G, b: &G, u: usize) -> (__m512i, __m512i) {
    let (m4, m30) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    let ql = join32(a.ql(u), b.ql(u));
    let qh = join32(a.qh(u % 8), b.qh(u % 8));
    // Run `u` takes bits 0-1 (u < 8) or 2-3 of `qh`; run `u + 16` bits 4-5 or 6-7.
    let (h_lo, h_hi) = if u < 8 {
        (_mm512_slli_epi16::<4>(qh), qh)
    } else {
        (_mm512_slli_epi16::<2>(qh), _mm512_srli_epi16::<2>(qh))
    };
    (
        _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(h_lo, m30)),
        _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
            _mm512_and_si512(h_hi, m30),
        ),
    )
}

/// The sixteen rows of four Q6_K groups (`groups[0]`'s four rows first) against `M`
/// activation rows: `out[i][r]`, bit for bit the scalar f64 sum. Per 16 values (sub-block
/// `s`) and row, as [`k4_quad_dot`]: two `vpdpbusd` of the unsigned values `q` (0..63) with
/// the activations' bytes, started from `−32·bsums[s]` in one of the row's two lanes (the
/// offset of `q − 32`), times the row's signed scale (`vpmulld`); the scales are spread per
/// super-block by one `vpermt2w` per two sub-blocks and two groups, sign-extended by shifts.
/// Then `(d·d')·dots` in f64 (exact product, one rounding) added to the row's sum, as the
/// scalar does.
///
/// # Safety
/// As [`k4_quad_dot`].
#[inline(always)]
pub unsafe fn q6k_quad_dot<G: Q6Group, const M: usize>(
    groups: [&[G]; 4],
    xs: &[ActRow<'_, BlockQ8K>; M],
) -> [[f64; QUAD_ROWS]; M] {
    super::frame::realign_frame!();
    let mut acc = [[_mm512_setzero_pd(); 2]; M];
    for b in 0..groups[0].len() {
        let (g, ahead) = records(groups, b);
        // The scale bytes of groups 0, 1 and of groups 2, 3 (a table of two zmm each).
        let tables = [
            [
                _mm512_loadu_si512(g[0].scales().as_ptr() as *const _),
                _mm512_loadu_si512(g[1].scales().as_ptr() as *const _),
            ],
            [
                _mm512_loadu_si512(g[2].scales().as_ptr() as *const _),
                _mm512_loadu_si512(g[3].scales().as_ptr() as *const _),
            ],
        ];
        let mut dots = [[_mm512_setzero_si512(); 2]; M];
        for w in 0..4 {
            prefetch_ahead(g[w], ahead);
            // Sub-blocks 2w, 2w + 1 (from word w) and 2w + 8, 2w + 9 (word w + 4) of both
            // pairs of groups, each row's scale sign-extended into both its i32 lanes.
            let mut scale = [[_mm512_setzero_si512(); 4]; 2];
            for h in 0..2 {
                for (n, word) in [w, w + 4].into_iter().enumerate() {
                    let idx = _mm512_loadu_si512(SCALE_WORDS[word].as_ptr() as *const _);
                    let v = _mm512_permutex2var_epi16(tables[h][0], idx, tables[h][1]);
                    scale[h][2 * n] = _mm512_srai_epi32::<24>(_mm512_slli_epi32::<8>(v));
                    scale[h][2 * n + 1] = _mm512_srai_epi32::<24>(v);
                }
            }
            for kk in 0..2 {
                let k = 2 * w + kk;
                // Runs 2k, 2k + 1 (sub-block k) and 2k + 16, 2k + 17 (sub-block k + 8).
                let (l00, h00) = q6k_runs(g[0], g[1], 2 * k);
                let (l01, h01) = q6k_runs(g[0], g[1], 2 * k + 1);
                let (l10, h10) = q6k_runs(g[2], g[3], 2 * k);
                let (l11, h11) = q6k_runs(g[2], g[3], 2 * k + 1);
                let runs = [[[l00, l01], [h00, h01]], [[l10, l11], [h10, h11]]];
                super::unrolled!(M, |i| {
                    let x = xs[i].0.get_unchecked(b);
                    let a = x.qs.as_ptr() as *const i64;
                    let q = |t: usize| _mm512_set1_epi64(std::ptr::read_unaligned(a.add(t)));
                    for (part, s) in [k, k + 8].into_iter().enumerate() {
                        let offset = -32 * *x.bsums.get_unchecked(s) as i32;
                        let init = _mm512_set1_epi64(offset as u32 as i64);
                        for h in 0..2 {
                            let r = &runs[h][part];
                            let t = _mm512_dpbusd_epi32(init, r[0], q(2 * s));
                            let t = _mm512_dpbusd_epi32(t, r[1], q(2 * s + 1));
                            let sc = scale[h][2 * part + kk];
                            dots[i][h] = _mm512_add_epi32(dots[i][h], _mm512_mullo_epi32(t, sc));
                        }
                    }
                });
            }
        }
        let wd = f16x16_pd([g[0].d(), g[1].d(), g[2].d(), g[3].d()]);
        super::unrolled!(M, |i| {
            let x = xs[i].0.get_unchecked(b);
            let d = pair_lanes(dots[i][0], dots[i][1]);
            let xd = _mm512_set1_pd(x.d as f64);
            let d = i32x16_pd(d);
            for h in 0..2 {
                // Not an FMA: the scalar rounds the product, then the sum.
                let dd = _mm512_mul_pd(wd[h], xd);
                acc[i][h] = _mm512_add_pd(acc[i][h], _mm512_mul_pd(dd, d[h]));
            }
        });
    }
    store_rows(&acc)
}

/// [`q6k_quad_dot`] compiled with the features it needs.
///
/// # Safety
/// As [`k4_quad_dot`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn q6k_quad_dot_vnni<G: Q6Group, const M: usize>(
    groups: [&[G]; 4],
    xs: &[ActRow<'_, BlockQ8K>; M],
) -> [[f64; QUAD_ROWS]; M] {
    q6k_quad_dot(groups, xs)
}
