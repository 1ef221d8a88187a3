//! [`Interleave`]: what a block type provides to be repacked four rows at a time (its
//! interleaved record, its kernels), and the runs of 8 bytes per row that the 32-wide types'
//! records use.

use super::panel;
use crate::f64_dot::F64Dot;

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::q4_0::BlockQ4_0 {}
    impl Sealed for crate::q4_1::BlockQ4_1 {}
    impl Sealed for crate::q5_0::BlockQ5_0 {}
    impl Sealed for crate::q5_1::BlockQ5_1 {}
    impl Sealed for crate::q8_0::BlockQ8_0 {}
    impl Sealed for crate::q4_k::BlockQ4K {}
    impl Sealed for crate::q5_k::BlockQ5K {}
    impl Sealed for crate::q6_k::BlockQ6K {}
}

/// One activation row as the group kernels read it: its blocks, their
/// [`Interleave::act_sum`]s and their [`Interleave::act_scales`].
#[doc(hidden)]
pub type ActRow<'a, A> = (&'a [A], &'a [i32], &'a [[f64; 2]]);

/// A block type whose weights the crate repacks four rows at a time (implemented for Q4_0,
/// Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks; sealed).
pub trait Interleave: F64Dot + sealed::Sealed {
    /// Block `b` of four consecutive rows, interleaved.
    type X4: Copy + Send + Sync + std::fmt::Debug + 'static;
    /// Four all-zero blocks (the padding rows of a last, partial group).
    const X4_ZERO: Self::X4;

    /// Whether products of 8+ activation rows run tiles of 8 rather than 4 (the k-quants,
    /// whose kernels unpack a super-block once per tile: measured on a Zen 3 core at 64
    /// activation rows, Q6_K 1.26x and Q4_K 1.15x faster; Q4_0 0.88x, so not for the 32-wide
    /// types; with [`crate::kernel::Kernel::Avx512Vnni`] every type runs tiles of 8, its 32 registers
    /// holding them).
    const TILE_8: bool = false;

    /// Puts `block` as row `r` (0..4) of `x4`.
    fn set_row(x4: &mut Self::X4, r: usize, block: &Self);

    /// Row `r`'s block, as GGUF stores it.
    fn row(x4: &Self::X4, r: usize) -> Self;

    /// The block's `BLOCK` values, as candle dequantizes them.
    fn dequantize(block: &Self, out: &mut [f32]);

    /// What the AVX2 kernel wants precomputed per activation block, once for all weight rows
    /// (Q4_0: `8 · Σ q'`); 0 where it wants nothing.
    fn act_sum(_x: &Self::Act) -> i32 {
        0
    }

    /// What the 32-wide types' kernels want precomputed per activation block, once for all
    /// weight rows: its scales `[d', s']` as f64 (`s'` 0 where the block has none), so that
    /// each use is a broadcast from memory rather than an f16 conversion; zeros where the
    /// kernels want nothing (the k-quants).
    fn act_scales(_x: &Self::Act) -> [f64; 2] {
        [0.0; 2]
    }

    /// The four rows of `group` against `M` activation rows (`xs[i]`: the blocks, their
    /// [`Interleave::act_sum`]s and [`Interleave::act_scales`]): `out[i][r]`, bit for bit the
    /// scalar f64 sum.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every slice of `xs` has `group.len()` entries.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn group_dot_avx2<const M: usize>(
        group: &[Self::X4],
        xs: [ActRow<'_, Self::Act>; M],
    ) -> [[f64; 4]; M];

    /// [`Interleave::group_dot_avx2`] with AVX-512 VNNI, bit for bit the same; by default
    /// the AVX2 kernel itself.
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni;
    /// every slice of `xs` has `group.len()` entries.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn group_dot_avx512<const M: usize>(
        group: &[Self::X4],
        xs: [ActRow<'_, Self::Act>; M],
    ) -> [[f64; 4]; M] {
        Self::group_dot_avx2(group, xs)
    }

    /// Whether products of [`panel::MIN_ROWS`]+ activation rows with AVX-512 VNNI unpack
    /// sixteen weight rows at a time into a [`panel`] and run
    /// [`Interleave::panel_dot_avx512`] (the k-quants).
    #[doc(hidden)]
    const PANEL: bool = false;

    /// Block `b` of four groups (sixteen rows: `groups[0]`'s four first) unpacked into `out`
    /// ([`panel::PanelBlock`]). Only called where [`Interleave::PANEL`] is set.
    ///
    /// # Safety
    /// As [`Interleave::group_dot_avx512`].
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn unpack_panel_avx512(_groups: [&Self::X4; 4], _out: &mut panel::PanelBlock) {
        unreachable!("{} has no panel kernel", Self::NAME)
    }

