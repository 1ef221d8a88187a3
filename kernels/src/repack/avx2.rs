//! The AVX2 and AVX-512 VNNI kernels and helpers the repacked block types share.

use super::f64_step::f64_step8;
use super::Act8;
use std::arch::x86_64::*;

/// Bytes ahead of the group's current block that each step prefetches (measured for
/// Q4_0 on a Zen 3 core: 512 streamed 10-15 % faster than none, and than 1024).
pub const PREFETCH: usize = 512;

/// How far ahead the four-row kernels (`group_dot` here, Q8_0's, Q4_K's and Q5_K's, Q6_K's)
/// prefetch their one weight stream, in bytes, every cache line of each record. A decode
/// step reads each weight once from memory, one stream per thread; with the 512 bytes above
/// (eight lines) the loads waited on memory: on a Zen 5 core, one thread, 1 B Llama's
/// 5632 x 2048 at one activation row, 12 KiB ran Q8_0 1.54x (362 -> 236 µs), and the 1 B
/// Q8_0 decode at world 1 went from 23.8 to 31.3-31.6 tokens/s (`bench_repacked`,
/// `bench_generate`, 2026-11-28).
pub const STREAM_PREFETCH: usize = 12 << 10;

/// Prefetches every cache line of the record `G` at `g`, [`STREAM_PREFETCH`] bytes ahead.
///
/// # Safety
/// A hint only: no fault, even past the end of the weight.
#[inline(always)]
pub unsafe fn prefetch_record<G>(g: &G) {
    let at = (g as *const G as *const i8).wrapping_add(STREAM_PREFETCH);
    let mut line = 0;
    while line < std::mem::size_of::<G>() {
        // SAFETY: a prefetch is a hint; it never faults.
        unsafe { _mm_prefetch(at.wrapping_add(line), _MM_HINT_T0) };
        line += 64;
    }
}

/// Eight bytes of `p`, in each 64-bit lane.
#[inline(always)]
pub unsafe fn bytes8(p: *const i8) -> __m256i {
    _mm256_set1_epi64x(std::ptr::read_unaligned(p as *const i64))
}

/// A 32-wide block's 16 nibble bytes of four rows stored in runs of 8 (`runs[c][r]`:
/// row `r`'s bytes `8c .. 8c + 8`, whose low nibbles are values `8c ..` and high nibbles
/// values `16 + 8c ..`) as the runs of values `unsigned_group_dot` takes: vector `t` holds
/// values `8t .. 8t + 8` of rows 0, 1, 2, 3 in turn.
#[inline(always)]
pub unsafe fn nibble_runs(runs: &[[[u8; 8]; 4]; 2]) -> [__m256i; 4] {
    let low = _mm256_set1_epi8(0x0F);
    let v0 = _mm256_loadu_si256(runs[0].as_ptr() as *const __m256i);
    let v1 = _mm256_loadu_si256(runs[1].as_ptr() as *const __m256i);
    [
        _mm256_and_si256(v0, low),
        _mm256_and_si256(v1, low),
        _mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
        _mm256_and_si256(_mm256_srli_epi16(v1, 4), low),
    ]
}

/// The fifth bits of four rows (`qh[r]`: row `r`'s 32 bits, little-endian) as `0x10` bytes
/// in the runs of [`nibble_runs`]: vector `t` holds bits `8t .. 8t + 8` of each row.
#[inline(always)]
pub unsafe fn fifth_bit_runs(qh: &[[u8; 4]; 4]) -> [__m256i; 4] {
    let words = _mm256_broadcastsi128_si256(_mm_loadu_si128(qh.as_ptr() as *const __m128i));
    // Byte t of rows 0, 1 (low half) and 2, 3 (high half), eight times each.
    let control = |t: i8| {
        let (a, b) = (
            _mm_set1_epi64x(0x0101_0101_0101_0101 * t as i64),
            _mm_set1_epi64x(0x0101_0101_0101_0101 * (4 + t) as i64),
        );
        let lo = _mm_unpacklo_epi64(a, b);
        let hi = _mm_add_epi8(lo, _mm_set1_epi8(8));
        _mm256_set_m128i(hi, lo)
    };
    let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    std::array::from_fn(|t| {
        let bytes = _mm256_shuffle_epi8(words, control(t as i8));
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bits), bits);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    })
}

