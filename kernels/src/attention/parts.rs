//! The pieces of attention that the row-by-row kernels (`attention.rs`) and the blocked
//! prompt kernels (`attention/blocks.rs`) share: the shape of a task's query rows, a causal
//! row's softmax in either lane width, the sixteen-lane dot product and its AVX2 loops, and their
//! prefetches.

use super::KvElement;

/// The softmax of `row` in place: minus the largest value, exponentials, divided by their sum
/// (all NaN if any value is NaN, as Candle's softmax gives).
#[inline(always)]
pub(super) fn softmax_in_place(row: &mut [f32], lanes: Lanes) {
    #[cfg(target_arch = "x86_64")]
    if let Lanes::Avx2 | Lanes::Avx512 = lanes {
        // SAFETY: `Lanes::Avx2` and `Lanes::Avx512` are only passed from functions that
        // enable avx2 and fma.
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
    /// [`Lanes::Avx2`]'s exponential, with the decode loops on 512-bit vectors
    /// ([`super::wide`]; the same sums, bit for bit).
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// `Σ a·b` in sixteen lanes of fused multiply-adds: lane `l` sums `a[16i + l] · b[16i + l]`
/// over the whole chunks of 16, lanes 0-7 then take a last half chunk of 8 where one is left,
/// the lanes are added as `t_l = s_l + s_{l+8}` and `((t0 + t4) + (t2 + t6)) + ((t1 + t5) +
/// (t3 + t7))`, then the tail (under 8) in order. The AVX2 loops ([`dot_avx2`],
/// [`scores_avx2`]: two eight-lane registers) and the AVX-512 ones ([`super::wide`]: one
/// sixteen-lane register) give these sums bit for bit.
#[inline(always)]
pub(super) fn dot<T: KvElement>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [0f32; 16];
    let whole = a.len() / 16 * 16;
    for (x, y) in a[..whole].chunks_exact(16).zip(b[..whole].chunks_exact(16)) {
        for l in 0..16 {
            acc[l] = x[l].mul_add(y[l].get(), acc[l]);
        }
    }
    let end = half_chunk_end(a.len());
    for l in 0..end - whole {
        acc[l] = a[whole + l].mul_add(b[whole + l].get(), acc[l]);
    }
    let t: [f32; 8] = std::array::from_fn(|l| acc[l] + acc[l + 8]);
    let mut s = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
    for (x, y) in a[end..].iter().zip(&b[end..]) {
        s = x.mul_add(y.get(), s);
    }
    s
}

/// Where [`dot`]'s lanes end for `n` components: the whole chunks of 16, plus a half chunk of
/// 8 where one is left; the components from there on are the sequential tail.
#[inline(always)]
pub(super) fn half_chunk_end(n: usize) -> usize {
    let whole = n / 16 * 16;
    if n - whole >= 8 {
        whole + 8
    } else {
        whole
    }
}

/// The sum of an eight-lane register as [`dot`] adds its lanes `t`: `((t0 + t4) + (t2 + t6)) +
/// ((t1 + t5) + (t3 + t7))`.
///
/// # Safety
/// The CPU must support avx (inline this into a function that enables it).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn hsum8(acc: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    // [0 + 4, 1 + 5, 2 + 6, 3 + 7], then [(0 + 4) + (2 + 6), (1 + 5) + (3 + 7)], then their sum.
    let t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    let u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)))
}

/// [`hsum8`] of four registers at once, by one transpose: `[Σ acc[0], .., Σ acc[3]]`, each
/// added in [`dot`]'s order.
///
/// # Safety
/// The CPU must support avx (inline this into a function that enables it).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn hsum8x4(acc: [std::arch::x86_64::__m256; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    // Per register [0 + 4, 1 + 5, 2 + 6, 3 + 7]; then, across the four, the sums (0 + 4) +
    // (2 + 6) and (1 + 5) + (3 + 7), and their sum.
    let mut h = [_mm_setzero_ps(); 4];
    for (h, a) in h.iter_mut().zip(acc) {
        *h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    }
    let ab = _mm_add_ps(_mm_unpacklo_ps(h[0], h[1]), _mm_unpackhi_ps(h[0], h[1]));
    let cd = _mm_add_ps(_mm_unpacklo_ps(h[2], h[3]), _mm_unpackhi_ps(h[2], h[3]));
    let mut sums = [0f32; 4];
    _mm_storeu_ps(
        sums.as_mut_ptr(),
        _mm_add_ps(_mm_movelh_ps(ab, cd), _mm_movehl_ps(cd, ab)),
    );
    sums
}

