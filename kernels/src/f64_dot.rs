//! Quantized dot products accumulated in f64: a row's value does not depend on how its blocks
//! are split between ranks.
//!
//! A row-parallel layer gives each rank a range of every weight row's blocks and adds the
//! ranks' partial sums. Candle's kernels (and the crate's f32 Q4_1 kernel) accumulate the
//! blocks in f32 lanes, so the sum of 18 blocks on one rank and of 9 + 9 on two differ by an
//! ulp or so; the next layer rounds its input to 8 bits and an ulp sometimes flips a step, so
//! worlds 1, 2 and 3 drift apart by the size of that quantization noise (logits off by ~1,
//! greedy ids parting at near-ties).
//!
//! Here each block's contribution is an integer sum times a product of the block scales
//! (f16 × f16 or f16 × f32: exact in f64), and the blocks are added in f64, whose rounding is
//! 2⁻⁵³ of the largest term. The ranks' f64 partials are all-reduced in f64 and the total is
//! rounded to f32 once, so every world gets the f32 value of (almost exactly) the same real
//! sum: the results are equal except where that sum lies within ~10⁻¹⁶ of an f32 rounding
//! boundary.
//!
//! Each type describes its block's product once, in scalar code ([`F64Dot::block_dot`]), and
//! [`dot_f64`] adds the blocks one after the other: the reference every kernel is tested
//! against. The kernels themselves are the repacked engines ([`crate::repack`]), one per
//! instruction set (AVX2, AVX-512 VNNI), which multiply four or sixteen weight rows at a time
//! and give these sums bit for bit (tested); the block types describe to them how their
//! blocks unpack ([`crate::repack::Interleave`]).

use candle_core::Result;

/// A quantized weight block whose dot product with its activation blocks the crate computes
/// in f64.
///
/// # Safety
/// Implementors are `#[repr(C)]` plain data for which every bit pattern is valid, laid out as
/// GGUF stores the type, so that [`blocks_from_bytes`] may view a tensor's bytes as blocks.
pub unsafe trait F64Dot: Copy + Send + Sync + 'static {
    /// The activation block (what ggml and candle quantize an input row to for this type).
    type Act: Copy + Send + Sync + 'static;
    /// Values per weight block (and per activation block).
    const BLOCK: usize;
    /// The type's name as ggml spells it, for errors.
    const NAME: &'static str;
    /// An all-zero activation block, to size buffers.
    const ACT_ZERO: Self::Act;

    /// Quantizes `xs` (`ys.len() * BLOCK` values) into activation blocks, with candle 0.11's
    /// rounding for this type.
    fn quantize(xs: &[f32], ys: &mut [Self::Act]);

    /// One block's product in f64: its exact integer sum times the block scales.
    fn block_dot(w: &Self, x: &Self::Act) -> f64;
}

/// `Σ_b dot(w[b], x[b])` accumulated in f64, the blocks added one after the other: the
/// reference sum of one weight row (the matmuls, [`crate::repack::matmul_f64`] and
/// [`crate::repack::Repacked`], give it bit for bit, faster).
///
/// # Panics
/// If the slices differ in length.
pub fn dot_f64<B: F64Dot>(w: &[B], x: &[B::Act]) -> f64 {
    assert_eq!(
        w.len(),
        x.len(),
        "{} row of {} blocks against {} activation blocks",
        B::NAME,
        w.len(),
        x.len()
    );
    w.iter()
        .zip(x)
        .fold(0f64, |acc, (w, x)| acc + B::block_dot(w, x))
}

/// AVX2 helpers shared by the block types' kernels.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// The sums of the 8 i32 lanes of each of four vectors: `[Σ s0, Σ s1, Σ s2, Σ s3]`.
    #[inline(always)]
    pub unsafe fn hsum4(s: [__m256i; 4]) -> __m128i {
        let t0 = _mm256_hadd_epi32(s[0], s[1]);
        let t1 = _mm256_hadd_epi32(s[2], s[3]);
        let t2 = _mm256_hadd_epi32(t0, t1);
        _mm_add_epi32(_mm256_castsi256_si128(t2), _mm256_extracti128_si256(t2, 1))
    }

    /// The sum of the 8 f32 lanes of `v` (halves, then pairs, then the last two).
    #[inline(always)]
    pub unsafe fn hsum_ps(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// The 32 nibbles of the 16 bytes at `qs` as bytes 0..16, in ggml's order: the low
    /// nibbles are values 0..16 (the low lane), the high nibbles values 16..32.
    ///
    /// # Safety
    /// `qs` points to 16 readable bytes.
    #[inline(always)]
    pub unsafe fn nibbles(qs: *const u8) -> __m256i {
        // Both lanes hold the 16 bytes (a broadcast load); the high lane's 64-bit halves are
        // shifted right by 4, which brings every byte's high nibble down (the bits shifted in
        // from the next byte are masked off).
        let packed = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs as *const __m128i));
        let shifted = _mm256_srlv_epi64(packed, _mm256_setr_epi64x(0, 0, 4, 4));
        _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
    }

    /// Each bit of `bits` as a byte: byte `j` is `0xFF` where bit `j` is set, else 0 (the
    /// fifth bits of Q5_0 / Q5_1 values, ggml's `bytes_from_bits_32`).
    #[inline(always)]
    pub unsafe fn bit_bytes(bits: u32) -> __m256i {
        // Byte j gets byte j / 8 of `bits` (the shuffle works within each 128-bit lane, and
        // both lanes hold all four bytes), then keeps bit j % 8 of it.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_setr_epi64x(
                0,
                0x0101_0101_0101_0101,
                0x0202_0202_0202_0202,
                0x0303_0303_0303_0303,
            ),
        );
        let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select)
    }
}

