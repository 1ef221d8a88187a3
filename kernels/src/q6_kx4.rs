//! Q6_K weights repacked four rows at a time ([`BlockQ6Kx4`], [`crate::repack`] says why),
//! and their AVX2 product with Q8_K activations summed in f64: what every Q6_K matmul of
//! candle-tp runs on the CPU (decode, prefill, row-parallel partials).
//!
//! Four rows' super-blocks `b` are one 840-byte record (the four super-scales, the four rows'
//! 16 scales, then their values' low 4 and high 2 bits in runs of 8 values of each row), so a
//! group of four rows is one sequential stream and one 32-byte load holds 8 values of each of
//! the four rows. Per super-block the kernel unpacks the values `q` (0..63, unsigned) once for
//! all activation rows; per 16 values it multiplies them by the Q8_K bytes `q'` (`maddubs`,
//! two added in i16) and by the four rows' scales `sc` (one `madd`), and takes the offset off
//! as `32·Σ_j sc_j·bsums_j` (as [`crate::q6_k`]'s per-row kernel): `Σ_j sc_j Σ (q − 32)·q'`,
//! one exact integer per row, times the exact product of the scales `d·d'` in f64, the blocks
//! added in order: every value is bit for bit [`crate::f64_dot::dot_f64`] of the unpacked row
//! (tested).

use crate::q6_k::BlockQ6K;
use crate::q8_k::{BlockQ8K, QK_K};
use crate::repack::panel::{self, PanelBlock};
use crate::repack::{repack_bytes, Interleave, Repacked, RepackedMatMul};
use candle_core::Result;
use half::f16;
use std::sync::Arc;

/// Four Q6_K super-blocks of four consecutive rows (the same block index), interleaved: row
/// `r`'s block is `d[r]` and `scales[r]` (as in [`BlockQ6K`]) and its 256 six-bit values `q`
/// (value `p` as [`BlockQ6K`] orders them, before the offset 32) in runs of 8, so that one
/// 32-byte load holds the same 8 values of the four rows: `ql[u][r][l]` holds the low 4 bits
/// of values `8u + l` (low nibble) and `8(u + 16) + l` (high nibble), `qh[w][r][l]` the high 2
/// bits of values `8(w + 8i) + l` in its bits `2i, 2i + 1` (`i = 0..4`). 840 bytes, the four
/// blocks' size.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ6Kx4 {
    /// The rows' super-scales.
    pub d: [f16; 4],
    /// The rows' scales, one per 16 values.
    pub scales: [[i8; QK_K / 16]; 4],
    /// The low 4 bits of the values, two runs of 8 of each row in turn.
    pub ql: [[[u8; 8]; 4]; QK_K / 16],
    /// The high 2 bits of the values, four runs of 8 of each row in turn.
    pub qh: [[[u8; 8]; 4]; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockQ6Kx4>() == 840);

impl BlockQ6Kx4 {
    /// Four all-zero blocks (the padding rows of a last, partial group).
    pub const ZERO: Self = Self {
        d: [f16::ZERO; 4],
        scales: [[0; QK_K / 16]; 4],
        ql: [[[0; 8]; 4]; QK_K / 16],
        qh: [[[0; 8]; 4]; QK_K / 32],
    };
}

