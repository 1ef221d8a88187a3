//! Q4_0 weights repacked four rows at a time ([`BlockQ4_0x4`]), and their product with Q8_0
//! activations summed in f64: what every Q4_0 matmul of candle-tp runs on the CPU (decode,
//! prefill, row-parallel partials).
//!
//! GGUF stores a Q4_0 matrix row after row, each row a run of 18-byte blocks. A kernel that
//! multiplies four rows at once then reads four streams of short rows (1152 bytes for
//! `k = 2048`), which the hardware prefetcher follows badly: measured on a Zen 3 core, one
//! thread, weights streaming from memory, the four-row f32 kernel reached 4.6-6.2 GB/s.
//! [`RepackedQ4_0`] interleaves rows `4g .. 4g + 4` block by block (the four f16 scales, then
//! the four 16-byte nibble runs: 72 bytes, the same as four blocks), so a group of four rows
//! is one sequential stream, and the kernel prefetches ahead of it: 10-12 GB/s on the same
//! core (llama.cpp repacks Q4_0 for the same reason, into 8-row blocks, `ggml-cpu/repack.cpp`).
//!
//! The integer work per block and row is also lighter than the sign trick that
//! `maddubs` needs for signed × signed bytes (ggml's `ggml_vec_dot_q4_0_q8_0`): the nibbles
//! `q` (0..15) are unsigned, so `Σ (q − 8)·q' = Σ q·q' − 8·Σ q'`, where `Σ q'` is computed once
//! per activation block for all rows. The four rows' sums are reduced to one integer each per
//! block and multiplied by the exact product of the scales `d·d'` in f64, the blocks added in
//! order: every value is bit for bit [`crate::f64_dot::dot_f64`] of the unpacked row (tested),
//! whatever the kernel, the number of activation rows or the thread count. The f32 product
//! ([`RepackedQ4_0::matmul_f32`]) rounds that f64 sum, so decode, prefill, batches and
//! row-parallel shards all compute the same numbers.

use crate::f64_matmul::{check_matmul, fill_by_weight_rows};
use crate::kernel::Kernel;
use crate::q4_0::{BlockQ4_0, QK4_0};
use crate::q8_0::{quantize_row_q8_0, BlockQ8_0, QK8_0};
use candle_core::Result;
use half::f16;

/// Four Q4_0 blocks of four consecutive rows (the same block index), interleaved: row `r`'s
/// block is `d[r]` and `qs[r]` (values as in [`BlockQ4_0`]). 72 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ4_0x4 {
    /// The rows' scales.
    pub d: [f16; 4],
    /// The rows' packed 4-bit values.
    pub qs: [[u8; QK4_0 / 2]; 4],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0x4>() == 72);

impl BlockQ4_0x4 {
    /// Four all-zero blocks (the padding rows of a last, partial group).
    pub const ZERO: Self = Self {
        d: [f16::ZERO; 4],
        qs: [[0; QK4_0 / 2]; 4],
    };
}

/// A Q4_0 weight `[n, k]` repacked in groups of four rows (the last group padded with zero
/// rows), with its products against f32 activations.
///
/// ```
/// use candle_tp_kernels::{kernel::Kernel, q4_0::BlockQ4_0, q4_0x4::RepackedQ4_0};
/// let block = BlockQ4_0 { d: half::f16::from_f32(0.5), qs: [0x9A; 16] }; // values 1 and 2
/// let w = RepackedQ4_0::new(&[block; 3], 3, 32).unwrap(); // 3 rows of one block
/// let x = [127.0f32; 32]; // Q8_0: scale 1, values 127
/// let mut y = [0f32; 3];
/// w.matmul_f32(Kernel::detect(), 1, &x, &mut y).unwrap();
/// assert_eq!(y, [3048.0; 3]); // 0.5 · 127 · (16 · 2 + 16 · 1)
/// ```
#[derive(Debug, Clone)]
pub struct RepackedQ4_0 {
    groups: Vec<BlockQ4_0x4>,
    n: usize,
    kb: usize,
}

