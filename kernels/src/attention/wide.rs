//! The decode attention's loops on 512-bit vectors (AVX-512 F), for [`super::group`] with
//! [`Lanes::Avx512`](super::parts::Lanes): a KV head's scores and weighted sums for up to four
//! query heads of its group at once, so that each load of a key or value row serves them all.
//!
//! The AVX2 loops ([`super::parts::scores_avx2`], [`super::parts::weighted_sum_avx2`]) take
//! one query head at a time in 256-bit registers: per position and head, a key row of 64
//! components is eight loads for eight multiply-adds, and the weighted sum loads every value
//! row again for each head. Here a chunk of sixteen components is one register, four key rows'
//! chunks are loaded once for four heads (sixteen accumulators), and a value row's chunks once
//! for the heads' weighted sums.
//!
//! The sums are [`dot`](super::parts::dot)'s, bit for bit: lane `l` of a register is lane `l` of [`dot`](super::parts::dot)'s sixteen
//! (the AVX2 loops hold them in two registers), a last half chunk of eight goes into lanes 0-7
//! by a masked multiply-add, and the lanes are folded (`s_l + s_{l+8}`) and added in the same
//! order. A weighted sum's components are each summed over the positions in order, whatever
//! the register width. So [`crate::kernel::Kernel::Avx512Vnni`] gives the AVX2 kernel's values
//! (tested).

use super::parts::{
    check_rows, finish_scores, half_chunk_end, hsum8, hsum8x4, weighted_sum_avx2, Prefetch, Strided,
};
use super::KvElement;
use std::arch::x86_64::*;

/// Query heads that share each load of a key or value row.
const HEADS: usize = 4;
/// Positions whose scores are added up at once (one transpose of four registers).
const POSITIONS: usize = 4;
/// Sixteen-component registers per run of a weighted sum.
const RUN: usize = 4;

/// Lanes 0-7 plus lanes 8-15 of `z`: [`dot`](super::parts::dot)'s `t_l = s_l + s_{l+8}`.
#[inline(always)]
unsafe fn fold(z: __m512) -> __m256 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1));
    _mm256_add_ps(_mm512_castps512_ps256(z), hi)
}

/// Eight components at `p` in lanes 0-7 (lanes 8-15 zero), for a half chunk.
#[inline(always)]
unsafe fn half<T: KvElement>(p: *const T) -> __m512 {
    _mm512_zextps256_ps512(T::load8(p))
}

/// `acc + x·y` in lanes 0-7 only (a half chunk), the others kept as they are.
#[inline(always)]
unsafe fn half_fmadd(x: __m512, y: __m512, acc: __m512) -> __m512 {
    _mm512_mask3_fmadd_ps(x, y, acc, 0x00FF)
}

/// [`dot`](super::parts::dot) in one 512-bit register: the scalar form's sums, bit for bit.
///
/// # Safety
/// avx512f, and f16c where `T` is f16 (inline this into a function that enables them).
#[inline(always)]
unsafe fn dot_avx512<T: KvElement>(a: &[f32], b: &[T]) -> f32 {
    let n = a.len().min(b.len());
    let (whole, end) = (n / 16 * 16, half_chunk_end(n));
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = _mm512_setzero_ps();
    for i in (0..whole).step_by(16) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), T::load16(pb.add(i)), acc);
    }
    if end > whole {
        acc = half_fmadd(half(pa.add(whole)), half(pb.add(whole)), acc);
    }
    let mut s = hsum8(fold(acc));
    for (x, y) in a[end..n].iter().zip(&b[end..n]) {
        s = x.mul_add(y.get(), s);
    }
    s
}

/// [`super::parts::scores_avx2`] on 512-bit registers, up to four query heads against each
/// load of four key rows: `scores[j · positions + t] = scale · q_j · K[t]`, [`dot`](super::parts::dot)'s sums bit
/// for bit.
///
/// # Safety
/// avx2, fma and avx512f, and f16c where `T` is f16 (inline this into a function that enables
/// them).
#[inline(always)]
pub(super) unsafe fn scores<T: KvElement>(
    q: &[f32],
    (k, k0, k_pos): Strided<'_, T>,
    (v, v0, v_pos): Strided<'_, T>,
    positions: usize,
    d: usize,
    scale: f32,
    scores: &mut [f32],
) {
    if !check_rows(q, (k, k0, k_pos), (v, v0, v_pos), positions, d, scores) {
        return;
    }
    let g = q.len() / d;
    let keys = (k.as_ptr().add(k0), k_pos, positions);
    let values = (v.as_ptr().add(v0), v_pos);
    let mut j = 0;
    while j < g {
        let heads = (g - j).min(HEADS);
        match heads {
            4 => scores_of::<T, 4>(q, j, keys, values, d, scale, scores),
            3 => scores_of::<T, 3>(q, j, keys, values, d, scale, scores),
            2 => scores_of::<T, 2>(q, j, keys, values, d, scale, scores),
            _ => scores_of::<T, 1>(q, j, keys, values, d, scale, scores),
        }
        j += heads;
    }
}

