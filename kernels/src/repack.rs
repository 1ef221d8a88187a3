//! Quantized weights repacked four rows at a time ([`Repacked`]), and their product with
//! quantized activations summed in f64: what candle-tp's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and
//! Q6_K products run on the CPU (decode, prefill, row-parallel partials).
//!
//! GGUF stores a quantized matrix row after row, each row a run of blocks. A kernel that
//! multiplies four rows at once then reads four streams of short rows (1152 bytes for a Q4_0
//! row of 2048 values), which the hardware prefetcher follows badly: measured on a Zen 3 core,
//! one thread, Q4_0 weights streaming from memory, the four-row kernel reached 4.6-6.2 GB/s.
//! [`Repacked`] interleaves rows `4g .. 4g + 4` block by block ([`Interleave::X4`]: for Q4_0
//! the four f16 scales, then the four 16-byte nibble runs, 72 bytes, the size of the four
//! blocks), so a group of four rows is one sequential stream, which the kernels also
//! prefetch ahead of: 10-12 GB/s on the same core (llama.cpp repacks Q4_0 for the same reason,
//! into 8-row blocks, `ggml-cpu/repack.cpp`).
//!
//! Each block type's kernel reduces the four rows' products with one activation block to one
//! integer each, multiplies it by the exact product of the scales in f64 and adds the blocks
//! in order: every value is bit for bit [`crate::f64_dot::dot_f64`] of the unpacked row
//! (tested), whatever the kernel, the number of activation rows or the thread count. The f32
//! product ([`Repacked::matmul_f32`]) rounds that f64 sum, so decode, prefill, batches and
//! row-parallel shards all compute the same numbers.

use crate::f64_dot::F64Dot;
use crate::f64_matmul::{check_matmul, fill_in_place, RowsOut};
use crate::kernel::Kernel;
use candle_core::Result;
use std::sync::Arc;

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::q4_0::BlockQ4_0 {}
    impl Sealed for crate::q4_1::BlockQ4_1 {}
    impl Sealed for crate::q5_0::BlockQ5_0 {}
    impl Sealed for crate::q5_1::BlockQ5_1 {}
    impl Sealed for crate::q8_0::BlockQ8_0 {}
    impl Sealed for crate::q4_k::BlockQ4K {}
    impl Sealed for crate::q5_k::BlockQ5K {}
    impl Sealed for crate::q6_k::BlockQ6K {}
}

/// One activation row as the group kernels read it: its blocks, their
/// [`Interleave::act_sum`]s and their [`Interleave::act_scales`].
#[doc(hidden)]
pub type ActRow<'a, A> = (&'a [A], &'a [i32], &'a [[f64; 2]]);

/// A block type whose weights the crate repacks four rows at a time (implemented for Q4_0,
/// Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks; sealed).
pub trait Interleave: F64Dot + sealed::Sealed {
    /// Block `b` of four consecutive rows, interleaved.
    type X4: Copy + Send + Sync + std::fmt::Debug + 'static;
    /// Four all-zero blocks (the padding rows of a last, partial group).
    const X4_ZERO: Self::X4;

    /// Whether products of 8+ activation rows run tiles of 8 rather than 4 (the k-quants,
    /// whose kernels unpack a super-block once per tile: measured on a Zen 3 core at 64
    /// activation rows, Q6_K 1.26x and Q4_K 1.15x faster; Q4_0 0.88x, so not for the 32-wide
    /// types; with [`Kernel::Avx512Vnni`] every type runs tiles of 8, its 32 registers
    /// holding them).
    const TILE_8: bool = false;

    /// Puts `block` as row `r` (0..4) of `x4`.
    fn set_row(x4: &mut Self::X4, r: usize, block: &Self);

    /// Row `r`'s block, as GGUF stores it.
    fn row(x4: &Self::X4, r: usize) -> Self;

    /// The block's `BLOCK` values, as candle dequantizes them.
    fn dequantize(block: &Self, out: &mut [f32]);

    /// What the AVX2 kernel wants precomputed per activation block, once for all weight rows
    /// (Q4_0: `8 · Σ q'`); 0 where it wants nothing.
    fn act_sum(_x: &Self::Act) -> i32 {
        0
    }

    /// What the 32-wide types' kernels want precomputed per activation block, once for all
    /// weight rows: its scales `[d', s']` as f64 (`s'` 0 where the block has none), so that
    /// each use is a broadcast from memory rather than an f16 conversion; zeros where the
    /// kernels want nothing (the k-quants).
    fn act_scales(_x: &Self::Act) -> [f64; 2] {
        [0.0; 2]
    }

    /// The four rows of `group` against `M` activation rows (`xs[i]`: the blocks and their
    /// [`Interleave::act_sum`]s): `out[i][r]`, bit for bit the scalar f64 sum.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every slice of `xs` has `group.len()` entries.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn group_dot_avx2<const M: usize>(
        group: &[Self::X4],
        xs: [ActRow<'_, Self::Act>; M],
    ) -> [[f64; 4]; M];

    /// [`Interleave::group_dot_avx2`] with AVX-512 VNNI, bit for bit the same; by default
    /// the AVX2 kernel itself.
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni;
    /// every slice of `xs` has `group.len()` entries.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn group_dot_avx512<const M: usize>(
        group: &[Self::X4],
        xs: [ActRow<'_, Self::Act>; M],
    ) -> [[f64; 4]; M] {
        Self::group_dot_avx2(group, xs)
    }

    /// Two groups (eight rows: `group0`'s four, then `group1`'s) against `M` activation rows
    /// (`xs[i]`: the blocks, their [`Interleave::act_sum`]s and [`Interleave::act_scales`])
    /// with AVX-512 VNNI: `out[i][r]`, bit for bit the scalar f64 sum. By default the two
    /// groups' [`Interleave::group_dot_avx512`]; the 32-wide unsigned types put each of the
    /// eight rows' sums in one lane, so that the per-block scaling in f64 is one 512-bit
    /// step for eight rows instead of two 256-bit steps and two horizontal reductions.
    ///
    /// # Safety
    /// As [`Interleave::group_dot_avx512`]; both groups have as many blocks as every slice
    /// of `xs`.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn group_pair_dot_avx512<const M: usize>(
        group0: &[Self::X4],
        group1: &[Self::X4],
        xs: &[ActRow<'_, Self::Act>; M],
    ) -> [[f64; 8]; M] {
        let xs = *xs;
        let (a, b) = (
            Self::group_dot_avx512(group0, xs),
            Self::group_dot_avx512(group1, xs),
        );
        std::array::from_fn(|i| std::array::from_fn(|r| if r < 4 { a[i][r] } else { b[i][r - 4] }))
    }
}

