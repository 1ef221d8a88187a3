//! The f64 step the AVX-512 VNNI kernels share: one block's integer sums of eight weight
//! rows scaled and added to the rows' f64 sums, rounding once, as the scalar sum does. The
//! two-group kernels (`avx2.rs`) and the four-group engine (`avx512.rs`) both take it from
//! here; with the conversion of sixteen rows' integer sums to f64 that the four-group
//! engines (`avx512.rs`, `k_quad.rs`) and the panels (`panel.rs`) share.

use std::arch::x86_64::*;

/// One block's f64 step for eight rows: `acc + Σ·d'·d`, or `acc + (Σ·d'·d + m·s')` with
/// `HAS_M` (`sums`: the rows' integer sums, `xd`: `d'` in every lane, `xs`: `s'`). `Σ·d'` and
/// then times `d` are exact in f64 (|Σ| < 2^20, `d` and `d'` f16), as is `m·s'`, so the FMA
/// rounds once, as the scalar `Σ · (d·d')` added to the sum does.
///
/// # Safety
/// The CPU must support avx512f (inline this into a function that enables it).
#[inline(always)]
pub unsafe fn f64_step8<const HAS_M: bool>(
    acc: __m512d,
    sums: __m512d,
    xd: __m512d,
    wd: __m512d,
    wm: __m512d,
    xs: f64,
) -> __m512d {
    let s = _mm512_mul_pd(sums, xd);
    if HAS_M {
        let ms = _mm512_mul_pd(wm, _mm512_set1_pd(xs));
        _mm512_add_pd(acc, _mm512_fmadd_pd(s, wd, ms))
    } else {
        _mm512_fmadd_pd(s, wd, acc)
    }
}

/// Sixteen i32 lanes as two f64x8 (lanes 0..8, then 8..16), exactly.
///
/// # Safety
/// The CPU must support avx512f (inline this into a function that enables it).
#[inline(always)]
pub unsafe fn i32x16_pd(v: __m512i) -> [__m512d; 2] {
    [
        _mm512_cvtepi32_pd(_mm512_castsi512_si256(v)),
        _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64::<1>(v)),
    ]
}
