//! Causal attention in one pass on the CPU, in f32: each query row against the keys and
//! values it may see, `softmax(scale · q · Kᵀ) · V`, for a decode step (one query row per
//! head against the KV cache) and for a prefill (the prompt's rows, each seeing the positions
//! up to its own, or the last `window` of them).
//!
//! Candle computes it as two matmuls, a mask and a softmax, each a separate op with its own
//! output. For one query row its gemm pays a setup per head for a product of one row (on a
//! SmolLM2 decode at 400 positions, 17 % of the time went to `gemm_common`'s dispatch and its
//! one-row micro-kernel); for a prompt it computes every score, masked ones included, then
//! exponentiates them one at a time with libm (on a SmolLM2 prefill of 512 tokens the
//! attention's gemm, `expf`, the mask and their copies took about a third of the time). Here
//! one task takes a KV head with all the query heads of its group, whose keys and values stay
//! in the core's cache while it runs: the scores of each query head against the visible key
//! rows (dot products in sixteen lanes, fused multiply-adds; on AVX2 four positions at a time
//! against one load of the query, in two eight-lane registers each; with AVX-512 in one
//! sixteen-lane register, four heads against each load of the keys, `wide`), then a softmax
//! per query head (with an eight-lane exponential), then each head's weighted sum of the
//! value rows (up to 64 components held in registers over all the positions; with AVX-512
//! four heads against each load of a value row). The key rows are prefetched ahead and the
//! value rows while the scores run (a decode step's caches come from memory). Masked
//! positions are never computed. A prompt's
//! rows go in blocks instead (`blocks`, on AVX2, with 512-bit tiles on AVX-512): the keys
//! packed once per KV head, then per block of six query rows register tiles as a gemm's, over
//! the key panels the block may see. Within a block, a row's weight at a
//! position it must not see is 0, so a NaN or infinite value row there makes it NaN, as
//! candle's `p · v` does.
//!
//! The sums run in another order than Candle's gemm, so results differ from it by rounding
//! (tested: within 1e-5 of the definition in f64).
//!
//! ```
//! use candle_tp_kernels::attention::{causal_attention, AttentionShape, CacheView};
//! use candle_tp_kernels::kernel::Kernel;
//! // One head of dimension 2, two cached positions, the query at the second.
//! let shape = AttentionShape {
//!     batch: 1, q_heads: 1, kv_heads: 1, queries: 1, positions: 2, head_dim: 2,
//! };
//! let (k, v) = ([1.0f32, 0.0, 0.0, 1.0], [10.0f32, 0.0, 0.0, 20.0]);
//! let view = |data| CacheView { data, offset: 0, batch: 4, head: 4, pos: 2 };
//! let mut out = [0f32; 2];
//! causal_attention(Kernel::detect(), &[0.0, 0.0], view(&k), view(&v), shape, None, 1.0, &mut out)
//!     .unwrap();
//! assert_eq!(out, [5.0, 10.0]); // equal scores: the mean of the two value rows
//! ```

use crate::kernel::Kernel;
use candle_core::Result;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod blocks;
mod parts;
#[cfg(target_arch = "x86_64")]
mod wide;
mod widen;

use parts::{dot, softmax_in_place, Lanes, Rows, Strided};
pub use widen::KvElement;
use widen::WIDENED;

/// A cache's keys or values as the kernel reads them: element `(b, h, t, i)` (sequence `b`, KV
/// head `h`, position `t`, component `i`) at `data[offset + b·batch + h·head + t·pos + i]`.
///
/// The elements are f32, or f16 for a cache kept in half precision ([`KvElement`]): the AVX2
/// decode loops widen f16 in registers as they read it; otherwise each task widens its KV
/// head's rows to f32 once, into a scratch buffer that stays in the core's cache, and runs the
/// f32 kernels on them. Either way the values are the f32 kernels' on the widened cache, bit
/// for bit, from half the memory.
#[derive(Debug, Clone, Copy)]
pub struct CacheView<'a, T = f32> {
    /// The buffer.
    pub data: &'a [T],
    /// Where element `(0, 0, 0, 0)` is.
    pub offset: usize,
    /// The stride of sequences.
    pub batch: usize,
    /// The stride of KV heads.
    pub head: usize,
    /// The stride of positions.
    pub pos: usize,
}