/// [`scores`] for query heads `j0 .. j0 + G` against the key rows at `kp + t · k_pos`.
///
/// # Safety
/// As [`scores`]; every key row within its buffer (checked there).
#[inline(always)]
unsafe fn scores_of<T: KvElement, const G: usize>(
    q: &[f32],
    j0: usize,
    (kp, k_pos, positions): (*const T, usize, usize),
    (vp, v_pos): (*const T, usize),
    d: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let (whole, end) = (d / 16 * 16, half_chunk_end(d));
    let qs: [&[f32]; G] = std::array::from_fn(|h| &q[(j0 + h) * d..(j0 + h + 1) * d]);
    let mut prefetch = Prefetch::new((kp, k_pos), (vp, v_pos), positions, d, j0 == 0);
    let mut t = 0;
    while t + POSITIONS <= positions {
        let rows: [*const T; POSITIONS] = std::array::from_fn(|i| kp.add((t + i) * k_pos));
        prefetch.at(t);
        let mut acc = [[_mm512_setzero_ps(); POSITIONS]; G];
        for c in (0..whole).step_by(16) {
            let mut key = [_mm512_setzero_ps(); POSITIONS];
            for (y, row) in key.iter_mut().zip(rows) {
                *y = T::load16(row.add(c));
            }
            for (qh, acc) in qs.iter().zip(acc.iter_mut()) {
                let x = _mm512_loadu_ps(qh.as_ptr().add(c));
                for (a, &y) in acc.iter_mut().zip(&key) {
                    *a = _mm512_fmadd_ps(x, y, *a);
                }
            }
        }
        if end > whole {
            let mut key = [_mm512_setzero_ps(); POSITIONS];
            for (y, row) in key.iter_mut().zip(rows) {
                *y = half(row.add(whole));
            }
            for (qh, acc) in qs.iter().zip(acc.iter_mut()) {
                let x = half(qh.as_ptr().add(whole));
                for (a, &y) in acc.iter_mut().zip(&key) {
                    *a = half_fmadd(x, y, *a);
                }
            }
        }
        for (h, (qh, acc)) in qs.iter().zip(&acc).enumerate() {
            let mut folded = [_mm256_setzero_ps(); POSITIONS];
            for (f, &a) in folded.iter_mut().zip(acc) {
                *f = fold(a);
            }
            let out = &mut scores[(j0 + h) * positions + t..];
            finish_scores(hsum8x4(folded), rows, (qh, end), scale, out);
        }
        t += POSITIONS;
    }
    for t in t..positions {
        let key = std::slice::from_raw_parts(kp.add(t * k_pos), d);
        for (h, qh) in qs.iter().enumerate() {
            scores[(j0 + h) * positions + t] = dot_avx512(qh, key) * scale;
        }
    }
}

/// The weighted sums of a group: `out[j · d ..][..d] = Σ_t p[j · positions + t] · V[t]` for
/// each of its `out.len() / d` query heads, the value rows `V[t]` at `v[v0 + t · v_pos ..]`;
/// each component summed over `t` in order with fused multiply-adds from 0, as the scalar
/// loop and [`weighted_sum_avx2`] sum it (the same bits). Up to four heads share each load of a
/// value row, in runs of up to 64 components held in registers over all the positions; the
/// components past the last sixteen go through [`weighted_sum_avx2`].
///
/// # Safety
/// avx2, fma and avx512f, and f16c where `T` is f16 (inline this into a function that enables
/// them).
#[inline(always)]
pub(super) unsafe fn weighted_sums<T: KvElement>(
    p: &[f32],
    positions: usize,
    (v, v0, v_pos): Strided<'_, T>,
    d: usize,
    out: &mut [f32],
) {
    if d == 0 {
        return;
    }
    let g = out.len() / d;
    assert!(
        p.len() >= g * positions,
        "attention: fewer weights than heads × positions"
    );
    if let Some(t) = positions.checked_sub(1) {
        // Every read below is within the last row's `d` components.
        assert!(
            v0 + t * v_pos + d <= v.len(),
            "attention: value rows past their buffer"
        );
    }
    let whole = d / 16 * 16;
    let mut j = 0;
    while j < g {
        let heads = (g - j).min(HEADS);
        let mut c = 0;
        while c < whole {
            let regs = ((whole - c) / 16).min(RUN);
            let run = Run {
                p,
                positions,
                j0: j,
                v: v.as_ptr().add(v0 + c),
                v_pos,
                at: c,
                d,
            };
            match heads {
                4 => run.by_registers::<4>(regs, out),
                3 => run.by_registers::<3>(regs, out),
                2 => run.by_registers::<2>(regs, out),
                _ => run.by_registers::<1>(regs, out),
            }
            c += 16 * regs;
        }
        if whole < d {
            for h in j..j + heads {
                let ph = &p[h * positions..(h + 1) * positions];
                weighted_sum_avx2(
                    ph,
                    (v, v0 + whole, v_pos),
                    &mut out[h * d + whole..(h + 1) * d],
                );
            }
        }
        j += heads;
    }
}

