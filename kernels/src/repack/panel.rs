//! The k-quants' prefill kernel with AVX-512 VNNI: sixteen weight rows unpacked to bytes once
//! per product ([`PanelBlock`]), then multiplied by tiles of eight activation rows.
//!
//! The four-row kernels ([`super::Interleave::group_dot_avx512`]) unpack a super-block for
//! each tile of activation rows and multiply 32-byte vectors: eight bytes of four rows against
//! an eight-byte broadcast of the activations (`maddubs`, then a `madd` by the scales), which
//! cannot be folded into VNNI's `vpdpbusd` (its broadcast is four bytes). A panel holds the
//! unsigned values of sixteen rows four by four (`q[kg]`: values `4kg .. 4kg + 4` of row `r` in
//! bytes `4r .. 4r + 4`), so that one `vpdpbusd` with a four-byte broadcast of an activation row
//! from memory gives sixteen rows' sums of four products; the panel is made once and serves
//! every tile. llama.cpp's tiled k-quant GEMM (`ggml-cpu/tiled`) unpacks its weights to bytes
//! for the same reason.
//!
//! Per super-block, each type's integers are its scalar `block_dot`'s: per sub-block (16 or 32
//! values) `Σ q·q'` exact in i32 lanes, times the sub-block's scale (`vpmullo`); the offset or
//! minimum term `Σ_j c_j · bsums_j` by `vpdpwssd` on pairs of the activation's sums of 16.
//! They are combined with the scales in f64 in the scalar's order, so every value is bit for
//! bit [`crate::f64_dot::dot_f64`] of the unpacked row (tested with the types).

use crate::q8_k::{BlockQ8K, QK_K};
use std::cell::RefCell;

/// Weight rows in a panel.
pub const ROWS: usize = 16;
/// Activation rows in a tile.
pub const TILE: usize = 8;
/// Activation rows from which a product runs panels. Against the four-row kernels, two tiles
/// repaid the unpacking (Zen 4, one thread, 1 B Llama: prefill of 8 tokens Q6_K 0.93x, of 16
/// 1.0x, of 32 1.3x); against the quads that run below it (`k_quad.rs`), five (Zen 5, one
/// thread, 5632 x 2048, the quads against panels: 16 rows 1.7x (Q4_K) and 2.2x (Q6_K), 32
/// rows 1.2x and 1.3x, 48 rows 1.0x and 0.87x, 64 rows 0.87x and 0.83x).
pub const MIN_ROWS: usize = 5 * TILE;

/// Super-block `b` of sixteen weight rows, unpacked for [`dot`]: 5888 bytes.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub struct PanelBlock {
    /// Values `4kg .. 4kg + 4` of row `r` (unsigned) in `q[kg][4r .. 4r + 4]`.
    pub q: [[u8; 4 * ROWS]; QK_K / 4],
    /// The scale of sub-block `s` of row `r` in `sc[s][r]` (sub-blocks of 32 values use the
    /// first 8).
    pub sc: [[i32; ROWS]; QK_K / 16],
    /// Row `r`'s multipliers of the activation's sums of 16 `bsums[2j]` and `bsums[2j + 1]`,
    /// as the low and high i16 of `off[j][r]`.
    pub off: [[i32; ROWS]; QK_K / 32],
    /// The rows' super-scales.
    pub d: [f64; ROWS],
    /// The rows' super-scales of the minimums (0 where the type has none).
    pub dmin: [f64; ROWS],
}
const _: () = assert!(std::mem::size_of::<PanelBlock>() == 5888);

impl PanelBlock {
    /// An all-zero block.
    pub const ZERO: Self = Self {
        q: [[0; 4 * ROWS]; QK_K / 4],
        sc: [[0; ROWS]; QK_K / 16],
        off: [[0; ROWS]; QK_K / 32],
        d: [0.0; ROWS],
        dmin: [0.0; ROWS],
    };
}

/// Two i16 multipliers in one i32 lane (`a` low), for `vpdpwssd`.
pub fn pair(a: i16, b: i16) -> i32 {
    (a as u16 as u32 | (b as u16 as u32) << 16) as i32
}