/// The sizes of an attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences.
    pub batch: usize,
    /// Query heads; query head `h` attends with KV head `h / (q_heads / kv_heads)` (GQA's
    /// groups of consecutive heads).
    pub q_heads: usize,
    /// KV heads (divides `q_heads`).
    pub kv_heads: usize,
    /// Query rows per head: the last `queries` of the `positions` (1 for a decode step).
    pub queries: usize,
    /// Positions in the keys and values, the queries' own included.
    pub positions: usize,
    /// Components per head.
    pub head_dim: usize,
}

/// Query rows per head from which the AVX2 kernels take a prompt in blocks of rows (register
/// tiles over packed keys, `blocks`) rather than row by row.
#[cfg(target_arch = "x86_64")]
const BLOCKED_MIN_QUERIES: usize = blocks::ROWS / 2;

/// Work per rayon task at least (multiply-adds), below which a task costs more than its work.
const MIN_PER_TASK: usize = 1 << 16;

/// Causal attention: for every sequence `b`, query head `h` and query row `i`, at position
/// `p = positions − queries + i`, `out[b][h][i] = softmax(scale · q[b][h][i] · K[b][kv(h)][lo..=p]ᵀ)
/// · V[b][kv(h)][lo..=p]` with `lo = 0`, or with a sliding `window` `w` the last `w` positions
/// up to `p` (`lo = max(0, p + 1 − w)`), as Llama's and Mistral's masks say. `q` and `out` are
/// `[batch, q_heads, queries, head_dim]` (contiguous); `k` and `v` hold `positions` positions
/// of `kv_heads` heads. Runs over the current rayon pool when there is enough work, with
/// `kernel` (AVX2 and FMA from [`Kernel::Avx2`] on; normally [`Kernel::detect`]).
///
/// A NaN among a row's visible scores makes that row's output NaN. An error (naming the sizes)
/// when `kv_heads` does not divide `q_heads`, when there are more queries than positions, when
/// `q` or `out` has the wrong length, when the window is 0, or when a view reaches past its
/// buffer.
///
/// # Panics
/// If `kernel` is not available on this CPU.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention<T: KvElement>(
    kernel: Kernel,
    q: &[f32],
    k: CacheView<'_, T>,
    v: CacheView<'_, T>,
    shape: AttentionShape,
    window: Option<usize>,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    causal_attention_groups(kernel, q, k, v, shape, None, window, scale, out)
}

