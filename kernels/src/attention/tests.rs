//! The attention kernels' tests: every kernel against the definition in f64, uneven GQA
//! groups, f16 caches, NaN rows and refused sizes.

use super::*;
use crate::f64_dot::testing::pseudo;

/// The reference in f64: scores, softmax and weighted sum over the visible positions,
/// straight from the definition; query head `h` reads KV head `h / (q_heads / kv_heads)`,
/// or with `groups` the KV head whose group of consecutive heads holds `h`.
fn reference(
    q: &[f32],
    k: &CacheView<'_>,
    v: &CacheView<'_>,
    s: AttentionShape,
    groups: Option<&[usize]>,
    window: Option<usize>,
    scale: f32,
) -> Vec<f64> {
    let d = s.head_dim;
    let kv_of: Vec<usize> = match groups {
        None => (0..s.q_heads)
            .map(|h| h / (s.q_heads / s.kv_heads))
            .collect(),
        Some(g) => g
            .iter()
            .enumerate()
            .flat_map(|(j, &n)| std::iter::repeat_n(j, n))
            .collect(),
    };
    let mut out = vec![0f64; s.batch * s.q_heads * s.queries * d];
    for b in 0..s.batch {
        for (h, &kv) in kv_of.iter().enumerate() {
            for i in 0..s.queries {
                let at = |w: &CacheView<'_>, t: usize, c: usize| {
                    w.data[w.offset + b * w.batch + kv * w.head + t * w.pos + c] as f64
                };
                let row = ((b * s.q_heads + h) * s.queries + i) * d;
                let p = s.positions - s.queries + i;
                let seen: Vec<usize> = (0..=p)
                    .filter(|&t| window.is_none_or(|w| p - t < w))
                    .collect();
                let scores: Vec<f64> = seen
                    .iter()
                    .map(|&t| {
                        (0..d).map(|c| q[row + c] as f64 * at(k, t, c)).sum::<f64>() * scale as f64
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for c in 0..d {
                    out[row + c] = seen
                        .iter()
                        .zip(&e)
                        .map(|(&t, e)| e / sum * at(v, t, c))
                        .sum();
                }
            }
        }
    }
    out
}

/// Every kernel, MHA and GQA groups, head sizes with and without a tail of lanes, a
/// decode row and prompts (all positions new, or after cached ones), with and without a
/// sliding window, caches strided as the KV cache's buffers are (head stride = capacity),
/// within 1e-5 of the f64 definition (values of order 1); outputs finite.
#[test]
fn every_kernel_is_the_definition() {
    for kernel in Kernel::under_test() {
        // Uniform groups, and uneven ones (a rank's share of a split group).
        let uneven: [&[usize]; 3] = [&[3, 2], &[1, 3], &[2, 1, 1]];
        for (batch, q_heads, kv_heads, d, groups) in [
            (1, 4, 4, 64, None),
            (1, 9, 3, 64, None),
            (2, 6, 2, 20, None),
            (1, 4, 2, 24, None),
            (2, 5, 2, 20, Some(uneven[0])),
            (1, 4, 2, 64, Some(uneven[1])),
            (2, 4, 3, 24, Some(uneven[2])),
        ] {
            for (queries, positions) in [(1, 1), (1, 7), (1, 130), (5, 5), (9, 40), (40, 70)] {
                for window in [None, Some(4)] {
                    let capacity = positions + 5;
                    let shape = AttentionShape {
                        batch,
                        q_heads,
                        kv_heads,
                        queries,
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
                    let q: Vec<f32> = (0..batch * q_heads * queries * d)
                        .map(|i| pseudo(i + 555))
                        .collect();
                    let scale = 1.0 / (d as f32).sqrt();
                    let want = reference(&q, &k, &v, shape, groups, window, scale);
                    let mut got = vec![f32::NAN; want.len()];
                    causal_attention_groups(
                        kernel, &q, k, v, shape, groups, window, scale, &mut got,
                    )
                    .unwrap();
                    let case = format!("{kernel:?} {shape:?} groups {groups:?} window {window:?}");
                    assert!(got.iter().all(|x| x.is_finite()), "{case}");
                    let err = got
                        .iter()
                        .zip(&want)
                        .map(|(&a, &b)| (a as f64 - b).abs())
                        .fold(0f64, f64::max);
                    assert!(err < 1e-5, "{case}: max |diff| {err}");
                }
            }
        }
    }
}

/// A view of `data` with no offset and the strides of sequences, heads and positions.
fn strided<T>(data: &[T], batch: usize, head: usize, pos: usize) -> CacheView<'_, T> {
    CacheView {
        data,
        offset: 0,
        batch,
        head,
        pos,
    }
}

/// The kernel over caches of `T`, strided as the KV cache's buffers (`(batch, head, pos)`
/// strides), at scale 0.125: the outputs' bits, after checking that they are finite.
fn attend<T: KvElement>(
    kernel: Kernel,
    q: &[f32],
    (k, v): (&[T], &[T]),
    (batch, head, pos): (usize, usize, usize),
    shape: AttentionShape,
    window: Option<usize>,
) -> Vec<u32> {
    let mut out = vec![f32::NAN; q.len()];
    let (k, v) = (strided(k, batch, head, pos), strided(v, batch, head, pos));
    causal_attention(kernel, q, k, v, shape, window, 0.125, &mut out).unwrap();
    assert!(out.iter().all(|x| x.is_finite()), "{kernel:?} {shape:?}");
    out.iter().map(|x| x.to_bits()).collect()
}

/// A cache of f16 gives, on every kernel, decode rows (which the AVX2 loops read as f16)
/// and prompts (widened first), the f32 kernel's outputs on the same values widened to
/// f32, bit for bit (and finite).
#[test]
fn an_f16_cache_is_the_f32_kernel_on_its_widened_values() {
    use half::f16;
    for kernel in Kernel::under_test() {
        // Head sizes of whole lanes, with a tail, and past one run of 64 components.
        let sizes = [
            (1, 1, 24),
            (1, 37, 24),
            (1, 37, 20),
            (1, 6, 72),
            (9, 40, 24),
        ];
        for (queries, positions, d) in sizes {
            let (q_heads, kv_heads, capacity) = (6, 2, positions + 3);
            let shape = AttentionShape {
                batch: 1,
                q_heads,
                kv_heads,
                queries,
                positions,
                head_dim: d,
            };
            let n = kv_heads * capacity * d;
            let kh: Vec<f16> = (0..n).map(|i| f16::from_f32(2.0 * pseudo(i + 5))).collect();
            let vh: Vec<f16> = (0..n)
                .map(|i| f16::from_f32(3.0 * pseudo(i + 99)))
                .collect();
            let (kf, vf): (Vec<f32>, Vec<f32>) = (
                kh.iter().map(|x| x.to_f32()).collect(),
                vh.iter().map(|x| x.to_f32()).collect(),
            );
            let q: Vec<f32> = (0..q_heads * queries * d).map(|i| pseudo(i + 7)).collect();
            let strides = (n, capacity * d, d);
            let half_out = attend(kernel, &q, (&kh, &vh), strides, shape, None);
            let f32_out = attend(kernel, &q, (&kf, &vf), strides, shape, None);
            assert_eq!(half_out, f32_out, "{kernel:?} {shape:?}");
        }
    }
}

/// The AVX-512 kernel gives the AVX2 kernel's outputs, bit for bit: decode rows (scores and
/// weighted sums on 512-bit vectors, four heads to a load) and prompts (512-bit tiles of the
/// blocked kernel; the same sums): groups of 1 to 7 heads, head sizes with a half chunk and a
/// tail, f32 and f16 caches, a window, prompts after cached positions and alone, with odd
/// and even counts of key panels.
#[test]
fn the_avx512_kernel_is_the_avx2_one() {
    use half::f16;
    let kernels = Kernel::under_test();
    if !kernels.contains(&Kernel::Avx512Vnni) || !kernels.contains(&Kernel::Avx2) {
        eprintln!("not run: AVX-512 and AVX2 are not both under test");
        return;
    }
    let sizes = [
        (4, 4, 64),
        (9, 3, 64),
        (14, 2, 72),
        (5, 1, 128),
        (6, 2, 20),
        (2, 1, 40),
    ];
    let rows = [(1, 1), (1, 6), (1, 33), (5, 5), (9, 40), (40, 70), (70, 70)];
    for (q_heads, kv_heads, d) in sizes {
        for (queries, positions) in rows {
            for window in [None, Some(5)] {
                let (batch, capacity) = (2, positions + 3);
                let shape = AttentionShape {
                    batch,
                    q_heads,
                    kv_heads,
                    queries,
                    positions,
                    head_dim: d,
                };
                let n = batch * kv_heads * capacity * d;
                let kf: Vec<f32> = (0..n).map(|i| 2.0 * pseudo(i + 3)).collect();
                let vf: Vec<f32> = (0..n).map(|i| 3.0 * pseudo(i + 404)).collect();
                let (kh, vh): (Vec<f16>, Vec<f16>) = (
                    kf.iter().map(|&x| f16::from_f32(x)).collect(),
                    vf.iter().map(|&x| f16::from_f32(x)).collect(),
                );
                let q: Vec<f32> = (0..batch * q_heads * queries * d)
                    .map(|i| pseudo(i + 71))
                    .collect();
                let strides = (n / batch, capacity * d, d);
                for f32_cache in [true, false] {
                    let [avx2, avx512] = [Kernel::Avx2, Kernel::Avx512Vnni].map(|kernel| {
                        if f32_cache {
                            attend(kernel, &q, (&kf, &vf), strides, shape, window)
                        } else {
                            attend(kernel, &q, (&kh, &vh), strides, shape, window)
                        }
                    });
                    let case = format!("{shape:?} window {window:?} f32 cache {f32_cache}");
                    assert!(avx2 == avx512, "{case}");
                }
            }
        }
    }
}

/// Every kernel: rows of two heads of a prompt's queries (after cached positions, and all
/// new), with and without a window, against the f64 definition: masked positions exactly
/// 0, the others within 1e-6; a bad size is an error.
#[test]
fn causal_softmax_is_the_masked_definition() {
    for kernel in Kernel::under_test() {
        for (queries, positions) in [(1, 9), (5, 5), (7, 30), (3, 300)] {
            for window in [None, Some(4)] {
                let n = 2 * queries * positions;
                let x: Vec<f32> = (0..n).map(|i| 6.0 * pseudo(i + 3)).collect();
                let mut got = vec![f32::NAN; n];
                let scale = 0.7f32;
                causal_softmax(kernel, &x, &mut got, (queries, positions), window, scale).unwrap();
                for (r, row) in got.chunks(positions).enumerate() {
                    let p = positions - queries + r % queries;
                    let seen = |t: usize| t <= p && window.is_none_or(|w| p - t < w);
                    let xs = &x[r * positions..(r + 1) * positions];
                    let max = (0..positions)
                        .filter(|&t| seen(t))
                        .map(|t| (xs[t] * scale) as f64)
                        .fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = (0..positions)
                        .filter(|&t| seen(t))
                        .map(|t| ((xs[t] * scale) as f64 - max).exp())
                        .sum();
                    for (t, &g) in row.iter().enumerate() {
                        let case =
                            format!("{kernel:?} {queries}/{positions} {window:?} row {r} at {t}");
                        if seen(t) {
                            let want = ((xs[t] * scale) as f64 - max).exp() / sum;
                            assert!((g as f64 - want).abs() <= 1e-6, "{case}: {g} vs {want}");
                        } else {
                            assert_eq!(g, 0.0, "{case}");
                        }
                    }
                }
            }
        }
    }
    let e = causal_softmax(
        Kernel::Scalar,
        &[0.0; 10],
        &mut [0.0; 10],
        (2, 4),
        None,
        1.0,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("10 scores into 10 outputs, rows of 4 positions"),
        "{e}"
    );
}

#[test]
fn nan_queries_give_nan_rows_and_bad_sizes_are_errors() {
    let shape = AttentionShape {
        batch: 1,
        q_heads: 2,
        kv_heads: 1,
        queries: 1,
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
    // Every kernel, a decode row and a prompt of 3 rows (blocked on AVX2): a NaN in head
    // 0's last query row makes that row NaN and no other.
    for kernel in Kernel::under_test() {
        for queries in [1, 3] {
            let shape = AttentionShape { queries, ..shape };
            let mut q = vec![0.5f32; 2 * queries * 4];
            q[(queries - 1) * 4 + 1] = f32::NAN;
            let mut out = vec![0f32; q.len()];
            causal_attention(kernel, &q, view, view, shape, None, 1.0, &mut out).unwrap();
            for (row, out) in out.chunks(4).enumerate() {
                let case = format!("{kernel:?} {queries} rows: row {row} {out:?}");
                if row == queries - 1 {
                    assert!(out.iter().all(|x| x.is_nan()), "{case}");
                } else {
                    assert!(out.iter().all(|&x| (x - 1.0).abs() < 1e-6), "{case}");
                }
            }
        }
    }
    let q = vec![0.5f32; 8];
    let mut out = vec![0f32; 8];
    let err = |s: AttentionShape, w: Option<usize>, out: &mut [f32]| {
        causal_attention(Kernel::Scalar, &q, view, view, s, w, 1.0, out)
            .unwrap_err()
            .to_string()
    };
    let e = err(
        AttentionShape {
            kv_heads: 3,
            ..shape
        },
        None,
        &mut out,
    );
    assert!(e.contains("2 query heads over 3 KV heads"), "{e}");
    assert!(e.contains("1 query rows at 3 positions"), "{e}");
    let e = err(shape, Some(0), &mut out);
    assert!(e.contains("window Some(0)"), "{e}");
    // Groups that do not sum to the query heads, or one short of the KV heads.
    for groups in [&[1usize][..], &[3], &[1, 1]] {
        let e = causal_attention_groups(
            Kernel::Scalar,
            &q,
            view,
            view,
            shape,
            Some(groups),
            None,
            1.0,
            &mut out,
        );
        let e = e.expect_err("groups that do not fit").to_string();
        assert!(
            e.contains("for 1 KV heads and 2 query heads"),
            "{groups:?}: {e}"
        );
    }
    let e = err(shape, None, &mut [0f32; 7]);
    assert!(
        e.contains("out 7, expected 8 (1 x 2 heads x 1 rows x 4)"),
        "{e}"
    );
    let e = err(
        AttentionShape {
            positions: 4,
            ..shape
        },
        None,
        &mut out,
    );
    assert!(e.contains("reaches 16, past its 12 values"), "{e}");
}
