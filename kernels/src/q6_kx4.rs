//! Q6_K weights repacked four rows at a time ([`BlockQ6Kx4`], [`crate::repack`] says why),
//! and their AVX2 product with Q8_K activations summed in f64: what every Q6_K matmul of
//! candle-tp runs on the CPU (decode, prefill, row-parallel partials).
//!
//! Four rows' super-blocks `b` are one 840-byte record (the four super-scales, the four rows'
//! 16 scales, their low 4 bits, then their high 2 bits), so a group of four rows is one
//! sequential stream. Per super-block the kernel unpacks each row's 256 six-bit values `q`
//! (0..63, unsigned) once for all activation rows, multiplies them by the Q8_K bytes `q'`
//! (`maddubs`) and each 16 by their scale `sc` (`madd`), and takes the offset off as
//! `32·Σ_j sc_j·bsums_j` (as [`crate::q6_k`]'s per-row kernel): `Σ_j sc_j Σ (q − 32)·q'`, one
//! exact integer per row, times the exact product of the scales `d·d'` in f64, the blocks added
//! in order: every value is bit for bit [`crate::f64_dot::dot_f64`] of the unpacked row
//! (tested).

use crate::q6_k::BlockQ6K;
use crate::q8_k::{BlockQ8K, QK_K};
use crate::repack::{repack_bytes, Interleave, Repacked, RepackedMatMul};
use candle_core::Result;
use half::f16;
use std::sync::Arc;

/// Four Q6_K super-blocks of four consecutive rows (the same block index), interleaved: row
/// `r`'s block is `d[r]`, `scales[r]`, `ql[r]` and `qh[r]` (values as in [`BlockQ6K`]).
/// 840 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ6Kx4 {
    /// The rows' super-scales.
    pub d: [f16; 4],
    /// The rows' scales, one per 16 values.
    pub scales: [[i8; QK_K / 16]; 4],
    /// The rows' low 4 bits of the values.
    pub ql: [[u8; QK_K / 2]; 4],
    /// The rows' high 2 bits of the values.
    pub qh: [[u8; QK_K / 4]; 4],
}
const _: () = assert!(std::mem::size_of::<BlockQ6Kx4>() == 840);

impl BlockQ6Kx4 {
    /// Four all-zero blocks (the padding rows of a last, partial group).
    pub const ZERO: Self = Self {
        d: [f16::ZERO; 4],
        scales: [[0; QK_K / 16]; 4],
        ql: [[0; QK_K / 2]; 4],
        qh: [[0; QK_K / 4]; 4],
    };
}

/// A repacked Q6_K weight ([`Repacked`] of [`BlockQ6K`]).
pub type RepackedQ6K = Repacked<BlockQ6K>;

/// [`crate::repack::repack_bytes`] for Q6_K, instantiated in this crate so that the kernel
/// and its driver are compiled with its optimisations in every profile (a generic
/// instantiated in candle-tp's debug build, what its tests run, would be unoptimised).
pub fn repack(bytes: &[u8], n: usize, k: usize) -> Result<Arc<dyn RepackedMatMul>> {
    repack_bytes::<BlockQ6K>(bytes, n, k)
}

impl Interleave for BlockQ6K {
    type X4 = BlockQ6Kx4;
    const X4_ZERO: BlockQ6Kx4 = BlockQ6Kx4::ZERO;

    fn set_row(x4: &mut BlockQ6Kx4, r: usize, block: &Self) {
        x4.d[r] = block.d;
        x4.scales[r] = block.scales;
        x4.ql[r] = block.ql;
        x4.qh[r] = block.qh;
    }

    fn row(x4: &BlockQ6Kx4, r: usize) -> Self {
        BlockQ6K {
            ql: x4.ql[r],
            qh: x4.qh[r],
            scales: x4.scales[r],
            d: x4.d[r],
        }
    }