/// [`dot`] in two 256-bit registers (lanes 0-7 and 8-15 of each chunk of 16), added into one
/// before [`hsum8`]: the scalar form's sums, bit for bit.
///
/// # Safety
/// The CPU must support avx2 and fma, and f16c where `T` is f16 (inline this into a function
/// that enables them).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn dot_avx2<T: KvElement>(a: &[f32], b: &[T]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (whole, end) = (n / 16 * 16, half_chunk_end(n));
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for i in (0..whole).step_by(16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), T::load8(pb.add(i)), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), T::load8(pb.add(i + 8)), hi);
    }
    if end > whole {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(whole)), T::load8(pb.add(whole)), lo);
    }
    let mut s = hsum8(_mm256_add_ps(lo, hi));
    for (x, y) in a[end..n].iter().zip(&b[end..n]) {
        s = x.mul_add(y.get(), s);
    }
    s
}

/// Four positions' scores from their lane sums (`sums[i]`, key row `i` at `rows[i]`): the
/// tail components `end..d` added in order, as [`dot`] adds them, then times `scale`, into
/// `out[..4]`.
///
/// # Safety
/// `d` elements readable at every `rows[i]`.
#[inline(always)]
pub(super) unsafe fn finish_scores<T: KvElement>(
    sums: [f32; 4],
    rows: [*const T; 4],
    (q, end): (&[f32], usize),
    scale: f32,
    out: &mut [f32],
) {
    for ((o, mut s), row) in out[..4].iter_mut().zip(sums).zip(rows) {
        let key = std::slice::from_raw_parts(row, q.len());
        for (x, y) in q[end..].iter().zip(&key[end..]) {
            s = x.mul_add(y.get(), s);
        }
        *o = s * scale;
    }
}

/// Checks what a score loop reads and writes: every key and value row of `positions` within
/// its buffer, room for the `q.len() / d` heads' scores. `false` when there is nothing to
/// compute (no position or an empty head).
///
/// # Panics
/// Where a row is past its buffer or the scores do not fit.
pub(super) fn check_rows<T>(
    q: &[f32],
    (k, k0, k_pos): Strided<'_, T>,
    (v, v0, v_pos): Strided<'_, T>,
    positions: usize,
    d: usize,
    scores: &[f32],
) -> bool {
    if positions == 0 || d == 0 {
        return false;
    }
    assert!(
        k0 + (positions - 1) * k_pos + d <= k.len() && scores.len() >= q.len() / d * positions,
        "attention: key rows past their buffer"
    );
    assert!(
        v0 + (positions - 1) * v_pos + d <= v.len(),
        "attention: value rows past their buffer"
    );
    true
}

/// The software prefetches of a group's score loop, four positions at a time: the key rows
/// [`Prefetch::AHEAD`] positions ahead (and the first ones at the start), and the value rows of
/// the positions being scored, so that the weighted sums after the softmax find them in the
/// core's cache. A decode step's caches come from memory (30 layers of 16 sequences do not
/// fit in a core's cache), and each KV head's rows are a short stream that the hardware
/// prefetcher picks up late: on a Zen 5 core, `bench_attention` at 64-1024 cached positions
/// measured 1.3-1.6x (f32 cache) and 1.4-1.6x (f16) the time without them.
#[cfg(target_arch = "x86_64")]
pub(super) struct Prefetch<T> {
    keys: (*const T, usize),
    values: (*const T, usize),
    positions: usize,
    row_bytes: usize,
    on: bool,
}

#[cfg(target_arch = "x86_64")]
impl<T> Prefetch<T> {
    /// Key rows prefetched ahead of the one being scored.
    pub(super) const AHEAD: usize = 16;
    /// Rows per call of [`Prefetch::at`].
    const ROWS: usize = 4;

