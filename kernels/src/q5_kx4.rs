//! Q5_K weights repacked four rows at a time ([`BlockQ5Kx4`], [`crate::repack`] says why),
//! and their AVX2 product with Q8_K activations summed in f64: what every Q5_K matmul of
//! candle-tp runs on the CPU (decode, prefill, row-parallel partials).
//!
//! Per super-block of 256 values and row, two integers, as [`crate::q5_k`] computes them:
//! `Σ_j sc_j Σ q·q'` (the 5-bit values, nibbles and their fifth bits unpacked once per group
//! for every activation row, times the activation bytes by `maddubs`, each 32-value sub-block
//! scaled by its 6-bit scale in `madd`) and `Σ_j mn_j · bsums_j` (the minimums times the
//! activations' sums of 16, one `madd`). The scales and minimums, unpacked to a byte each when
//! the weight is repacked, are spread once per group for every activation row; the four rows'
//! integers are reduced together and combined with `d`, `dmin` and `d'` in f64 in the scalar
//! order: every value is bit for bit [`crate::f64_dot::dot_f64`] of the unpacked row (tested).

use crate::q4_kx4::{pack_scales_mins, scales_mins};
use crate::q5_k::BlockQ5K;
use crate::q8_k::{BlockQ8K, QK_K};
use crate::repack::{put_runs, repack_bytes, take_runs, Interleave, Repacked, RepackedMatMul};
use candle_core::Result;
use half::f16;
use std::sync::Arc;

/// Four Q5_K super-blocks of four consecutive rows (the same block index), interleaved: row
/// `r`'s block is `d[r]`, `dmin[r]` (as in [`BlockQ5K`]), its scales `sc[r]` and minimums
/// `mn[r]` a byte each (as [`crate::q4_kx4::BlockQ4Kx4`]'s), its 128 bytes of
/// nibbles in runs of 8, `qs[t][r]` holding its bytes `8t .. 8t + 8`, and its 32 bytes of
/// fifth bits in runs of 8, `qh[c][r]` holding its bytes `8c .. 8c + 8`: one 32-byte load
/// holds the same 8 bytes of the four rows, and the fifth bits of the values in run
/// `t = 4j + c` are bits `2j` (low nibbles) and `2j + 1` (high nibbles) of run `c` of `qh`.
/// 720 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ5Kx4 {
    /// The rows' super-scales of the scales.
    pub d: [f16; 4],
    /// The rows' super-scales of the minimums.
    pub dmin: [f16; 4],
    /// The rows' eight 6-bit scales, unpacked from GGUF's 12 bytes (one byte each).
    pub sc: [[u8; 8]; 4],
    /// The rows' eight 6-bit minimums, unpacked likewise.
    pub mn: [[u8; 8]; 4],
    /// The rows' fifth bits, 8 bytes of each row in turn.
    pub qh: [[[u8; 8]; 4]; QK_K / 64],
    /// The rows' packed low 4 bits, 8 bytes of each row in turn.
    pub qs: [[[u8; 8]; 4]; QK_K / 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ5Kx4>() == 4 * 176 + 16);

impl BlockQ5Kx4 {
    /// Four all-zero blocks (the padding rows of a last, partial group).
    pub const ZERO: Self = Self {
        d: [f16::ZERO; 4],
        dmin: [f16::ZERO; 4],
        sc: [[0; 8]; 4],
        mn: [[0; 8]; 4],
        qh: [[[0; 8]; 4]; QK_K / 64],
        qs: [[[0; 8]; 4]; QK_K / 16],
    };
}

/// A repacked Q5_K weight ([`Repacked`] of [`BlockQ5K`]).
pub type RepackedQ5K = Repacked<BlockQ5K>;

/// [`crate::repack::repack_bytes`] for Q5_K, instantiated in this crate so that the kernel
/// and its driver are compiled with its optimisations in every profile (a generic
/// instantiated in candle-tp's debug build, what its tests run, would be unoptimised).
pub fn repack(bytes: &[u8], n: usize, k: usize) -> Result<Arc<dyn RepackedMatMul>> {
    repack_bytes::<BlockQ5K>(bytes, n, k)
}

impl Interleave for BlockQ5K {
    type X4 = BlockQ5Kx4;
    const X4_ZERO: BlockQ5Kx4 = BlockQ5Kx4::ZERO;
    const TILE_8: bool = true;

    fn set_row(x4: &mut BlockQ5Kx4, r: usize, block: &Self) {
        x4.d[r] = block.d;
        x4.dmin[r] = block.dmin;
        let (sc, mn) = scales_mins(&block.scales);
        (x4.sc[r], x4.mn[r]) = (sc.to_le_bytes(), mn.to_le_bytes());
        put_runs(&mut x4.qh, r, &block.qh);
        put_runs(&mut x4.qs, r, &block.qs);
    }