/// Puts row `r`'s bytes into `runs` of 8 bytes per row (`runs[c][r]` = `bytes[8c .. 8c + 8]`),
/// the layout in which one 32-byte load holds the same 8 bytes of four rows.
pub(crate) fn put_runs<const C: usize>(runs: &mut [[[u8; 8]; 4]; C], r: usize, bytes: &[u8]) {
    for (c, run) in bytes.chunks_exact(8).enumerate() {
        runs[c][r].copy_from_slice(run);
    }
}

/// Row `r`'s bytes back from `runs` ([`put_runs`]).
pub(crate) fn take_runs<const C: usize, const N: usize>(
    runs: &[[[u8; 8]; 4]; C],
    r: usize,
) -> [u8; N] {
    std::array::from_fn(|j| runs[j / 8][r][j % 8])
}

/// A quantized weight `[n, k]` repacked in groups of four rows (the last group padded with
/// zero rows), with its products against f32 activations.
///
/// ```
/// use candle_tp_kernels::{kernel::Kernel, q4_0::BlockQ4_0, repack::Repacked};
/// let block = BlockQ4_0 { d: half::f16::from_f32(0.5), qs: [0x9A; 16] }; // values 1 and 2
/// let w = Repacked::new(&[block; 3], 3, 32).unwrap(); // 3 rows of one block
/// let x = [127.0f32; 32]; // Q8_0: scale 1, values 127
/// let mut y = [0f32; 3];
/// w.matmul_f32(Kernel::detect(), 1, &x, &mut y).unwrap();
/// assert_eq!(y, [3048.0; 3]); // 0.5 · 127 · (16 · 2 + 16 · 1)
/// ```
#[derive(Clone)]
pub struct Repacked<B: Interleave> {
    groups: Vec<B::X4>,
    n: usize,
    kb: usize,
}

impl<B: Interleave> std::fmt::Debug for Repacked<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Repacked({} [{}, {}])", B::NAME, self.n, self.k())
    }
}

impl<B: Interleave> Repacked<B> {
    /// Repacks `n` rows of `k / BLOCK` blocks each (GGUF's layout of a `[n, k]` tensor).
    /// Errors if `k` is not a multiple of the block or `w` holds another number of blocks.
    pub fn new(w: &[B], n: usize, k: usize) -> Result<Self> {
        let name = B::NAME;
        if !k.is_multiple_of(B::BLOCK) {
            candle_core::bail!(
                "{name} weight [{n}, {k}]: k is not a multiple of {}",
                B::BLOCK
            )
        }
        let kb = k / B::BLOCK;
        if w.len() != n * kb {
            candle_core::bail!(
                "{name} weight [{n}, {k}]: {} blocks, expected {}",
                w.len(),
                n * kb
            )
        }
        let mut groups = vec![B::X4_ZERO; n.div_ceil(4) * kb];
        for (row, blocks) in w.chunks_exact(kb.max(1)).enumerate().take(n) {
            let (g, r) = (row / 4, row % 4);
            for (dst, src) in groups[g * kb..(g + 1) * kb].iter_mut().zip(blocks) {
                B::set_row(dst, r, src);
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
        self.kb * B::BLOCK
    }

    /// Block `b` of row `row`, as GGUF stores it.
    ///
    /// # Panics
    /// If `row >= n` or `b >= k / BLOCK`.
    pub fn block(&self, row: usize, b: usize) -> B {
        assert!(
            row < self.n && b < self.kb,
            "{} block ({row}, {b}) of [{}, {} blocks]",
            B::NAME,
            self.n,
            self.kb
        );
        B::row(&self.groups[row / 4 * self.kb + b], row % 4)
    }

    /// Row `row` dequantized into `out` (`k` values), as candle dequantizes it.
    ///
    /// # Panics
    /// If `row >= n` or `out.len() != k`.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert_eq!(
            out.len(),
            self.k(),
            "{} row of {} values into {}",
            B::NAME,
            self.k(),
            out.len()
        );
        for (b, out) in out.chunks_exact_mut(B::BLOCK).enumerate() {
            B::dequantize(&self.block(row, b), out);
        }
    }

    /// `dst[i * n + j] = Σ_t x[i, t] · W[j, t]` for `m` activation rows of `k` values, summed
    /// in f64 (see the module's documentation); the activations are quantized as candle
    /// quantizes them for this type. Weight rows are split over the current rayon pool.
    pub fn matmul_f64(&self, kernel: Kernel, m: usize, x: &[f32], dst: &mut [f64]) -> Result<()> {
        self.matmul(kernel, m, x, dst, |v| v)
    }

    /// [`Repacked::matmul_f64`] rounded to f32.
    pub fn matmul_f32(&self, kernel: Kernel, m: usize, x: &[f32], dst: &mut [f32]) -> Result<()> {
        self.matmul(kernel, m, x, dst, |v| v as f32)
    }

    /// Quantizes `m` activation rows `x` (`m · k` values) as this weight's kernels read
    /// them, for [`Repacked::matmul_prepared_f32`] / `_f64` with `kernel`: once for every
    /// weight of this type that takes the same input (a layer's q, k and v projections).
    pub fn prepare(&self, kernel: Kernel, m: usize, x: &[f32]) -> Result<Prepared<B>> {
        let (k, kb) = (self.k(), self.kb);
        let what = format!("{} (repacked) matmul", B::NAME);
        // `check_matmul` counts weight blocks; the repacked weight has them by construction.
        check_matmul(
            &what,
            kernel,
            (m, k, self.n),
            B::BLOCK,
            (x.len(), self.n * kb, self.n * m),
        )?;
        let mut act = vec![B::ACT_ZERO; m * kb];
        B::quantize(x, &mut act);
        let sums: Vec<i32> = act.iter().map(B::act_sum).collect();
        let scales: Vec<[f64; 2]> = act.iter().map(B::act_scales).collect();
        Ok(Prepared {
            kernel,
            m,
            k,
            act,
            sums,
            scales,
        })
    }

    /// [`Repacked::matmul_f64`] of activations made by [`Repacked::prepare`].
    pub fn matmul_prepared_f64(&self, x: &Prepared<B>, dst: &mut [f64]) -> Result<()> {
        self.matmul_prepared(x, dst, |v| v)
    }

    /// [`Repacked::matmul_f32`] of activations made by [`Repacked::prepare`].
    pub fn matmul_prepared_f32(&self, x: &Prepared<B>, dst: &mut [f32]) -> Result<()> {
        self.matmul_prepared(x, dst, |v| v as f32)
    }

    fn matmul<T: Send + Copy + Default>(
        &self,
        kernel: Kernel,
        m: usize,
        x: &[f32],
        dst: &mut [T],
        out: impl Fn(f64) -> T + Sync,
    ) -> Result<()> {
        self.matmul_prepared(&self.prepare(kernel, m, x)?, dst, out)
    }