impl RepackedQ4_0 {
    /// Repacks `n` rows of `k / 32` blocks each (GGUF's layout of a `[n, k]` Q4_0 tensor).
    /// Errors if `k` is not a multiple of 32 or `w` holds another number of blocks.
    pub fn new(w: &[BlockQ4_0], n: usize, k: usize) -> Result<Self> {
        if k % QK4_0 != 0 {
            candle_core::bail!("Q4_0 weight [{n}, {k}]: k is not a multiple of {QK4_0}")
        }
        let kb = k / QK4_0;
        if w.len() != n * kb {
            candle_core::bail!(
                "Q4_0 weight [{n}, {k}]: {} blocks, expected {}",
                w.len(),
                n * kb
            )
        }
        let mut groups = vec![BlockQ4_0x4::ZERO; n.div_ceil(4) * kb];
        for (row, blocks) in w.chunks_exact(kb.max(1)).enumerate().take(n) {
            let (g, r) = (row / 4, row % 4);
            for (dst, src) in groups[g * kb..(g + 1) * kb].iter_mut().zip(blocks) {
                dst.d[r] = src.d;
                dst.qs[r] = src.qs;
            }
        }
        Ok(Self { groups, n, kb })
    }

    /// Rows (output features).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Columns (input features).
    pub fn k(&self) -> usize {
        self.kb * QK4_0
    }

    /// Block `b` of row `row`, as GGUF stores it.
    ///
    /// # Panics
    /// If `row >= n` or `b >= k / 32`.
    pub fn block(&self, row: usize, b: usize) -> BlockQ4_0 {
        assert!(
            row < self.n && b < self.kb,
            "Q4_0 block ({row}, {b}) of [{}, {} blocks]",
            self.n,
            self.kb
        );
        let g = &self.groups[row / 4 * self.kb + b];
        BlockQ4_0 {
            d: g.d[row % 4],
            qs: g.qs[row % 4],
        }
    }

    /// Row `row` dequantized into `out` (`k` values): `d · (q − 8)`, as candle dequantizes.
    ///
    /// # Panics
    /// If `row >= n` or `out.len() != k`.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert_eq!(
            out.len(),
            self.k(),
            "Q4_0 row of {} values into {}",
            self.k(),
            out.len()
        );
        for (b, out) in out.chunks_exact_mut(QK4_0).enumerate() {
            let block = self.block(row, b);
            let d = block.d.to_f32();
            for (j, &q) in block.qs.iter().enumerate() {
                out[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
                out[j + QK4_0 / 2] = ((q >> 4) as i32 - 8) as f32 * d;
            }
        }
    }

    /// `dst[i * n + j] = Σ_t x[i, t] · W[j, t]` for `m` activation rows of `k` values, summed
    /// in f64 (see the module's documentation); the activations are quantized to Q8_0 with
    /// candle's rounding. Weight rows are split over the current rayon pool.
    pub fn matmul_f64(&self, kernel: Kernel, m: usize, x: &[f32], dst: &mut [f64]) -> Result<()> {
        self.matmul(kernel, m, x, dst, |v| v)
    }

    /// [`RepackedQ4_0::matmul_f64`] rounded to f32.
    pub fn matmul_f32(&self, kernel: Kernel, m: usize, x: &[f32], dst: &mut [f32]) -> Result<()> {
        self.matmul(kernel, m, x, dst, |v| v as f32)
    }

    fn matmul<T: Send + Copy + Default>(
        &self,
        kernel: Kernel,
        m: usize,
        x: &[f32],
        dst: &mut [T],
        out: impl Fn(f64) -> T + Sync,
    ) -> Result<()> {
        let (n, k, kb) = (self.n, self.k(), self.kb);
        let what = "Q4_0 (repacked) matmul";
        // `check_matmul` counts weight blocks; the repacked weight has them by construction.
        check_matmul(what, kernel, (m, k, n), QK4_0, (x.len(), n * kb, dst.len()))?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        if kb == 0 {
            dst.fill(out(0.0)); // empty sums
            return Ok(());
        }
        let act = Activations::quantize(x, kb);
        let fill = |row0: usize, o: &mut [T]| {
            let rows = o.len() / m;
            // Task ranges start on a group (`fill_by_weight_rows` cuts multiples of 4 rows).
            debug_assert_eq!(row0 % 4, 0);
            for g in 0..rows.div_ceil(4) {
                let group = &self.groups[(row0 / 4 + g) * kb..(row0 / 4 + g + 1) * kb];
                let live = (rows - 4 * g).min(4);
                let mut put = |i: usize, v: [f64; 4]| {
                    for (r, &v) in v.iter().enumerate().take(live) {
                        o[(4 * g + r) * m + i] = out(v);
                    }
                };
                let tiled = m / 4 * 4;
                for i in (0..tiled).step_by(4) {
                    let v = group_dot::<4>(kernel, group, std::array::from_fn(|t| act.row(i + t)));
                    for (t, v) in v.into_iter().enumerate() {
                        put(i + t, v);
                    }
                }
                for i in tiled..m {
                    put(i, group_dot::<1>(kernel, group, [act.row(i)])[0]);
                }
            }
        };
        fill_by_weight_rows(n, m, dst, fill);
        Ok(())
    }
}

