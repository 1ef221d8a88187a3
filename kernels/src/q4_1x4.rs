//! Q4_1 weights repacked four rows at a time ([`BlockQ4_1x4`], [`crate::repack`] says why),
//! and their AVX2 product with Q8_1 activations summed in f64: what every Q4_1 matmul of
//! candle-tp runs on the CPU.
//!
//! Per block and row `d·d' · Σ q·q' + m·s'` ([`crate::q4_1`]): the unsigned nibbles go straight
//! into `maddubs`, the four rows' sums are reduced to one integer each, and the block's value
//! is rounded once in f64 (`d·d'` and `m·s'` are exact products of f16 values) before it is
//! added to the row's sum, in block order: every value is bit for bit
//! [`crate::f64_dot::dot_f64`] of the unpacked row (tested).

use crate::q4_1::{BlockQ4_1, QK4_1};
use crate::q8_1::BlockQ8_1;
use crate::repack::{put_runs, repack_bytes, take_runs, Interleave, Repacked, RepackedMatMul};
use candle_core::Result;
use half::f16;
use std::sync::Arc;

/// Four Q4_1 blocks of four consecutive rows (the same block index), interleaved: row `r`'s
/// block is `d[r]`, `m[r]` and `qs[r]`. 80 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ4_1x4 {
    /// The rows' scales.
    pub d: [f16; 4],
    /// The rows' offsets.
    pub m: [f16; 4],
    /// The rows' low four bits, two values per byte (byte `j` holds values `j` and `j + 16`),
    /// in runs of 8 bytes: `qs[c][r]` is row `r`'s bytes `8c .. 8c + 8`.
    pub qs: [[[u8; 8]; 4]; 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1x4>() == 80);

impl BlockQ4_1x4 {
    /// Four all-zero blocks (the padding rows of a last, partial group).
    pub const ZERO: Self = Self {
        d: [f16::ZERO; 4],
        m: [f16::ZERO; 4],
        qs: [[[0; 8]; 4]; 2],
    };
}

/// A repacked Q4_1 weight ([`Repacked`] of [`BlockQ4_1`]).
pub type RepackedQ4_1 = Repacked<BlockQ4_1>;

/// [`crate::repack::repack_bytes`] for Q4_1, instantiated in this crate so that the kernel
/// and its driver are compiled with its optimisations in every profile (a generic
/// instantiated in candle-tp's debug build, what its tests run, would be unoptimised).
pub fn repack(bytes: &[u8], n: usize, k: usize) -> Result<Arc<dyn RepackedMatMul>> {
    repack_bytes::<BlockQ4_1>(bytes, n, k)
}

impl Interleave for BlockQ4_1 {
    type X4 = BlockQ4_1x4;
    const X4_ZERO: BlockQ4_1x4 = BlockQ4_1x4::ZERO;

    fn set_row(x4: &mut BlockQ4_1x4, r: usize, block: &Self) {
        x4.d[r] = block.d;
        x4.m[r] = block.m;
        put_runs(&mut x4.qs, r, &block.qs);
    }

    fn row(x4: &BlockQ4_1x4, r: usize) -> Self {
        BlockQ4_1 {
            d: x4.d[r],
            m: x4.m[r],
            qs: take_runs(&x4.qs, r),
        }
    }

    fn dequantize(block: &Self, out: &mut [f32]) {
        let (d, m) = (block.d.to_f32(), block.m.to_f32());
        for (j, &q) in block.qs.iter().enumerate() {
            out[j] = (q & 0x0F) as f32 * d + m;
            out[j + QK4_1 / 2] = (q >> 4) as f32 * d + m;
        }
    }

    /// `[d', s']` in f64, for the eight-row kernel.
    fn act_scales(x: &BlockQ8_1) -> [f64; 2] {
        [x.d.to_f64(), x.s.to_f64()]
    }

    crate::repack::avx2::unsigned_items!(BlockQ4_1x4, BlockQ8_1);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::BlockQ4_1x4;
    use crate::q8_1::BlockQ8_1;
    use crate::repack::avx2::{f16x4, nibble_runs, unsigned_kernels};

    // `unsigned_group_dot` with the nibbles as `u` and the blocks' offsets `m`.
    unsigned_kernels!(BlockQ4_1x4, BlockQ8_1, true, |g| {
        let u = nibble_runs(&g.qs);
        (u, f16x4(&g.d), f16x4(&g.m))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f64_dot::testing::{pseudo, pseudo_bytes};
    use crate::repack::testing;

    /// Block `b` of row `r`: every nibble pattern, scales and offsets of both signs.
    fn block(r: usize, b: usize) -> BlockQ4_1 {
        BlockQ4_1 {
            d: f16::from_f32(0.01 + 0.02 * pseudo(r * 97 + b)),
            m: f16::from_f32(0.3 * pseudo(r * 89 + b + 3)),
            qs: pseudo_bytes::<16>(r * 1000 + b * 16 + 99),
        }
    }

    #[test]
    fn every_value_is_the_unpacked_rows_f64_dot() {
        testing::every_value_is_the_unpacked_rows_f64_dot(block);
    }

    #[test]
    fn blocks_and_rows_come_back_as_stored() {
        testing::blocks_and_rows_come_back(block, |b| {
            let (d, m) = (b.d.to_f32(), b.m.to_f32());
            let mut v = vec![0f32; 32];
            for j in 0..16 {
                v[j] = (b.qs[j] & 15) as f32 * d + m;
                v[j + 16] = (b.qs[j] >> 4) as f32 * d + m;
            }
            v
        });
    }

    #[test]
    fn nan_activations_give_nan_and_bad_sizes_are_errors() {
        testing::nan_activations_give_nan_and_bad_sizes_are_errors(block);
    }
}