    fn matmul_prepared<T: Send + Copy + Default>(
        &self,
        x: &Prepared<B>,
        dst: &mut [T],
        out: impl Fn(f64) -> T + Sync,
    ) -> Result<()> {
        let (n, k, kb, m, kernel) = (self.n, self.k(), self.kb, x.m, x.kernel);
        if x.k != k || dst.len() != m * n {
            candle_core::bail!(
                "{} (repacked) matmul: activations of {} rows x {} against the weight [{n}, {k}] into {} outputs ({} expected)",
                B::NAME,
                m,
                x.k,
                dst.len(),
                m * n
            )
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        if kb == 0 {
            dst.fill(out(0.0)); // empty sums
            return Ok(());
        }
        let (act, sums, scales) = (&x.act, &x.sums, &x.scales);
        let row = |i: usize| {
            let r = i * kb..(i + 1) * kb;
            (&act[r.clone()], &sums[r.clone()], &scales[r])
        };
        // The eight-row kernel's tiles of activation rows, made once for every weight pair.
        let pair_tiles: Vec<[ActRow<'_, B::Act>; 8]> = if kernel == Kernel::Avx512Vnni {
            (0..m / 8)
                .map(|t| std::array::from_fn(|r| row(8 * t + r)))
                .collect()
        } else {
            Vec::new()
        };
        let fill = |mut o: RowsOut<'_, T>| {
            let (row0, rows) = (o.row0(), o.rows());
            // Task ranges start on a group (`fill_in_place` cuts multiples of 4 rows).
            debug_assert_eq!(row0 % 4, 0);
            let groups = rows.div_ceil(4);
            let group = |g: usize| {
                let first = (row0 / 4 + g) * kb;
                &self.groups[first..first + kb]
            };
            // Rows `4g ..` of this share (`R` of them: one group or a pair) for activation
            // rows `i ..`, as many as the tile has.
            let mut put = |g: usize, i: usize, tile: &[[f64; 8]], r_max: usize| {
                let live = (rows - 4 * g).min(r_max);
                for (t, v) in tile.iter().enumerate() {
                    let dst = &mut o.row(i + t)[4 * g..4 * g + live];
                    for (d, &v) in dst.iter_mut().zip(v) {
                        *d = out(v);
                    }
                }
            };
            // Tiles of 8 activation rows where the type unpacks much per weight block,
            // and for every type with AVX-512's 32 vector registers (measured on a Zen 4
            // core against tiles of 4: 1.05-1.25x at 8 and 64 activation rows).
            let tiled8 = if B::TILE_8 || kernel == Kernel::Avx512Vnni {
                m / 8 * 8
            } else {
                0
            };
            let tiled = tiled8 + (m - tiled8) / 4 * 4;
            // With AVX-512 VNNI, tiles of 8 activation rows run groups in pairs (eight
            // weight rows at once; on a Zen 4 core 1.4-1.9x one group at a time at 8 and 64
            // activation rows, but 0.5x at 1 and 0.9x at 4, where regrouping the weights per
            // block costs more than the f64 steps it saves).
            let pairs = if kernel == Kernel::Avx512Vnni && tiled8 > 0 {
                groups / 2
            } else {
                0
            };
            for p in 0..pairs {
                let (g0, g1) = (group(2 * p), group(2 * p + 1));
                for (t, tile) in pair_tiles[..tiled8 / 8].iter().enumerate() {
                    let v = pair_dot::<B, 8>(g0, g1, tile);
                    put(2 * p, 8 * t, &v, 8);
                }
            }
            let widen = |v: [f64; 4]| std::array::from_fn(|r| if r < 4 { v[r] } else { 0.0 });
            for g in 0..groups {
                let group = group(g);
                // The tiles of 8 of paired groups ran above.
                let paired = if g < 2 * pairs { tiled8 } else { 0 };
                for i in (paired..tiled8).step_by(8) {
                    let v = group_dot::<B, 8>(kernel, group, std::array::from_fn(|t| row(i + t)));
                    put(g, i, &v.map(widen), 4);
                }
                for i in (tiled8..tiled).step_by(4) {
                    let v = group_dot::<B, 4>(kernel, group, std::array::from_fn(|t| row(i + t)));
                    put(g, i, &v.map(widen), 4);
                }
                for i in tiled..m {
                    let v = group_dot::<B, 1>(kernel, group, [row(i)]);
                    put(g, i, &v.map(widen), 4);
                }
            }
        };
        fill_in_place(n, m, dst, fill);
        Ok(())
    }
}

/// Activation rows quantized for the weights of block type `B` and one kernel
/// ([`Repacked::prepare`]), to be multiplied by any number of such weights of `k` inputs.
#[derive(Debug, Clone)]
pub struct Prepared<B: Interleave> {
    kernel: Kernel,
    m: usize,
    k: usize,
    act: Vec<B::Act>,
    /// [`Interleave::act_sum`] per block.
    sums: Vec<i32>,
    /// [`Interleave::act_scales`] per block.
    scales: Vec<[f64; 2]>,
}

impl<B: Interleave> Prepared<B> {
    /// Activation rows.
    pub fn m(&self) -> usize {
        self.m
    }

    /// Values per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// The kernel they were prepared for.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }
}

/// `unrolled!(M, |i| { … })`: the block for `i` = 0, …, `M − 1` (`M` at most 8), written out
/// one after another, so that each copy indexes the kernels' per-row arrays with a constant.
/// A `for i in 0..M` loop whose body is too large for LLVM to unroll indexes them at run
/// time, so they live on the stack: Q4_0's eight-row kernel then stored and reloaded each
/// row's 512-bit accumulator per block (`perf annotate`: the store and the instruction after
/// it took half its samples). A macro, not a function taking a closure: a closure's calls
/// are not always inlined into the kernel.
macro_rules! unrolled {
    ($m:expr, |$i:ident| $body:block) => {{
        const { assert!($m <= 8, "unrolled!: at most 8 copies") };
        if $m > 0 {
            let $i = 0usize;
            $body
        }
        if $m > 1 {
            let $i = 1usize;
            $body
        }
        if $m > 2 {
            let $i = 2usize;
            $body
        }
        if $m > 3 {
            let $i = 3usize;
            $body
        }
        if $m > 4 {
            let $i = 4usize;
            $body
        }
        if $m > 5 {
            let $i = 5usize;
            $body
        }
        if $m > 6 {
            let $i = 6usize;
            $body
        }
        if $m > 7 {
            let $i = 7usize;
            $body
        }
    }};
}
pub(crate) use unrolled;