/// Puts a run of 8 values of four rows (`v`: row 0's eight values, then rows 1, 2, 3'; the
/// runs the four-row kernels read), values `8t .. 8t + 8` of rows `4i .. 4i + 4`, into `out`.
///
/// # Safety
/// The CPU must support avx2 (inline this into a function that enables it).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn put_run(out: &mut PanelBlock, i: usize, t: usize, v: std::arch::x86_64::__m256i) {
    use std::arch::x86_64::*;
    // Words [r0 0..4, r0 4..8, r1 0..4, …] -> [r0 0..4, r1 0..4, r2, r3 | r0 4..8, r1, r2, r3].
    let v = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    let mut at = |kg: usize| out.q[kg][16 * i..].as_mut_ptr() as *mut __m128i;
    _mm_storeu_si128(at(2 * t), _mm256_castsi256_si128(v));
    _mm_storeu_si128(at(2 * t + 1), _mm256_extracti128_si256::<1>(v));
}

thread_local! {
    /// The panel of the product running on this thread (kept between products: a fresh
    /// buffer of hundreds of KiB would be fresh pages, faulted in on every product).
    static SCRATCH: RefCell<Vec<PanelBlock>> = const { RefCell::new(Vec::new()) };
}

/// `f` on this thread's panel buffer of `blocks` blocks.
pub(crate) fn with_panel<R>(blocks: usize, f: impl FnOnce(&mut [PanelBlock]) -> R) -> R {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < blocks {
            s.resize(blocks, PanelBlock::ZERO);
        }
        f(&mut s[..blocks])
    })
}

/// [`dot`]'s engine: `vpdpbusd` with four-byte broadcasts.
pub const VNNI: u8 = 0;
/// [`dot`]'s engine: one AMX tile product per sub-block ([`super::amx`]).
pub const AMX: u8 = 1;
/// [`dot`]'s engine: [`AMX`] with its tile products emulated by scalar code (tests).
pub const AMX_EMULATED: u8 = 2;