/// [`causal_attention`] with GQA groups of any sizes: `groups[j]` consecutive query heads read
/// KV head `j` (`groups` summing to `q_heads`, one entry per KV head; `None`: `q_heads /
/// kv_heads` each). A rank that holds query heads of a KV group split across ranks has such
/// groups (9 heads in 3 KV groups as 5 + 4 heads: 3 + 2 and 1 + 3). Each KV head's keys and
/// values are still read once for its whole group. An error names the sizes where the groups
/// do not fit the shape.
///
/// # Panics
/// If `kernel` is not available on this CPU.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_groups<T: KvElement>(
    kernel: Kernel,
    q: &[f32],
    k: CacheView<'_, T>,
    v: CacheView<'_, T>,
    shape: AttentionShape,
    groups: Option<&[usize]>,
    window: Option<usize>,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    let AttentionShape {
        batch,
        q_heads,
        kv_heads,
        queries,
        positions,
        head_dim: d,
    } = shape;
    let uniform = groups.is_none();
    if kv_heads == 0
        || (uniform && q_heads % kv_heads != 0)
        || queries > positions
        || window == Some(0)
    {
        candle_core::bail!(
            "attention: {q_heads} query heads over {kv_heads} KV heads, {queries} query rows \
             at {positions} positions, window {window:?} (KV heads must divide the query \
             heads, the queries be among the positions, a window hold a position)"
        )
    }
    let groups: Vec<usize> = match groups {
        None => vec![q_heads / kv_heads; kv_heads],
        Some(g) if g.len() == kv_heads && g.iter().sum::<usize>() == q_heads => g.to_vec(),
        Some(g) => candle_core::bail!(
            "attention: groups {g:?} of query heads for {kv_heads} KV heads and {q_heads} \
             query heads (one group per KV head, summing to the query heads)"
        ),
    };
    let want = batch * q_heads * queries * d;
    if q.len() != want || out.len() != want {
        candle_core::bail!(
            "attention: q has {} values and out {}, expected {want} ({batch} x {q_heads} \
             heads x {queries} rows x {d})",
            q.len(),
            out.len()
        )
    }
    if want == 0 {
        return Ok(());
    }
    for (name, view) in [("keys", &k), ("values", &v)] {
        let last = view.offset
            + (batch - 1) * view.batch
            + (kv_heads - 1) * view.head
            + (positions - 1) * view.pos
            + d;
        if last > view.data.len() {
            candle_core::bail!(
                "attention: the {name} view (offset {}, strides {} / {} / {}) of {batch} x \
                 {kv_heads} heads x {positions} positions x {d} reaches {last}, past its {} \
                 values",
                view.offset,
                view.batch,
                view.head,
                view.pos,
                view.data.len()
            )
        }
    }
    let window = window.unwrap_or(usize::MAX);
    // Where each KV head's group starts among a sequence's query heads.
    let starts: Vec<usize> = groups
        .iter()
        .scan(0, |at, &g| {
            let start = *at;
            *at += g;
            Some(start)
        })
        .collect();
    let per_head = queries * d;
    // One task per sequence and KV head: its group's query rows (`g` heads of `queries` rows,
    // contiguous in `q` and `out`).
    let task = |(b, h, out): (usize, usize, &mut [f32])| {
        let first = (b * q_heads + starts[h]) * per_head;
        let q = &q[first..first + groups[h] * per_head];
        let at = |view: &CacheView<'_, T>| view.offset + b * view.batch + h * view.head;
        let rows = Rows {
            queries,
            positions,
            window,
            d,
            scale,
        };
        let run = |k: Strided<'_>, v: Strided<'_>, out: &mut [f32]| {
            crate::kernel::by_kernel!(kernel,
            scalar => group_rows(q, k, v, rows, out, Lanes::Scalar),
            avx2 => if queries >= BLOCKED_MIN_QUERIES {
                blocks::group_blocks(q, k, v, rows, out)
            } else {
                avx2::group_rows(q, k, v, rows, out)
            },
            avx512 => if queries >= BLOCKED_MIN_QUERIES {
                blocks::group_blocks_avx512(q, k, v, rows, out)
            } else {
                avx512::group_rows(q, k, v, rows, out)
            })
        };
        if let (Some(kd), Some(vd)) = (T::as_f32(k.data), T::as_f32(v.data)) {
            return run((kd, at(&k), k.pos), (vd, at(&v), v.pos), out);
        }
        // The AVX2 decode loops read an f16 cache as it is, widening in registers (exact, so
        // the same values as through the scratch buffer, with half the bytes).
        #[cfg(target_arch = "x86_64")]
        if kernel != Kernel::Scalar && queries < BLOCKED_MIN_QUERIES {
            let (k, v) = ((k.data, at(&k), k.pos), (v.data, at(&v), v.pos));
            return crate::kernel::by_kernel!(kernel,
                scalar => unreachable!("the scalar kernel widens"),
                avx2 => avx2::group_rows(q, k, v, rows, out),
                avx512 => avx512::group_rows(q, k, v, rows, out));
        }
        // Widened: this head's `positions` key rows, then its value rows, `d` apart.
        WIDENED.with(|w| {
            let mut w = w.borrow_mut();
            w.resize(2 * positions * d, 0.0);
            let (wk, wv) = w.split_at_mut(positions * d);
            for (view, wide) in [(&k, wk), (&v, wv)] {
                let first = at(view);
                if view.pos == d {
                    // The positions' rows are adjacent (the KV cache's layout): one call.
                    T::widen(&view.data[first..first + positions * d], wide);
                    continue;
                }
                for (t, row) in wide.chunks_exact_mut(d).enumerate() {
                    let from = first + t * view.pos;
                    T::widen(&view.data[from..from + d], row);
                }
            }
            let (wk, wv) = w.split_at(positions * d);
            run((wk, 0, d), (wv, 0, d), out)
        })
    };
    // The tasks' outputs, in the order of `out`: sequence by sequence, group by group.
    let mut tasks = Vec::with_capacity(batch * kv_heads);
    let mut rest = out;
    for b in 0..batch {
        for (h, &g) in groups.iter().enumerate() {
            let (mine, others) = rest.split_at_mut(g * per_head);
            tasks.push((b, h, mine));
            rest = others;
        }
    }
    let work = groups.iter().max().copied().unwrap_or(0) * queries * positions * d;
    if rayon::current_num_threads() > 1 && batch * kv_heads > 1 && work >= MIN_PER_TASK {
        tasks.into_par_iter().for_each(task);
    } else {
        tasks.into_iter().for_each(task);
    }
    Ok(())
}