/// Views GGUF bytes (a `QTensor`'s data) as blocks of `B`, without copying. Errors if the
/// length is not a whole number of blocks or the bytes are not aligned for `B`.
pub fn blocks_from_bytes<B: F64Dot>(bytes: &[u8]) -> Result<&[B]> {
    let size = std::mem::size_of::<B>();
    if !bytes.len().is_multiple_of(size) {
        candle_core::bail!(
            "{} data of {} bytes is not a whole number of {size}-byte blocks",
            B::NAME,
            bytes.len()
        )
    }
    if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<B>()) {
        candle_core::bail!(
            "{} data at {:p} is not {}-byte aligned",
            B::NAME,
            bytes.as_ptr(),
            std::mem::align_of::<B>()
        )
    }
    // SAFETY: length and alignment checked above; the trait's contract makes every bit
    // pattern a valid `B`.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const B, bytes.len() / size) })
}

/// Test helpers shared by the block types' tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Deterministic values in [-1, 1).
    pub fn pseudo(i: usize) -> f32 {
        let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        (x as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Activations that test a quantizer's rounding, blocks of `block` values: blocks whose
    /// largest magnitude is 127 (a scale of exactly 1, so that `k + 0.5` values are ties that
    /// round away from zero), pseudo-random blocks, zeros of both signs, subnormals (tiny,
    /// and large enough that the scale's inverse overflows), values near `f32::MAX`, an
    /// infinity and a NaN.
    pub fn quantizer_inputs(block: usize) -> Vec<f32> {
        let mut xs = Vec::new();
        for kind in 0..10 {
            for j in 0..block {
                xs.push(match kind {
                    0 | 1 if j == 0 => -127.0,
                    0 | 1 => (j as f32 - (block / 2) as f32) * (1.0 + kind as f32) + 0.5,
                    2 | 3 => 3.0 * pseudo(kind * 1000 + j),
                    4 => [0.0, -0.0][j % 2],
                    5 => f32::from_bits(1 + j as u32) * [1.0, -1.0][j % 2],
                    6 if j == 3 => f32::INFINITY,
                    7 if j == 5 => f32::NAN,
                    // Scales whose inverse overflows to infinity, and values near f32::MAX.
                    8 => 1e-39 * pseudo(j + 77),
                    9 => 3e38 * pseudo(j + 78),
                    _ => pseudo(j) * 1e-3,
                });
            }
        }
        xs
    }

    /// The bytes of `blocks` (plain data), for comparisons that a NaN does not defeat.
    pub fn bytes_of<T: Copy>(blocks: &[T]) -> Vec<u8> {
        // SAFETY: reading a slice of plain `Copy` data of repr(C) block types, without padding.
        unsafe {
            std::slice::from_raw_parts(blocks.as_ptr() as *const u8, std::mem::size_of_val(blocks))
        }
        .to_vec()
    }

    /// Quantizes pseudo-random weights with candle's `QTensor::quantize` to `dtype`, views
    /// the blocks as `B`, and checks `dot_f64` against the f64 dot product of candle's
    /// dequantized weights with the dequantized activation blocks (`act`), for several block
    /// counts, plus `extra` per block (what the format adds besides the values); within
    /// `tol` relative.
    pub fn check_against_candle<B: F64Dot>(
        dtype: candle_core::quantized::GgmlDType,
        act: impl Fn(&B::Act) -> Vec<f64>,
        extra: impl Fn(&B, &B::Act) -> f64,
        tol: f64,
    ) {
        use candle_core::{quantized::QTensor, Device, Tensor};
        for nb in [1usize, 2, 3, 5, 6, 9] {
            let k = nb * B::BLOCK;
            let wf: Vec<f32> = (0..k).map(|i| pseudo(i) * 0.2 - 0.03).collect();
            let qt = QTensor::quantize(&Tensor::from_vec(wf, (1, k), &Device::Cpu).unwrap(), dtype)
                .unwrap();
            let bytes = qt.data().unwrap();
            let w = blocks_from_bytes::<B>(&bytes).unwrap();
            assert_eq!(w.len(), nb);
            let wd: Vec<f32> = qt
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let x: Vec<f32> = (0..k)
                .map(|i| pseudo(i + 1000) * 3.0 + if i % 97 == 5 { 20.0 } else { 0.0 })
                .collect();
            let mut xq = vec![B::ACT_ZERO; nb];
            B::quantize(&x, &mut xq);
            let xd: Vec<f64> = xq.iter().flat_map(&act).collect();
            let want: f64 = wd.iter().zip(&xd).map(|(&a, &b)| a as f64 * b).sum::<f64>()
                + w.iter().zip(&xq).map(|(w, x)| extra(w, x)).sum::<f64>();
            let got = dot_f64(w, &xq);
            assert!(
                got.is_finite() && want.is_finite(),
                "{}: {got} {want}",
                B::NAME
            );
            assert!(
                (got - want).abs() <= tol * (1.0 + want.abs()) && want.abs() > 1e-3,
                "{} nb={nb}: block_dot sum {got}, dequantized {want}",
                B::NAME
            );
        }
    }

    /// `N` deterministic pseudo-random bytes, `i` their seed.
    pub fn pseudo_bytes<const N: usize>(i: usize) -> [u8; N] {
        std::array::from_fn(|j| (pseudo(i * 131 + j + 99).to_bits() >> 3) as u8)
    }

    /// A row's f64 sum split into block ranges as row-parallel ranks split it (2 and 3 parts,
    /// uneven, odd part sizes included), the parts' sums added in f64: the same f32 value as
    /// the whole row's, and the same f64 value within 2⁻⁵⁰ of the blocks' magnitudes.
    pub fn split_sums_round_alike<B: F64Dot>(block: impl Fn(usize) -> B) {
        for nb in [6usize, 7, 18, 19] {
            let w: Vec<B> = (0..nb).map(&block).collect();
            let x: Vec<f32> = (0..nb * B::BLOCK)
                .map(|i| pseudo(i + 5000) * 2.0 + if i % 53 == 11 { 15.0 } else { 0.0 })
                .collect();
            let mut xq = vec![B::ACT_ZERO; nb];
            B::quantize(&x, &mut xq);
            let mag: f64 = w
                .iter()
                .zip(&xq)
                .map(|(w, x)| B::block_dot(w, x).abs())
                .sum();
            let cuts = [
                vec![0, nb / 2, nb],
                vec![0, nb / 2 + 1, nb],
                vec![0, 1, nb],
                vec![0, nb / 3, 2 * nb / 3 + 1, nb],
            ];
            let whole = dot_f64(&w, &xq);
            assert!(
                whole.is_finite() && mag > 1e-3,
                "{} nb={nb}: {whole}",
                B::NAME
            );
            for cut in &cuts {
                let parts: f64 = cut
                    .windows(2)
                    .map(|r| dot_f64(&w[r[0]..r[1]], &xq[r[0]..r[1]]))
                    .sum();
                assert!(parts.is_finite(), "{} {cut:?}", B::NAME);
                assert!(
                    (parts - whole).abs() <= mag * 2f64.powi(-50),
                    "{} nb={nb} split {cut:?}: {parts} vs {whole}",
                    B::NAME
                );
                assert_eq!(
                    parts as f32,
                    whole as f32,
                    "{} nb={nb} split {cut:?}",
                    B::NAME
                );
            }
        }
    }

    /// A NaN among the activations makes the product NaN (the quantizer must not round it to a
    /// finite block), and so does an infinity.
    pub fn nan_and_inf_activations_propagate<B: F64Dot>(dtype: candle_core::quantized::GgmlDType) {
        use candle_core::{quantized::QTensor, Device, Tensor};
        let nb = 3;
        let k = nb * B::BLOCK;
        let wf: Vec<f32> = (0..k).map(|i| pseudo(i + 77) * 0.2 - 0.03).collect();
        let qt =
            QTensor::quantize(&Tensor::from_vec(wf, (1, k), &Device::Cpu).unwrap(), dtype).unwrap();
        let bytes = qt.data().unwrap();
        let ws = blocks_from_bytes::<B>(&bytes).unwrap();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x: Vec<f32> = (0..nb * B::BLOCK).map(|i| pseudo(i) * 2.0).collect();
            x[B::BLOCK + 5] = bad;
            let mut xq = vec![B::ACT_ZERO; nb];
            B::quantize(&x, &mut xq);
            let got = dot_f64(ws, &xq);
            assert!(
                got.is_nan(),
                "{}: an activation {bad} gave {got}, not NaN",
                B::NAME
            );
        }
    }
}
