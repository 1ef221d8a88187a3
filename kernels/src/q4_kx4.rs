//! Q4_K weights repacked four rows at a time ([`BlockQ4Kx4`], [`crate::repack`] says why),
//! and their AVX2 product with Q8_K activations summed in f64: what every Q4_K matmul of
//! candle-tp runs on the CPU (decode, prefill, row-parallel partials).
//!
//! Per super-block of 256 values and row, two integers, as [`crate::q4_k`] computes them:
//! `Σ_j sc_j Σ q·q'` (the nibbles times the activation bytes by `maddubs`, each 32-value
//! sub-block scaled by its 6-bit scale in `madd`) and `Σ_j mn_j · bsums_j` (the minimums times
//! the activations' sums of 16, one `madd`). The scales and minimums, unpacked to a byte each
//! when the weight is repacked, are spread once per group for every activation row; the four
//! rows' integers are reduced together and combined with `d`, `dmin` and `d'` in f64 in the
//! scalar order: every value is bit for bit [`crate::f64_dot::dot_f64`] of the unpacked row
//! (tested).

use crate::q4_k::BlockQ4K;
use crate::q8_k::{BlockQ8K, QK_K};
use crate::repack::{put_runs, repack_bytes, take_runs, Interleave, Repacked, RepackedMatMul};
use candle_core::Result;
use half::f16;
use std::sync::Arc;

/// Four Q4_K super-blocks of four consecutive rows (the same block index), interleaved: row
/// `r`'s block is `d[r]`, `dmin[r]` (as in [`BlockQ4K`]), its scales `sc[r]` and minimums
/// `mn[r]` unpacked to a byte each (16 bytes for GGUF's 12: the kernel's scalar unpacking cost
/// 10-15 % of a decode, the 16 bytes 2.8 % more to read), and its 128 bytes of nibbles in runs
/// of 8, `qs[t][r]` holding its bytes `8t .. 8t + 8`, so that one 32-byte load holds the same
/// 8 bytes of the four rows. 592 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ4Kx4 {
    /// The rows' super-scales of the scales.
    pub d: [f16; 4],
    /// The rows' super-scales of the minimums.
    pub dmin: [f16; 4],
    /// The rows' eight 6-bit scales, unpacked from GGUF's 12 bytes (one byte each).
    pub sc: [[u8; 8]; 4],
    /// The rows' eight 6-bit minimums, unpacked likewise.
    pub mn: [[u8; 8]; 4],
    /// The rows' packed 4-bit values, 8 bytes of each row in turn.
    pub qs: [[[u8; 8]; 4]; QK_K / 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ4Kx4>() == 592);

impl BlockQ4Kx4 {
    /// Four all-zero blocks (the padding rows of a last, partial group).
    pub const ZERO: Self = Self {
        d: [f16::ZERO; 4],
        dmin: [f16::ZERO; 4],
        sc: [[0; 8]; 4],
        mn: [[0; 8]; 4],
        qs: [[[0; 8]; 4]; QK_K / 16],
    };
}

/// A repacked Q4_K weight ([`Repacked`] of [`BlockQ4K`]).
pub type RepackedQ4K = Repacked<BlockQ4K>;

/// [`crate::repack::repack_bytes`] for Q4_K, instantiated in this crate so that the kernel
/// and its driver are compiled with its optimisations in every profile (a generic
/// instantiated in candle-tp's debug build, what its tests run, would be unoptimised).
pub fn repack(bytes: &[u8], n: usize, k: usize) -> Result<Arc<dyn RepackedMatMul>> {
    repack_bytes::<BlockQ4K>(bytes, n, k)
}

