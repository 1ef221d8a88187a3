//! Q8_0 weights repacked four rows at a time ([`BlockQ8_0x4`], [`crate::repack`] says why),
//! and their AVX2 product with Q8_0 activations summed in f64: what every Q8_0 matmul of
//! candle-tp runs on the CPU.
//!
//! Signed bytes against signed bytes: `maddubs` wants an unsigned left operand, so each row
//! multiplies `|q|` by `q'` with `q`'s sign (as ggml's `ggml_vec_dot_q8_0_q8_0`; a pair sums to
//! at most 2·128·127, no saturation). The four rows' sums are reduced to one integer each per
//! block and multiplied by the exact product of the scales `d·d'` in f64, the blocks added in
//! order: every value is bit for bit [`crate::f64_dot::dot_f64`] of the unpacked row (tested).

use crate::q8_0::{BlockQ8_0, QK8_0};
use crate::repack::{repack_bytes, Interleave, Repacked, RepackedMatMul};
use candle_core::Result;
use half::f16;
use std::sync::Arc;

/// Four Q8_0 blocks of four consecutive rows (the same block index), interleaved: row `r`'s
/// block is `d[r]` and `qs[r]`. 136 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8_0x4 {
    /// The rows' scales.
    pub d: [f16; 4],
    /// The rows' values.
    pub qs: [[i8; QK8_0]; 4],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0x4>() == 136);

impl BlockQ8_0x4 {
    /// Four all-zero blocks (the padding rows of a last, partial group).
    pub const ZERO: Self = Self {
        d: [f16::ZERO; 4],
        qs: [[0; QK8_0]; 4],
    };
}

/// A repacked Q8_0 weight ([`Repacked`] of [`BlockQ8_0`]).
pub type RepackedQ8_0 = Repacked<BlockQ8_0>;

/// [`crate::repack::repack_bytes`] for Q8_0, instantiated in this crate so that the kernel
/// and its driver are compiled with its optimisations in every profile (a generic
/// instantiated in candle-tp's debug build, what its tests run, would be unoptimised).
pub fn repack(bytes: &[u8], n: usize, k: usize) -> Result<Arc<dyn RepackedMatMul>> {
    repack_bytes::<BlockQ8_0>(bytes, n, k)
}

impl Interleave for BlockQ8_0 {
    type X4 = BlockQ8_0x4;
    const X4_ZERO: BlockQ8_0x4 = BlockQ8_0x4::ZERO;

    fn set_row(x4: &mut BlockQ8_0x4, r: usize, block: &Self) {
        x4.d[r] = block.d;
        x4.qs[r] = block.qs;
    }

    fn row(x4: &BlockQ8_0x4, r: usize) -> Self {
        BlockQ8_0 {
            d: x4.d[r],
            qs: x4.qs[r],
        }
    }

    fn dequantize(block: &Self, out: &mut [f32]) {
        let d = block.d.to_f32();
        for (o, &q) in out.iter_mut().zip(&block.qs) {
            *o = q as f32 * d;
        }
    }

    /// `128·Σ q'`, which the VNNI kernel's unsigned weights `q + 128` add to each row's sum.
    fn act_sum(x: &BlockQ8_0) -> i32 {
        128 * x.qs.iter().map(|&q| q as i32).sum::<i32>()
    }

    /// `[d', 0]` in f64, for the eight-row kernel.
    fn act_scales(x: &BlockQ8_0) -> [f64; 2] {
        [x.d.to_f64(), 0.0]
    }

    /// One row stays on the four-row kernel: on a Zen 5 core the quads measured 0.80-1.04x
    /// its time there (by run), against 1.5-2x at 2 and 4 rows.
    const QUAD_SINGLE: bool = false;

    crate::repack::avx2::unsigned_items!(BlockQ8_0x4, BlockQ8_0);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::BlockQ8_0x4;
    use crate::f64_dot::avx2::hsum4;
    use crate::q8_0::BlockQ8_0;
    use crate::repack::avx2::{f16x4, pair_dot_words, prefetch_record};
    use crate::repack::avx512::{join_ps, quad_dot, QUAD_PREFETCH};
    use crate::repack::ActRow;
    use std::arch::x86_64::*;

