//! A decode step's attention in one pass: one query row per head against the KV cache,
//! `softmax(scale · q · Kᵀ) · V`, in f32.
//!
//! Candle computes it as two matmuls and a softmax, each a separate op with its own output:
//! for one query row its gemm pays a setup per head for a product of one row (on a SmolLM2
//! decode at 400 positions, 17 % of the time went to `gemm_common`'s dispatch and its
//! one-row micro-kernel), and GQA's query heads read their KV head's cache once each. Here each
//! KV head's keys and values are read once for all the query heads of its group: per cached
//! position, one key row against the group's query rows (dot products in eight lanes, fused
//! multiply-adds), then a softmax per query head (with an eight-lane exponential), then per
//! position one value row added into the group's outputs.
//!
//! The sums run in another order than Candle's gemm, so results differ from it by rounding
//! (tested: within 1e-5 of the two matmuls and softmax in f64).
//!
//! ```
//! use candle_tp_kernels::attention::{decode_attention, CacheView, DecodeShape};
//! use candle_tp_kernels::kernel::Kernel;
//! // One head of dimension 2, two cached positions.
//! let shape = DecodeShape { batch: 1, q_heads: 1, kv_heads: 1, positions: 2, head_dim: 2 };
//! let (k, v) = ([1.0f32, 0.0, 0.0, 1.0], [10.0f32, 0.0, 0.0, 20.0]);
//! let view = |data| CacheView { data, offset: 0, batch: 4, head: 4, pos: 2 };
//! let mut out = [0f32; 2];
//! decode_attention(Kernel::detect(), &[0.0, 0.0], view(&k), view(&v), shape, 1.0, &mut out).unwrap();
//! assert_eq!(out, [5.0, 10.0]); // equal scores: the mean of the two value rows
//! ```

use crate::kernel::Kernel;
use candle_core::Result;
use rayon::prelude::*;

/// A cache's keys or values as the kernel reads them: element `(b, h, t, i)` (sequence `b`, KV
/// head `h`, position `t`, component `i`) at `data[offset + b·batch + h·head + t·pos + i]`.
#[derive(Debug, Clone, Copy)]
pub struct CacheView<'a> {
    /// The buffer.
    pub data: &'a [f32],
    /// Where element `(0, 0, 0, 0)` is.
    pub offset: usize,
    /// The stride of sequences.
    pub batch: usize,
    /// The stride of KV heads.
    pub head: usize,
    /// The stride of positions.
    pub pos: usize,
}

/// The sizes of a decode step's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    /// Sequences.
    pub batch: usize,
    /// Query heads; query head `h` attends with KV head `h / (q_heads / kv_heads)` (GQA's
    /// groups of consecutive heads).
    pub q_heads: usize,
    /// KV heads (divides `q_heads`).
    pub kv_heads: usize,
    /// Cached positions, the new one included.
    pub positions: usize,
    /// Components per head.
    pub head_dim: usize,
}

/// Work per rayon task at least (multiply-adds), below which a task costs more than its work.
const MIN_PER_TASK: usize = 1 << 16;

/// `out[b][h] = softmax(scale · q[b][h] · K[b][kv(h)]ᵀ) · V[b][kv(h)]` for every sequence `b`
/// and query head `h`: `q` and `out` are `[batch, q_heads, head_dim]` (contiguous), `k` and
/// `v` hold `positions` positions of `kv_heads` heads. Runs over the current rayon pool when
/// there is enough work, with `kernel` (AVX2 and FMA from [`Kernel::Avx2`] on; normally
/// [`Kernel::detect`]).
///
/// # Panics
/// If `kernel` is not available on this CPU.
///
/// A NaN among the scores makes its head's output NaN. An error (naming the sizes) when
/// `kv_heads` does not divide `q_heads`, when there is no position, when `q` or `out` has
/// the wrong length, or when a view reaches past its buffer.
pub fn decode_attention(
    kernel: Kernel,
    q: &[f32],
    k: CacheView<'_>,
    v: CacheView<'_>,
    shape: DecodeShape,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    let DecodeShape {
        batch,
        q_heads,
        kv_heads,
        positions,
        head_dim: d,
    } = shape;
    if kv_heads == 0 || q_heads % kv_heads != 0 || positions == 0 {
        candle_core::bail!(
            "decode attention: {q_heads} query heads over {kv_heads} KV heads at {positions} \
             positions (KV heads must divide the query heads, and a position is needed)"
        )
    }
    let want = batch * q_heads * d;
    if q.len() != want || out.len() != want {
        candle_core::bail!(
            "decode attention: q has {} values and out {}, expected {want} ({batch} x \
             {q_heads} heads x {d})",
            q.len(),
            out.len()
        )
    }
    for (name, view) in [("keys", &k), ("values", &v)] {
        let last = view.offset
            + (batch.max(1) - 1) * view.batch
            + (kv_heads - 1) * view.head
            + (positions - 1) * view.pos
            + d;
        if batch > 0 && d > 0 && last > view.data.len() {
            candle_core::bail!(
                "decode attention: the {name} view (offset {}, strides {} / {} / {}) of \
                 {batch} x {kv_heads} heads x {positions} positions x {d} reaches {last}, \
                 past its {} values",
                view.offset,
                view.batch,
                view.head,
                view.pos,
                view.data.len()
            )
        }
    }
    if want == 0 {
        return Ok(());
    }
    let g = q_heads / kv_heads;
    // One task per sequence and KV head: its group's query rows and outputs.
    let task = |(i, out): (usize, &mut [f32])| {
        let (b, h) = (i / kv_heads, i % kv_heads);
        let q = &q[i * g * d..(i + 1) * g * d];
        let at = |view: &CacheView<'_>| view.offset + b * view.batch + h * view.head;
        let (k0, v0) = (at(&k), at(&v));
        crate::kernel::by_kernel!(kernel,
            scalar => group(q, (k.data, k0, k.pos), (v.data, v0, v.pos), positions, d, scale, out, Lanes::Scalar),
            avx2 => avx2::group(q, (k.data, k0, k.pos), (v.data, v0, v.pos), positions, d, scale, out))
    };
    let work = g * positions * d;
    if rayon::current_num_threads() > 1 && batch * kv_heads > 1 && work >= MIN_PER_TASK {
        out.par_chunks_mut(g * d).enumerate().for_each(task);
    } else {
        out.chunks_mut(g * d).enumerate().for_each(task);
    }
    Ok(())
}