    /// The sixteen rows of `panel` ([`Interleave::unpack_panel_avx512`]) against eight
    /// activation rows with AVX-512 VNNI, its sub-block sums made by `ENGINE`
    /// ([`panel::VNNI`], [`panel::AMX`] or [`panel::AMX_EMULATED`]): `out[t][r]`, bit for
    /// bit the scalar f64 sum. Only called where [`Interleave::PANEL`] is set.
    ///
    /// # Safety
    /// As [`Interleave::group_dot_avx512`], and for [`panel::AMX`] the CPU must support
    /// amx-tile and amx-int8, granted to this process; every slice of `xs` has `panel.len()`
    /// blocks.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn panel_dot_avx512<const ENGINE: u8>(
        _panel: &[panel::PanelBlock],
        _xs: &[ActRow<'_, Self::Act>; panel::TILE],
    ) -> [[f64; panel::ROWS]; panel::TILE] {
        unreachable!("{} has no panel kernel", Self::NAME)
    }

    /// Whether products with AVX-512 VNNI run the activation rows left over from tiles of 8
    /// (decode's one row, tiles of 4, the last 1-3 rows) on four groups at once
    /// ([`Interleave::group_quad_dot_avx512`]: the 32-wide types, and Q4_K and Q5_K below
    /// [`panel::MIN_ROWS`] rows).
    #[doc(hidden)]
    const QUAD: bool = false;

    /// Whether a single activation row left over (decode) runs on the quads too, where
    /// [`Interleave::QUAD`] is set.
    #[doc(hidden)]
    const QUAD_SINGLE: bool = true;

    /// Four groups (sixteen rows: `groups[0]`'s four first) against `M` activation rows with
    /// 512-bit VNNI: `out[i][r]`, bit for bit the scalar f64 sum. Only called where
    /// [`Interleave::QUAD`] is set.
    ///
    /// # Safety
    /// As [`Interleave::group_dot_avx512`]; the groups have as many blocks as every slice of
    /// `xs`.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn group_quad_dot_avx512<const M: usize>(
        _groups: [&[Self::X4]; 4],
        _xs: &[ActRow<'_, Self::Act>; M],
    ) -> [[f64; 16]; M] {
        unreachable!("{} has no four-group kernel", Self::NAME)
    }

    /// Whether products with [`crate::kernel::Kernel::Amx`] run their tiles of eight
    /// activation rows on four groups at once with AMX tiles
    /// ([`Interleave::group_quad_dot_amx`]: the 32-wide types).
    #[doc(hidden)]
    const AMX: bool = false;

    /// [`Interleave::group_quad_dot_avx512`] of a tile of eight activation rows with AMX-INT8,
    /// bit for bit the same. Only called where [`Interleave::AMX`] is set. `EMULATE`: the
    /// tile product computed by scalar code instead, around the same layouts (for the tests
    /// of hosts without AMX).
    ///
    /// # Safety
    /// As [`Interleave::group_quad_dot_avx512`], and unless `EMULATE`, the CPU must support
    /// amx-tile and amx-int8, granted to this process by the OS
    /// ([`crate::kernel::Kernel::Amx`]).
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn group_quad_dot_amx<const EMULATE: bool>(
        _groups: [&[Self::X4]; 4],
        _xs: &[ActRow<'_, Self::Act>; 8],
    ) -> [[f64; 16]; 8] {
        unreachable!("{} has no AMX kernel", Self::NAME)
    }

    /// Two groups (eight rows: `group0`'s four, then `group1`'s) against `M` activation rows
    /// (`xs[i]` as for [`Interleave::group_dot_avx2`]) with AVX-512 VNNI: `out[i][r]`, bit for bit the scalar f64 sum. By default the two
    /// groups' [`Interleave::group_dot_avx512`]; the 32-wide unsigned types put each of the
    /// eight rows' sums in one lane, so that the per-block scaling in f64 is one 512-bit
    /// step for eight rows instead of two 256-bit steps and two horizontal reductions.
    ///
    /// # Safety
    /// As [`Interleave::group_dot_avx512`]; both groups have as many blocks as every slice
    /// of `xs`.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn group_pair_dot_avx512<const M: usize>(
        group0: &[Self::X4],
        group1: &[Self::X4],
        xs: &[ActRow<'_, Self::Act>; M],
    ) -> [[f64; 8]; M] {
        let xs = *xs;
        let (a, b) = (
            Self::group_dot_avx512(group0, xs),
            Self::group_dot_avx512(group1, xs),
        );
        std::array::from_fn(|i| std::array::from_fn(|r| if r < 4 { a[i][r] } else { b[i][r - 4] }))
    }
}

/// Puts row `r`'s bytes into `runs` of 8 bytes per row (`runs[c][r]` = `bytes[8c .. 8c + 8]`),
/// the layout in which one 32-byte load holds the same 8 bytes of four rows.
pub(crate) fn put_runs<const C: usize>(runs: &mut [[[u8; 8]; 4]; C], r: usize, bytes: &[u8]) {
    for (c, run) in bytes.chunks_exact(8).enumerate() {
        runs[c][r].copy_from_slice(run);
    }
}

/// Row `r`'s bytes back from `runs` ([`put_runs`]).
pub(crate) fn take_runs<const C: usize, const N: usize>(
    runs: &[[[u8; 8]; 4]; C],
    r: usize,
) -> [u8; N] {
    std::array::from_fn(|j| runs[j / 8][r][j % 8])
}