    fn row(x4: &BlockQ5Kx4, r: usize) -> Self {
        BlockQ5K {
            d: x4.d[r],
            dmin: x4.dmin[r],
            scales: pack_scales_mins(x4.sc[r], x4.mn[r]),
            qh: take_runs(&x4.qh, r),
            qs: take_runs(&x4.qs, r),
        }
    }

    fn dequantize(block: &Self, out: &mut [f32]) {
        // candle's `BlockQ5K::to_float`, operation for operation.
        let (d, min) = (block.d.to_f32(), block.dmin.to_f32());
        let (scales, mins) = scales_mins(&block.scales);
        let (sc, mn) = (scales.to_le_bytes(), mins.to_le_bytes());
        let (mut u1, mut u2) = (1u8, 2u8);
        for j in 0..QK_K / 64 {
            let q = &block.qs[32 * j..32 * j + 32];
            let out = &mut out[64 * j..64 * j + 64];
            let (d1, m1) = (d * sc[2 * j] as f32, min * mn[2 * j] as f32);
            let (d2, m2) = (d * sc[2 * j + 1] as f32, min * mn[2 * j + 1] as f32);
            for (l, (&q, &h)) in q.iter().zip(&block.qh).enumerate() {
                let add1 = if h & u1 != 0 { 16f32 } else { 0f32 };
                let add2 = if h & u2 != 0 { 16f32 } else { 0f32 };
                out[l] = d1 * ((q & 0xF) as f32 + add1) - m1;
                out[32 + l] = d2 * ((q >> 4) as f32 + add2) - m2;
            }
            u1 <<= 2;
            u2 <<= 2;
        }
    }

    crate::repack::avx2::four_row_items!(BlockQ5Kx4, BlockQ8K);

    crate::q4_kx4::k4_avx512_items!(BlockQ5Kx4);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::BlockQ5Kx4;
    use crate::q4_kx4::avx2::{k4_group_dot, k4_unpack_panel, K4Group};
    use crate::q8_k::BlockQ8K;
    use crate::repack::avx512::join32;
    use crate::repack::panel::PanelBlock;
    use half::f16;
    use std::arch::x86_64::*;