/// The four rows of `group` against `M` activation rows: `out[i][r]`.
fn group_dot<B: Interleave, const M: usize>(
    kernel: Kernel,
    group: &[B::X4],
    xs: [ActRow<'_, B::Act>; M],
) -> [[f64; 4]; M] {
    check_blocks::<B, M>(group.len(), &xs);
    crate::kernel::by_kernel!(kernel,
        scalar => group_dot_scalar::<B, M>(group, xs),
        // The lengths were checked above.
        avx2 => B::group_dot_avx2(group, xs),
        avx512 => B::group_dot_avx512(group, xs))
}

/// Panics unless every activation row of `xs` (blocks and their sums) has `blocks` blocks,
/// as a group of the weight has.
fn check_blocks<B: Interleave, const M: usize>(blocks: usize, xs: &[ActRow<'_, B::Act>; M]) {
    for (x, s, scales) in xs {
        assert!(
            x.len() == blocks && s.len() == blocks && scales.len() == blocks,
            "{} group of {} blocks against {} activation blocks ({} sums, {} scales)",
            B::NAME,
            blocks,
            x.len(),
            s.len(),
            scales.len()
        );
    }
}

/// Two groups (eight rows) against `M` activation rows with AVX-512 VNNI: `out[i][r]`.
///
/// # Panics
/// If a group and an activation row differ in blocks, or the CPU lacks AVX-512 VNNI.
fn pair_dot<B: Interleave, const M: usize>(
    group0: &[B::X4],
    group1: &[B::X4],
    xs: &[ActRow<'_, B::Act>; M],
) -> [[f64; 8]; M] {
    assert_eq!(
        group0.len(),
        group1.len(),
        "{} groups of {} and {} blocks",
        B::NAME,
        group0.len(),
        group1.len()
    );
    check_blocks::<B, M>(group0.len(), xs);
    assert!(
        Kernel::Avx512Vnni.is_available(),
        "the AVX-512 VNNI kernel needs avx2, fma, f16c, avx512f, avx512bw, avx512vl and \
         avx512vnni"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the features and the lengths were checked just above.
    unsafe {
        B::group_pair_dot_avx512(group0, group1, xs)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("is_available is false off x86-64")
}

/// The reference: each row's blocks' [`F64Dot::block_dot`] added in block order, as the
/// scalar [`crate::f64_dot::dot_f64`] does.
fn group_dot_scalar<B: Interleave, const M: usize>(
    group: &[B::X4],
    xs: [ActRow<'_, B::Act>; M],
) -> [[f64; 4]; M] {
    let mut acc = [[0f64; 4]; M];
    for (acc, (x, _, _)) in acc.iter_mut().zip(xs) {
        for (g, x) in group.iter().zip(x) {
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc += B::block_dot(&B::row(g, r), x);
            }
        }
    }
    acc
}

/// The 8-bit activation blocks the repacked kernels read (Q8_0 and Q8_1).
#[cfg(target_arch = "x86_64")]
pub(crate) trait Act8 {
    /// The 32 values.
    fn qs(&self) -> &[i8; 32];
}

#[cfg(target_arch = "x86_64")]
impl Act8 for crate::q8_0::BlockQ8_0 {
    fn qs(&self) -> &[i8; 32] {
        &self.qs
    }
}

#[cfg(target_arch = "x86_64")]
impl Act8 for crate::q8_1::BlockQ8_1 {
    fn qs(&self) -> &[i8; 32] {
        &self.qs
    }
}

/// The AVX2 group kernel shared by the 32-wide types whose values are unsigned bytes.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::Act8;
    use std::arch::x86_64::*;

    /// Bytes ahead of the group's current block that each step prefetches (measured for
    /// Q4_0 on a Zen 3 core: 512 streamed 10-15 % faster than none, and than 1024).
    pub const PREFETCH: usize = 512;

    /// Eight bytes of `p`, in each 64-bit lane.
    #[inline(always)]
    pub unsafe fn bytes8(p: *const i8) -> __m256i {
        _mm256_set1_epi64x(std::ptr::read_unaligned(p as *const i64))
    }

    /// A 32-wide block's 16 nibble bytes of four rows stored in runs of 8 (`runs[c][r]`:
    /// row `r`'s bytes `8c .. 8c + 8`, whose low nibbles are values `8c ..` and high nibbles
    /// values `16 + 8c ..`) as the runs of values `unsigned_group_dot` takes: vector `t` holds
    /// values `8t .. 8t + 8` of rows 0, 1, 2, 3 in turn.
    #[inline(always)]
    pub unsafe fn nibble_runs(runs: &[[[u8; 8]; 4]; 2]) -> [__m256i; 4] {
        let low = _mm256_set1_epi8(0x0F);
        let v0 = _mm256_loadu_si256(runs[0].as_ptr() as *const __m256i);
        let v1 = _mm256_loadu_si256(runs[1].as_ptr() as *const __m256i);
        [
            _mm256_and_si256(v0, low),
            _mm256_and_si256(v1, low),
            _mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
            _mm256_and_si256(_mm256_srli_epi16(v1, 4), low),
        ]
    }

    /// The fifth bits of four rows (`qh[r]`: row `r`'s 32 bits, little-endian) as `0x10` bytes
    /// in the runs of [`nibble_runs`]: vector `t` holds bits `8t .. 8t + 8` of each row.
    #[inline(always)]
    pub unsafe fn fifth_bit_runs(qh: &[[u8; 4]; 4]) -> [__m256i; 4] {
        let words = _mm256_broadcastsi128_si256(_mm_loadu_si128(qh.as_ptr() as *const __m128i));
        // Byte t of rows 0, 1 (low half) and 2, 3 (high half), eight times each.
        let control = |t: i8| {
            let (a, b) = (
                _mm_set1_epi64x(0x0101_0101_0101_0101 * t as i64),
                _mm_set1_epi64x(0x0101_0101_0101_0101 * (4 + t) as i64),
            );
            let lo = _mm_unpacklo_epi64(a, b);
            let hi = _mm_add_epi8(lo, _mm_set1_epi8(8));
            _mm256_set_m128i(hi, lo)
        };
        let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        std::array::from_fn(|t| {
            let bytes = _mm256_shuffle_epi8(words, control(t as i8));
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bits), bits);
            _mm256_and_si256(set, _mm256_set1_epi8(0x10))
        })
    }

    /// The four rows of `group` against `M` activation rows, for a type whose block `b` of
    /// row `r` is `d·(u − o) + m` with unsigned byte values `u` (Q4_0: nibbles, `o` = 8, no
    /// `m`; Q4_1: nibbles and `m`; Q5_0 / Q5_1: five bits): `unpack(g)` gives the four rows'
    /// `u` in runs of 8 (vector `t`: values `8t .. 8t + 8` of rows 0, 1, 2, 3 in turn, as
    /// [`nibble_runs`] makes them), their `d` and `m` (0 where the type has none) as f32;
    /// `xs[i].1` holds `o·Σ q'` per activation block and `xs[i].2` its scales `[d', s']` in
    /// f64. Per block and activation row: four `maddubs` of a run with the activations' same
    /// 8 bytes (broadcast), added in i16 (each lane at most 4·2·31·128 = 31744 < 32767), one
    /// `madd` by ones (two i32 lanes per row), one `hadd`: the four rows' `Σ u·q'`, minus
    /// `o·Σ q'`, times `d'` and `d`, plus `m·s'` (every product exact in f64), rounded once
    /// by an FMA and added to the row's f64 sum: bit for bit the types' scalar `block_dot`
    /// added in block order (tested for each type). `HAS_M`: whether the type has `m` (Q4_1,
    /// Q5_1); without it the FMA adds the product to the row's sum directly (the same single
    /// rounding), and the `m·s'` work is skipped.
    /// `VNNI`: the four `maddubs`, their additions and the `madd` become four `vpdpbusd`
    /// into one i32 accumulator (the same integers: no saturation either way).
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c, and with `VNNI` avx512vl and avx512vnni
    /// (inline this into a function that enables them); every slice of `xs` has
    /// `group.len()` entries.
    #[inline(always)]
    pub unsafe fn unsigned_group_dot<
        G,
        A: Act8,
        const M: usize,
        const HAS_M: bool,
        const VNNI: bool,
    >(
        group: &[G],
        xs: [super::ActRow<'_, A>; M],
        unpack: impl Fn(&G) -> ([__m256i; 4], __m128, __m128),
    ) -> [[f64; 4]; M] {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_pd(); M];
        for (b, g) in group.iter().enumerate() {
            // A hint: no fault past the end of the weight.
            _mm_prefetch(
                (g as *const G as *const i8).wrapping_add(PREFETCH),
                _MM_HINT_T0,
            );
            let (u, wd, wm) = unpack(g);
            // Shared by the activation rows: the weight scales in f64.
            let (wd, wm) = (_mm256_cvtps_pd(wd), _mm256_cvtps_pd(wm));
            for i in 0..M {
                let (x, offsets, scales) = xs[i];
                let x = x.get_unchecked(b);
                let [xd, xs] = *scales.get_unchecked(b);
                let a = x.qs().as_ptr();
                let h = if VNNI {
                    let h = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u[0], bytes8(a));
                    let h = _mm256_dpbusd_epi32(h, u[1], bytes8(a.add(8)));
                    let h = _mm256_dpbusd_epi32(h, u[2], bytes8(a.add(16)));
                    _mm256_dpbusd_epi32(h, u[3], bytes8(a.add(24)))
                } else {
                    let p = _mm256_add_epi16(
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(u[0], bytes8(a)),
                            _mm256_maddubs_epi16(u[1], bytes8(a.add(8))),
                        ),
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(u[2], bytes8(a.add(16))),
                            _mm256_maddubs_epi16(u[3], bytes8(a.add(24))),
                        ),
                    );
                    _mm256_madd_epi16(p, ones)
                };
                // Lanes [r0, r0, r1, r1 | r2, r2, r3, r3] -> [r0, r1, r2, r3].
                let h = _mm256_hadd_epi32(h, h);
                let h =
                    _mm_unpacklo_epi64(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                let sums = _mm_sub_epi32(h, _mm_set1_epi32(*offsets.get_unchecked(b)));
                // `Σ·d'`, then times `d` in the FMA: every product exact in f64.
                let sums = _mm256_mul_pd(_mm256_cvtepi32_pd(sums), _mm256_set1_pd(xd));
                acc[i] = if HAS_M {
                    let ms = _mm256_mul_pd(wm, _mm256_set1_pd(xs));
                    _mm256_add_pd(acc[i], _mm256_fmadd_pd(sums, wd, ms))
                } else {
                    _mm256_fmadd_pd(sums, wd, acc[i])
                };
            }
        }
        let mut out = [[0f64; 4]; M];
        for i in 0..M {
            _mm256_storeu_pd(out[i].as_mut_ptr(), acc[i]);
        }
        out
    }

    /// [`unsigned_group_dot`] with AVX-512 VNNI for two groups at once (eight weight rows):
    /// `unpack` gives each group's values in runs of 8 (two 32-bit words per row); one
    /// `vpermd` and one 128-bit permute per run and group regroup them as the words
    /// [`pair_dot_words`] takes.
    ///
    /// # Safety
    /// As [`pair_dot_words`].
    #[inline(always)]
    pub unsafe fn unsigned_pair_dot<G, A: Act8, const M: usize, const HAS_M: bool>(
        group0: &[G],
        group1: &[G],
        xs: &[super::ActRow<'_, A>; M],
        unpack: impl Fn(&G) -> ([__m256i; 4], __m128, __m128),
    ) -> [[f64; 8]; M] {
        // Each row's two words of a run, first words then second words.
        let order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        pair_dot_words::<_, _, M, HAS_M, PREFETCH, true>(group0, group1, xs, |g0, g1| {
            let (u0, wd0, wm0) = unpack(g0);
            let (u1, wd1, wm1) = unpack(g1);
            let mut w = [_mm256_setzero_si256(); 8];
            for t in 0..4 {
                let p0 = _mm256_permutevar8x32_epi32(u0[t], order);
                let p1 = _mm256_permutevar8x32_epi32(u1[t], order);
                w[2 * t] = _mm256_permute2x128_si256(p0, p1, 0x20);
                w[2 * t + 1] = _mm256_permute2x128_si256(p0, p1, 0x31);
            }
            (w, _mm256_set_m128(wd1, wd0), _mm256_set_m128(wm1, wm0))
        })
    }

    /// The kernel of two groups at once (eight weight rows) with AVX-512 VNNI, each row's
    /// integer sum in one 32-bit lane, for a 32-wide type whose block `b` of row `r` is
    /// `d·u + m` against activations that take `o·Σ q'` off (`xs[i].1`) and whose scales
    /// `[d', s']` come as f64 (`xs[i].2`): `words(g0, g1)` gives a block's `w[j]`, values
    /// `4j .. 4j + 4` of the eight rows (unsigned bytes), and the eight rows' `d` and `m`
    /// (0 where the type has none) as f32. Per block and activation row: [`eight_row_sums`],
    /// then the f64 step of [`unsigned_group_dot`] on eight lanes at once (the integer sum
    /// times `d'` times `d` is exact in f64, as is `m·s'`, so an FMA into the row's sum
    /// rounds once, as the scalar addition does): bit for bit the scalar sum (tested with
    /// each type's blocks). `AHEAD`: the prefetch distance of each stream
    /// ([`pair_prefetch`]). `UNROLL`: the activation rows written out one by one
    /// (`unrolled!`), so that their accumulators stay in registers (Q4_0 at 64 rows on a
    /// Zen 4 core: 0.8-0.93x the time of the loop), unless `words` itself needs the
    /// registers (Q8_0's transpose: 1.02-1.05x).
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512vl and avx512vnni (inline this
    /// into a function that enables them); both groups and every slice of `xs` have the same
    /// length.
    #[inline(always)]
    pub unsafe fn pair_dot_words<
        G,
        A: Act8,
        const M: usize,
        const HAS_M: bool,
        const AHEAD: usize,
        const UNROLL: bool,
    >(
        group0: &[G],
        group1: &[G],
        xs: &[super::ActRow<'_, A>; M],
        words: impl Fn(&G, &G) -> ([__m256i; 8], __m256, __m256),
    ) -> [[f64; 8]; M] {
        let mut acc = [_mm512_setzero_pd(); M];
        for b in 0..group0.len() {
            let (g0, g1) = (group0.get_unchecked(b), group1.get_unchecked(b));
            pair_prefetch::<_, AHEAD>(g0, g1, b, group0.len());
            let (w, wd, wm) = words(g0, g1);
            // Shared by the activation rows: the weight scales in f64.
            let (wd, wm) = (_mm512_cvtps_pd(wd), _mm512_cvtps_pd(wm));
            // One activation row: `acc[$i]` += its eight rows' block products. `Σ·d'`, then
            // times `d`: every product exact in f64 (|Σ| < 2^20, `d` and `d'` f16), so the FMA
            // rounds once, as the scalar `Σ · (d·d')` added to the sum does.
            macro_rules! row {
                ($i:expr) => {{
                    let i = $i;
                    let (x, offsets, scales) = xs[i];
                    let x = x.get_unchecked(b);
                    let [xd, xs] = *scales.get_unchecked(b);
                    let sums = eight_row_sums(&w, x.qs(), *offsets.get_unchecked(b));
                    let sums = _mm512_mul_pd(sums, _mm512_set1_pd(xd));
                    acc[i] = if HAS_M {
                        let ms = _mm512_mul_pd(wm, _mm512_set1_pd(xs));
                        _mm512_add_pd(acc[i], _mm512_fmadd_pd(sums, wd, ms))
                    } else {
                        _mm512_fmadd_pd(sums, wd, acc[i])
                    };
                }};
            }
            if UNROLL {
                super::unrolled!(M, |i| { row!(i) });
            } else {
                for i in 0..M {
                    row!(i);
                }
            }
        }
        let mut out = [[0f64; 8]; M];
        for i in 0..M {
            _mm512_storeu_pd(out[i].as_mut_ptr(), acc[i]);
        }
        out
    }

    /// Eight weight rows' integer sums against one activation block, in f64 lanes: `w[j]`
    /// holds values `4j .. 4j + 4` of the eight rows (unsigned), `a` the activation's 32
    /// signed values, `offset` what comes off each sum (`o·Σ q'`). Eight `vpdpbusd` with the
    /// activations' word `j` broadcast, in two chains (the first started at `−offset`).
    ///
    /// # Safety
    /// The CPU must support avx2, avx512f, avx512vl and avx512vnni (inline this into a
    /// function that enables them).
    #[inline(always)]
    pub unsafe fn eight_row_sums(w: &[__m256i; 8], a: &[i8; 32], offset: i32) -> __m512d {
        let a = a.as_ptr() as *const i32;
        let word = |j: usize| _mm256_set1_epi32(std::ptr::read_unaligned(a.add(j)));
        let mut h0 = _mm256_set1_epi32(-offset);
        let mut h1 = _mm256_setzero_si256();
        for j in (0..8).step_by(2) {
            h0 = _mm256_dpbusd_epi32(h0, w[j], word(j));
            h1 = _mm256_dpbusd_epi32(h1, w[j + 1], word(j + 1));
        }
        _mm512_cvtepi32_pd(_mm256_add_epi32(h0, h1))
    }

    /// Prefetch hints for block `b` of a pair of groups of `kb` blocks (`g0`, `g1`: their
    /// blocks `b`): `AHEAD` bytes ahead in each group's stream; where that passes the end
    /// of the first group (the second group's blocks, being read), ahead in the group after
    /// the second one (the next pair's second group, which no stream reaches otherwise: a
    /// pair of short rows, SmolLM2's 18 blocks, otherwise starts it on cache misses).
    #[inline(always)]
    pub unsafe fn pair_prefetch<G, const AHEAD: usize>(g0: &G, g1: &G, b: usize, kb: usize) {
        let size = std::mem::size_of::<G>();
        let group = kb * size;
        let first = if b * size + AHEAD < group {
            AHEAD
        } else {
            AHEAD + 2 * group
        };
        // Hints: no fault past the end of the weight.
        _mm_prefetch(
            (g0 as *const G as *const i8).wrapping_add(first),
            _MM_HINT_T0,
        );
        _mm_prefetch(
            (g1 as *const G as *const i8).wrapping_add(AHEAD),
            _MM_HINT_T0,
        );
    }

    /// Defines a 32-wide unsigned type's three group kernels on [`unsigned_group_dot`] and
    /// [`unsigned_pair_dot`]: `group_dot` (AVX2), `group_dot_vnni` and `pair_dot_vnni`
    /// (AVX-512 VNNI, one group or two), for weight groups `$x4`,
    /// activation blocks `$act`, `$has_m` as `HAS_M` and `$unpack` as `unpack`. All are
    /// `unsafe`: the CPU must have their features, and every slice of `xs` has `group.len()`
    /// blocks.
    macro_rules! unsigned_kernels {
        ($x4:ty, $act:ty, $has_m:expr, $unpack:expr) => {
            /// The AVX2 kernel (`unsigned_group_dot`).
            ///
            /// # Safety
            /// The CPU must support avx2, fma and f16c; every slice of `xs` has `group.len()`
            /// blocks.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn group_dot<const M: usize>(
                group: &[$x4],
                xs: [$crate::repack::ActRow<'_, $act>; M],
            ) -> [[f64; 4]; M] {
                $crate::repack::avx2::unsigned_group_dot::<_, _, M, { $has_m }, false>(
                    group, xs, $unpack,
                )
            }

            /// The AVX-512 VNNI kernel (`unsigned_group_dot` with `vpdpbusd`).
            ///
            /// # Safety
            /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and
            /// avx512vnni; every slice of `xs` has `group.len()` blocks.
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
            pub(super) unsafe fn group_dot_vnni<const M: usize>(
                group: &[$x4],
                xs: [$crate::repack::ActRow<'_, $act>; M],
            ) -> [[f64; 4]; M] {
                $crate::repack::avx2::unsigned_group_dot::<_, _, M, { $has_m }, true>(
                    group, xs, $unpack,
                )
            }

            /// The AVX-512 VNNI kernel for two groups (`unsigned_pair_dot`).
            ///
            /// # Safety
            /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and
            /// avx512vnni; both groups and every slice of `xs` have the same length.
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
            pub(super) unsafe fn pair_dot_vnni<const M: usize>(
                group0: &[$x4],
                group1: &[$x4],
                xs: &[$crate::repack::ActRow<'_, $act>; M],
            ) -> [[f64; 8]; M] {
                $crate::repack::avx2::unsigned_pair_dot::<_, _, M, { $has_m }>(
                    group0, group1, xs, $unpack,
                )
            }
        };
    }
    pub(crate) use unsigned_kernels;

    /// Four f16 values as f32.
    #[inline(always)]
    pub unsafe fn f16x4(v: &[half::f16; 4]) -> __m128 {
        _mm_cvtph_ps(_mm_loadl_epi64(v.as_ptr() as *const __m128i))
    }
}

/// A repacked weight of any type, as `candle_tp::quant::QuantMatMul` holds it.
pub trait RepackedMatMul: Send + Sync + std::fmt::Debug {
    /// The block type's name (`Q4_0`).
    fn type_name(&self) -> &'static str;
    /// `(n, k)`.
    fn dims(&self) -> (usize, usize);
    /// [`Repacked::matmul_f64`].
    fn matmul_f64(&self, kernel: Kernel, m: usize, x: &[f32], dst: &mut [f64]) -> Result<()>;
    /// [`Repacked::matmul_f32`].
    fn matmul_f32(&self, kernel: Kernel, m: usize, x: &[f32], dst: &mut [f32]) -> Result<()>;
    /// [`Repacked::dequantize_row`].
    fn dequantize_row(&self, row: usize, out: &mut [f32]);
    /// [`Repacked::prepare`], for any weight of this block type.
    fn prepare(&self, kernel: Kernel, m: usize, x: &[f32]) -> Result<PreparedActs>;
    /// [`Repacked::matmul_prepared_f64`]; an error if `x` was prepared for another type.
    fn matmul_prepared_f64(&self, x: &PreparedActs, dst: &mut [f64]) -> Result<()>;
    /// [`Repacked::matmul_prepared_f32`]; an error if `x` was prepared for another type.
    fn matmul_prepared_f32(&self, x: &PreparedActs, dst: &mut [f32]) -> Result<()>;
}

/// [`Prepared`] activations of some block type, as [`RepackedMatMul::prepare`] gives them.
pub struct PreparedActs {
    type_name: &'static str,
    m: usize,
    k: usize,
    kernel: Kernel,
    inner: Box<dyn std::any::Any + Send + Sync>,
}

impl PreparedActs {
    /// The block type they were prepared for (`Q4_0`).
    pub fn type_name(&self) -> &'static str {
        self.type_name
    }

    /// Activation rows.
    pub fn m(&self) -> usize {
        self.m
    }

    /// Values per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// The kernel they were prepared for.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    fn get<B: Interleave>(&self) -> Result<&Prepared<B>> {
        match self.inner.downcast_ref::<Prepared<B>>() {
            Some(x) => Ok(x),
            None => candle_core::bail!(
                "{} (repacked) matmul: activations prepared for {} weights",
                B::NAME,
                self.type_name
            ),
        }
    }
}

impl std::fmt::Debug for PreparedActs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PreparedActs({} rows x {} for {}, {:?})",
            self.m, self.k, self.type_name, self.kernel
        )
    }
}