    /// Bytes ahead that each of the two streams of [`pair_dot_vnni`] prefetches.
    const PAIR_PREFETCH: usize = 1024;

    /// The engines' `words` ([`quad_dot`]) of block `b` of the four groups (`g`): each group's
    /// rows 0-1 and rows 2-3 are one 64-byte load each; one `vpermt2q` per run and group pair
    /// and a blend put values `8t .. 8t + 8` of the sixteen rows into two zmm, flipped to
    /// `q + 128` for `vpdpbusd` (the activations' `128·Σ q'` comes off each sum): the same
    /// integers. (Its target features let the closures in it inline their intrinsics: a
    /// closure takes the features of the function it is written in.)
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q8_words(g: [&BlockQ8_0x4; 4]) -> ([__m512i; 8], __m512, __m512) {
        let flip = _mm512_set1_epi8(-128);
        // Qword `k` of row `r` holds its values `8k .. 8k + 8`; a load of rows (0, 1) or (2, 3)
        // holds qwords `4r + k` of the pair, so run `t` of the four rows is `t, 4 + t` of the
        // first load and of the second (indexes 8 + ...).
        let idx = |t: i64| _mm512_setr_epi64(t, 4 + t, 8 + t, 12 + t, t, 4 + t, 8 + t, 12 + t);
        let load =
            |g: &BlockQ8_0x4, r: usize| _mm512_loadu_si512(g.qs[r].as_ptr() as *const __m512i);
        let rows: [[__m512i; 2]; 4] = std::array::from_fn(|i| [load(g[i], 0), load(g[i], 2)]);
        let w = std::array::from_fn(|j| {
            let (t, first) = (j % 4, if j < 4 { 0 } else { 2 });
            let [a, b] = [rows[first], rows[first + 1]];
            let lo = _mm512_permutex2var_epi64(a[0], idx(t as i64), a[1]);
            let hi = _mm512_permutex2var_epi64(b[0], idx(t as i64), b[1]);
            _mm512_xor_si512(_mm512_mask_blend_epi64(0xF0, lo, hi), flip)
        });
        let d = join_ps(
            _mm256_set_m128(f16x4(&g[1].d), f16x4(&g[0].d)),
            _mm256_set_m128(f16x4(&g[3].d), f16x4(&g[2].d)),
        );
        (w, d, _mm512_setzero_ps())
    }

    /// The 512-bit kernel for four groups ([`quad_dot`] of [`q8_words`]).
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni; the
    /// groups and every slice of `xs` have the same length.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn quad_dot_vnni<const M: usize>(
        groups: [&[BlockQ8_0x4]; 4],
        xs: &[ActRow<'_, BlockQ8_0>; M],
    ) -> [[f64; 16]; M] {
        quad_dot::<_, _, M, false, QUAD_PREFETCH>(groups, xs, |g| q8_words(g))
    }

    /// The AMX kernel for four groups and eight activation rows ([`crate::repack::amx_quad::quad_dot_amx`]
    /// of [`q8_words`]).
    ///
    /// # Safety
    /// As [`quad_dot_vnni`], and unless `EMULATE` (scalar tile products, for tests) the CPU
    /// must support amx-tile and amx-int8, granted to this process.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn quad_dot_amx<const EMULATE: bool>(
        groups: [&[BlockQ8_0x4]; 4],
        xs: &[ActRow<'_, BlockQ8_0>; 8],
    ) -> [[f64; 16]; 8] {
        crate::repack::amx_quad::quad_dot_amx::<_, _, false, EMULATE>(groups, xs, |g| q8_words(g))
    }

