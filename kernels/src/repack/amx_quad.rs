//! The AMX-INT8 engine of the 32-wide types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): sixteen weight
//! rows (four groups) against a tile of eight activation rows, each block's 8 × 16 integer
//! sums one `tdpbsud`, for [`crate::kernel::Kernel::Amx`].
//!
//! Per block, the weights unpack as for the 512-bit engine ([`super::avx512::quad_dot`]'s
//! `words`: runs of 8 unsigned values per row), which two `vpermt2d` per run turn into the
//! tile layout AMX multiplies by (`B[kg]`: values `4kg .. 4kg + 4` of row `r` in bytes
//! `4r .. 4r + 4`, eight rows of 64 bytes). The activations' 32 signed bytes per row load
//! straight from the prepared activation rows, whose blocks lie one row's length apart (a
//! copy where they do not). `tdpbsud` (signed activations times unsigned weights) gives the
//! block's `Σ u·q'` of every activation row and weight row, which the 512-bit engine gets from
//! sixteen `vpdpbusd` and a pairing of lanes per activation row; the tile is stored and each
//! activation row's sixteen sums go through the same offset and f64 steps
//! ([`super::avx512::scale_quad_row`]), so every value is bit for bit the scalar sum (tested
//! where AMX runs, and against the 512-bit engine).
//!
//! The tiles themselves (configuration, product, emulation) are [`super::amx`]'s.

use super::amx::{config, load_config, release, tile_product, uniform_stride};
use super::amx::{TileConfig, TILE};
use super::avx512::{prefetch_quad, scale_quad_row, scales_pd, QUAD_PREFETCH, QUAD_ROWS};
use super::frame::Aligned;
use super::{Act8, ActRow};
use std::arch::x86_64::*;

/// The sixteen rows of four groups against [`TILE`] activation rows with AMX, for a type
/// whose block unpacks as [`super::avx512::quad_dot`]'s `words` gives it (`HAS_M`: whether
/// the rows have a minimum): `out[i][r]`, bit for bit the scalar f64 sum. `EMULATE`: each
/// tile product by scalar code ([`tile_product`]) rather than the tile instructions, around the same
/// layouts, so that hosts without AMX test all but the instructions themselves.
///
/// # Safety
/// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni, and
/// unless `EMULATE` amx-tile and amx-int8, with the tile state granted to this process by the
/// OS (inline this into a function that enables the vector features); the four groups and
/// every slice of `xs` have the same number of blocks.
#[inline(always)]
pub unsafe fn quad_dot_amx<G, A: Act8, const HAS_M: bool, const EMULATE: bool>(
    groups: [&[G]; 4],
    xs: &[ActRow<'_, A>; TILE],
    words: impl Fn([&G; 4]) -> ([__m512i; 8], __m512, __m512),
) -> [[f64; QUAD_ROWS]; TILE] {
    let blocks = groups[0].len();
    let group = std::mem::size_of_val(groups[0]);
    let direct = if blocks > 0 {
        uniform_stride(&xs.map(|x| x.0))
    } else {
        None
    };
    let mut copy = Aligned([[0i8; 32]; TILE]);
    let mut b_tile = Aligned([_mm512_setzero_si512(); 8]);
    let mut sums = Aligned([[0i32; QUAD_ROWS]; TILE]);
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    let mut acc = [[_mm512_setzero_pd(); 2]; TILE];
    const CONFIG: TileConfig = config(32);
    load_config::<EMULATE>(&CONFIG);
    for b in 0..blocks {
        let g = groups.map(|s| s.get_unchecked(b));
        prefetch_quad::<G, QUAD_PREFETCH>(g, b, group);
        let (w, wd, wm) = words(g);
        // Values 4kg .. 4kg + 4 of the sixteen rows: dword h of each row's run t.
        for t in 0..4 {
            b_tile.0[2 * t] = _mm512_permutex2var_epi32(w[t], even, w[4 + t]);
            b_tile.0[2 * t + 1] = _mm512_permutex2var_epi32(w[t], odd, w[4 + t]);
        }
        let (a, a_stride) = match direct {
            Some(stride) => (xs[0].0.get_unchecked(b).qs().as_ptr(), stride),
            None => {
                for (i, row) in copy.0.iter_mut().enumerate() {
                    *row = *xs[i].0.get_unchecked(b).qs();
                }
                (copy.0.as_ptr() as *const i8, 32)
            }
        };
        tile_product::<EMULATE>(a, a_stride, 32, b_tile.0.as_ptr() as *const u8, &mut sums.0);
        let (wd, wm) = scales_pd::<HAS_M>(wd, wm);
        super::unrolled!(TILE, |i| {
            let s = _mm512_load_si512(sums.0[i].as_ptr() as *const __m512i);
            scale_quad_row::<A, HAS_M>(&mut acc[i], s, xs[i], b, wd, wm);
        });
    }
    release::<EMULATE>();
    super::avx512::store_rows(&acc)
}