/// Activation rows quantized to Q8_0, with `8 · Σ q'` of every block.
struct Activations {
    blocks: Vec<BlockQ8_0>,
    sums8: Vec<i32>,
    kb: usize,
}

impl Activations {
    fn quantize(x: &[f32], kb: usize) -> Self {
        let mut blocks = vec![BlockQ8_0::ZERO; x.len() / QK8_0];
        quantize_row_q8_0(x, &mut blocks);
        let sums8 = blocks
            .iter()
            .map(|b| 8 * b.qs.iter().map(|&q| q as i32).sum::<i32>())
            .collect();
        Self { blocks, sums8, kb }
    }

    /// Activation row `i`: its blocks and their sums.
    fn row(&self, i: usize) -> (&[BlockQ8_0], &[i32]) {
        let r = i * self.kb..(i + 1) * self.kb;
        (&self.blocks[r.clone()], &self.sums8[r])
    }
}

/// The four rows of `group` against `M` activation rows: `out[i][r]`.
fn group_dot<const M: usize>(
    kernel: Kernel,
    group: &[BlockQ4_0x4],
    xs: [(&[BlockQ8_0], &[i32]); M],
) -> [[f64; 4]; M] {
    for (x, s) in xs {
        assert!(
            x.len() == group.len() && s.len() == group.len(),
            "Q4_0 group of {} blocks against {} activation blocks",
            group.len(),
            x.len()
        );
    }
    crate::kernel::by_kernel!(kernel,
        scalar => group_dot_scalar(group, xs),
        // The lengths were checked above.
        avx2 => avx2::group_dot(group, xs))
}

