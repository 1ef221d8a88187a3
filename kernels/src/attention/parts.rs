//! The pieces of attention that the row-by-row kernels (`attention.rs`) and the blocked
//! prompt kernels (`attention/blocks.rs`) share: the shape of a task's query rows, a causal
//! row's softmax in either lane width, and the eight-lane dot product.

use super::KvElement;

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

/// `Σ a·b` in eight lanes of fused multiply-adds (added in a fixed order), the tail after
/// ([`dot_avx2`] is the same sums in one 256-bit register).
#[inline(always)]
pub(super) fn dot<T: KvElement>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [0f32; 8];
    let whole = a.len() / 8 * 8;
    for (x, y) in a[..whole].chunks_exact(8).zip(b[..whole].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l].get(), acc[l]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (x, y) in a[whole..].iter().zip(&b[whole..]) {
        s = x.mul_add(y.get(), s);
    }
    s
}

/// [`dot`] in one 256-bit register: lane `l` sums `a[8i + l] · b[8i + l]` over `i` with fused
/// multiply-adds, the lanes are added as `((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))`, then the
/// tail: the scalar form's sums, bit for bit. (Written out because the compiler turned the
/// scalar form's eight accumulators into four two-lane registers, loaded eight bytes at a
/// time: half of a decode step's attention time, by `perf annotate`.)
///
/// # Safety
/// The CPU must support avx2 and fma, and f16c where `T` is f16 (inline this into a function
/// that enables them).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_avx2<T: KvElement>(a: &[f32], b: &[T]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let whole = n / 8 * 8;
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = _mm256_setzero_ps();
    for i in (0..whole).step_by(8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), T::load8(pb.add(i)), acc);
    }
    // [0 + 4, 1 + 5, 2 + 6, 3 + 7], then [(0 + 4) + (2 + 6), (1 + 5) + (3 + 7)], then their sum.
    let t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    let u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    let mut s = _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
    for (x, y) in a[whole..n].iter().zip(&b[whole..n]) {
        s = x.mul_add(y.get(), s);
    }
    s
}

/// The scores `scale · q_j · K[t]` of a group's `g` query vectors `q` (`g · d` values) against
/// the key rows `K[t]` at `k[k0 + t · k_pos ..]`, `t < positions`, into `scores[j · positions +
/// t]`: [`dot`]'s sums bit for bit, four positions at a time (four independent chains of
/// multiply-adds against one load of the query, their lanes added in [`dot`]'s order by one
/// transpose of four registers).
///
/// # Safety
/// The CPU must support avx2 and fma, and f16c where `T` is f16 (inline this into a function
/// that enables them).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn scores_avx2<T: KvElement>(
    q: &[f32],
    (k, k0, k_pos): Strided<'_, T>,
    positions: usize,
    d: usize,
    scale: f32,
    scores: &mut [f32],
) {
    use std::arch::x86_64::*;
    if positions == 0 || d == 0 {
        return;
    }
    let g = q.len() / d;
    assert!(
        k0 + (positions - 1) * k_pos + d <= k.len() && scores.len() >= g * positions,
        "attention: key rows past their buffer"
    );
    let whole = d / 8 * 8;
    let kp = k.as_ptr().add(k0);
    let vscale = _mm_set1_ps(scale);
    for j in 0..g {
        let qj = &q[j * d..(j + 1) * d];
        let qp = qj.as_ptr();
        let out = &mut scores[j * positions..(j + 1) * positions];
        let mut t = 0;
        while t + 4 <= positions {
            let rows = [0, 1, 2, 3].map(|i| kp.add((t + i) * k_pos));
            let mut acc = [_mm256_setzero_ps(); 4];
            for c in (0..whole).step_by(8) {
                let x = _mm256_loadu_ps(qp.add(c));
                for (a, row) in acc.iter_mut().zip(rows) {
                    *a = _mm256_fmadd_ps(x, T::load8(row.add(c)), *a);
                }
            }
            // Per register [0 + 4, 1 + 5, 2 + 6, 3 + 7]; then, across the four, the sums
            // (0 + 4) + (2 + 6) and (1 + 5) + (3 + 7), and their sum: `dot`'s order.
            let h = acc.map(|a| _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)));
            let ab = _mm_add_ps(_mm_unpacklo_ps(h[0], h[1]), _mm_unpackhi_ps(h[0], h[1]));
            let cd = _mm_add_ps(_mm_unpacklo_ps(h[2], h[3]), _mm_unpackhi_ps(h[2], h[3]));
            let mut sums = [0f32; 4];
            _mm_storeu_ps(
                sums.as_mut_ptr(),
                _mm_add_ps(_mm_movelh_ps(ab, cd), _mm_movehl_ps(cd, ab)),
            );
            if whole == d {
                _mm_storeu_ps(
                    out.as_mut_ptr().add(t),
                    _mm_mul_ps(_mm_loadu_ps(sums.as_ptr()), vscale),
                );
            } else {
                for (i, s) in sums.iter_mut().enumerate() {
                    let key = std::slice::from_raw_parts(rows[i], d);
                    for (x, y) in qj[whole..].iter().zip(&key[whole..]) {
                        *s = x.mul_add(y.get(), *s);
                    }
                    out[t + i] = *s * scale;
                }
            }
            t += 4;
        }
        for (t, o) in out.iter_mut().enumerate().skip(t) {
            let key = std::slice::from_raw_parts(kp.add(t * k_pos), d);
            *o = dot_avx2(qj, key) * scale;
        }
    }
}