/// The sixteen rows of `panel` against eight activation rows: `out[t][r]`, each the type's
/// scalar f64 sum. `SUB`: values per sub-block (16: Q6_K, 32: Q4_K and Q5_K). `MINS`: the
/// block's product is `d'·(d·dots − dmin·mins)` (Q4_K, Q5_K) with `mins` the offset integer;
/// otherwise `(d·d')·(dots − 32·offsets)` (Q6_K, whose values carry the offset 32).
/// `ENGINE`: how each sub-block's `Σ q·q'` of the eight activation rows and sixteen weight
/// rows is made, [`VNNI`], [`AMX`] (the panel's bytes are a tile's layout already, and the
/// activation rows load in place where they lie one stride apart) or [`AMX_EMULATED`]; the
/// integers are the same, so the bits are.
///
/// # Safety
/// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni, and for
/// [`AMX`] amx-tile and amx-int8 with the tile state granted to this process; every slice of
/// `xs` has `panel.len()` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot<const SUB: usize, const MINS: bool, const ENGINE: u8>(
    panel: &[PanelBlock],
    xs: [&[BlockQ8K]; TILE],
) -> [[f64; ROWS]; TILE] {
    use super::amx;
    use super::f64_step::i32x16_pd;
    use super::frame::Aligned;
    use std::arch::x86_64::*;
    const { assert!(TILE == amx::TILE && ROWS == amx::ROWS) };
    let word = |p: *const u8| _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32));
    let mut acc = [[_mm512_setzero_pd(); 2]; TILE];
    let tiles = ENGINE != VNNI;
    let emulate = ENGINE == AMX_EMULATED;
    let direct = if tiles && !panel.is_empty() {
        amx::uniform_stride(&xs)
    } else {
        None
    };
    let mut copy = Aligned([[0i8; QK_K]; TILE]);
    let mut sums = Aligned([[0i32; ROWS]; TILE]);
    let config = amx::config(SUB);
    if tiles {
        if emulate {
            amx::load_config::<true>(&config)
        } else {
            amx::load_config::<false>(&config)
        }
    }
    for (b, p) in panel.iter().enumerate() {
        // In bounds: every `xs[t]` has `panel.len()` blocks (the caller's contract).
        let x: [&BlockQ8K; TILE] = std::array::from_fn(|t| xs[t].get_unchecked(b));
        let a: [*const u8; TILE] = std::array::from_fn(|t| x[t].qs.as_ptr() as *const u8);
        let mut dots = [_mm512_setzero_si512(); TILE];
        if tiles {
            let (rows, stride) = match direct {
                Some(stride) => (x[0].qs.as_ptr(), stride),
                None => {
                    for (t, row) in copy.0.iter_mut().enumerate() {
                        *row = x[t].qs;
                    }
                    (copy.0.as_ptr() as *const i8, QK_K as isize)
                }
            };
            for s in 0..QK_K / SUB {
                let (a, w) = (rows.add(s * SUB), p.q[s * SUB / 4].as_ptr());
                if emulate {
                    amx::tile_product::<true>(a, stride, SUB, w, &mut sums.0);
                } else {
                    amx::tile_product::<false>(a, stride, SUB, w, &mut sums.0);
                }
                let sc = _mm512_load_si512(p.sc[s].as_ptr() as *const __m512i);
                super::unrolled!(TILE, |t| {
                    let v = _mm512_load_si512(sums.0[t].as_ptr() as *const __m512i);
                    dots[t] = _mm512_add_epi32(dots[t], _mm512_mullo_epi32(v, sc));
                });
            }
        }
        for s in (0..QK_K / SUB).filter(|_| !tiles) {
            let mut sums = [_mm512_setzero_si512(); TILE];
            for g in 0..SUB / 4 {
                let kg = s * SUB / 4 + g;
                let w = _mm512_load_si512(p.q[kg].as_ptr() as *const __m512i);
                super::unrolled!(TILE, |t| {
                    sums[t] = _mm512_dpbusd_epi32(sums[t], w, word(a[t].add(4 * kg)));
                });
            }
            let sc = _mm512_load_si512(p.sc[s].as_ptr() as *const __m512i);
            super::unrolled!(TILE, |t| {
                dots[t] = _mm512_add_epi32(dots[t], _mm512_mullo_epi32(sums[t], sc));
            });
        }
        let mut offs = [_mm512_setzero_si512(); TILE];
        for j in 0..QK_K / 32 {
            let c = _mm512_load_si512(p.off[j].as_ptr() as *const __m512i);
            super::unrolled!(TILE, |t| {
                let sums = word(x[t].bsums.as_ptr().add(2 * j) as *const u8);
                offs[t] = _mm512_dpwssd_epi32(offs[t], c, sums);
            });
        }
        let d = [
            _mm512_load_pd(p.d.as_ptr()),
            _mm512_load_pd(p.d[8..].as_ptr()),
        ];
        let dmin = [
            _mm512_load_pd(p.dmin.as_ptr()),
            _mm512_load_pd(p.dmin[8..].as_ptr()),
        ];
        super::unrolled!(TILE, |t| {
            let dx = _mm512_set1_pd(x[t].d as f64);
            if MINS {
                let (dots, mins) = (i32x16_pd(dots[t]), i32x16_pd(offs[t]));
                for h in 0..2 {
                    // d'·(d·dots − dmin·mins), as the scalar (no FMA).
                    let v = _mm512_sub_pd(
                        _mm512_mul_pd(d[h], dots[h]),
                        _mm512_mul_pd(dmin[h], mins[h]),
                    );
                    acc[t][h] = _mm512_add_pd(acc[t][h], _mm512_mul_pd(dx, v));
                }
            } else {
                let dots = i32x16_pd(_mm512_sub_epi32(dots[t], _mm512_slli_epi32::<5>(offs[t])));
                for h in 0..2 {
                    // (d·d')·dots, as the scalar (no FMA).
                    let dd = _mm512_mul_pd(d[h], dx);
                    acc[t][h] = _mm512_add_pd(acc[t][h], _mm512_mul_pd(dd, dots[h]));
                }
            }
        });
    }
    if tiles && !emulate {
        amx::release::<false>();
    }
    let mut out = [[0f64; ROWS]; TILE];
    for t in 0..TILE {
        _mm512_storeu_pd(out[t].as_mut_ptr(), acc[t][0]);
        _mm512_storeu_pd(out[t][8..].as_mut_ptr(), acc[t][1]);
    }
    out
}