/// The reference: each block's exact product `(d·d') · Σ (q − 8)·q'` added in block order, as
/// [`crate::f64_dot::F64Dot::block_dot`] for [`BlockQ4_0`].
fn group_dot_scalar<const M: usize>(
    group: &[BlockQ4_0x4],
    xs: [(&[BlockQ8_0], &[i32]); M],
) -> [[f64; 4]; M] {
    let mut acc = [[0f64; 4]; M];
    for (acc, (x, _)) in acc.iter_mut().zip(xs) {
        for (g, x) in group.iter().zip(x) {
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut sum = 0i32;
                for j in 0..QK4_0 / 2 {
                    sum += ((g.qs[r][j] & 0x0F) as i32 - 8) * x.qs[j] as i32
                        + ((g.qs[r][j] >> 4) as i32 - 8) * x.qs[j + QK4_0 / 2] as i32;
                }
                *acc += (g.d[r].to_f64() * x.d.to_f64()) * sum as f64;
            }
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::BlockQ4_0x4;
    use crate::f64_dot::avx2::hsum4;
    use crate::q8_0::BlockQ8_0;
    use std::arch::x86_64::*;

    /// Bytes ahead of the group's current block that each step prefetches (measured: 512
    /// streamed 10-15 % faster than none, and than 1024, on a Zen 3 core).
    const PREFETCH: usize = 512;

    /// The 32 nibbles of a 16-byte run as unsigned bytes in ggml's order: low nibbles (values
    /// 0..16) in the low lane, high nibbles (16..32) in the high lane.
    #[inline(always)]
    unsafe fn nibbles(qs: &[u8; 16]) -> __m256i {
        let packed = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs.as_ptr() as *const __m128i));
        let shifted = _mm256_srlv_epi64(packed, _mm256_setr_epi64x(0, 0, 4, 4));
        _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
    }

    /// As `group_dot_scalar`, bit for bit: per block, the four rows' `Σ q·q'` (`maddubs` of
    /// unsigned nibbles and signed activations: pairs of at most 2·15·127, no saturation)
    /// reduced to one integer each, minus `8·Σ q'`, times `d·d'` (exact in f32, widened to
    /// f64), added to the row's f64 sum by an FMA whose product is exact, so it rounds once,
    /// as the scalar addition does.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every slice of `xs` has `group.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group_dot<const M: usize>(
        group: &[BlockQ4_0x4],
        xs: [(&[BlockQ8_0], &[i32]); M],
    ) -> [[f64; 4]; M] {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_pd(); M];
        for (b, g) in group.iter().enumerate() {
            // A hint: no fault past the end of the weight.
            _mm_prefetch(
                (g as *const BlockQ4_0x4 as *const i8).wrapping_add(PREFETCH),
                _MM_HINT_T0,
            );
            let q = [
                nibbles(&g.qs[0]),
                nibbles(&g.qs[1]),
                nibbles(&g.qs[2]),
                nibbles(&g.qs[3]),
            ];
            let wd = _mm_cvtph_ps(_mm_loadl_epi64(g.d.as_ptr() as *const __m128i));
            for i in 0..M {
                let (x, sums8) = xs[i];
                let x = x.get_unchecked(b);
                let qx = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
                let s = [
                    _mm256_madd_epi16(_mm256_maddubs_epi16(q[0], qx), ones),
                    _mm256_madd_epi16(_mm256_maddubs_epi16(q[1], qx), ones),
                    _mm256_madd_epi16(_mm256_maddubs_epi16(q[2], qx), ones),
                    _mm256_madd_epi16(_mm256_maddubs_epi16(q[3], qx), ones),
                ];
                let sums = _mm_sub_epi32(hsum4(s), _mm_set1_epi32(*sums8.get_unchecked(b)));
                let xd = _mm_cvtph_ps(_mm_set1_epi16(x.d.to_bits() as i16));
                let dd = _mm256_cvtps_pd(_mm_mul_ps(wd, xd));
                acc[i] = _mm256_fmadd_pd(_mm256_cvtepi32_pd(sums), dd, acc[i]);
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
    use crate::f64_dot::dot_f64;
    use crate::f64_dot::testing::pseudo;

    /// Block `b` of row `r`: every nibble pattern, scales of both signs.
    fn block(r: usize, b: usize) -> BlockQ4_0 {
        BlockQ4_0 {
            d: f16::from_f32(0.01 + 0.02 * pseudo(r * 97 + b)),
            qs: std::array::from_fn(|j| {
                (pseudo(r * 1000 + b * 16 + j + 99).to_bits() & 0xFF) as u8
            }),
        }
    }

    fn weight(n: usize, kb: usize) -> Vec<BlockQ4_0> {
        (0..n * kb).map(|i| block(i / kb, i % kb)).collect()
    }

    fn activations(m: usize, k: usize) -> Vec<f32> {
        (0..m * k).map(|i| 3.0 * pseudo(i + 5)).collect()
    }

    /// Every value of every kernel, for 1..9 activation rows (tiles of four and the rows
    /// left over), row counts that leave partial groups and block counts odd and even, is
    /// bit for bit the f64 dot product of the unpacked row (`dot_f64`, scalar).
    #[test]
    fn every_value_is_the_unpacked_rows_f64_dot() {
        let kernels = Kernel::under_test();
        for n in [1, 3, 4, 5, 8, 9] {
            for kb in [1, 2, 3, 5, 18] {
                let w = weight(n, kb);
                let packed = RepackedQ4_0::new(&w, n, kb * 32).unwrap();
                for m in 1..=9 {
                    let x = activations(m, kb * 32);
                    let mut xq = vec![BlockQ8_0::ZERO; m * kb];
                    quantize_row_q8_0(&x, &mut xq);
                    for &kernel in &kernels {
                        let mut y = vec![f64::NAN; m * n];
                        packed.matmul_f64(kernel, m, &x, &mut y).unwrap();
                        let mut y32 = vec![f32::NAN; m * n];
                        packed.matmul_f32(kernel, m, &x, &mut y32).unwrap();
                        for i in 0..m {
                            for j in 0..n {
                                let want = dot_f64(
                                    Kernel::Scalar,
                                    &w[j * kb..(j + 1) * kb],
                                    &xq[i * kb..(i + 1) * kb],
                                );
                                assert!(want.is_finite() && want != 0.0);
                                let got = y[i * n + j];
                                assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{kernel:?} n={n} kb={kb} m={m} ({i}, {j}): {got} != {want}"
                                );
                                assert_eq!(y32[i * n + j].to_bits(), (want as f32).to_bits());
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn blocks_and_rows_come_back_as_stored() {
        let (n, kb) = (7, 3);
        let w = weight(n, kb);
        let packed = RepackedQ4_0::new(&w, n, kb * 32).unwrap();
        assert_eq!((packed.n(), packed.k()), (7, 96));
        let mut row = vec![0f32; kb * 32];
        for r in 0..n {
            packed.dequantize_row(r, &mut row);
            for b in 0..kb {
                let blk = &w[r * kb + b];
                assert_eq!(packed.block(r, b), *blk);
                let d = blk.d.to_f32();
                for j in 0..16 {
                    assert_eq!(row[b * 32 + j], ((blk.qs[j] & 15) as f32 - 8.0) * d);
                    assert_eq!(row[b * 32 + j + 16], ((blk.qs[j] >> 4) as f32 - 8.0) * d);
                }
            }
        }
    }

    #[test]
    fn nan_activations_give_nan_and_bad_sizes_are_errors() {
        let w = weight(5, 2);
        let packed = RepackedQ4_0::new(&w, 5, 64).unwrap();
        for kernel in Kernel::under_test() {
            let mut x = activations(2, 64);
            x[70] = f32::NAN; // row 1, block 0
            let mut y = vec![0f32; 10];
            packed.matmul_f32(kernel, 2, &x, &mut y).unwrap();
            assert!(y[..5].iter().all(|v| v.is_finite()), "{kernel:?}: {y:?}");
            assert!(y[5..].iter().all(|v| v.is_nan()), "{kernel:?}: {y:?}");
            let err = packed
                .matmul_f32(kernel, 2, &x[..100], &mut y)
                .unwrap_err()
                .to_string();
            assert!(err.contains("Q4_0") && err.contains("100"), "{err}");
        }
        let err = RepackedQ4_0::new(&w, 5, 96).unwrap_err().to_string();
        assert!(
            err.contains("[5, 96]") && err.contains("10 blocks"),
            "{err}"
        );
        assert!(RepackedQ4_0::new(&w, 5, 40).is_err());
    }
}