/// `out = Σ_t p[t] · V[t]` over the value rows `V[t]` at `v[v0 + t · v_pos ..]` (`out.len()`
/// components each), each component summed over `t` in order with fused multiply-adds from
/// 0, as [`group`](super::group)'s scalar loop sums it (the same bits). The components go in
/// runs of up to 64 held in eight registers over all the positions, instead of the output row
/// loaded and stored again for every position (its stores bound a decode step's attention).
///
/// # Safety
/// The CPU must support avx2 and fma, and f16c where `T` is f16 (inline this into a function
/// that enables them).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn weighted_sum_avx2<T: KvElement>(
    p: &[f32],
    (v, v0, v_pos): Strided<'_, T>,
    out: &mut [f32],
) {
    let d = out.len();
    if let Some(t) = p.len().checked_sub(1) {
        // Every read below is within the last row's `d` components.
        assert!(
            v0 + t * v_pos + d <= v.len(),
            "attention: value rows past their buffer"
        );
    }
    let whole = d / 8 * 8;
    let mut c = 0;
    while c < whole {
        let run = &mut out[c..c + (whole - c).min(64)];
        let at = v.as_ptr().add(v0 + c);
        match run.len() / 8 {
            8 => weighted_run::<T, 8>(p, at, v_pos, run),
            7 => weighted_run::<T, 7>(p, at, v_pos, run),
            6 => weighted_run::<T, 6>(p, at, v_pos, run),
            5 => weighted_run::<T, 5>(p, at, v_pos, run),
            4 => weighted_run::<T, 4>(p, at, v_pos, run),
            3 => weighted_run::<T, 3>(p, at, v_pos, run),
            2 => weighted_run::<T, 2>(p, at, v_pos, run),
            _ => weighted_run::<T, 1>(p, at, v_pos, run),
        }
        c += run.len();
    }
    for (i, o) in out.iter_mut().enumerate().skip(whole) {
        *o = p.iter().enumerate().fold(0.0, |acc, (t, &w)| {
            w.mul_add(v[v0 + t * v_pos + i].get(), acc)
        });
    }
}

/// [`weighted_sum_avx2`]'s run of `N` registers: `out[..8N] = Σ_t p[t] · row_t[..8N]`, row `t`
/// at `v + t · v_pos`.
///
/// # Safety
/// avx2 and fma (and f16c for f16); `v + t · v_pos + 8N` within the buffer for every
/// `t < p.len()`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn weighted_run<T: KvElement, const N: usize>(
    p: &[f32],
    v: *const T,
    v_pos: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); N];
    for (t, &w) in p.iter().enumerate() {
        let w = _mm256_set1_ps(w);
        let row = v.add(t * v_pos);
        for (u, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(w, T::load8(row.add(8 * u)), *a);
        }
    }
    for (u, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.as_mut_ptr().add(8 * u), *a);
    }
}

/// A buffer, the offset of position 0 of one head, and the stride of positions.
pub(super) type Strided<'a, T = f32> = (&'a [T], usize, usize);

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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::f64_dot::testing::pseudo;
    use crate::kernel::Kernel;

    #[target_feature(enable = "avx2,fma")]
    unsafe fn scores(q: &[f32], k: Strided<'_>, positions: usize, d: usize) -> Vec<f32> {
        let mut s = vec![f32::NAN; q.len() / d * positions];
        scores_avx2(q, k, positions, d, 0.3, &mut s);
        s
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn weighted(p: &[f32], v: Strided<'_>, d: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; d];
        weighted_sum_avx2(p, v, &mut out);
        out
    }

    /// The written-out AVX2 score and weighted-sum loops give the scalar forms' sums bit for
    /// bit: head sizes with and without a tail of lanes and past one run of 64, position
    /// counts around the blocks of four, strided rows, NaN and infinite inputs.
    #[test]
    fn avx2_scores_and_weighted_sums_are_the_scalar_sums() {
        if !Kernel::under_test().contains(&Kernel::Avx2) {
            eprintln!("not run: AVX2 is not under test");
            return;
        }
        for d in [1, 3, 8, 13, 16, 64, 72, 128, 136] {
            for positions in [1, 3, 4, 5, 8, 11] {
                for g in [1, 3] {
                    let k_pos = d + 5;
                    let mut k: Vec<f32> =
                        (0..7 + positions * k_pos).map(|i| pseudo(i + 17)).collect();
                    let mut q: Vec<f32> = (0..g * d).map(|i| pseudo(i + 1000)).collect();
                    let mut p: Vec<f32> = (0..positions).map(|i| pseudo(i + 3000).abs()).collect();
                    if positions > 4 && d > 2 {
                        k[7 + 2 * k_pos + 1] = f32::NAN;
                        q[d - 1] = f32::INFINITY;
                        p[positions - 1] = f32::NAN;
                    }
                    let got = unsafe { scores(&q, (&k, 7, k_pos), positions, d) };
                    for j in 0..g {
                        for t in 0..positions {
                            let key = &k[7 + t * k_pos..7 + t * k_pos + d];
                            let want = dot(&q[j * d..(j + 1) * d], key) * 0.3;
                            let at = got[j * positions + t];
                            assert!(
                                want.to_bits() == at.to_bits() || (want.is_nan() && at.is_nan()),
                                "score d {d} positions {positions} head {j} row {t}: {at} against {want}"
                            );
                        }
                    }
                    let got = unsafe { weighted(&p, (&k, 7, k_pos), d) };
                    for (c, &at) in got.iter().enumerate() {
                        let want =
                            (0..positions).fold(0f32, |o, t| p[t].mul_add(k[7 + t * k_pos + c], o));
                        assert!(
                            want.to_bits() == at.to_bits() || (want.is_nan() && at.is_nan()),
                            "weighted sum d {d} positions {positions} component {c}: {at} against {want}"
                        );
                    }
                }
            }
        }
    }
}