impl<B: Interleave> RepackedMatMul for Repacked<B> {
    fn type_name(&self) -> &'static str {
        B::NAME
    }
    fn dims(&self) -> (usize, usize) {
        (self.n, self.k())
    }
    fn matmul_f64(&self, kernel: Kernel, m: usize, x: &[f32], dst: &mut [f64]) -> Result<()> {
        Repacked::matmul_f64(self, kernel, m, x, dst)
    }
    fn matmul_f32(&self, kernel: Kernel, m: usize, x: &[f32], dst: &mut [f32]) -> Result<()> {
        Repacked::matmul_f32(self, kernel, m, x, dst)
    }
    fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        Repacked::dequantize_row(self, row, out)
    }
    fn prepare(&self, kernel: Kernel, m: usize, x: &[f32]) -> Result<PreparedActs> {
        let p = Repacked::prepare(self, kernel, m, x)?;
        Ok(PreparedActs {
            type_name: B::NAME,
            m: p.m,
            k: p.k,
            kernel,
            inner: Box::new(p),
        })
    }
    fn matmul_prepared_f64(&self, x: &PreparedActs, dst: &mut [f64]) -> Result<()> {
        Repacked::matmul_prepared_f64(self, x.get::<B>()?, dst)
    }
    fn matmul_prepared_f32(&self, x: &PreparedActs, dst: &mut [f32]) -> Result<()> {
        Repacked::matmul_prepared_f32(self, x.get::<B>()?, dst)
    }
}