/// The softmax of `scale · x` over each row's visible positions, 0 at the others: `x` and `out`
/// hold rows of `positions` scores (`q · kᵀ` of a prompt's rows), row `r` being query row
/// `r % queries` at position `p = positions − queries + r % queries`, which sees the positions
/// up to `p` (with a sliding `window` `w`, the last `w` of them), as [`causal_attention`]'s
/// rows do. What candle's scale, mask and softmax compute in three ops and four passes, in
/// one pass per row with the eight-lane exponential, never exponentiating a masked score.
/// Runs over the current rayon pool for many rows.
///
/// An error naming the sizes when `x` and `out` differ in length or are not whole rows, when
/// there are more queries than positions, or when the window is 0.
///
/// # Panics
/// If `kernel` is not available on this CPU.
pub fn causal_softmax(
    kernel: Kernel,
    x: &[f32],
    out: &mut [f32],
    (queries, positions): (usize, usize),
    window: Option<usize>,
    scale: f32,
) -> Result<()> {
    if x.len() != out.len()
        || queries == 0
        || queries > positions
        || !x.len().is_multiple_of(positions)
        || window == Some(0)
    {
        candle_core::bail!(
            "causal softmax: {} scores into {} outputs, rows of {positions} positions for \
             {queries} query rows, window {window:?} (whole rows, the queries among the \
             positions, a window holding a position)",
            x.len(),
            out.len()
        )
    }
    let window = window.unwrap_or(usize::MAX);
    let rows = |(r0, (x, out)): (usize, (&[f32], &mut [f32]))| {
        crate::kernel::by_kernel!(kernel,
            scalar => softmax_rows(x, out, r0, (queries, positions), window, scale, Lanes::Scalar),
            avx2 => avx2::softmax_rows(x, out, r0, (queries, positions), window, scale))
    };
    // Rows per task: about MIN_PER_TASK scores.
    let per_task = (MIN_PER_TASK / positions).max(1);
    let chunk = per_task * positions;
    if rayon::current_num_threads() > 1 && x.len() > chunk {
        x.par_chunks(chunk)
            .zip(out.par_chunks_mut(chunk))
            .enumerate()
            .for_each(|(t, pair)| rows((t * per_task, pair)));
    } else {
        rows((0, (x, out)));
    }
    Ok(())
}

/// [`causal_softmax`] on whole rows of `positions` scores, the first being row `r0`.
#[inline(always)]
fn softmax_rows(
    x: &[f32],
    out: &mut [f32],
    r0: usize,
    (queries, positions): (usize, usize),
    window: usize,
    scale: f32,
    lanes: Lanes,
) {
    for (r, (x, out)) in x
        .chunks(positions)
        .zip(out.chunks_mut(positions))
        .enumerate()
    {
        let p = positions - queries + (r0 + r) % queries;
        let lo = (p + 1).saturating_sub(window);
        out[..lo].fill(0.0);
        out[p + 1..].fill(0.0);
        let (x, row) = (&x[lo..=p], &mut out[lo..=p]);
        for (o, &v) in row.iter_mut().zip(x) {
            *o = v * scale;
        }
        softmax_in_place(row, lanes);
    }
}

/// One KV head's group over all its query rows: `q` and `out` hold `g` heads of `queries`
/// rows each (`g · queries · d` values, head-major). Each row's `g` query vectors are gathered
/// and its outputs scattered (a copy of `g · d` values each way), so that [`group`] reads each
/// visible key and value row once for the whole group.
#[inline(always)]
fn group_rows<T: KvElement>(
    q: &[f32],
    k: Strided<'_, T>,
    v: Strided<'_, T>,
    rows: Rows,
    out: &mut [f32],
    lanes: Lanes,
) {
    let Rows {
        queries,
        positions,
        window,
        d,
        scale,
    } = rows;
    let g = q.len() / (queries * d);
    let (mut q_row, mut o_row) = (vec![0f32; g * d], vec![0f32; g * d]);
    let mut scores = Vec::new();
    for i in 0..queries {
        let p = positions - queries + i;
        let lo = (p + 1).saturating_sub(window);
        for j in 0..g {
            let at = (j * queries + i) * d;
            q_row[j * d..(j + 1) * d].copy_from_slice(&q[at..at + d]);
        }
        let (k, v) = ((k.0, k.1 + lo * k.2, k.2), (v.0, v.1 + lo * v.2, v.2));
        group(
            &q_row,
            k,
            v,
            p + 1 - lo,
            d,
            scale,
            &mut o_row,
            &mut scores,
            lanes,
        );
        for j in 0..g {
            let at = (j * queries + i) * d;
            out[at..at + d].copy_from_slice(&o_row[j * d..(j + 1) * d]);
        }
    }
}