/// The four rows of `group` against `M` activation rows, for a type whose block `b` of
/// row `r` is `d·(u − o) + m` with unsigned byte values `u` (Q4_0: nibbles, `o` = 8, no
/// `m`; Q4_1: nibbles and `m`; Q5_0 / Q5_1: five bits): `unpack(g)` gives the four rows'
/// `u` in runs of 8 (vector `t`: values `8t .. 8t + 8` of rows 0, 1, 2, 3 in turn, as
/// [`nibble_runs`] makes them), their `d` and `m` (0 where the type has none) as f32;
/// `xs[i].1` holds `o·Σ q'` per activation block and `xs[i].2` its scales `[d', s']` in
/// f64. Per block and activation row: four `maddubs` of a run with the activations' same
/// 8 bytes (broadcast), added in i16 (each lane at most 4·2·31·128 = 31744 < 32767), one
/// `madd` by ones (two i32 lanes per row), one `hadd`: the four rows' `Σ u·q'`, minus
/// `o·Σ q'`, times `d'` and `d`, plus `m·s'` (every product exact in f64), rounded once
/// by an FMA and added to the row's f64 sum: bit for bit the types' scalar `block_dot`
/// added in block order (tested for each type). `HAS_M`: whether the type has `m` (Q4_1,
/// Q5_1); without it the FMA adds the product to the row's sum directly (the same single
/// rounding), and the `m·s'` work is skipped.
/// `VNNI`: the four `maddubs`, their additions and the `madd` become four `vpdpbusd`
/// into one i32 accumulator (the same integers: no saturation either way).
///
/// # Safety
/// The CPU must support avx2, fma and f16c, and with `VNNI` avx512vl and avx512vnni
/// (inline this into a function that enables them); every slice of `xs` has
/// `group.len()` entries.
#[inline(always)]
pub unsafe fn unsigned_group_dot<
    G,
    A: Act8,
    const M: usize,
    const HAS_M: bool,
    const VNNI: bool,
>(
    group: &[G],
    xs: [super::ActRow<'_, A>; M],
    unpack: impl Fn(&G) -> ([__m256i; 4], __m128, __m128),
) -> [[f64; 4]; M] {
    super::frame::realign_frame!();
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_pd(); M];
    for (b, g) in group.iter().enumerate() {
        prefetch_record(g);
        let (u, wd, wm) = unpack(g);
        // Shared by the activation rows: the weight scales in f64.
        let (wd, wm) = (_mm256_cvtps_pd(wd), _mm256_cvtps_pd(wm));
        for i in 0..M {
            let (x, offsets, scales) = xs[i];
            let x = x.get_unchecked(b);
            let [xd, xs] = *scales.get_unchecked(b);
            let a = x.qs().as_ptr();
            let h = if VNNI {
                let h = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u[0], bytes8(a));
                let h = _mm256_dpbusd_epi32(h, u[1], bytes8(a.add(8)));
                let h = _mm256_dpbusd_epi32(h, u[2], bytes8(a.add(16)));
                _mm256_dpbusd_epi32(h, u[3], bytes8(a.add(24)))
            } else {
                let p = _mm256_add_epi16(
                    _mm256_add_epi16(
                        _mm256_maddubs_epi16(u[0], bytes8(a)),
                        _mm256_maddubs_epi16(u[1], bytes8(a.add(8))),
                    ),
                    _mm256_add_epi16(
                        _mm256_maddubs_epi16(u[2], bytes8(a.add(16))),
                        _mm256_maddubs_epi16(u[3], bytes8(a.add(24))),
                    ),
                );
                _mm256_madd_epi16(p, ones)
            };
            // Lanes [r0, r0, r1, r1 | r2, r2, r3, r3] -> [r0, r1, r2, r3].
            let h = _mm256_hadd_epi32(h, h);
            let h = _mm_unpacklo_epi64(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            let sums = _mm_sub_epi32(h, _mm_set1_epi32(*offsets.get_unchecked(b)));
            // `Σ·d'`, then times `d` in the FMA: every product exact in f64.
            let sums = _mm256_mul_pd(_mm256_cvtepi32_pd(sums), _mm256_set1_pd(xd));
            acc[i] = if HAS_M {
                let ms = _mm256_mul_pd(wm, _mm256_set1_pd(xs));
                _mm256_add_pd(acc[i], _mm256_fmadd_pd(sums, wd, ms))
            } else {
                _mm256_fmadd_pd(sums, wd, acc[i])
            };
        }
    }
    let mut out = [[0f64; 4]; M];
    for i in 0..M {
        _mm256_storeu_pd(out[i].as_mut_ptr(), acc[i]);
    }
    out
}