/// How [`group`] computes exponentials.
#[derive(Clone, Copy)]
enum Lanes {
    /// libm's `expf`, one value at a time.
    Scalar,
    /// [`crate::swiglu`]'s eight-lane exponential (within 2 ulp of `expf`).
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

/// `Σ a·b` in eight lanes of fused multiply-adds (added in a fixed order), the tail after.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
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

/// `e^x` for every value of `xs`, in place.
#[inline(always)]
fn exp_in_place(xs: &mut [f32], lanes: Lanes) {
    match lanes {
        Lanes::Scalar => xs.iter_mut().for_each(|x| *x = x.exp()),
        #[cfg(target_arch = "x86_64")]
        Lanes::Avx2 => {
            use std::arch::x86_64::*;
            let whole = xs.len() / 8 * 8;
            for c in xs[..whole].chunks_exact_mut(8) {
                // SAFETY: `Lanes::Avx2` is only passed from a function that enables avx2 and
                // fma; `c` holds 8 values.
                unsafe {
                    let p = c.as_mut_ptr();
                    _mm256_storeu_ps(p, crate::swiglu::avx2::exp(_mm256_loadu_ps(p)));
                }
            }
            xs[whole..].iter_mut().for_each(|x| *x = x.exp());
        }
    }
}

/// One KV head's group: `q` holds its `g` query rows (`g · d` values), `k` and `v` are the
/// buffer, the offset of position 0 and the stride of positions; `out` gets the `g` rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn group(
    q: &[f32],
    (k, k0, k_pos): (&[f32], usize, usize),
    (v, v0, v_pos): (&[f32], usize, usize),
    positions: usize,
    d: usize,
    scale: f32,
    out: &mut [f32],
    lanes: Lanes,
) {
    let g = q.len() / d;
    // Scores of query row `j` at `j · positions ..`; each key row is read once for the group.
    let mut scores = vec![0f32; g * positions];
    for t in 0..positions {
        let key = &k[k0 + t * k_pos..k0 + t * k_pos + d];
        for j in 0..g {
            scores[j * positions + t] = dot(&q[j * d..(j + 1) * d], key) * scale;
        }
    }
    for row in scores.chunks_mut(positions) {
        // The largest score (NaN if any is NaN), as Candle's softmax subtracts it.
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| {
            if s.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(s)
            }
        });
        row.iter_mut().for_each(|s| *s -= max);
        exp_in_place(row, lanes);
        let sum: f32 = row.iter().sum();
        row.iter_mut().for_each(|p| *p /= sum);
    }
    out.fill(0.0);
    for t in 0..positions {
        let value = &v[v0 + t * v_pos..v0 + t * v_pos + d];
        for (j, o) in out.chunks_mut(d).enumerate() {
            let p = scores[j * positions + t];
            for (o, &x) in o.iter_mut().zip(value) {
                *o = p.mul_add(x, *o);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{group as body, Lanes};

    /// [`super::group`] compiled with AVX2 and FMA (its lanes and multiply-adds vectorised),
    /// with the eight-lane exponential.
    ///
    /// # Safety
    /// The CPU must support avx2 and fma.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn group(
        q: &[f32],
        k: (&[f32], usize, usize),
        v: (&[f32], usize, usize),
        positions: usize,
        d: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        body(q, k, v, positions, d, scale, out, Lanes::Avx2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f64_dot::testing::pseudo;

    /// The reference in f64: scores, softmax and weighted sum, straight from the definition.
    fn reference(
        q: &[f32],
        k: &CacheView<'_>,
        v: &CacheView<'_>,
        s: DecodeShape,
        scale: f32,
    ) -> Vec<f64> {
        let d = s.head_dim;
        let g = s.q_heads / s.kv_heads;
        let mut out = vec![0f64; s.batch * s.q_heads * d];
        for b in 0..s.batch {
            for h in 0..s.q_heads {
                let kv = h / g;
                let at = |w: &CacheView<'_>, t: usize, i: usize| {
                    w.data[w.offset + b * w.batch + kv * w.head + t * w.pos + i] as f64
                };
                let qi = |i: usize| q[(b * s.q_heads + h) * d + i] as f64;
                let scores: Vec<f64> = (0..s.positions)
                    .map(|t| (0..d).map(|i| qi(i) * at(k, t, i)).sum::<f64>() * scale as f64)
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for i in 0..d {
                    out[(b * s.q_heads + h) * d + i] =
                        (0..s.positions).map(|t| e[t] / sum * at(v, t, i)).sum();
                }
            }
        }
        out
    }

    /// Every kernel, MHA and GQA groups, head sizes with and without a tail of lanes, one and
    /// many positions, caches strided as the KV cache's buffers are (head stride = capacity),
    /// within 1e-5 of the f64 definition (values of order 1); outputs finite.
    #[test]
    fn every_kernel_is_the_definition() {
        for kernel in Kernel::under_test() {
            for (batch, q_heads, kv_heads, d) in [(1, 4, 4, 64), (1, 9, 3, 64), (2, 6, 2, 20)] {
                for positions in [1, 7, 130] {
                    let capacity = positions + 5;
                    let shape = DecodeShape {
                        batch,
                        q_heads,
                        kv_heads,
                        positions,
                        head_dim: d,
                    };
                    let n = 3 + batch * kv_heads * capacity * d;
                    let kd: Vec<f32> = (0..n).map(|i| 2.0 * pseudo(i + 11)).collect();
                    let vd: Vec<f32> = (0..n).map(|i| 3.0 * pseudo(i + 7777)).collect();
                    let view = |data| CacheView {
                        data,
                        offset: 3,
                        batch: kv_heads * capacity * d,
                        head: capacity * d,
                        pos: d,
                    };
                    let (k, v) = (view(&kd), view(&vd));
                    let q: Vec<f32> = (0..batch * q_heads * d).map(|i| pseudo(i + 555)).collect();
                    let scale = 1.0 / (d as f32).sqrt();
                    let want = reference(&q, &k, &v, shape, scale);
                    let mut got = vec![f32::NAN; want.len()];
                    decode_attention(kernel, &q, k, v, shape, scale, &mut got).unwrap();
                    assert!(got.iter().all(|x| x.is_finite()), "{kernel:?} {shape:?}");
                    let err = got
                        .iter()
                        .zip(&want)
                        .map(|(&a, &b)| (a as f64 - b).abs())
                        .fold(0f64, f64::max);
                    assert!(err < 1e-5, "{kernel:?} {shape:?}: max |diff| {err}");
                }
            }
        }
    }

    #[test]
    fn nan_scores_give_nan_and_bad_sizes_are_errors() {
        let shape = DecodeShape {
            batch: 1,
            q_heads: 2,
            kv_heads: 1,
            positions: 3,
            head_dim: 4,
        };
        let data = vec![1f32; 12];
        let view = CacheView {
            data: &data,
            offset: 0,
            batch: 12,
            head: 12,
            pos: 4,
        };
        let mut q = vec![0.5f32; 8];
        q[1] = f32::NAN;
        let mut out = vec![0f32; 8];
        decode_attention(Kernel::Scalar, &q, view, view, shape, 1.0, &mut out).unwrap();
        assert!(out[..4].iter().all(|x| x.is_nan()), "{out:?}");
        assert!(out[4..].iter().all(|&x| x == 1.0), "{out:?}");
        let err = |s: DecodeShape, v: CacheView<'_>, out: &mut [f32]| {
            decode_attention(Kernel::Scalar, &q, v, v, s, 1.0, out)
                .unwrap_err()
                .to_string()
        };
        let e = err(
            DecodeShape {
                kv_heads: 3,
                ..shape
            },
            view,
            &mut out,
        );
        assert!(e.contains("2 query heads over 3 KV heads"), "{e}");
        let e = err(shape, view, &mut [0f32; 7]);
        assert!(e.contains("out 7, expected 8"), "{e}");
        let e = err(
            DecodeShape {
                positions: 4,
                ..shape
            },
            view,
            &mut out,
        );
        assert!(e.contains("reaches 16, past its 12 values"), "{e}");
    }
}