    /// The AVX2 kernel ([`q8_group_dot`]).
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every slice of `xs` has `group.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group_dot<const M: usize>(
        group: &[BlockQ8_0x4],
        xs: [ActRow<'_, BlockQ8_0>; M],
    ) -> [[f64; 4]; M] {
        q8_group_dot::<M, false>(group, xs)
    }

    /// The AVX-512 VNNI kernel ([`q8_group_dot`] with `vpdpbusd`).
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni;
    /// every slice of `xs` has `group.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn group_dot_vnni<const M: usize>(
        group: &[BlockQ8_0x4],
        xs: [ActRow<'_, BlockQ8_0>; M],
    ) -> [[f64; 4]; M] {
        q8_group_dot::<M, true>(group, xs)
    }

    /// [`q8_group_dot`] with VNNI for two groups at once (eight weight rows), on
    /// [`pair_dot_words`]: per block, the eight rows' `q + 128` are transposed (24 shuffles,
    /// shared by the `M` activation rows) into its words, `w[j]` holding values `4j .. 4j + 4`
    /// of each row; the activations' `128·Σ q'` comes off each sum. Bit for bit the scalar
    /// sum (tested).
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni;
    /// both groups and every slice of `xs` have the same length.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn pair_dot_vnni<const M: usize>(
        group0: &[BlockQ8_0x4],
        group1: &[BlockQ8_0x4],
        xs: &[ActRow<'_, BlockQ8_0>; M],
    ) -> [[f64; 8]; M] {
        let flip = _mm256_set1_epi8(i8::MIN);
        let load = |g: &BlockQ8_0x4, r: usize| {
            _mm256_xor_si256(_mm256_loadu_si256(g.qs[r].as_ptr() as *const __m256i), flip)
        };
        pair_dot_words::<_, _, M, false, PAIR_PREFETCH, false>(group0, group1, xs, |g0, g1| {
            // Rows 0..8 (words 0..8 each) -> words 0..8 (rows 0..8 each).
            let rows = [
                load(g0, 0),
                load(g0, 1),
                load(g0, 2),
                load(g0, 3),
                load(g1, 0),
                load(g1, 1),
                load(g1, 2),
                load(g1, 3),
            ];
            let wd = _mm256_set_m128(f16x4(&g1.d), f16x4(&g0.d));
            (transpose8x32(rows), wd, _mm256_setzero_ps())
        })
    }

    /// The 8 × 8 transpose of 32-bit words: `out[j]` lane `r` is `rows[r]` lane `j`.
    #[inline(always)]
    unsafe fn transpose8x32(rows: [__m256i; 8]) -> [__m256i; 8] {
        let [r0, r1, r2, r3, r4, r5, r6, r7] = rows;
        // Pairs of rows, words interleaved: [a0 b0 a1 b1 | a4 b4 a5 b5] and the odd half.
        let t0 = _mm256_unpacklo_epi32(r0, r1);
        let t1 = _mm256_unpackhi_epi32(r0, r1);
        let t2 = _mm256_unpacklo_epi32(r2, r3);
        let t3 = _mm256_unpackhi_epi32(r2, r3);
        let t4 = _mm256_unpacklo_epi32(r4, r5);
        let t5 = _mm256_unpackhi_epi32(r4, r5);
        let t6 = _mm256_unpacklo_epi32(r6, r7);
        let t7 = _mm256_unpackhi_epi32(r6, r7);
        // Four rows: [a0 b0 c0 d0 | a4 b4 c4 d4], ...
        let u0 = _mm256_unpacklo_epi64(t0, t2);
        let u1 = _mm256_unpackhi_epi64(t0, t2);
        let u2 = _mm256_unpacklo_epi64(t1, t3);
        let u3 = _mm256_unpackhi_epi64(t1, t3);
        let u4 = _mm256_unpacklo_epi64(t4, t6);
        let u5 = _mm256_unpackhi_epi64(t4, t6);
        let u6 = _mm256_unpacklo_epi64(t5, t7);
        let u7 = _mm256_unpackhi_epi64(t5, t7);
        [
            _mm256_permute2x128_si256(u0, u4, 0x20),
            _mm256_permute2x128_si256(u1, u5, 0x20),
            _mm256_permute2x128_si256(u2, u6, 0x20),
            _mm256_permute2x128_si256(u3, u7, 0x20),
            _mm256_permute2x128_si256(u0, u4, 0x31),
            _mm256_permute2x128_si256(u1, u5, 0x31),
            _mm256_permute2x128_si256(u2, u6, 0x31),
            _mm256_permute2x128_si256(u3, u7, 0x31),
        ]
    }

    /// As the scalar sum, bit for bit: per block, the four rows' `Σ q·q'` reduced to one
    /// integer each, times `d·d'` (exact in f32, widened to f64), added to the row's f64 sum
    /// by an FMA whose product is exact, so it rounds once, as the scalar addition does.
    /// Without `VNNI`, `sign` and `maddubs` per row (signed × signed bytes) and a `madd`;
    /// with it, one `vpdpbusd` (unsigned × signed bytes) per row, the weights going in as
    /// `q + 128` (a flip of the sign bit) and the activations' `128·Σ q'`
    /// ([`super::Interleave::act_sum`]) coming off each row's sum: the same integers.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c, and with `VNNI` avx512vl and avx512vnni
    /// (inline this into a function that enables them); every slice of `xs` has
    /// `group.len()` blocks.
    #[inline(always)]
    unsafe fn q8_group_dot<const M: usize, const VNNI: bool>(
        group: &[BlockQ8_0x4],
        xs: [ActRow<'_, BlockQ8_0>; M],
    ) -> [[f64; 4]; M] {
        crate::repack::frame::realign_frame!();
        let ones = _mm256_set1_epi16(1);
        let flip = _mm256_set1_epi8(i8::MIN);
        let mut acc = [_mm256_setzero_pd(); M];
        for (b, g) in group.iter().enumerate() {
            // A hint: no fault past the end of the weight.
            prefetch_record(g);
            let load = |r: usize| _mm256_loadu_si256(g.qs[r].as_ptr() as *const __m256i);
            let q = [load(0), load(1), load(2), load(3)];
            // AVX2: |q| for `maddubs`; VNNI: q + 128.
            // Direct calls, not `array::map`: a closure there is compiled without the
            // caller's target features, and its intrinsics become calls.
            let prep = |q: __m256i| {
                if VNNI {
                    _mm256_xor_si256(q, flip)
                } else {
                    _mm256_sign_epi8(q, q)
                }
            };
            let aq = [prep(q[0]), prep(q[1]), prep(q[2]), prep(q[3])];
            let wd = _mm_cvtph_ps(_mm_loadl_epi64(g.d.as_ptr() as *const __m128i));
            for i in 0..M {
                let (x, offsets, _) = xs[i];
                let x = x.get_unchecked(b);
                let qx = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
                let dot = |r: usize| {
                    if VNNI {
                        _mm256_dpbusd_epi32(_mm256_setzero_si256(), aq[r], qx)
                    } else {
                        let pairs = _mm256_maddubs_epi16(aq[r], _mm256_sign_epi8(qx, q[r]));
                        _mm256_madd_epi16(pairs, ones)
                    }
                };
                let sums = hsum4([dot(0), dot(1), dot(2), dot(3)]);
                let sums = if VNNI {
                    _mm_sub_epi32(sums, _mm_set1_epi32(*offsets.get_unchecked(b)))
                } else {
                    sums
                };
                let xd = _mm_cvtph_ps(_mm_set1_epi16(x.d.to_bits() as i16));
                let dd = _mm256_cvtps_pd(_mm_mul_ps(wd, xd));
                acc[i] = _mm256_fmadd_pd(_mm256_cvtepi32_pd(sums), dd, acc[i]);
            }
        }
        let mut out = [[0f64; 4]; M];
        for i in 0..M {
            _mm256_storeu_pd(out[i].as_mut_ptr(), acc[i]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f64_dot::testing::{pseudo, pseudo_bytes};
    use crate::repack::testing;

    /// Block `b` of row `r`: every byte, −128 included, scales of both signs.
    fn block(r: usize, b: usize) -> BlockQ8_0 {
        BlockQ8_0 {
            d: f16::from_f32(0.01 + 0.02 * pseudo(r * 97 + b)),
            qs: pseudo_bytes::<32>(r * 1000 + b * 32 + 7).map(|v| v as i8),
        }
    }

    #[test]
    fn every_value_is_the_unpacked_rows_f64_dot() {
        assert!((0..64).any(|i| block(i / 8, i % 8).qs.contains(&-128)));
        testing::every_value_is_the_unpacked_rows_f64_dot(block);
    }

    #[test]
    fn blocks_and_rows_come_back_as_stored() {
        testing::blocks_and_rows_come_back(block, |b| {
            b.qs.iter().map(|&q| q as f32 * b.d.to_f32()).collect()
        });
    }

    #[test]
    fn nan_activations_give_nan_and_bad_sizes_are_errors() {
        testing::nan_activations_give_nan_and_bad_sizes_are_errors(block);
    }
}