/// One query row of a KV head's group: `q` holds its `g` query vectors (`g · d` values), `k`
/// and `v` the `positions` visible rows; `out` gets the `g` output vectors; `scores` is
/// scratch.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn group<T: KvElement>(
    q: &[f32],
    (k, k0, k_pos): Strided<'_, T>,
    (v, v0, v_pos): Strided<'_, T>,
    positions: usize,
    d: usize,
    scale: f32,
    out: &mut [f32],
    scores: &mut Vec<f32>,
    lanes: Lanes,
) {
    let g = q.len() / d;
    // Scores of query vector `j` at `j · positions ..`; each key row is read once for the
    // group.
    scores.clear();
    scores.resize(g * positions, 0.0);
    let (keys, values) = ((k, k0, k_pos), (v, v0, v_pos));
    match lanes {
        // SAFETY: `Lanes::Avx2` comes only from `avx2::group_rows` here (avx2, fma, f16c).
        #[cfg(target_arch = "x86_64")]
        Lanes::Avx2 => unsafe { parts::scores_avx2(q, keys, values, positions, d, scale, scores) },
        // SAFETY: `Lanes::Avx512` comes only from `avx512::group_rows` (avx2, fma, f16c,
        // avx512f).
        #[cfg(target_arch = "x86_64")]
        Lanes::Avx512 => unsafe { wide::scores(q, keys, values, positions, d, scale, scores) },
        Lanes::Scalar => {
            for t in 0..positions {
                let key = &k[k0 + t * k_pos..k0 + t * k_pos + d];
                for j in 0..g {
                    scores[j * positions + t] = dot(&q[j * d..(j + 1) * d], key) * scale;
                }
            }
        }
    }
    for row in scores.chunks_mut(positions) {
        softmax_in_place(row, lanes);
    }
    match lanes {
        #[cfg(target_arch = "x86_64")]
        Lanes::Avx2 => {
            for (j, o) in out.chunks_mut(d).enumerate() {
                let p = &scores[j * positions..(j + 1) * positions];
                // SAFETY: `Lanes::Avx2` comes only from `avx2::group_rows` here (avx2, fma,
                // f16c).
                unsafe { parts::weighted_sum_avx2(p, (v, v0, v_pos), o) };
            }
        }
        // SAFETY: `Lanes::Avx512` comes only from `avx512::group_rows` (avx2, fma, f16c,
        // avx512f).
        #[cfg(target_arch = "x86_64")]
        Lanes::Avx512 => unsafe { wide::weighted_sums(scores, positions, (v, v0, v_pos), d, out) },
        Lanes::Scalar => {
            out.fill(0.0);
            for t in 0..positions {
                let value = &v[v0 + t * v_pos..v0 + t * v_pos + d];
                for (j, o) in out.chunks_mut(d).enumerate() {
                    let p = scores[j * positions + t];
                    for (o, &x) in o.iter_mut().zip(value) {
                        *o = p.mul_add(x.get(), *o);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{group_rows as body, KvElement, Lanes, Rows, Strided};

    /// [`super::softmax_rows`] compiled with AVX2 and FMA, with the eight-lane exponential.
    ///
    /// # Safety
    /// The CPU must support avx2 and fma.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn softmax_rows(
        x: &[f32],
        out: &mut [f32],
        r0: usize,
        rows: (usize, usize),
        window: usize,
        scale: f32,
    ) {
        super::softmax_rows(x, out, r0, rows, window, scale, Lanes::Avx2)
    }

    /// [`super::group_rows`] compiled with AVX2, FMA and F16C (its lanes and multiply-adds
    /// vectorised, an f16 cache widened as it is read), with the eight-lane exponential.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group_rows<T: KvElement>(
        q: &[f32],
        k: Strided<'_, T>,
        v: Strided<'_, T>,
        rows: Rows,
        out: &mut [f32],
    ) {
        body(q, k, v, rows, out, Lanes::Avx2)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{group_rows as body, KvElement, Lanes, Rows, Strided};

    /// [`super::group_rows`] with the scores and weighted sums on 512-bit vectors (`wide`,
    /// the AVX2 form's values bit for bit) and the eight-lane exponential.
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c and avx512f.
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub(super) unsafe fn group_rows<T: KvElement>(
        q: &[f32],
        k: Strided<'_, T>,
        v: Strided<'_, T>,
        rows: Rows,
        out: &mut [f32],
    ) {
        body(q, k, v, rows, out, Lanes::Avx512)
    }
}

#[cfg(test)]
mod tests;
