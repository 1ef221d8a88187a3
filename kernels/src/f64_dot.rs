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
//! Each type has a scalar block product ([`F64Dot::block_dot`], the reference: blocks added one
//! after the other) and an AVX2 kernel ([`Kernel::Avx2`], chosen at run time) that computes
//! the integer sums 32 lanes at a time (`maddubs`/`madd`, as ggml's kernels do), four 32-wide
//! blocks' sums at once, and then adds the blocks' f64 products in the same order as the
//! scalar code: the two give bit-identical results (tested).

use crate::kernel::Kernel;
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

    /// The AVX2 kernel: what adding [`F64Dot::block_dot`] block after block gives, bit for
    /// bit. Call [`dot_f64`].
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; `w` and `x` have the same length.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn dot_avx2(w: &[Self], x: &[Self::Act]) -> f64;
}

/// The scalar kernel: blocks added one after the other.
fn dot_scalar<B: F64Dot>(w: &[B], x: &[B::Act]) -> f64 {
    w.iter()
        .zip(x)
        .fold(0f64, |acc, (w, x)| acc + B::block_dot(w, x))
}

/// `Σ_b dot(w[b], x[b])` accumulated in f64, with the chosen kernel.
///
/// # Panics
/// If the slices differ in length, or `kernel` is not available on this CPU.
pub fn dot_f64<B: F64Dot>(kernel: Kernel, w: &[B], x: &[B::Act]) -> f64 {
    assert_eq!(
        w.len(),
        x.len(),
        "{} row of {} blocks against {} activation blocks",
        B::NAME,
        w.len(),
        x.len()
    );
    crate::kernel::by_kernel!(kernel,
        scalar => dot_scalar(w, x),
        // The lengths were checked at the top.
        avx2 => B::dot_avx2(w, x))
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

    /// The sum of the 8 i32 lanes of `v`.
    #[inline(always)]
    pub unsafe fn hsum(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    /// The first four bytes of each of four blocks (two f16: a block's scales) as eight
    /// f32 `[a0, b0, a1, b1, a2, b2, a3, b3]`.
    #[inline(always)]
    pub unsafe fn f16_pairs<T>(blocks: *const T) -> __m256 {
        let word = |t: usize| std::ptr::read_unaligned(blocks.add(t) as *const i32);
        _mm256_cvtph_ps(_mm_setr_epi32(word(0), word(1), word(2), word(3)))
    }

    /// Lanes `[0, 2, 4, 6]` of `v` in the low half, `[1, 3, 5, 7]` in the high half.
    #[inline(always)]
    pub unsafe fn deinterleave(v: __m256) -> __m256 {
        _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7))
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

    /// `acc + p[0] + … + p[n - 1]` (`n ≤ 4`), added in that order (as the scalar kernel does).
    #[inline(always)]
    unsafe fn add_in_order(acc: f64, p: __m256d, n: usize) -> f64 {
        let mut v = [0f64; 4];
        _mm256_storeu_pd(v.as_mut_ptr(), p);
        v[..n].iter().fold(acc, |a, &x| a + x)
    }

    /// The driver of the four-block kernels: `Σ_b dot(w[b], x[b])` in f64, where `four(w, x)`
    /// gives the f64 products of blocks `w[0..4]` and `x[0..4]`, added to the total in block
    /// order; a last group of fewer than four runs on copies padded with zero blocks
    /// (`zero` and `B::ACT_ZERO`), whose lanes are not added. When `four`'s lanes are
    /// [`super::F64Dot::block_dot`]'s values, the result is the scalar sum's, bit for bit.
    ///
    /// # Safety
    /// `four`'s requirements (the CPU features of its intrinsics); `w` and `x` have the same
    /// length. Inlined, with `four`, into the `#[target_feature]` function that calls it, so
    /// that the intrinsics compile with its features.
    #[inline(always)]
    pub unsafe fn dot_by_fours<B: super::F64Dot>(
        w: &[B],
        x: &[B::Act],
        zero: B,
        four: impl Fn(*const B, *const B::Act) -> __m256d,
    ) -> f64 {
        let quads = w.len() / 4 * 4;
        let mut acc = 0f64;
        for b in (0..quads).step_by(4) {
            acc = add_in_order(acc, four(w.as_ptr().add(b), x.as_ptr().add(b)), 4);
        }
        let n = w.len() - quads;
        if n > 0 {
            let (mut wt, mut xt) = ([zero; 4], [B::ACT_ZERO; 4]);
            wt[..n].copy_from_slice(&w[quads..]);
            xt[..n].copy_from_slice(&x[quads..]);
            acc = add_in_order(acc, four(wt.as_ptr(), xt.as_ptr()), n);
        }
        acc
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
    /// `tol` relative. And the AVX2 kernel against the scalar one, bit for bit.
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
            // Each kernel under test against the dequantized product, and every kernel
            // against the first (the scalar one unless CANDLE_TP_KERNEL forces another) bit
            // for bit.
            let mut first: Option<(Kernel, f64)> = None;
            for kernel in Kernel::under_test() {
                let got = dot_f64(kernel, w, &xq);
                assert!(
                    got.is_finite() && want.is_finite(),
                    "{} {kernel:?}: {got} {want}",
                    B::NAME
                );
                assert!(
                    (got - want).abs() <= tol * (1.0 + want.abs()) && want.abs() > 1e-3,
                    "{} nb={nb} {kernel:?}: kernel {got}, dequantized {want}",
                    B::NAME
                );
                match first {
                    None => first = Some((kernel, got)),
                    Some((k0, v0)) => assert_eq!(
                        got.to_bits(),
                        v0.to_bits(),
                        "{} nb={nb}: {kernel:?} {got} {k0:?} {v0}",
                        B::NAME
                    ),
                }
            }
        }
    }

    /// `N` deterministic pseudo-random bytes, `i` their seed.
    pub fn pseudo_bytes<const N: usize>(i: usize) -> [u8; N] {
        std::array::from_fn(|j| (pseudo(i * 131 + j + 99).to_bits() >> 3) as u8)
    }

    /// A row's f64 sum split into block ranges as row-parallel ranks split it (2 and 3 parts,
    /// uneven, odd part sizes included), the parts' sums added in f64: the same f32 value as
    /// the whole row's, and the same f64 value within 2⁻⁵⁰ of the blocks' magnitudes, with
    /// every kernel under test (and the same bits from every kernel).
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
            let mut first: Option<f64> = None;
            for kernel in Kernel::under_test() {
                let whole = dot_f64(kernel, &w, &xq);
                assert!(
                    whole.is_finite() && mag > 1e-3,
                    "{} nb={nb}: {whole}",
                    B::NAME
                );
                if let Some(v) = first {
                    assert_eq!(whole.to_bits(), v.to_bits(), "{} {kernel:?}", B::NAME);
                }
                first = Some(whole);
                for cut in &cuts {
                    let parts: f64 = cut
                        .windows(2)
                        .map(|r| dot_f64(kernel, &w[r[0]..r[1]], &xq[r[0]..r[1]]))
                        .sum();
                    assert!(parts.is_finite(), "{} {kernel:?} {cut:?}", B::NAME);
                    assert!(
                        (parts - whole).abs() <= mag * 2f64.powi(-50),
                        "{} {kernel:?} nb={nb} split {cut:?}: {parts} vs {whole}",
                        B::NAME
                    );
                    assert_eq!(
                        parts as f32,
                        whole as f32,
                        "{} {kernel:?} nb={nb} split {cut:?}",
                        B::NAME
                    );
                }
            }
        }
    }

    /// A NaN among the activations makes the product NaN with every kernel under test (the
    /// quantizer must not round it to a finite block), and so does an infinity.
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
            for kernel in Kernel::under_test() {
                let got = dot_f64(kernel, ws, &xq);
                assert!(
                    got.is_nan(),
                    "{} {kernel:?}: an activation {bad} gave {got}, not NaN",
                    B::NAME
                );
            }
        }
    }
}
