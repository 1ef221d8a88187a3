//! The pieces of attention that the row-by-row kernels (`attention.rs`) and the blocked
//! prompt kernels (`attention/blocks.rs`) share: the shape of a task's query rows, a causal
//! row's softmax in either lane width, and the eight-lane dot product.

/// The softmax of `row` in place: minus the largest value, exponentials, divided by their sum
/// (all NaN if any value is NaN, as Candle's softmax gives).
#[inline(always)]
pub(super) fn softmax_in_place(row: &mut [f32], lanes: Lanes) {
    #[cfg(target_arch = "x86_64")]
    if let Lanes::Avx2 = lanes {
        // SAFETY: `Lanes::Avx2` is only passed from a function that enables avx2 and fma.
        return unsafe { softmax_avx2(row) };
    }
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| {
        if s.is_nan() || m.is_nan() {
            f32::NAN
        } else {
            m.max(s)
        }
    });
    row.iter_mut().for_each(|s| *s -= max);
    row.iter_mut().for_each(|x| *x = x.exp());
    let sum: f32 = row.iter().sum();
    row.iter_mut().for_each(|p| *p /= sum);
}

/// [`softmax_in_place`] in eight lanes: the maximum, then the exponentials and their sum in
/// one pass, then one multiplication by the sum's inverse (the scalar form's serial `max` and
/// sum took a third of a prompt's blocked attention). A NaN makes the row NaN without being
/// the maximum: its exponential, hence the sum, is NaN.
///
/// # Safety
/// The CPU must support avx2 and fma (inline this into a function that enables them).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn softmax_avx2(row: &mut [f32]) {
    use std::arch::x86_64::*;
    let whole = row.len() / 8 * 8;
    let (body, tail) = row.split_at_mut(whole);
    let p = body.as_mut_ptr();
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    for i in (0..whole).step_by(8) {
        m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(i)));
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_movehdup_ps(m));
    let max = tail.iter().fold(_mm_cvtss_f32(m), |m, &x| m.max(x));
    let vmax = _mm256_set1_ps(max);
    let mut sum = _mm256_setzero_ps();
    for i in (0..whole).step_by(8) {
        let e = crate::swiglu::avx2::exp(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), vmax));
        _mm256_storeu_ps(p.add(i), e);
        sum = _mm256_add_ps(sum, e);
    }
    let sum = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    let sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    let mut sum = _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
    for x in tail.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = 1.0 / sum;
    let vinv = _mm256_set1_ps(inv);
    for i in (0..whole).step_by(8) {
        _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), vinv));
    }
    tail.iter_mut().for_each(|x| *x *= inv);
}

/// How [`group`] computes exponentials.
#[derive(Clone, Copy)]
pub(super) enum Lanes {
    /// libm's `expf`, one value at a time.
    Scalar,
    /// [`crate::swiglu`]'s eight-lane exponential (within 2 ulp of `expf`).
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

/// `Σ a·b` in eight lanes of fused multiply-adds (added in a fixed order), the tail after.
#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let whole = a.len() / 8 * 8;
    for (x, y) in a[..whole].chunks_exact(8).zip(b[..whole].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (x, y) in a[whole..].iter().zip(&b[whole..]) {
        s = x.mul_add(*y, s);
    }
    s
}

/// A buffer, the offset of position 0 of one head, and the stride of positions.
pub(super) type Strided<'a> = (&'a [f32], usize, usize);

/// What one task's query rows are: `queries` rows per head, the last of `positions`, with the
/// window, the head size and the scale.
#[derive(Clone, Copy)]
pub(super) struct Rows {
    pub(super) queries: usize,
    pub(super) positions: usize,
    pub(super) window: usize,
    pub(super) d: usize,
    pub(super) scale: f32,
}