/// The eight 6-bit scales and the eight 6-bit minimums packed in `q` (ggml's
/// `get_scale_min_k4` for `j = 0..8`), as two little-endian words of eight bytes.
#[inline(always)]
pub(crate) fn scales_mins(q: &[u8; 12]) -> (u64, u64) {
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (w0, w1, w2) = (word(0), word(1), word(2));
    let scales = (w0 & LOW6) as u64 | (((w2 & LOW4) | (((w0 >> 6) & LOW2) << 4)) as u64) << 32;
    let mins = (w1 & LOW6) as u64 | ((((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4)) as u64) << 32;
    (scales, mins)
}

/// The inverse of [`scales_mins`]: eight 6-bit scales and minimums (a byte each) packed into
/// GGUF's 12 bytes.
pub(crate) fn pack_scales_mins(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
    std::array::from_fn(|i| match i {
        0..=3 => (sc[i] & 63) | ((sc[i + 4] >> 4) << 6),
        4..=7 => (mn[i - 4] & 63) | ((mn[i] >> 4) << 6),
        _ => (sc[i - 4] & 0xF) | ((mn[i - 4] & 0xF) << 4),
    })
}

impl Interleave for BlockQ4K {
    type X4 = BlockQ4Kx4;
    const X4_ZERO: BlockQ4Kx4 = BlockQ4Kx4::ZERO;
    const TILE_8: bool = true;

    fn set_row(x4: &mut BlockQ4Kx4, r: usize, block: &Self) {
        x4.d[r] = block.d;
        x4.dmin[r] = block.dmin;
        let (sc, mn) = scales_mins(&block.scales);
        (x4.sc[r], x4.mn[r]) = (sc.to_le_bytes(), mn.to_le_bytes());
        put_runs(&mut x4.qs, r, &block.qs);
    }

    fn row(x4: &BlockQ4Kx4, r: usize) -> Self {
        BlockQ4K {
            d: x4.d[r],
            dmin: x4.dmin[r],
            scales: pack_scales_mins(x4.sc[r], x4.mn[r]),
            qs: take_runs(&x4.qs, r),
        }
    }

    fn dequantize(block: &Self, out: &mut [f32]) {
        // candle's `BlockQ4K::to_float`, operation for operation.
        let (d, min) = (block.d.to_f32(), block.dmin.to_f32());
        let (scales, mins) = scales_mins(&block.scales);
        let (sc, mn) = (scales.to_le_bytes(), mins.to_le_bytes());
        for j in 0..QK_K / 64 {
            let q = &block.qs[32 * j..32 * j + 32];
            let out = &mut out[64 * j..64 * j + 64];
            let (d1, m1) = (d * sc[2 * j] as f32, min * mn[2 * j] as f32);
            let (d2, m2) = (d * sc[2 * j + 1] as f32, min * mn[2 * j + 1] as f32);
            for (l, &q) in q.iter().enumerate() {
                out[l] = d1 * (q & 0xF) as f32 - m1;
                out[32 + l] = d2 * (q >> 4) as f32 - m2;
            }
        }
    }

    crate::repack::avx2::four_row_items!(BlockQ4Kx4, BlockQ8K);

    crate::q4_kx4::k4_avx512_items!(BlockQ4Kx4);
}

/// The AVX-512 items of the `Interleave` impl of a type laid out as Q4_K's (`$x4`: Q4_K,
/// Q5_K): panels on (its module's `avx2::unpack_panel`, sub-blocks of 32 values with
/// minimums), and quads on ([`crate::repack::k_quad`]).
macro_rules! k4_avx512_items {
    ($x4:ty) => {
        const PANEL: bool = true;
        const QUAD: bool = true;
        // One activation row streams its weight faster as one sequence of four-row records
        // than as four (Zen 5, one thread, Q4_K 5632 x 2048: 170 against 220-254 µs).
        const QUAD_SINGLE: bool = false;

        #[cfg(target_arch = "x86_64")]
        unsafe fn group_quad_dot_avx512<const M: usize>(
            groups: [&[$x4]; 4],
            xs: &[$crate::repack::ActRow<'_, $crate::q8_k::BlockQ8K>; M],
        ) -> [[f64; 16]; M] {
            $crate::repack::k_quad::k4_quad_dot_vnni(groups, xs)
        }

        #[cfg(target_arch = "x86_64")]
        unsafe fn unpack_panel_avx512(
            groups: [&$x4; 4],
            out: &mut $crate::repack::panel::PanelBlock,
        ) {
            avx2::unpack_panel(groups, out)
        }

        #[cfg(target_arch = "x86_64")]
        unsafe fn panel_dot_avx512<const ENGINE: u8>(
            panel: &[$crate::repack::panel::PanelBlock],
            xs: &[$crate::repack::ActRow<'_, $crate::q8_k::BlockQ8K>; $crate::repack::panel::TILE],
        ) -> [[f64; $crate::repack::panel::ROWS]; $crate::repack::panel::TILE] {
            $crate::repack::panel::dot::<32, true, ENGINE>(panel, xs.map(|x| x.0))
        }
    };
}
pub(crate) use k4_avx512_items;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::BlockQ4Kx4;
    use crate::q8_k::BlockQ8K;
    use crate::repack::avx2::{f16x4, prefetch_record};
    use crate::repack::avx512::join32;
    pub(crate) use crate::repack::k_quad::K4Group;
    use crate::repack::panel::{pair, put_run, PanelBlock};
    use half::f16;
    use std::arch::x86_64::*;

    impl K4Group for BlockQ4Kx4 {
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
        #[inline(always)]
        unsafe fn values(&self, j: usize) -> ([__m256i; 4], [__m256i; 4]) {
            let low = _mm256_set1_epi8(0x0F);
            let q: [__m256i; 4] = std::array::from_fn(|c| {
                _mm256_loadu_si256(self.qs[4 * j + c].as_ptr() as *const __m256i)
            });
            (
                q.map(|q| _mm256_and_si256(q, low)),
                q.map(|q| _mm256_and_si256(_mm256_srli_epi16(q, 4), low)),
            )
        }
        #[inline(always)]
        unsafe fn values_pair(a: &Self, b: &Self, j: usize) -> ([__m512i; 4], [__m512i; 4]) {
            let low = _mm512_set1_epi8(0x0F);
            let (mut lo, mut hi) = ([_mm512_setzero_si512(); 4], [_mm512_setzero_si512(); 4]);
            for c in 0..4 {
                let q = join32(&a.qs[4 * j + c], &b.qs[4 * j + c]);
                lo[c] = _mm512_and_si512(q, low);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16::<4>(q), low);
            }
            (lo, hi)
        }
        #[inline(always)]
        unsafe fn values_wide(&self, j: usize) -> ([__m512i; 2], [__m512i; 2]) {
            let low = _mm512_set1_epi8(0x0F);
            let (mut lo, mut hi) = ([_mm512_setzero_si512(); 2], [_mm512_setzero_si512(); 2]);
            for p in 0..2 {
                let q = _mm512_loadu_si512(self.qs[4 * j + 2 * p].as_ptr() as *const _);
                lo[p] = _mm512_and_si512(q, low);
                hi[p] = _mm512_and_si512(_mm512_srli_epi16::<4>(q), low);
            }
            (lo, hi)
        }
    }

    /// One block of four groups (sixteen rows) of a type laid out as Q4_K's, as a panel's
    /// block: the values four by four, the scales widened to i32, each minimum twice in a pair
    /// of i16 (sub-block `j`'s minimum multiplies the sums of 16 `bsums[2j]` and
    /// `bsums[2j + 1]`).
    ///
    /// # Safety
    /// The CPU must support avx2 (inline this into a function that enables it).
    #[inline(always)]
    pub(crate) unsafe fn k4_unpack_panel<G: K4Group>(groups: [&G; 4], out: &mut PanelBlock) {
        for (i, g) in groups.into_iter().enumerate() {
            for j in 0..4 {
                let (lo, hi) = g.values(j);
                for c in 0..4 {
                    put_run(out, i, 8 * j + c, lo[c]);
                    put_run(out, i, 8 * j + 4 + c, hi[c]);
                }
            }
            for r in 0..4 {
                let row = 4 * i + r;
                out.d[row] = g.d()[r].to_f64();
                out.dmin[row] = g.dmin()[r].to_f64();
                for s in 0..8 {
                    out.sc[s][row] = g.sc()[r][s] as i32;
                    let mn = g.mn()[r][s] as i16;
                    out.off[s][row] = pair(mn, mn);
                }
            }
        }
    }

    /// Q4_K's [`k4_unpack_panel`].
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn unpack_panel(groups: [&BlockQ4Kx4; 4], out: &mut PanelBlock) {
        k4_unpack_panel(groups, out)
    }

    /// `shuffle_epi8` controls: sub-block `s`'s scale of rows `0, 1` (`2, 3` in the high half),
    /// from eight bytes per row, in lanes of `lane` bytes (its low byte; the others zero):
    /// four i16 each (`lane` = 2, for `madd`) or two i32 (`lane` = 4, `vpdpbusd`'s sums).
    const fn scale_control(s: u8, lane: usize) -> [i8; 32] {
        let mut c = [0i8; 32];
        let mut i = 0;
        while i < 32 {
            let row = (i % 16) / 8; // row within the 128-bit half
            c[i] = if i % lane == 0 {
                (8 * row as u8 + s) as i8
            } else {
                -128
            };
            i += 1;
        }
        c
    }

    /// [`scale_control`] of the eight sub-blocks, in lanes of `lane` bytes.
    const fn controls(lane: usize) -> [[i8; 32]; 8] {
        let mut c = [[0i8; 32]; 8];
        let mut s = 0;
        while s < 8 {
            c[s] = scale_control(s as u8, lane);
            s += 1;
        }
        c
    }
    const CONTROLS: [[i8; 32]; 8] = controls(2);
    const CONTROLS_32: [[i8; 32]; 8] = controls(4);

    /// Eight bytes of `p`, in each 64-bit lane.
    #[inline(always)]
    unsafe fn bytes8(p: *const i8) -> __m256i {
        _mm256_set1_epi64x(std::ptr::read_unaligned(p as *const i64))
    }

    /// Q4_K's kernel.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every slice of `xs` has `group.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group_dot<const M: usize>(
        group: &[BlockQ4Kx4],
        xs: [crate::repack::ActRow<'_, BlockQ8K>; M],
    ) -> [[f64; 4]; M] {
        k4_group_dot::<_, M, false>(group, xs)
    }

    /// Q4_K's kernel with `vpdpbusd` ([`k4_group_dot`]'s `VNNI`).
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni;
    /// every slice of `xs` has `group.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn group_dot_vnni<const M: usize>(
        group: &[BlockQ4Kx4],
        xs: [crate::repack::ActRow<'_, BlockQ8K>; M],
    ) -> [[f64; 4]; M] {
        k4_group_dot::<_, M, true>(group, xs)
    }

    /// The four rows of `group` against `M` activation rows, for a type laid out as Q4_K's
    /// ([`K4Group`]; values of at most `vmax` = 15 for Q4_K, 31 for Q5_K). Per super-block:
    /// the four rows' scales spread once, as i16 per row and sub-block (`shuffle_epi8`), and
    /// minimums. Per activation row and sub-block, four `maddubs` of 8 values of each row
    /// (one vector) with the activations' same 8 bytes (broadcast) added in i16 (each lane at
    /// most 4·2·vmax·128: 15360 or 31744 < 32767, no overflow), then one `madd` with the
    /// rows' scales (two i32 lanes per row); the minimums times the activations' sums of 32
    /// in one `madd` per two rows. Then `d'·(d·dots − dmin·mins)` in f64, both products
    /// exact, as the scalar `combine` rounds it: bit for bit the types' scalar `block_dot`
    /// added in block order (tested for each type). `VNNI`: per sub-block four `vpdpbusd`
    /// into i32 (two lanes per row, as the `madd` leaves them) times the rows' scales as i32
    /// (`mullo`): the same integers (a sub-block's sum times its scale is below
    /// 32·31·128·63 < 2^31).
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c, and with `VNNI` avx512vl and avx512vnni
    /// (inline this into a function that enables them); every slice of `xs` has
    /// `group.len()` blocks.
    #[inline(always)]
    pub(crate) unsafe fn k4_group_dot<G: K4Group, const M: usize, const VNNI: bool>(
        group: &[G],
        xs: [crate::repack::ActRow<'_, BlockQ8K>; M],
    ) -> [[f64; 4]; M] {
        crate::repack::frame::realign_frame!();
        let mut acc = [_mm256_setzero_pd(); M];
        for (b, g) in group.iter().enumerate() {
            // Every line of the record, `STREAM_PREFETCH` bytes ahead (before, one line 512
            // bytes ahead at 1-4 rows, every line at 8).
            prefetch_record(g);
            let scales = _mm256_loadu_si256(g.sc().as_ptr() as *const __m256i);
            let mins = g.mn().as_ptr() as *const __m128i;
            let mins01 = _mm256_cvtepu8_epi16(_mm_loadu_si128(mins));
            let mins23 = _mm256_cvtepu8_epi16(_mm_loadu_si128(mins.add(1)));
            let wd = _mm256_cvtps_pd(f16x4(g.d()));
            let wmin = _mm256_cvtps_pd(f16x4(g.dmin()));
            let mut dots = [_mm256_setzero_si256(); M];
            // One activation row (decode) with VNNI: two runs to a zmm (measured on a Zen 5
            // core, Q4_K 5632 x 2048: 151-158 against 161-173 µs).
            let wide = VNNI && M == 1;
            if wide {
                dots[0] =
                    crate::repack::k_quad::k4_row_dots(g, xs[0].0.get_unchecked(b).qs.as_ptr());
            } else {
                for j in 0..4 {
                    let sc = |s: usize| {
                        let c = _mm256_loadu_si256(CONTROLS[s].as_ptr() as *const __m256i);
                        _mm256_shuffle_epi8(scales, c)
                    };
                    let (lo, hi) = g.values(j);
                    if VNNI {
                        let sc = |s: usize| {
                            let c = _mm256_loadu_si256(CONTROLS_32[s].as_ptr() as *const __m256i);
                            _mm256_shuffle_epi8(scales, c)
                        };
                        let (sc_lo, sc_hi) = (sc(2 * j), sc(2 * j + 1));
                        for i in 0..M {
                            let a = xs[i].0.get_unchecked(b).qs.as_ptr().add(64 * j);
                            let dot = |v: &[__m256i; 4], a: *const i8| {
                                let h =
                                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), v[0], bytes8(a));
                                let h = _mm256_dpbusd_epi32(h, v[1], bytes8(a.add(8)));
                                let h = _mm256_dpbusd_epi32(h, v[2], bytes8(a.add(16)));
                                _mm256_dpbusd_epi32(h, v[3], bytes8(a.add(24)))
                            };
                            let s_lo = _mm256_mullo_epi32(dot(&lo, a), sc_lo);
                            let s_hi = _mm256_mullo_epi32(dot(&hi, a.add(32)), sc_hi);
                            dots[i] = _mm256_add_epi32(dots[i], _mm256_add_epi32(s_lo, s_hi));
                        }
                        continue;
                    }
                    let (sc_lo, sc_hi) = (sc(2 * j), sc(2 * j + 1));
                    for i in 0..M {
                        let a = xs[i].0.get_unchecked(b).qs.as_ptr().add(64 * j);
                        let half = |v: &[__m256i; 4], a: *const i8| {
                            let p0 = _mm256_maddubs_epi16(v[0], bytes8(a));
                            let p1 = _mm256_maddubs_epi16(v[1], bytes8(a.add(8)));
                            let p2 = _mm256_maddubs_epi16(v[2], bytes8(a.add(16)));
                            let p3 = _mm256_maddubs_epi16(v[3], bytes8(a.add(24)));
                            _mm256_add_epi16(_mm256_add_epi16(p0, p1), _mm256_add_epi16(p2, p3))
                        };
                        let s_lo = _mm256_madd_epi16(half(&lo, a), sc_lo);
                        let s_hi = _mm256_madd_epi16(half(&hi, a.add(32)), sc_hi);
                        dots[i] = _mm256_add_epi32(dots[i], _mm256_add_epi32(s_lo, s_hi));
                    }
                }
            }
            for i in 0..M {
                let x = xs[i].0.get_unchecked(b);
                // Lanes [r0, r0, r1, r1 | r2, r2, r3, r3] -> [r0, r1, r2, r3].
                let h = _mm256_hadd_epi32(dots[i], dots[i]);
                let d =
                    _mm_unpacklo_epi64(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                // The activations' sums of 32 values, in both halves.
                let bsums = _mm256_loadu_si256(x.bsums.as_ptr() as *const __m256i);
                let pairs =
                    _mm256_permute4x64_epi64(_mm256_hadd_epi16(bsums, bsums), 0b10_00_10_00);
                // [r0 ×4 | r1 ×4] and [r2 ×4 | r3 ×4] -> [r0, r2, r0, r2 | r1, r3, r1, r3].
                let h = _mm256_hadd_epi32(
                    _mm256_madd_epi16(mins01, pairs),
                    _mm256_madd_epi16(mins23, pairs),
                );
                let h = _mm256_hadd_epi32(h, h);
                let m =
                    _mm_unpacklo_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                let t = _mm256_sub_pd(
                    _mm256_mul_pd(wd, _mm256_cvtepi32_pd(d)),
                    _mm256_mul_pd(wmin, _mm256_cvtepi32_pd(m)),
                );
                let block = _mm256_mul_pd(_mm256_set1_pd(x.d as f64), t);
                acc[i] = _mm256_add_pd(acc[i], block);
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
pub(crate) mod tests {
    use super::*;
    use crate::f64_dot::testing::{pseudo, pseudo_bytes};
    use crate::repack::testing;

    /// Block `b` of row `r`: every nibble and 6-bit pattern, minimums' scales of both signs.
    fn block(r: usize, b: usize) -> BlockQ4K {
        let i = r * 97 + b;
        BlockQ4K {
            d: f16::from_f32(0.002 + 0.001 * pseudo(i)),
            dmin: f16::from_f32(0.003 * pseudo(i + 7)),
            scales: pseudo_bytes(i + 11),
            qs: pseudo_bytes(i + 5000),
        }
    }

    /// ggml's `get_scale_min_k4`, written from the format's description.
    pub(crate) fn scale_min(j: usize, q: &[u8; 12]) -> (u8, u8) {
        if j < 4 {
            (q[j] & 63, q[j + 4] & 63)
        } else {
            (
                (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
                (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
            )
        }
    }

    #[test]
    fn scales_and_minimums_pack_back_to_the_same_bytes() {
        for i in 0..2000 {
            let q: [u8; 12] = pseudo_bytes(i);
            let (sc, mn) = scales_mins(&q);
            assert_eq!(pack_scales_mins(sc.to_le_bytes(), mn.to_le_bytes()), q);
        }
    }

    #[test]
    fn scales_and_minimums_unpack_as_ggml_reads_them() {
        for i in 0..2000 {
            let q: [u8; 12] = pseudo_bytes(i);
            let (sc, mn) = scales_mins(&q);
            for j in 0..8 {
                let want = scale_min(j, &q);
                assert_eq!(
                    (sc.to_le_bytes()[j], mn.to_le_bytes()[j]),
                    want,
                    "{q:?} {j}"
                );
            }
        }
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
                    let (sc, mn) = scale_min(p / 32, &b.scales);
                    let byte = b.qs[p / 64 * 32 + p % 32];
                    let q = if p % 64 < 32 { byte & 15 } else { byte >> 4 };
                    d * sc as f32 * q as f32 - dmin * mn as f32
                })
                .collect()
        });
    }

    #[test]
    fn dequantize_is_candles() {
        let blocks: Vec<BlockQ4K> = (0..6).map(|b| block(3, b)).collect();
        testing::dequantize_is_candles::<_, candle_core::quantized::k_quants::BlockQ4K>(&blocks);
    }

    #[test]
    fn nan_activations_give_nan_and_bad_sizes_are_errors() {
        testing::nan_activations_give_nan_and_bad_sizes_are_errors(block);
    }

    #[test]
    fn prepared_activations_serve_every_weight() {
        testing::prepared_activations_serve_every_weight(block);
    }
}