/// The 256 six-bit values of a block (0..63, before the offset 32), in order.
fn values(block: &BlockQ6K) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for half in 0..2 {
        let (ql, qh) = (&block.ql[64 * half..], &block.qh[32 * half..]);
        let q = &mut q[128 * half..128 * half + 128];
        for l in 0..32 {
            q[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            q[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    q
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
    const TILE_8: bool = true;

    fn set_row(x4: &mut BlockQ6Kx4, r: usize, block: &Self) {
        x4.d[r] = block.d;
        x4.scales[r] = block.scales;
        let q = values(block);
        for u in 0..QK_K / 16 {
            for l in 0..8 {
                x4.ql[u][r][l] = (q[8 * u + l] & 0xF) | ((q[8 * (u + 16) + l] & 0xF) << 4);
            }
        }
        for w in 0..QK_K / 32 {
            for l in 0..8 {
                x4.qh[w][r][l] =
                    (0..4).fold(0, |h, i| h | ((q[8 * (w + 8 * i) + l] >> 4) << (2 * i)));
            }
        }
    }

    fn row(x4: &BlockQ6Kx4, r: usize) -> Self {
        let q: [u8; QK_K] = std::array::from_fn(|p| {
            let (t, l) = (p / 8, p % 8);
            let low = x4.ql[t % 16][r][l] >> (4 * (t / 16)) & 0xF;
            let high = (x4.qh[t % 8][r][l] >> (2 * (t / 8))) & 3;
            low | (high << 4)
        });
        let mut block = BlockQ6K {
            ql: [0; QK_K / 2],
            qh: [0; QK_K / 4],
            scales: x4.scales[r],
            d: x4.d[r],
        };
        for half in 0..2 {
            let q = &q[128 * half..128 * half + 128];
            for l in 0..32 {
                block.ql[64 * half + l] = (q[l] & 0xF) | ((q[l + 64] & 0xF) << 4);
                block.ql[64 * half + l + 32] = (q[l + 32] & 0xF) | ((q[l + 96] & 0xF) << 4);
                block.qh[32 * half + l] = (q[l] >> 4)
                    | ((q[l + 32] >> 4) << 2)
                    | ((q[l + 64] >> 4) << 4)
                    | ((q[l + 96] >> 4) << 6);
            }
        }
        block
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

    crate::repack::avx2::four_row_items!(BlockQ6Kx4, BlockQ8K);

    const PANEL: bool = true;
    const QUAD: bool = true;
    // As Q4_K's: one activation row stays on the four-row kernel's single stream.
    const QUAD_SINGLE: bool = false;

    #[cfg(target_arch = "x86_64")]
    unsafe fn group_quad_dot_avx512<const M: usize>(
        groups: [&[BlockQ6Kx4]; 4],
        xs: &[crate::repack::ActRow<'_, BlockQ8K>; M],
    ) -> [[f64; 16]; M] {
        crate::repack::k_quad::q6k_quad_dot_vnni(groups, xs)
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn unpack_panel_avx512(groups: [&BlockQ6Kx4; 4], out: &mut PanelBlock) {
        avx2::unpack_panel(groups, out)
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn panel_dot_avx512<const ENGINE: u8>(
        panel: &[PanelBlock],
        xs: &[crate::repack::ActRow<'_, BlockQ8K>; panel::TILE],
    ) -> [[f64; panel::ROWS]; panel::TILE] {
        panel::dot::<16, false, ENGINE>(panel, xs.map(|x| x.0))
    }
}

#[cfg(target_arch = "x86_64")]
impl crate::repack::k_quad::Q6Group for BlockQ6Kx4 {
    fn d(&self) -> &[f16; 4] {
        &self.d
    }
    fn scales(&self) -> &[[i8; 16]; 4] {
        &self.scales
    }
    fn ql(&self, u: usize) -> &[[u8; 8]; 4] {
        &self.ql[u]
    }
    fn qh(&self, w: usize) -> &[[u8; 8]; 4] {
        &self.qh[w]
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::BlockQ6Kx4;
    use crate::f64_dot::avx2::hsum4;
    use crate::q8_k::{BlockQ8K, QK_K};
    use crate::repack::avx2::{f16x4, prefetch_record};
    use crate::repack::panel::{pair, put_run, PanelBlock};
    use std::arch::x86_64::*;

    /// Eight bytes of `p`, in each 64-bit lane.
    #[inline(always)]
    unsafe fn bytes8(p: *const i8) -> __m256i {
        _mm256_set1_epi64x(std::ptr::read_unaligned(p as *const i64))
    }

    /// As the scalar sum, bit for bit. Per super-block, once for every activation row: the
    /// four rows' values in runs of 8 ([`BlockQ6Kx4`]: `v[t]` holds values `8t .. 8t + 8` of
    /// each row, unsigned 0..63) and, per 16 values, the four rows' scales as i16 (four lanes
    /// each: a byte transpose of the scales). Per activation row and 16 values: two `maddubs`
    /// with the activations' bytes (broadcast) added in i16 (each lane at most
    /// 2·2·63·128 = 32256, no overflow), one `madd` by the rows' scales (two i32 lanes per
    /// row), minus `32·Σ_j sc_j·bsums_j` per row; the scalar's `dots`, below 2^31 in
    /// magnitude, times `d·d'` (exact in f64) with one rounding, added to the row's f64 sum.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every slice of `xs` has `group.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group_dot<const M: usize>(
        group: &[BlockQ6Kx4],
        xs: [crate::repack::ActRow<'_, BlockQ8K>; M],
    ) -> [[f64; 4]; M] {
        q6k_group_dot::<M, false>(group, xs)
    }

    /// [`group_dot`] with VNNI's `vpdpwssd`, the `madd` by the scales and the addition in one
    /// instruction: the same integers.
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni;
    /// every slice of `xs` has `group.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn group_dot_vnni<const M: usize>(
        group: &[BlockQ6Kx4],
        xs: [crate::repack::ActRow<'_, BlockQ8K>; M],
    ) -> [[f64; 4]; M] {
        q6k_group_dot::<M, true>(group, xs)
    }

    /// Values `8u ..` and `8(u + 16) ..` of the four rows of `g` (`u < 16`), unsigned.
    ///
    /// # Safety
    /// The CPU must support avx2 (inline this into a function that enables it).
    #[inline(always)]
    unsafe fn values(g: &BlockQ6Kx4, u: usize) -> (__m256i, __m256i) {
        let (m4, m30) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
        let ql = _mm256_loadu_si256(g.ql[u].as_ptr() as *const __m256i);
        let qh = _mm256_loadu_si256(g.qh[u % 8].as_ptr() as *const __m256i);
        // Values 8u.. take bits 0-1 (u < 8) or 2-3 of `qh`; values 8(u + 16).. bits 4-5 or
        // 6-7.
        let (h_lo, h_hi) = if u < 8 {
            (_mm256_slli_epi16(qh, 4), qh)
        } else {
            (_mm256_slli_epi16(qh, 2), _mm256_srli_epi16(qh, 2))
        };
        (
            _mm256_or_si256(_mm256_and_si256(ql, m4), _mm256_and_si256(h_lo, m30)),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4),
                _mm256_and_si256(h_hi, m30),
            ),
        )
    }

    /// One block of four groups (sixteen rows) as a panel's block: the values four by four, the
    /// scales widened to i32 and in pairs of i16 for the offset `32·Σ_j sc_j·bsums_j`.
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn unpack_panel(groups: [&BlockQ6Kx4; 4], out: &mut PanelBlock) {
        for (i, g) in groups.into_iter().enumerate() {
            for u in 0..QK_K / 16 {
                let (lo, hi) = values(g, u);
                put_run(out, i, u, lo);
                put_run(out, i, u + 16, hi);
            }
            for r in 0..4 {
                let (row, sc) = (4 * i + r, &g.scales[r]);
                out.d[row] = g.d[r].to_f64();
                out.dmin[row] = 0.0;
                for (s, &c) in sc.iter().enumerate() {
                    out.sc[s][row] = c as i32;
                }
                for j in 0..QK_K / 32 {
                    out.off[j][row] = pair(sc[2 * j] as i16, sc[2 * j + 1] as i16);
                }
            }
        }
    }

    /// The kernel of [`group_dot`] (`VNNI`: of [`group_dot_vnni`]).
    ///
    /// # Safety
    /// As those; inline this into a function that enables the features.
    #[inline(always)]
    unsafe fn q6k_group_dot<const M: usize, const VNNI: bool>(
        group: &[BlockQ6Kx4],
        xs: [crate::repack::ActRow<'_, BlockQ8K>; M],
    ) -> [[f64; 4]; M] {
        crate::repack::frame::realign_frame!();
        // Byte `s % 4` of four rows (one 32-bit word per 16 values), each repeated 4 times.
        let spread: [__m128i; 4] = std::array::from_fn(|w| {
            let c: [u8; 16] = std::array::from_fn(|i| (4 * w + i / 4) as u8);
            _mm_loadu_si128(c.as_ptr() as *const __m128i)
        });
        let mut acc = [_mm256_setzero_pd(); M];
        for (b, g) in group.iter().enumerate() {
            prefetch_record(g);
            // The scales transposed: `t[w]` holds, for `s = 4w .. 4w + 4`, the four rows'
            // scale `s` (one word each).
            let rows: [__m128i; 4] =
                std::array::from_fn(|r| _mm_loadu_si128(g.scales[r].as_ptr() as *const __m128i));
            let (a01, b01) = (
                _mm_unpacklo_epi8(rows[0], rows[1]),
                _mm_unpackhi_epi8(rows[0], rows[1]),
            );
            let (a23, b23) = (
                _mm_unpacklo_epi8(rows[2], rows[3]),
                _mm_unpackhi_epi8(rows[2], rows[3]),
            );
            let t = [
                _mm_unpacklo_epi16(a01, a23),
                _mm_unpackhi_epi16(a01, a23),
                _mm_unpacklo_epi16(b01, b23),
                _mm_unpackhi_epi16(b01, b23),
            ];
            // The four rows' scale `s` as i16, four lanes each.
            let scale = |s: usize| _mm256_cvtepi8_epi16(_mm_shuffle_epi8(t[s / 4], spread[s % 4]));
            let sc16: [__m256i; 4] = rows.map(|r| _mm256_cvtepi8_epi16(r));
            let dw = _mm256_cvtps_pd(f16x4(&g.d));
            // In bounds: every `xs[i].0` has `group.len()` blocks (the caller's contract).
            let a: [*const i8; M] = std::array::from_fn(|i| xs[i].0.get_unchecked(b).qs.as_ptr());
            // 16 values at a time for every activation row, so that the values and scales
            // are loaded once for all of them; the 16 values `s = k` and `s = k + 8` come
            // from the same loads of `ql` and `qh`, and are used as they are unpacked (the
            // super-block's 32 vectors of values would not stay in registers).
            let mut sum = [_mm256_setzero_si256(); M];
            for k in 0..QK_K / 32 {
                let ((v0, v2), (v1, v3)) = (values(g, 2 * k), values(g, 2 * k + 1));
                let (sc_a, sc_b) = (scale(k), scale(k + 8));
                for i in 0..M {
                    let (pa, pb) = (a[i].add(16 * k), a[i].add(16 * (k + 8)));
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(v0, bytes8(pa)),
                        _mm256_maddubs_epi16(v1, bytes8(pa.add(8))),
                    );
                    let q = _mm256_add_epi16(
                        _mm256_maddubs_epi16(v2, bytes8(pb)),
                        _mm256_maddubs_epi16(v3, bytes8(pb.add(8))),
                    );
                    sum[i] = if VNNI {
                        _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(sum[i], p, sc_a), q, sc_b)
                    } else {
                        _mm256_add_epi32(
                            sum[i],
                            _mm256_add_epi32(
                                _mm256_madd_epi16(p, sc_a),
                                _mm256_madd_epi16(q, sc_b),
                            ),
                        )
                    };
                }
            }
            for i in 0..M {
                let x = xs[i].0.get_unchecked(b);
                // Lanes [r0, r0, r1, r1 | r2, r2, r3, r3] -> [r0, r1, r2, r3].
                let h = _mm256_hadd_epi32(sum[i], sum[i]);
                let sums =
                    _mm_unpacklo_epi64(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                let bsums = _mm256_loadu_si256(x.bsums.as_ptr() as *const __m256i);
                let offsets = hsum4(sc16.map(|s| _mm256_madd_epi16(s, bsums)));
                let dots = _mm_sub_epi32(sums, _mm_slli_epi32(offsets, 5));
                let dd = _mm256_mul_pd(dw, _mm256_set1_pd(x.d as f64));
                // Not an FMA: the scalar rounds the product, then the sum.
                acc[i] = _mm256_add_pd(acc[i], _mm256_mul_pd(dd, _mm256_cvtepi32_pd(dots)));
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
        scales[(r + 3 * b) % 16] = if (r + b).is_multiple_of(2) { -128 } else { 127 };
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
    fn panels_are_the_unpacked_rows_f64_dot() {
        testing::panels_are_the_unpacked_rows_f64_dot(block);
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
    fn dequantize_is_candles() {
        let blocks: Vec<BlockQ6K> = (0..6).map(|b| block(3, b)).collect();
        testing::dequantize_is_candles::<_, candle_core::quantized::k_quants::BlockQ6K>(&blocks);
    }
}