/// Repacks a weight `[n, k]` given as GGUF bytes (a `QTensor`'s data) of blocks of `B`. Call
/// the block types' non-generic `repack` (e.g. [`crate::q4_0x4::repack`]) from other crates:
/// this generic would be instantiated there, with their optimisation level.
pub fn repack_bytes<B: Interleave>(
    bytes: &[u8],
    n: usize,
    k: usize,
) -> Result<Arc<dyn RepackedMatMul>> {
    let blocks = crate::f64_dot::blocks_from_bytes::<B>(bytes)?;
    Ok(Arc::new(Repacked::new(blocks, n, k)?))
}

/// The signature of [`repack_bytes`] for one block type.
pub type RepackFn = fn(&[u8], usize, usize) -> Result<Arc<dyn RepackedMatMul>>;

#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::f64_dot::dot_f64;
    use crate::f64_dot::testing::pseudo;

    fn activations(m: usize, k: usize) -> Vec<f32> {
        (0..m * k).map(|i| 3.0 * pseudo(i + 5)).collect()
    }

    /// Every value of every kernel, for 1..9 activation rows (tiles of four and the rows
    /// left over), row counts that leave partial groups and block counts odd and even, is
    /// bit for bit the f64 dot product of the unpacked row (`dot_f64`, scalar); the f32
    /// product is its rounding. `block(r, b)`: block `b` of row `r`.
    /// Activations prepared once give, with every weight of the type, the bits of
    /// `matmul_f32` / `matmul_f64` on the raw rows; a size that does not fit is an error.
    pub fn prepared_activations_serve_every_weight<B: Interleave>(
        block: impl Fn(usize, usize) -> B,
    ) {
        let (n, kb) = (9, 5);
        let k = kb * B::BLOCK;
        let weights: Vec<Repacked<B>> = (0..2)
            .map(|w| {
                let rows: Vec<B> = (0..n * kb)
                    .map(|i| block(i / kb + 50 * w, i % kb))
                    .collect();
                Repacked::new(&rows, n, k).unwrap()
            })
            .collect();
        for &kernel in &Kernel::under_test() {
            for m in [1, 4, 8, 9, 17] {
                let x = activations(m, k);
                let prepared = weights[0].prepare(kernel, m, &x).unwrap();
                for w in &weights {
                    let (mut want, mut got) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                    w.matmul_f32(kernel, m, &x, &mut want).unwrap();
                    w.matmul_prepared_f32(&prepared, &mut got).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert!(want.iter().all(|v| v.is_finite()), "{kernel:?} m={m}");
                    assert_eq!(bits(&got), bits(&want), "{} {kernel:?} m={m}", B::NAME);
                    let (mut want, mut got) = (vec![f64::NAN; m * n], vec![f64::NAN; m * n]);
                    w.matmul_f64(kernel, m, &x, &mut want).unwrap();
                    w.matmul_prepared_f64(&prepared, &mut got).unwrap();
                    let bits = |v: &[f64]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{} {kernel:?} m={m} f64", B::NAME);
                }
                let mut short = vec![0f32; m * n - 1];
                let err = weights[1].matmul_prepared_f32(&prepared, &mut short);
                assert!(
                    err.is_err(),
                    "{} m={m}: a short output was accepted",
                    B::NAME
                );
            }
            let wide: Vec<B> = (0..n * 2 * kb)
                .map(|i| block(i / (2 * kb), i % kb))
                .collect();
            let wide = Repacked::new(&wide, n, 2 * k).unwrap();
            let prepared = weights[0].prepare(kernel, 2, &activations(2, k)).unwrap();
            let err = wide
                .matmul_prepared_f32(&prepared, &mut vec![0f32; 2 * n])
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("[{n}, {}]", 2 * k)), "{err}");
        }
    }

    pub fn every_value_is_the_unpacked_rows_f64_dot<B: Interleave>(
        block: impl Fn(usize, usize) -> B,
    ) {
        let kernels = Kernel::under_test();
        for n in [1, 3, 4, 5, 8, 9] {
            for kb in [1, 2, 3, 5, 18] {
                let w: Vec<B> = (0..n * kb).map(|i| block(i / kb, i % kb)).collect();
                let packed = Repacked::new(&w, n, kb * B::BLOCK).unwrap();
                for m in 1..=9 {
                    let x = activations(m, kb * B::BLOCK);
                    let mut xq = vec![B::ACT_ZERO; m * kb];
                    B::quantize(&x, &mut xq);
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
                                assert!(want.is_finite() && want != 0.0, "{want}");
                                let got = y[i * n + j];
                                assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{} {kernel:?} n={n} kb={kb} m={m} ({i}, {j}): {got} != {want}",
                                    B::NAME
                                );
                                assert_eq!(y32[i * n + j].to_bits(), (want as f32).to_bits());
                            }
                        }
                    }
                }
            }
        }
    }

    /// Blocks and dequantized rows come back as stored (`dequantize(block)`: the values).
    pub fn blocks_and_rows_come_back<B: Interleave + PartialEq + std::fmt::Debug>(
        block: impl Fn(usize, usize) -> B,
        dequantize: impl Fn(&B) -> Vec<f32>,
    ) {
        let (n, kb) = (7, 3);
        let w: Vec<B> = (0..n * kb).map(|i| block(i / kb, i % kb)).collect();
        let packed = Repacked::new(&w, n, kb * B::BLOCK).unwrap();
        assert_eq!((packed.n(), packed.k()), (7, kb * B::BLOCK));
        let mut row = vec![0f32; kb * B::BLOCK];
        for r in 0..n {
            packed.dequantize_row(r, &mut row);
            for b in 0..kb {
                assert_eq!(packed.block(r, b), w[r * kb + b]);
                assert_eq!(
                    row[b * B::BLOCK..(b + 1) * B::BLOCK],
                    dequantize(&w[r * kb + b])
                );
            }
        }
    }

    /// [`Interleave::dequantize`] gives candle's `to_float` of the same blocks (`C`: candle's
    /// block type of the same layout), bit for bit.
    pub fn dequantize_is_candles<
        B: Interleave + std::fmt::Debug,
        C: candle_core::quantized::GgmlType,
    >(
        blocks: &[B],
    ) {
        assert_eq!(std::mem::size_of::<B>(), std::mem::size_of::<C>());
        let theirs: Vec<C> = blocks
            .iter()
            // SAFETY: the same repr(C) layout (sizes asserted above), every bit pattern valid.
            .map(|b| unsafe { std::mem::transmute_copy::<B, C>(b) })
            .collect();
        let mut want = vec![0f32; blocks.len() * B::BLOCK];
        C::to_float(&theirs, &mut want);
        let mut got = vec![0f32; B::BLOCK];
        for (b, want) in blocks.iter().zip(want.chunks_exact(B::BLOCK)) {
            B::dequantize(b, &mut got);
            for (j, (g, w)) in got.iter().zip(want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "value {j} of {b:?}: {g} != {w}");
            }
        }
    }

    /// A NaN activation gives NaN in its row only; wrong sizes are errors naming the type.
    pub fn nan_activations_give_nan_and_bad_sizes_are_errors<B: Interleave>(
        block: impl Fn(usize, usize) -> B,
    ) {
        let k = 2 * B::BLOCK;
        let w: Vec<B> = (0..10).map(|i| block(i / 2, i % 2)).collect();
        let packed = Repacked::new(&w, 5, k).unwrap();
        for kernel in Kernel::under_test() {
            let mut x = activations(2, k);
            x[k + 6] = f32::NAN; // row 1, block 0
            let mut y = vec![0f32; 10];
            packed.matmul_f32(kernel, 2, &x, &mut y).unwrap();
            assert!(y[..5].iter().all(|v| v.is_finite()), "{kernel:?}: {y:?}");
            assert!(y[5..].iter().all(|v| v.is_nan()), "{kernel:?}: {y:?}");
            let err = packed
                .matmul_f32(kernel, 2, &x[..k + 4], &mut y)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(B::NAME) && err.contains(&format!("{}", k + 4)),
                "{err}"
            );
        }
        let err = Repacked::new(&w, 5, 3 * B::BLOCK).unwrap_err().to_string();
        assert!(
            err.contains(&format!("[5, {}]", 3 * B::BLOCK)) && err.contains("10 blocks"),
            "{err}"
        );
        assert!(Repacked::new(&w, 5, k + 8).is_err());
    }
}
