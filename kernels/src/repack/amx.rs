//! AMX-INT8 tiles for [`crate::kernel::Kernel::Amx`]: the tile configuration, one tile
//! product (`tdpbsud`: signed activations times unsigned weights, [`tile_product`]) and its
//! scalar emulation, which the engines share: the 32-wide types' quads (`amx_quad.rs`) and
//! the k-quants' panels (`panel.rs`).
//!
//! The tile registers: `tmm0` the sums ([`TILE`] activation rows × 16 weight rows' i32),
//! `tmm1` the activations ([`TILE`] rows × `k` bytes), `tmm2` the weights (`k / 4` rows of 64
//! bytes: values `4kg .. 4kg + 4` of weight row `r` in bytes `4r .. 4r + 4`, the layout of a
//! [`super::panel::PanelBlock`]). An engine configures them on entry ([`load_config`]) and
//! releases them on exit ([`release`]), so no tile state outlives a product. Linux grants the
//! tile state to the process once ([`crate::kernel::Kernel::Amx`]'s detection); a thread that
//! ran a tile instruction without it would fault. The emulation (`EMULATE`) lets hosts
//! without AMX test everything around the instructions: the layouts, strides and copies.

use std::arch::asm;

/// Weight rows per tile product.
pub const ROWS: usize = 16;

/// Activation rows per tile.
pub const TILE: usize = 8;

/// `ldtilecfg`'s 64-byte operand, palette 1.
#[repr(C, align(64))]
pub struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    /// Bytes per row of each tile register.
    colsb: [u16; 16],
    /// Rows of each tile register.
    rows: [u8; 16],
}

/// The three tiles of a product of [`TILE`] activation rows by sixteen weight rows over `k`
/// values (a multiple of 4, at most 64): `tmm0` the sums (TILE rows of 16 i32), `tmm1` the
/// activations (TILE rows of `k` bytes), `tmm2` the weights (`k / 4` rows of sixteen rows'
/// 4 bytes).
pub const fn config(k: usize) -> TileConfig {
    assert!(k.is_multiple_of(4) && k > 0 && k <= 64);
    let mut colsb = [0u16; 16];
    let mut rows = [0u8; 16];
    (colsb[0], rows[0]) = (64, TILE as u8);
    (colsb[1], rows[1]) = (k as u16, TILE as u8);
    (colsb[2], rows[2]) = (64, (k / 4) as u8);
    TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb,
        rows,
    }
}

/// Configures the tile registers (`ldtilecfg`); nothing where `EMULATE`.
///
/// # Safety
/// Unless `EMULATE`, the CPU must support amx-tile, granted to this process by the OS.
#[inline(always)]
pub unsafe fn load_config<const EMULATE: bool>(config: &TileConfig) {
    if !EMULATE {
        asm!("ldtilecfg [{}]", in(reg) config, options(nostack, readonly));
    }
}

/// Releases the tile registers (`tilerelease`), so that no tile state outlives a product;
/// nothing where `EMULATE`.
///
/// # Safety
/// As [`load_config`].
#[inline(always)]
pub unsafe fn release<const EMULATE: bool>() {
    if !EMULATE {
        asm!("tilerelease", options(nostack, nomem));
    }
}

/// One tile product under [`config`]`(k)`: `sums[i][r] = Σ_kg Σ_j a[i][4kg + j] ·
/// w[kg][4r + j]` over `kg < k / 4`, with `a[i]` the `k` signed bytes at `a + i·stride` and
/// `w` the `k / 4` rows of 64 unsigned bytes at `w` (`tdpbsud` from zero, or scalar code
/// where `EMULATE`).
///
/// # Safety
/// The tiles are configured for `k` ([`load_config`]) unless `EMULATE`; `a + i·stride ..
/// + k` for every `i < TILE` and `w .. w + 16·k` are readable.
#[inline(always)]
pub unsafe fn tile_product<const EMULATE: bool>(
    a: *const i8,
    stride: isize,
    k: usize,
    w: *const u8,
    sums: &mut [[i32; ROWS]; TILE],
) {
    if EMULATE {
        for (i, sums) in sums.iter_mut().enumerate() {
            let a = std::slice::from_raw_parts(a.offset(i as isize * stride), k);
            let w = std::slice::from_raw_parts(w, 16 * k);
            for (r, s) in sums.iter_mut().enumerate() {
                *s = (0..k)
                    .map(|j| a[j] as i32 * w[64 * (j / 4) + 4 * r + j % 4] as i32)
                    .sum();
            }
        }
    } else {
        asm!(
            "tilezero tmm0",
            "tileloadd tmm1, [{a} + {sa} * 1]",
            "tileloadd tmm2, [{w} + {sw} * 1]",
            "tdpbsud tmm0, tmm1, tmm2",
            "tilestored [{s} + {ss} * 1], tmm0",
            a = in(reg) a,
            sa = in(reg) stride,
            w = in(reg) w,
            sw = in(reg) 64usize,
            s = in(reg) sums.as_mut_ptr(),
            ss = in(reg) 4 * ROWS,
            options(nostack),
        );
    }
}

/// The distance between consecutive rows of `rows` where they lie one fixed stride apart
/// (the rows of one prepared buffer), so that a tile loads them in place; `None` otherwise.
pub fn uniform_stride<T>(rows: &[&[T]; TILE]) -> Option<isize> {
    let first = rows[0].as_ptr() as isize;
    let stride = rows[1].as_ptr() as isize - first;
    (stride > 0 && (0..TILE).all(|i| rows[i].as_ptr() as isize == first + i as isize * stride))
        .then_some(stride)
}