    impl K4Group for BlockQ5Kx4 {
        fn d(&self) -> &[f16; 4] {
            &self.d
        }
        fn dmin(&self) -> &[f16; 4] {
            &self.dmin
        }
        fn sc(&self) -> &[[u8; 8]; 4] {
            &self.sc
        }
        fn mn(&self) -> &[[u8; 8]; 4] {
            &self.mn
        }
        /// Q4_K's nibbles with the fifth bits: the runs of `qh` shifted down by `2j`, so that
        /// bits 0 and 1 of each byte are those of the low and high nibbles of values
        /// `64j ..` (the bits a byte takes from its neighbour land at bit 2 or above, masked
        /// off), moved to bit 4.
        #[inline(always)]
        unsafe fn values(&self, j: usize) -> ([__m256i; 4], [__m256i; 4]) {
            let low = _mm256_set1_epi8(0x0F);
            let shift = _mm_cvtsi32_si128(2 * j as i32);
            let q: [__m256i; 4] = std::array::from_fn(|c| {
                _mm256_loadu_si256(self.qs[4 * j + c].as_ptr() as *const __m256i)
            });
            let qh: [__m256i; 4] = std::array::from_fn(|c| {
                _mm256_srl_epi16(
                    _mm256_loadu_si256(self.qh[c].as_ptr() as *const __m256i),
                    shift,
                )
            });
            let lo = std::array::from_fn(|c| {
                let h = _mm256_slli_epi16(_mm256_and_si256(qh[c], _mm256_set1_epi8(1)), 4);
                _mm256_or_si256(_mm256_and_si256(q[c], low), h)
            });
            let hi = std::array::from_fn(|c| {
                let h = _mm256_slli_epi16(_mm256_and_si256(qh[c], _mm256_set1_epi8(2)), 3);
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q[c], 4), low), h)
            });
            (lo, hi)
        }
        #[inline(always)]
        unsafe fn values_pair(a: &Self, b: &Self, j: usize) -> ([__m512i; 4], [__m512i; 4]) {
            let low = _mm512_set1_epi8(0x0F);
            let shift = _mm_cvtsi32_si128(2 * j as i32);
            let (mut lo, mut hi) = ([_mm512_setzero_si512(); 4], [_mm512_setzero_si512(); 4]);
            for c in 0..4 {
                let q = join32(&a.qs[4 * j + c], &b.qs[4 * j + c]);
                let qh = _mm512_srl_epi16(join32(&a.qh[c], &b.qh[c]), shift);
                let h = _mm512_slli_epi16::<4>(_mm512_and_si512(qh, _mm512_set1_epi8(1)));
                lo[c] = _mm512_or_si512(_mm512_and_si512(q, low), h);
                let h = _mm512_slli_epi16::<3>(_mm512_and_si512(qh, _mm512_set1_epi8(2)));
                hi[c] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(q), low), h);
            }
            (lo, hi)
        }
        #[inline(always)]
        unsafe fn values_wide(&self, j: usize) -> ([__m512i; 2], [__m512i; 2]) {
            let low = _mm512_set1_epi8(0x0F);
            let shift = _mm_cvtsi32_si128(2 * j as i32);
            let (mut lo, mut hi) = ([_mm512_setzero_si512(); 2], [_mm512_setzero_si512(); 2]);
            for p in 0..2 {
                let q = _mm512_loadu_si512(self.qs[4 * j + 2 * p].as_ptr() as *const _);
                let qh = _mm512_loadu_si512(self.qh[2 * p].as_ptr() as *const _);
                let qh = _mm512_srl_epi16(qh, shift);
                let h = _mm512_slli_epi16::<4>(_mm512_and_si512(qh, _mm512_set1_epi8(1)));
                lo[p] = _mm512_or_si512(_mm512_and_si512(q, low), h);
                let h = _mm512_slli_epi16::<3>(_mm512_and_si512(qh, _mm512_set1_epi8(2)));
                hi[p] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(q), low), h);
            }
            (lo, hi)
        }
    }

    /// Q4_K's panel unpacking ([`k4_unpack_panel`]) with five-bit values.
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn unpack_panel(groups: [&BlockQ5Kx4; 4], out: &mut PanelBlock) {
        k4_unpack_panel(groups, out)
    }

    /// Q4_K's kernel ([`k4_group_dot`]) with five-bit values.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every slice of `xs` has `group.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group_dot<const M: usize>(
        group: &[BlockQ5Kx4],
        xs: [crate::repack::ActRow<'_, BlockQ8K>; M],
    ) -> [[f64; 4]; M] {
        k4_group_dot::<_, M, false>(group, xs)
    }

    /// Q4_K's kernel with five-bit values and `vpdpbusd`.
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni;
    /// every slice of `xs` has `group.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn group_dot_vnni<const M: usize>(
        group: &[BlockQ5Kx4],
        xs: [crate::repack::ActRow<'_, BlockQ8K>; M],
    ) -> [[f64; 4]; M] {
        k4_group_dot::<_, M, true>(group, xs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f64_dot::testing::{pseudo, pseudo_bytes};
    use crate::q4_kx4::tests::scale_min;
    use crate::repack::testing;

    /// Block `b` of row `r`: every 5-bit value and 6-bit pattern, minimums' scales of both
    /// signs.
    fn block(r: usize, b: usize) -> BlockQ5K {
        let i = r * 97 + b;
        BlockQ5K {
            d: f16::from_f32(0.002 + 0.001 * pseudo(i)),
            dmin: f16::from_f32(0.003 * pseudo(i + 7)),
            scales: pseudo_bytes(i + 11),
            qh: pseudo_bytes(i + 3000),
            qs: pseudo_bytes(i + 5000),
        }
    }

    #[test]
    fn the_generated_blocks_hold_every_value_and_both_signs() {
        let blocks: Vec<BlockQ5K> = (0..9)
            .flat_map(|r| (0..18).map(move |b| block(r, b)))
            .collect();
        let mut seen = [false; 32];
        for b in &blocks {
            for p in 0..QK_K {
                let byte = b.qs[p / 64 * 32 + p % 32];
                let q = if p % 64 < 32 { byte & 15 } else { byte >> 4 };
                seen[(q | ((b.qh[p % 32] >> (p / 32)) & 1) << 4) as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s), "{seen:?}");
        assert!(blocks.iter().any(|b| b.dmin.to_f32() > 0.0));
        assert!(blocks.iter().any(|b| b.dmin.to_f32() < 0.0));
    }

    #[test]
    fn every_value_is_the_unpacked_rows_f64_dot() {
        testing::every_value_is_the_unpacked_rows_f64_dot(block);
    }

    #[test]
    fn panels_are_the_unpacked_rows_f64_dot() {
        testing::panels_are_the_unpacked_rows_f64_dot(block);
    }

    #[test]
    fn blocks_and_rows_come_back_as_stored() {
        testing::blocks_and_rows_come_back(block, |b| {
            let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
            (0..QK_K)
                .map(|p| {
                    // Value p: sub-block p / 32, its fifth bit bit p / 32 of qh[p % 32].
                    let (sc, mn) = scale_min(p / 32, &b.scales);
                    let byte = b.qs[p / 64 * 32 + p % 32];
                    let low = if p % 64 < 32 { byte & 15 } else { byte >> 4 };
                    let q = low | ((b.qh[p % 32] >> (p / 32)) & 1) << 4;
                    d * sc as f32 * q as f32 - dmin * mn as f32
                })
                .collect()
        });
    }

    #[test]
    fn dequantize_is_candles() {
        let blocks: Vec<BlockQ5K> = (0..6).map(|b| block(3, b)).collect();
        testing::dequantize_is_candles::<_, candle_core::quantized::k_quants::BlockQ5K>(&blocks);
    }

    #[test]
    fn nan_activations_give_nan_and_bad_sizes_are_errors() {
        testing::nan_activations_give_nan_and_bad_sizes_are_errors(block);
    }
}
