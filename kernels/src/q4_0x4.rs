//! Q4_0 weights repacked four rows at a time ([`BlockQ4_0x4`], [`crate::repack`] says why),
//! and their AVX2 product with Q8_0 activations summed in f64: what every Q4_0 matmul of
//! candle-tp runs on the CPU (decode, prefill, row-parallel partials).
//!
//! The integer work per block and row is also lighter than the sign trick that
//! `maddubs` needs for signed × signed bytes (ggml's `ggml_vec_dot_q4_0_q8_0`): the nibbles
//! `q` (0..15) are unsigned, so `Σ (q − 8)·q' = Σ q·q' − 8·Σ q'`, where `Σ q'` is computed once
//! per activation block for all rows. The four rows' sums are reduced to one integer each per
//! block and multiplied by the exact product of the scales `d·d'` in f64, the blocks added in
//! order: every value is bit for bit [`crate::f64_dot::dot_f64`] of the unpacked row (tested).

use crate::q4_0::{BlockQ4_0, QK4_0};
use crate::q8_0::BlockQ8_0;
use crate::repack::{put_runs, repack_bytes, take_runs, Interleave, Repacked, RepackedMatMul};
use candle_core::Result;
use half::f16;
use std::sync::Arc;

/// Four Q4_0 blocks of four consecutive rows (the same block index), interleaved: row `r`'s
/// block is `d[r]` and `qs[r]` (values as in [`BlockQ4_0`]). 72 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ4_0x4 {
    /// The rows' scales.
    pub d: [f16; 4],
    /// The rows' low four bits, two values per byte (byte `j` holds values `j` and `j + 16`),
    /// in runs of 8 bytes: `qs[c][r]` is row `r`'s bytes `8c .. 8c + 8`.
    pub qs: [[[u8; 8]; 4]; 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0x4>() == 72);

impl BlockQ4_0x4 {
    /// Four all-zero blocks (the padding rows of a last, partial group).
    pub const ZERO: Self = Self {
        d: [f16::ZERO; 4],
        qs: [[[0; 8]; 4]; 2],
    };
}

/// A repacked Q4_0 weight ([`Repacked`] of [`BlockQ4_0`]).
pub type RepackedQ4_0 = Repacked<BlockQ4_0>;

/// [`crate::repack::repack_bytes`] for Q4_0, instantiated in this crate so that the kernel
/// and its driver are compiled with its optimisations in every profile (a generic
/// instantiated in candle-tp's debug build, what its tests run, would be unoptimised).
pub fn repack(bytes: &[u8], n: usize, k: usize) -> Result<Arc<dyn RepackedMatMul>> {
    repack_bytes::<BlockQ4_0>(bytes, n, k)
}

impl Interleave for BlockQ4_0 {
    type X4 = BlockQ4_0x4;
    const X4_ZERO: BlockQ4_0x4 = BlockQ4_0x4::ZERO;

    fn set_row(x4: &mut BlockQ4_0x4, r: usize, block: &Self) {
        x4.d[r] = block.d;
        put_runs(&mut x4.qs, r, &block.qs);
    }

    fn row(x4: &BlockQ4_0x4, r: usize) -> Self {
        BlockQ4_0 {
            d: x4.d[r],
            qs: take_runs(&x4.qs, r),
        }
    }

    fn dequantize(block: &Self, out: &mut [f32]) {
        let d = block.d.to_f32();
        for (j, &q) in block.qs.iter().enumerate() {
            out[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
            out[j + QK4_0 / 2] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }

    fn act_sum(x: &BlockQ8_0) -> i32 {
        8 * x.qs.iter().map(|&q| q as i32).sum::<i32>()
    }

    /// `[d', 0]` in f64, for the eight-row kernel.
    fn act_scales(x: &BlockQ8_0) -> [f64; 2] {
        [x.d.to_f64(), 0.0]
    }

    crate::repack::avx2::unsigned_items!(BlockQ4_0x4, BlockQ8_0);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::BlockQ4_0x4;
    use crate::q8_0::BlockQ8_0;
    use crate::repack::avx2::{f16x4, nibble_runs, unsigned_kernels};
    use std::arch::x86_64::*;

    // `unsigned_group_dot` with the nibbles as `u`, no `m` (the `−8` is the activations'
    // `8·Σ q'`).
    unsigned_kernels!(BlockQ4_0x4, BlockQ8_0, false, |g| {
        let u = nibble_runs(&g.qs);
        (u, f16x4(&g.d), _mm_setzero_ps())
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f64_dot::testing::pseudo;
    use crate::repack::testing;

    /// Block `b` of row `r`: every nibble pattern, scales of both signs.
    fn block(r: usize, b: usize) -> BlockQ4_0 {
        BlockQ4_0 {
            d: f16::from_f32(0.01 + 0.02 * pseudo(r * 97 + b)),
            qs: std::array::from_fn(|j| {
                (pseudo(r * 1000 + b * 16 + j + 99).to_bits() & 0xFF) as u8
            }),
        }
    }

    #[test]
    fn every_value_is_the_unpacked_rows_f64_dot() {
        testing::every_value_is_the_unpacked_rows_f64_dot(block);
    }

    #[test]
    fn blocks_and_rows_come_back_as_stored() {
        testing::blocks_and_rows_come_back(block, |b| {
            let d = b.d.to_f32();
            let mut v = vec![0f32; 32];
            for j in 0..16 {
                v[j] = ((b.qs[j] & 15) as f32 - 8.0) * d;
                v[j + 16] = ((b.qs[j] >> 4) as f32 - 8.0) * d;
            }
            v
        });
    }

    #[test]
    fn nan_activations_give_nan_and_bad_sizes_are_errors() {
        testing::nan_activations_give_nan_and_bad_sizes_are_errors(block);
    }

    #[test]
    fn prepared_activations_serve_every_weight_and_only_their_type() {
        testing::prepared_activations_serve_every_weight(block);
        let rows: Vec<BlockQ4_0> = (0..4).map(|b| block(b / 2, b % 2)).collect();
        let bytes: Vec<u8> = rows
            .iter()
            .flat_map(|b| {
                let mut v = b.d.to_le_bytes().to_vec();
                v.extend_from_slice(&b.qs);
                v
            })
            .collect();
        let q4_0 = repack(&bytes, 2, 64).unwrap();
        let x = vec![0.5f32; 64];
        let prepared = q4_0.prepare(crate::kernel::Kernel::Scalar, 1, &x).unwrap();
        let q8_bytes = vec![0u8; 2 * 2 * 34];
        let q8_0 = crate::q8_0x4::repack(&q8_bytes, 2, 64).unwrap();
        let err = q8_0
            .matmul_prepared_f32(&prepared, &mut [0f32; 2])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Q8_0") && err.contains("prepared for Q4_0"),
            "{err}"
        );
    }
}