    /// The prefetches for key and value rows `t` at `keys.0 + t · keys.1` and `values.0 + t ·
    /// values.1`, `t < positions`, of `d` elements; none unless `on` (a group's first pass
    /// over the rows prefetches for the passes of its other heads). Prefetches the first
    /// [`Prefetch::AHEAD`] key rows at once.
    ///
    /// # Safety
    /// Every row must be within its buffer; the CPU must support sse (every x86-64).
    #[inline(always)]
    pub(super) unsafe fn new(
        keys: (*const T, usize),
        values: (*const T, usize),
        positions: usize,
        d: usize,
        on: bool,
    ) -> Self {
        let this = Self {
            keys,
            values,
            positions,
            row_bytes: d * std::mem::size_of::<T>(),
            on,
        };
        if on {
            for t in (Self::ROWS..positions.min(Self::AHEAD)).step_by(Self::ROWS) {
                this.rows(keys, t);
            }
        }
        this
    }

    /// Before scoring positions `t .. t + 4`: key rows `t + AHEAD ..` and value rows `t ..`.
    ///
    /// # Safety
    /// As [`Prefetch::new`].
    #[inline(always)]
    pub(super) unsafe fn at(&mut self, t: usize) {
        if self.on {
            self.rows(self.keys, t + Self::AHEAD);
            self.rows(self.values, t);
        }
    }

    /// Every line of rows `t .. t + 4` (those below `positions`) of `(base, stride)` into L1.
    #[inline(always)]
    unsafe fn rows(&self, (base, stride): (*const T, usize), t: usize) {
        use std::arch::x86_64::*;
        for r in t..(t + Self::ROWS).min(self.positions) {
            let row = base.add(r * stride) as *const i8;
            for at in (0..self.row_bytes).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(row.add(at));
            }
        }
    }
}

/// The scores `scale · q_j · K[t]` of a group's `g` query vectors `q` (`g · d` values) against
/// the key rows `K[t]` at `k[k0 + t · k_pos ..]`, `t < positions`, into `scores[j · positions +
/// t]`: [`dot`]'s sums bit for bit, four positions at a time (eight independent chains of
/// multiply-adds, two per position, against one load of the query, their lanes added in
/// [`dot`]'s order by one transpose of four registers).
///
/// # Safety
/// The CPU must support avx2 and fma, and f16c where `T` is f16 (inline this into a function
/// that enables them).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn scores_avx2<T: KvElement>(
    q: &[f32],
    (k, k0, k_pos): Strided<'_, T>,
    (v, v0, v_pos): Strided<'_, T>,
    positions: usize,
    d: usize,
    scale: f32,
    scores: &mut [f32],
) {
    use std::arch::x86_64::*;
    if !check_rows(q, (k, k0, k_pos), (v, v0, v_pos), positions, d, scores) {
        return;
    }
    let g = q.len() / d;
    let (whole, end) = (d / 16 * 16, half_chunk_end(d));
    let kp = k.as_ptr().add(k0);
    let values = (v.as_ptr().add(v0), v_pos);
    for j in 0..g {
        let mut prefetch = Prefetch::new((kp, k_pos), values, positions, d, j == 0);
        let qj = &q[j * d..(j + 1) * d];
        let qp = qj.as_ptr();
        let out = &mut scores[j * positions..(j + 1) * positions];
        let mut t = 0;
        while t + 4 <= positions {
            let rows = [0, 1, 2, 3].map(|i| kp.add((t + i) * k_pos));
            prefetch.at(t);
            let mut lo = [_mm256_setzero_ps(); 4];
            let mut hi = [_mm256_setzero_ps(); 4];
            for c in (0..whole).step_by(16) {
                let (x0, x1) = (_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(qp.add(c + 8)));
                for i in 0..4 {
                    lo[i] = _mm256_fmadd_ps(x0, T::load8(rows[i].add(c)), lo[i]);
                    hi[i] = _mm256_fmadd_ps(x1, T::load8(rows[i].add(c + 8)), hi[i]);
                }
            }
            if end > whole {
                let x = _mm256_loadu_ps(qp.add(whole));
                for i in 0..4 {
                    lo[i] = _mm256_fmadd_ps(x, T::load8(rows[i].add(whole)), lo[i]);
                }
            }
            for (lo, hi) in lo.iter_mut().zip(hi) {
                *lo = _mm256_add_ps(*lo, hi);
            }
            finish_scores(hsum8x4(lo), rows, (qj, end), scale, &mut out[t..]);
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
        scores_avx2(q, k, k, positions, d, 0.3, &mut s);
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