/// One run of [`weighted_sums`]: heads `j0 ..` (their weights `p[j · positions ..]`),
/// components `at ..` of each value row `v + t · v_pos` (`v` already at component `at`), into
/// `out[j · d + at ..]`.
struct Run<'a, T> {
    p: &'a [f32],
    positions: usize,
    j0: usize,
    v: *const T,
    v_pos: usize,
    at: usize,
    d: usize,
}

impl<T: KvElement> Run<'_, T> {
    /// [`Run::sums`] with `regs` (1-4) registers per head.
    ///
    /// # Safety
    /// As [`weighted_sums`]; `16 · regs` components readable in every value row from `v`.
    #[inline(always)]
    unsafe fn by_registers<const G: usize>(&self, regs: usize, out: &mut [f32]) {
        match regs {
            4 => self.sums::<G, 4>(out),
            3 => self.sums::<G, 3>(out),
            2 => self.sums::<G, 2>(out),
            _ => self.sums::<G, 1>(out),
        }
    }

    /// `G` heads' sums over `R` registers of sixteen components.
    ///
    /// # Safety
    /// As [`Run::by_registers`].
    #[inline(always)]
    unsafe fn sums<const G: usize, const R: usize>(&self, out: &mut [f32]) {
        let ps: [&[f32]; G] = std::array::from_fn(|h| {
            let j = self.j0 + h;
            &self.p[j * self.positions..(j + 1) * self.positions]
        });
        let mut acc = [[_mm512_setzero_ps(); R]; G];
        for t in 0..self.positions {
            let row = self.v.add(t * self.v_pos);
            let mut value = [_mm512_setzero_ps(); R];
            for (u, x) in value.iter_mut().enumerate() {
                *x = T::load16(row.add(16 * u));
            }
            for (ph, acc) in ps.iter().zip(acc.iter_mut()) {
                let w = _mm512_set1_ps(*ph.get_unchecked(t));
                for (a, &x) in acc.iter_mut().zip(&value) {
                    *a = _mm512_fmadd_ps(w, x, *a);
                }
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            let o = out.as_mut_ptr().add((self.j0 + h) * self.d + self.at);
            for (u, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(o.add(16 * u), *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::parts::dot;
    use super::*;
    use crate::f64_dot::testing::pseudo;
    use crate::kernel::Kernel;

    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn wide_scores(q: &[f32], k: Strided<'_>, positions: usize, d: usize) -> Vec<f32> {
        let mut s = vec![f32::NAN; q.len() / d * positions];
        scores(q, k, k, positions, d, 0.3, &mut s);
        s
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn wide_sums(
        p: &[f32],
        positions: usize,
        v: Strided<'_>,
        d: usize,
        g: usize,
    ) -> Vec<f32> {
        let mut out = vec![f32::NAN; g * d];
        weighted_sums(p, positions, v, d, &mut out);
        out
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// The 512-bit scores and weighted sums are the scalar forms' sums bit for bit: groups of
    /// 1 to 9 heads (past one load's four), head sizes with and without a half chunk and a
    /// tail, past one run of 64, position counts around the blocks of four, strided rows, NaN
    /// and infinite inputs.
    #[test]
    fn avx512_scores_and_weighted_sums_are_the_scalar_sums() {
        if !Kernel::under_test().contains(&Kernel::Avx512Vnni) {
            eprintln!("not run: AVX-512 is not under test");
            return;
        }
        for d in [1, 3, 8, 13, 16, 24, 30, 64, 72, 80, 128, 136, 200] {
            for positions in [1, 3, 4, 5, 8, 11] {
                for g in [1, 3, 4, 5, 9] {
                    let k_pos = d + 5;
                    let mut k: Vec<f32> =
                        (0..7 + positions * k_pos).map(|i| pseudo(i + 17)).collect();
                    let mut q: Vec<f32> = (0..g * d).map(|i| pseudo(i + 1000)).collect();
                    let mut p: Vec<f32> =
                        (0..g * positions).map(|i| pseudo(i + 3000).abs()).collect();
                    if positions > 4 && d > 2 {
                        k[7 + 2 * k_pos + 1] = f32::NAN;
                        q[d - 1] = f32::INFINITY;
                        p[positions - 1] = f32::NAN;
                    }
                    let case = format!("d {d} positions {positions} heads {g}");
                    let got = unsafe { wide_scores(&q, (&k, 7, k_pos), positions, d) };
                    for j in 0..g {
                        for t in 0..positions {
                            let key = &k[7 + t * k_pos..7 + t * k_pos + d];
                            let want = dot(&q[j * d..(j + 1) * d], key) * 0.3;
                            let at = got[j * positions + t];
                            assert!(same(want, at), "{case} score {j} {t}: {at} against {want}");
                        }
                    }
                    let got = unsafe { wide_sums(&p, positions, (&k, 7, k_pos), d, g) };
                    for j in 0..g {
                        for c in 0..d {
                            let want = (0..positions).fold(0f32, |o, t| {
                                p[j * positions + t].mul_add(k[7 + t * k_pos + c], o)
                            });
                            let at = got[j * d + c];
                            assert!(same(want, at), "{case} sum {j} {c}: {at} against {want}");
                        }
                    }
                }
            }
        }
    }
}