    /// candle 0.11.1's `BlockQ6K::to_float`, operation for operation: `d · sc · (q − 32)` in
    /// f32, left to right.
    fn dequantize(block: &Self, out: &mut [f32]) {
        let d = block.d.to_f32();
        for half in 0..2 {
            let ql = &block.ql[64 * half..64 * half + 64];
            let qh = &block.qh[32 * half..32 * half + 32];
            let sc = &block.scales[8 * half..8 * half + 8];
            let out = &mut out[128 * half..128 * half + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                out[l] = d * sc[is] as f32 * q1 as f32;
                out[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                out[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                out[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn group_dot_avx2<const M: usize>(
        group: &[BlockQ6Kx4],
        xs: [(&[BlockQ8K], &[i32]); M],
    ) -> [[f64; 4]; M] {
        avx2::group_dot(group, xs)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::BlockQ6Kx4;
    use crate::f64_dot::avx2::hsum4;
    use crate::q8_k::BlockQ8K;
    use crate::repack::avx2::{f16x4, PREFETCH};
    use std::arch::x86_64::*;

    /// As the scalar sum, bit for bit: per super-block, each row's values unpacked once
    /// (unsigned, 0..63: low 4 bits of `ql`, high 2 of `qh`, as [`crate::q6_k`]'s kernel) with
    /// its scales widened to i16; per activation row, `Σ sc·q·q'` (`maddubs`, pairs of at most
    /// 2·63·128, no saturation, then `madd` by the scale of each 16 values) minus
    /// `32·Σ_j sc_j·bsums_j` (a `madd` of the scales with the block sums, shifted by 5), the
    /// four rows reduced to one integer each (the scalar's `dots`, whose magnitude is below
    /// 2^31, so wrapping lanes do not matter), times `d·d'` (exact in f64) with one rounding,
    /// then added to the row's f64 sum: the scalar's `(d · d') · dots` and `+`.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every slice of `xs` has `group.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group_dot<const M: usize>(
        group: &[BlockQ6Kx4],
        xs: [(&[BlockQ8K], &[i32]); M],
    ) -> [[f64; 4]; M] {
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        // Vector `t` of a half holds values `32 t .. 32 t + 32`: scale `2 t` in its low 128
        // bits, `2 t + 1` in its high 128 bits. `pick[t]` broadcasts those i16 words of a
        // half's eight scales (copied in both 128-bit lanes).
        let pick: [__m256i; 4] = std::array::from_fn(|t| {
            let bytes: [u8; 32] = std::array::from_fn(|j| (4 * t + 2 * (j / 16) + j % 2) as u8);
            _mm256_loadu_si256(bytes.as_ptr() as *const __m256i)
        });
        let mut acc = [_mm256_setzero_pd(); M];
        for (b, g) in group.iter().enumerate() {
            // A hint: no fault past the end of the weight. Every cache line of the record,
            // `PREFETCH` bytes ahead.
            let at = (g as *const BlockQ6Kx4 as *const i8).wrapping_add(PREFETCH);
            for line in (0..std::mem::size_of::<BlockQ6Kx4>()).step_by(64) {
                _mm_prefetch(at.wrapping_add(line), _MM_HINT_T0);
            }
            // The four rows' values (vector `4 h + t`: values `128 h + 32 t ..`), the
            // matching scales, and the 16 scales as i16, for every activation row.
            let mut q = [[_mm256_setzero_si256(); 8]; 4];
            let mut sc = [[_mm256_setzero_si256(); 8]; 4];
            let mut sc16 = [_mm256_setzero_si256(); 4];
            for r in 0..4 {
                let s =
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(g.scales[r].as_ptr() as *const __m128i));
                sc16[r] = s;
                let halves = [
                    _mm256_permute2x128_si256(s, s, 0x00),
                    _mm256_permute2x128_si256(s, s, 0x11),
                ];
                for (h, &scales) in halves.iter().enumerate() {
                    let ql = g.ql[r].as_ptr().add(64 * h);
                    let ql0 = _mm256_loadu_si256(ql as *const __m256i);
                    let ql1 = _mm256_loadu_si256(ql.add(32) as *const __m256i);
                    let qh = _mm256_loadu_si256(g.qh[r].as_ptr().add(32 * h) as *const __m256i);
                    let v = &mut q[r][4 * h..4 * h + 4];
                    v[0] = _mm256_or_si256(
                        _mm256_and_si256(ql0, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
                    );
                    v[1] = _mm256_or_si256(
                        _mm256_and_si256(ql1, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                    );
                    v[2] = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                        _mm256_and_si256(qh, m30),
                    );
                    v[3] = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
                    );
                    for t in 0..4 {
                        sc[r][4 * h + t] = _mm256_shuffle_epi8(scales, pick[t]);
                    }
                }
            }
            let dw = _mm256_cvtps_pd(f16x4(&g.d));
            for i in 0..M {
                // In bounds: `xs[i].0` has `group.len()` blocks (the caller's contract).
                let x = xs[i].0.get_unchecked(b);
                let mut a = [_mm256_setzero_si256(); 8];
                for (v, a) in a.iter_mut().enumerate() {
                    *a = _mm256_loadu_si256(x.qs.as_ptr().add(32 * v) as *const __m256i);
                }
                let bsums = _mm256_loadu_si256(x.bsums.as_ptr() as *const __m256i);
                let mut s = [_mm256_setzero_si256(); 4];
                for r in 0..4 {
                    let offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16[r], bsums), 5);
                    let mut sum = _mm256_sub_epi32(_mm256_setzero_si256(), offset);
                    for v in 0..8 {
                        let pairs = _mm256_maddubs_epi16(q[r][v], a[v]);
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, sc[r][v]));
                    }
                    s[r] = sum;
                }
                let dots = _mm256_cvtepi32_pd(hsum4(s));
                let dd = _mm256_mul_pd(dw, _mm256_set1_pd(x.d as f64));
                // Not an FMA: the scalar rounds the product, then the sum.
                acc[i] = _mm256_add_pd(acc[i], _mm256_mul_pd(dd, dots));
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

    /// Block `b` of row `r`: pseudo-random 6-bit values (all 64 over the blocks tested),
    /// scales of both signs (−128 and 127 included), super-scales of both signs.
    fn block(r: usize, b: usize) -> BlockQ6K {
        let seed = r * 1000 + b * 37;
        let mut scales = pseudo_bytes::<16>(seed + 5).map(|v| v as i8);
        scales[(r + 3 * b) % 16] = if (r + b) % 2 == 0 { -128 } else { 127 };
        BlockQ6K {
            ql: pseudo_bytes(seed + 11),
            qh: pseudo_bytes(seed + 23),
            scales,
            d: f16::from_f32(0.01 + 0.02 * pseudo(r * 97 + b)),
        }
    }

    /// Value `p` (0..256) of the block, unsigned (0..63), from the format: value `p` of half
    /// `h = p / 128` (`j = p % 128`, `t = j / 32`, `l = j % 32`) has its low 4 bits in
    /// `ql[64 h + 32 (t % 2) + l]` (the low nibble for `t < 2`, the high one for `t ≥ 2`) and
    /// its high 2 bits at bit `2 t` of `qh[32 h + l]`.
    fn q6(b: &BlockQ6K, p: usize) -> u8 {
        let (h, j) = (p / 128, p % 128);
        let (t, l) = (j / 32, j % 32);
        let low = (b.ql[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 0xF;
        let high = (b.qh[32 * h + l] >> (2 * t)) & 3;
        low | (high << 4)
    }

    /// The block's 256 values `d·sc·(q − 32)` (scale `scales[p / 16]`), in f32 left to right.
    fn values(b: &BlockQ6K) -> Vec<f32> {
        (0..QK_K)
            .map(|p| b.d.to_f32() * b.scales[p / 16] as f32 * (q6(b, p) as i32 - 32) as f32)
            .collect()
    }

    #[test]
    fn every_value_is_the_unpacked_rows_f64_dot() {
        let blocks: Vec<BlockQ6K> = (0..9 * 18).map(|i| block(i / 18, i % 18)).collect();
        let mut seen = [false; 64];
        for b in &blocks {
            for p in 0..QK_K {
                seen[q6(b, p) as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
        assert!(blocks.iter().any(|b| b.scales.contains(&-128)));
        assert!(blocks.iter().any(|b| b.scales.contains(&127)));
        assert!(blocks.iter().any(|b| b.d.to_f32() < 0.0));
        testing::every_value_is_the_unpacked_rows_f64_dot(block);
    }

    #[test]
    fn blocks_and_rows_come_back_as_stored() {
        testing::blocks_and_rows_come_back(block, values);
    }

    #[test]
    fn nan_activations_give_nan_and_bad_sizes_are_errors() {
        testing::nan_activations_give_nan_and_bad_sizes_are_errors(block);
    }

    #[test]
    fn dequantize_is_candles_to_float() {
        use candle_core::quantized::k_quants::{BlockQ6K as CandleQ6K, GgmlType};
        let blocks: Vec<BlockQ6K> = (0..6).map(|i| block(i % 3, i)).collect();
        // SAFETY: the same repr(C) 210-byte layout (asserted by both crates).
        let theirs: &[CandleQ6K] = unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast(), 6) };
        let mut want = vec![0f32; 6 * QK_K];
        CandleQ6K::to_float(theirs, &mut want);
        let mut got = vec![0f32; QK_K];
        for (b, want) in blocks.iter().zip(want.chunks_exact(QK_K)) {
            <BlockQ6K as Interleave>::dequantize(b, &mut got);
            for (j, (g, w)) in got.iter().zip(want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "value {j} of {b:?}: {g} != {w}");
            }
        }
    }
}