/// [`unsigned_group_dot`] with AVX-512 VNNI for two groups at once (eight weight rows):
/// `unpack` gives each group's values in runs of 8 (two 32-bit words per row); one
/// `vpermd` and one 128-bit permute per run and group regroup them as the words
/// [`pair_dot_words`] takes.
///
/// # Safety
/// As [`pair_dot_words`].
#[inline(always)]
pub unsafe fn unsigned_pair_dot<G, A: Act8, const M: usize, const HAS_M: bool>(
    group0: &[G],
    group1: &[G],
    xs: &[super::ActRow<'_, A>; M],
    unpack: impl Fn(&G) -> ([__m256i; 4], __m128, __m128),
) -> [[f64; 8]; M] {
    super::frame::realign_frame!();
    // Each row's two words of a run, first words then second words.
    let order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    pair_dot_words::<_, _, M, HAS_M, PREFETCH, true>(group0, group1, xs, |g0, g1| {
        let (u0, wd0, wm0) = unpack(g0);
        let (u1, wd1, wm1) = unpack(g1);
        let mut w = [_mm256_setzero_si256(); 8];
        for t in 0..4 {
            let p0 = _mm256_permutevar8x32_epi32(u0[t], order);
            let p1 = _mm256_permutevar8x32_epi32(u1[t], order);
            w[2 * t] = _mm256_permute2x128_si256(p0, p1, 0x20);
            w[2 * t + 1] = _mm256_permute2x128_si256(p0, p1, 0x31);
        }
        (w, _mm256_set_m128(wd1, wd0), _mm256_set_m128(wm1, wm0))
    })
}

/// The kernel of two groups at once (eight weight rows) with AVX-512 VNNI, each row's
/// integer sum in one 32-bit lane, for a 32-wide type whose block `b` of row `r` is
/// `d·u + m` against activations that take `o·Σ q'` off (`xs[i].1`) and whose scales
/// `[d', s']` come as f64 (`xs[i].2`): `words(g0, g1)` gives a block's `w[j]`, values
/// `4j .. 4j + 4` of the eight rows (unsigned bytes), and the eight rows' `d` and `m`
/// (0 where the type has none) as f32. Per block and activation row: [`eight_row_sums`],
/// then the f64 step of [`unsigned_group_dot`] on eight lanes at once (the integer sum
/// times `d'` times `d` is exact in f64, as is `m·s'`, so an FMA into the row's sum
/// rounds once, as the scalar addition does): bit for bit the scalar sum (tested with
/// each type's blocks). `AHEAD`: the prefetch distance of each stream
/// ([`pair_prefetch`]). `UNROLL`: the activation rows written out one by one
/// (`unrolled!`), so that their accumulators stay in registers (Q4_0 at 64 rows on a
/// Zen 4 core: 0.8-0.93x the time of the loop), unless `words` itself needs the
/// registers (Q8_0's transpose: 1.02-1.05x).
///
/// # Safety
/// The CPU must support avx2, fma, f16c, avx512f, avx512vl and avx512vnni (inline this
/// into a function that enables them); both groups and every slice of `xs` have the same
/// length.
#[inline(always)]
pub unsafe fn pair_dot_words<
    G,
    A: Act8,
    const M: usize,
    const HAS_M: bool,
    const AHEAD: usize,
    const UNROLL: bool,
>(
    group0: &[G],
    group1: &[G],
    xs: &[super::ActRow<'_, A>; M],
    words: impl Fn(&G, &G) -> ([__m256i; 8], __m256, __m256),
) -> [[f64; 8]; M] {
    super::frame::realign_frame!();
    let mut acc = [_mm512_setzero_pd(); M];
    for b in 0..group0.len() {
        let (g0, g1) = (group0.get_unchecked(b), group1.get_unchecked(b));
        pair_prefetch::<_, AHEAD>(g0, g1, b, group0.len());
        let (w, wd, wm) = words(g0, g1);
        // Shared by the activation rows: the weight scales in f64.
        let (wd, wm) = (_mm512_cvtps_pd(wd), _mm512_cvtps_pd(wm));
        // One activation row: `acc[$i]` += its eight rows' block products. `Σ·d'`, then
        // times `d`: every product exact in f64 (|Σ| < 2^20, `d` and `d'` f16), so the FMA
        // rounds once, as the scalar `Σ · (d·d')` added to the sum does.
        macro_rules! row {
            ($i:expr) => {{
                let i = $i;
                let (x, offsets, scales) = xs[i];
                let x = x.get_unchecked(b);
                let [xd, xs] = *scales.get_unchecked(b);
                let sums = eight_row_sums(&w, x.qs(), *offsets.get_unchecked(b));
                acc[i] = f64_step8::<HAS_M>(acc[i], sums, _mm512_set1_pd(xd), wd, wm, xs);
            }};
        }
        if UNROLL {
            super::unrolled!(M, |i| { row!(i) });
        } else {
            for i in 0..M {
                row!(i);
            }
        }
    }
    let mut out = [[0f64; 8]; M];
    for i in 0..M {
        _mm512_storeu_pd(out[i].as_mut_ptr(), acc[i]);
    }
    out
}

/// Eight weight rows' integer sums against one activation block, in f64 lanes: `w[j]`
/// holds values `4j .. 4j + 4` of the eight rows (unsigned), `a` the activation's 32
/// signed values, `offset` what comes off each sum (`o·Σ q'`). Eight `vpdpbusd` with the
/// activations' word `j` broadcast, in two chains (the first started at `−offset`).
///
/// # Safety
/// The CPU must support avx2, avx512f, avx512vl and avx512vnni (inline this into a
/// function that enables them).
#[inline(always)]
pub unsafe fn eight_row_sums(w: &[__m256i; 8], a: &[i8; 32], offset: i32) -> __m512d {
    let a = a.as_ptr() as *const i32;
    let word = |j: usize| _mm256_set1_epi32(std::ptr::read_unaligned(a.add(j)));
    let mut h0 = _mm256_set1_epi32(-offset);
    let mut h1 = _mm256_setzero_si256();
    for j in (0..8).step_by(2) {
        h0 = _mm256_dpbusd_epi32(h0, w[j], word(j));
        h1 = _mm256_dpbusd_epi32(h1, w[j + 1], word(j + 1));
    }
    _mm512_cvtepi32_pd(_mm256_add_epi32(h0, h1))
}

/// Prefetch hints for block `b` of a pair of groups of `kb` blocks (`g0`, `g1`: their
/// blocks `b`): `AHEAD` bytes ahead in each group's stream; where that passes the end
/// of the first group (the second group's blocks, being read), ahead in the group after
/// the second one (the next pair's second group, which no stream reaches otherwise: a
/// pair of short rows, SmolLM2's 18 blocks, otherwise starts it on cache misses).
#[inline(always)]
pub unsafe fn pair_prefetch<G, const AHEAD: usize>(g0: &G, g1: &G, b: usize, kb: usize) {
    let size = std::mem::size_of::<G>();
    let group = kb * size;
    let first = if b * size + AHEAD < group {
        AHEAD
    } else {
        AHEAD + 2 * group
    };
    // Hints: no fault past the end of the weight.
    _mm_prefetch(
        (g0 as *const G as *const i8).wrapping_add(first),
        _MM_HINT_T0,
    );
    _mm_prefetch(
        (g1 as *const G as *const i8).wrapping_add(AHEAD),
        _MM_HINT_T0,
    );
}

/// Defines a 32-wide unsigned type's four group kernels on [`unsigned_group_dot`],
/// [`unsigned_pair_dot`] and [`super::avx512::unsigned_quad_dot`]: `group_dot` (AVX2),
/// `group_dot_vnni`, `pair_dot_vnni` and `quad_dot_vnni` (AVX-512 VNNI, one group, two or
/// four) and `quad_dot_amx` (AMX, four groups), for weight groups `$x4`,
/// activation blocks `$act`, `$has_m` as `HAS_M` and `$unpack` as `unpack`. All are
/// `unsafe`: the CPU must have their features, and every slice of `xs` has `group.len()`
/// blocks.
/// The items of a block type's `Interleave` impl that hand its four-row products to the
/// kernels its `avx2` module has, `group_dot` (AVX2) and `group_dot_vnni` (AVX-512 VNNI).
/// `$x4`: the type's record, `$act`: its activation block.
macro_rules! four_row_items {
    ($x4:ty, $act:ty) => {
        #[cfg(target_arch = "x86_64")]
        unsafe fn group_dot_avx2<const M: usize>(
            group: &[$x4],
            xs: [$crate::repack::ActRow<'_, $act>; M],
        ) -> [[f64; 4]; M] {
            avx2::group_dot(group, xs)
        }

        #[cfg(target_arch = "x86_64")]
        unsafe fn group_dot_avx512<const M: usize>(
            group: &[$x4],
            xs: [$crate::repack::ActRow<'_, $act>; M],
        ) -> [[f64; 4]; M] {
            avx2::group_dot_vnni(group, xs)
        }
    };
}
pub(crate) use four_row_items;

/// The items of a 32-wide type's `Interleave` impl that hand its products to the kernels
/// [`unsigned_kernels!`] (or the type's own, of the same names) wrote in its `avx2` module:
/// the four-row kernels with AVX2 and with VNNI, the quads and the pairs with AVX-512 VNNI,
/// the quads' tiles of eight with AMX.
/// `$x4`: the type's record, `$act`: its activation block.
macro_rules! unsigned_items {
    ($x4:ty, $act:ty) => {
        $crate::repack::avx2::four_row_items!($x4, $act);

        const QUAD: bool = true;

        #[cfg(target_arch = "x86_64")]
        unsafe fn group_quad_dot_avx512<const M: usize>(
            groups: [&[$x4]; 4],
            xs: &[$crate::repack::ActRow<'_, $act>; M],
        ) -> [[f64; 16]; M] {
            avx2::quad_dot_vnni(groups, xs)
        }

        const AMX: bool = true;

        #[cfg(target_arch = "x86_64")]
        unsafe fn group_quad_dot_amx<const EMULATE: bool>(
            groups: [&[$x4]; 4],
            xs: &[$crate::repack::ActRow<'_, $act>; 8],
        ) -> [[f64; 16]; 8] {
            avx2::quad_dot_amx::<EMULATE>(groups, xs)
        }

        #[cfg(target_arch = "x86_64")]
        unsafe fn group_pair_dot_avx512<const M: usize>(
            group0: &[$x4],
            group1: &[$x4],
            xs: &[$crate::repack::ActRow<'_, $act>; M],
        ) -> [[f64; 8]; M] {
            avx2::pair_dot_vnni(group0, group1, xs)
        }
    };
}
pub(crate) use unsigned_items;

macro_rules! unsigned_kernels {
    ($x4:ty, $act:ty, $has_m:expr, $unpack:expr) => {
        /// The AVX2 kernel (`unsigned_group_dot`).
        ///
        /// # Safety
        /// The CPU must support avx2, fma and f16c; every slice of `xs` has `group.len()`
        /// blocks.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn group_dot<const M: usize>(
            group: &[$x4],
            xs: [$crate::repack::ActRow<'_, $act>; M],
        ) -> [[f64; 4]; M] {
            $crate::repack::avx2::unsigned_group_dot::<_, _, M, { $has_m }, false>(
                group, xs, $unpack,
            )
        }

        /// The AVX-512 VNNI kernel (`unsigned_group_dot` with `vpdpbusd`).
        ///
        /// # Safety
        /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and
        /// avx512vnni; every slice of `xs` has `group.len()` blocks.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(super) unsafe fn group_dot_vnni<const M: usize>(
            group: &[$x4],
            xs: [$crate::repack::ActRow<'_, $act>; M],
        ) -> [[f64; 4]; M] {
            $crate::repack::avx2::unsigned_group_dot::<_, _, M, { $has_m }, true>(
                group, xs, $unpack,
            )
        }

        /// The 512-bit kernel for four groups (`unsigned_quad_dot`).
        ///
        /// # Safety
        /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and
        /// avx512vnni; the groups and every slice of `xs` have the same length.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(super) unsafe fn quad_dot_vnni<const M: usize>(
            groups: [&[$x4]; 4],
            xs: &[$crate::repack::ActRow<'_, $act>; M],
        ) -> [[f64; $crate::repack::avx512::QUAD_ROWS]; M] {
            $crate::repack::avx512::unsigned_quad_dot::<_, _, M, { $has_m }>(groups, xs, $unpack)
        }

        /// The AMX kernel for four groups and eight activation rows (`quad_dot_amx`).
        ///
        /// # Safety
        /// As `quad_dot_vnni`, and unless `EMULATE` (scalar tile products, for tests) the CPU
        /// must support amx-tile and amx-int8, granted to this process.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(super) unsafe fn quad_dot_amx<const EMULATE: bool>(
            groups: [&[$x4]; 4],
            xs: &[$crate::repack::ActRow<'_, $act>; 8],
        ) -> [[f64; $crate::repack::avx512::QUAD_ROWS]; 8] {
            $crate::repack::amx_quad::quad_dot_amx::<_, _, { $has_m }, EMULATE>(groups, xs, |g| {
                $crate::repack::avx512::unsigned_words::<$x4>(g, &$unpack)
            })
        }

        /// The AVX-512 VNNI kernel for two groups (`unsigned_pair_dot`).
        ///
        /// # Safety
        /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and
        /// avx512vnni; both groups and every slice of `xs` have the same length.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(super) unsafe fn pair_dot_vnni<const M: usize>(
            group0: &[$x4],
            group1: &[$x4],
            xs: &[$crate::repack::ActRow<'_, $act>; M],
        ) -> [[f64; 8]; M] {
            $crate::repack::avx2::unsigned_pair_dot::<_, _, M, { $has_m }>(
                group0, group1, xs, $unpack,
            )
        }
    };
}
pub(crate) use unsigned_kernels;

/// Four f16 values as f32.
#[inline(always)]
pub unsafe fn f16x4(v: &[half::f16; 4]) -> __m128 {
    _mm_cvtph_ps(_mm_loadl_epi64(v.as_ptr() as *const __m128i))
}
