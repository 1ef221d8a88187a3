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
//!
//! With AVX-512 VNNI, the k-quants' products of 40+ activation rows (prefill) unpack sixteen
//! weight rows at a time to bytes, once per product, and multiply them by tiles of eight
//! activation rows with four-byte broadcasts ([`panel`]): measured on a Zen 4 core, one
//! thread, 1 B Llama pp128, Q6_K 1.5x, Q4_K_M 1.4x and Q5_K_M 1.6x the four-row kernels.
//! Below that, the 32-wide types and the k-quants run sixteen weight rows at once on whole
//! zmm (`avx512.rs`, `k_quad.rs`); the k-quants' single activation row (decode) stays on the
//! four-row kernel, whose one stream reads faster.

use crate::f64_matmul::{check_matmul, fill_in_place, RowsOut};
use crate::kernel::Kernel;
use candle_core::Result;

mod erased;
mod interleave;
mod unroll;

pub use erased::{repack_bytes, PreparedActs, RepackFn, RepackedMatMul};
pub(crate) use interleave::{put_runs, take_runs};
pub use interleave::{ActRow, Interleave};
pub(crate) use unroll::unrolled;

/// `dst[i * n + j] = Σ_t x[i, t] · W[j, t]` in f64, for `m` activation rows of `k` values and a
/// weight `w` of `n` rows of `k / BLOCK` blocks (GGUF's layout): each activation row quantized
/// once to the type's activation blocks (candle's rounding), every output bit for bit
/// [`crate::f64_dot::dot_f64`] of its row, whatever `m`, the kernel or the thread count. The
/// weight is repacked on every call: keep a [`Repacked`] to multiply it again.
pub fn matmul_f64<B: Interleave>(
    kernel: Kernel,
    (m, k, n): (usize, usize, usize),
    x: &[f32],
    w: &[B],
    dst: &mut [f64],
) -> Result<()> {
    check_matmul(
        &format!("{} f64 matmul", B::NAME),
        kernel,
        (m, k, n),
        B::BLOCK,
        (x.len(), w.len(), dst.len()),
    )?;
    Repacked::new(w, n, k)?.matmul_f64(kernel, m, x, dst)
}

/// [`matmul_f64`] of a weight given as GGUF bytes (a `QTensor`'s data), viewed as blocks of
/// `B` without copying: one function per block type, which a caller can pick from a table.
pub fn matmul_f64_bytes<B: Interleave>(
    kernel: Kernel,
    dims: (usize, usize, usize),
    x: &[f32],
    w: &[u8],
    dst: &mut [f64],
) -> Result<()> {
    matmul_f64(
        kernel,
        dims,
        x,
        crate::f64_dot::blocks_from_bytes::<B>(w)?,
        dst,
    )
}

/// The signature of [`matmul_f64_bytes`] for one block type.
pub type F64MatMulFn = fn(Kernel, (usize, usize, usize), &[f32], &[u8], &mut [f64]) -> Result<()>;

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
        let row = |i: usize| x.row(i);
        // The tiles of 8 activation rows of the eight-row kernel and the quads, made once for
        // every weight pair and quad.
        let pair_tiles: Vec<[ActRow<'_, B::Act>; 8]> = if kernel.has_avx512() {
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
            // Tiles of 8 activation rows where the type unpacks much per weight block,
            // and for every type with AVX-512's 32 vector registers (measured on a Zen 4
            // core against tiles of 4: 1.05-1.25x at 8 and 64 activation rows).
            let tiled8 = if B::TILE_8 || kernel.has_avx512() {
                m / 8 * 8
            } else {
                0
            };
            let tiled = tiled8 + (m - tiled8) / 4 * 4;
            // With AVX-512 VNNI, tiles of 8 activation rows run groups in pairs (eight
            // weight rows at once; on a Zen 4 core 1.4-1.9x one group at a time at 8 and 64
            // activation rows, but 0.5x at 1 and 0.9x at 4, where regrouping the weights per
            // block costs more than the f64 steps it saves).
            let pairs = if kernel.has_avx512() && tiled8 > 0 {
                groups / 2
            } else {
                0
            };
            // The panel types run quads of groups first (sixteen weight rows, unpacked once
            // for every tile of 8), from `panel::MIN_ROWS` rows on.
            let panels = if B::PANEL && pairs > 0 && tiled8 >= panel::MIN_ROWS {
                groups / 4
            } else {
                0
            };
            for p in 0..panels {
                let quad = std::array::from_fn(|i| group(4 * p + i));
                let next = if p + 1 < panels {
                    let first = (row0 / 4 + 4 * (p + 1)) * kb;
                    &self.groups[first..first + 4 * kb]
                } else {
                    &[]
                };
                panel_products::<B>(kernel, quad, next, &pair_tiles[..tiled8 / 8], |t, v| {
                    let live = (rows - 16 * p).min(panel::ROWS);
                    put_tile(&mut o, 16 * p, 8 * t, v, live, &out);
                });
            }
            // With AVX-512 VNNI, the types with a 512-bit kernel run four groups at once
            // (sixteen weight rows) against every activation row: tiles of 8 (with AMX
            // tiles where the kernel is `Amx` and the type has them) and of 4, then the last
            // 1-3 rows (decode's one). Measured on a Zen 5 core, one thread, against
            // the eight-row kernel 1.0-2.1x at 8 rows and 1.0-1.35x at 64, against the
            // four-row kernel 1.05-1.4x at one row and 1.5-2.5x at 2 and 4
            // (`bench_repacked`). A type may keep a single last row on the four-row kernel
            // (Q8_0).
            let quad_end = if m - tiled == 1 && !B::QUAD_SINGLE {
                tiled
            } else {
                m
            };
            // (Where panels ran, the rows they left run on the four-row kernels.)
            let quads = if B::QUAD && kernel.has_avx512() && quad_end > 0 && panels == 0 {
                groups / 4
            } else {
                0
            };
            debug_assert!(quads == 0 || panels == 0, "{}: quads and panels", B::NAME);
            for q in 0..quads {
                let quad = std::array::from_fn(|i| group(4 * q + i));
                let live = (rows - 16 * q).min(16);
                for (t, tile) in pair_tiles[..tiled8 / 8].iter().enumerate() {
                    let v = if B::AMX && kernel == Kernel::Amx {
                        quad_dot_amx::<B>(quad, tile)
                    } else {
                        quad_dot::<B, 8>(quad, tile)
                    };
                    put_tile(&mut o, 16 * q, 8 * t, &v, live, &out);
                }
                for i in (tiled8..tiled).step_by(4) {
                    let v = quad_dot::<B, 4>(quad, &std::array::from_fn(|t| row(i + t)));
                    put_tile(&mut o, 16 * q, i, &v, live, &out);
                }
                match quad_end - tiled {
                    1 => {
                        let v = quad_dot::<B, 1>(quad, &[row(tiled)]);
                        put_tile(&mut o, 16 * q, tiled, &v, live, &out);
                    }
                    2 => {
                        let v = quad_dot::<B, 2>(quad, &[row(tiled), row(tiled + 1)]);
                        put_tile(&mut o, 16 * q, tiled, &v, live, &out);
                    }
                    3 => {
                        let v = quad_dot::<B, 3>(quad, &std::array::from_fn(|t| row(tiled + t)));
                        put_tile(&mut o, 16 * q, tiled, &v, live, &out);
                    }
                    _ => {}
                }
            }
            // Rows `4g ..` of this share (`r_max` of them: one group or a pair) for
            // activation rows `i ..`, as many as the tile has.
            let mut put = |g: usize, i: usize, tile: &[[f64; 8]], r_max: usize| {
                put_tile(&mut o, 4 * g, i, tile, (rows - 4 * g).min(r_max), &out);
            };
            // Pairs of the groups that no panel or quad took.
            for p in (2 * panels).max(2 * quads)..pairs {
                let (g0, g1) = (group(2 * p), group(2 * p + 1));
                for (t, tile) in pair_tiles[..tiled8 / 8].iter().enumerate() {
                    let v = pair_dot::<B, 8>(g0, g1, tile);
                    put(2 * p, 8 * t, &v, 8);
                }
            }
            let widen = |v: [f64; 4]| std::array::from_fn(|r| if r < 4 { v[r] } else { 0.0 });
            for g in 0..groups {
                let group = group(g);
                // The tiles of 8 of paired groups ran above (the quads' groups are among
                // them: with tiles of 8, `2 · pairs` covers every group but an odd last one).
                let paired = if g < 2 * pairs { tiled8 } else { 0 };
                for i in (paired..tiled8).step_by(8) {
                    let v = group_dot::<B, 8>(kernel, group, std::array::from_fn(|t| row(i + t)));
                    put(g, i, &v.map(widen), 4);
                }
                // Rows `0 .. quad_end` ran in the quads above.
                let (tiles4, singles) = if g < 4 * quads {
                    (tiled8..tiled8, quad_end..m)
                } else {
                    (tiled8..tiled, tiled..m)
                };
                for i in tiles4.step_by(4) {
                    let v = group_dot::<B, 4>(kernel, group, std::array::from_fn(|t| row(i + t)));
                    put(g, i, &v.map(widen), 4);
                }
                for i in singles {
                    let v = group_dot::<B, 1>(kernel, group, [row(i)]);
                    put(g, i, &v.map(widen), 4);
                }
            }
        };
        fill_in_place(n, m, dst, fill);
        Ok(())
    }
}

/// Writes a tile of products into a task's share: `tile[t][c]` is the output of weight row
/// `col + c` (of the share) for activation row `i + t`, for `c < live`; a panel's sixteen
/// contiguous columns per activation row go out in one pass (one conversion per value, no
/// regrouping).
#[inline(always)]
fn put_tile<T, const W: usize>(
    o: &mut RowsOut<'_, T>,
    col: usize,
    i: usize,
    tile: &[[f64; W]],
    live: usize,
    out: &impl Fn(f64) -> T,
) {
    for (t, v) in tile.iter().enumerate() {
        let dst = &mut o.row(i + t)[col..col + live];
        for (d, &v) in dst.iter_mut().zip(v) {
            *d = out(v);
        }
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
    /// Activation row `i`: its blocks, their sums and their scales.
    pub(crate) fn row(&self, i: usize) -> ActRow<'_, B::Act> {
        let kb = self.k / B::BLOCK;
        let r = i * kb..(i + 1) * kb;
        (&self.act[r.clone()], &self.sums[r.clone()], &self.scales[r])
    }
}

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
    check_avx512_groups::<B, M>(&[group0, group1], xs);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the features and the lengths were checked just above.
    unsafe {
        B::group_pair_dot_avx512(group0, group1, xs)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("is_available is false off x86-64")
}

/// Panics unless the groups have as many blocks as each other and as every activation row
/// of `xs`, and the CPU runs AVX-512 VNNI: what the multi-group kernels need.
fn check_avx512_groups<B: Interleave, const M: usize>(
    groups: &[&[B::X4]],
    xs: &[ActRow<'_, B::Act>; M],
) {
    let blocks = groups[0].len();
    assert!(
        groups.iter().all(|g| g.len() == blocks),
        "{} groups of {:?} blocks",
        B::NAME,
        groups.iter().map(|g| g.len()).collect::<Vec<_>>()
    );
    check_blocks::<B, M>(blocks, xs);
    assert!(
        Kernel::Avx512Vnni.is_available(),
        "the AVX-512 VNNI kernel needs avx2, fma, f16c, avx512f, avx512bw, avx512vl and \
         avx512vnni"
    );
}

/// Four groups (sixteen weight rows) against `M` activation rows with 512-bit VNNI:
/// `out[i][r]`.
///
/// # Panics
/// If a group and an activation row differ in blocks, or the CPU lacks AVX-512 VNNI.
fn quad_dot<B: Interleave, const M: usize>(
    quad: [&[B::X4]; 4],
    xs: &[ActRow<'_, B::Act>; M],
) -> [[f64; 16]; M] {
    check_avx512_groups::<B, M>(&quad, xs);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the features and the lengths were checked just above.
    unsafe {
        B::group_quad_dot_avx512(quad, xs)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("is_available is false off x86-64")
}

/// Four groups (sixteen weight rows) against a tile of eight activation rows with AMX-INT8:
/// `out[i][r]`, bit for bit [`quad_dot`].
///
/// # Panics
/// If a group and an activation row differ in blocks, or the CPU or the OS does not offer
/// AMX.
fn quad_dot_amx<B: Interleave>(
    quad: [&[B::X4]; 4],
    xs: &[ActRow<'_, B::Act>; 8],
) -> [[f64; 16]; 8] {
    check_avx512_groups::<B, 8>(&quad, xs);
    check_amx();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the features and the lengths were checked just above.
    unsafe {
        B::group_quad_dot_amx::<false>(quad, xs)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("is_available is false off x86-64")
}

/// Panics unless the CPU and the OS offer AMX-INT8 tiles.
fn check_amx() {
    assert!(
        Kernel::Amx.is_available(),
        "the AMX kernel needs amx-tile and amx-int8, granted by the OS ({})",
        crate::kernel::amx_support()
    );
}

/// Sixteen weight rows (`quad`, four groups) against every tile of eight activation rows with
/// AVX-512 VNNI (AMX tiles where `kernel` is [`Kernel::Amx`]), through a [`panel`] unpacked
/// once: `put(t, out)` with `out[i][r]` for tile `t`. `next`: the weight records the next
/// panel will read (prefetched meanwhile).
///
/// # Panics
/// If the groups and an activation row differ in blocks, or the CPU lacks AVX-512 VNNI (or
/// AMX, for [`Kernel::Amx`]).
fn panel_products<B: Interleave>(
    kernel: Kernel,
    quad: [&[B::X4]; 4],
    next: &[B::X4],
    tiles: &[[ActRow<'_, B::Act>; panel::TILE]],
    mut put: impl FnMut(usize, &[[f64; panel::ROWS]; panel::TILE]),
) {
    let blocks = quad[0].len();
    for tile in tiles {
        check_avx512_groups::<B, { panel::TILE }>(&quad, tile);
    }
    let amx = kernel == Kernel::Amx;
    if amx {
        check_amx();
    }
    #[cfg(target_arch = "x86_64")]
    panel::with_panel(blocks, |buf| {
        for (b, out) in buf.iter_mut().enumerate() {
            // SAFETY: the features were checked above; `b` is in every group.
            unsafe { B::unpack_panel_avx512(quad.map(|g| &g[b]), out) }
        }
        // The unpacking above waits for the weights, which stream from memory once per
        // product in four short runs that the hardware prefetcher catches late (`perf
        // annotate`: its loads took most of its samples). The next panel's records are
        // fetched into L2 meanwhile, a share per tile.
        let bytes = std::mem::size_of_val(next);
        let lines = bytes.div_ceil(64);
        let per_tile = lines.div_ceil(tiles.len().max(1));
        for (t, tile) in tiles.iter().enumerate() {
            for line in (t * per_tile..((t + 1) * per_tile).min(lines)).map(|l| 64 * l) {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
                // SAFETY: a prefetch is a hint and never faults; the line is in `next`.
                unsafe { _mm_prefetch((next.as_ptr() as *const i8).add(line), _MM_HINT_T1) };
            }
            put(
                t,
                &if amx {
                    // SAFETY: as above, and AMX was checked above.
                    unsafe { B::panel_dot_avx512::<{ panel::AMX }>(buf, tile) }
                } else {
                    // SAFETY: the features and the lengths were checked above.
                    unsafe { B::panel_dot_avx512::<{ panel::VNNI }>(buf, tile) }
                },
            );
        }
    });
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("is_available is false off x86-64")
}

/// The reference: each row's blocks' [`crate::f64_dot::F64Dot::block_dot`] added in block order, as the
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
pub(crate) mod avx2;

/// The 512-bit four-group kernel of the same types.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;

/// A 64-byte aligned value, and the 512-bit engines' 64-byte aligned stack frames.
pub(crate) mod frame;

/// AMX-INT8 tiles: configuration, product, emulation.
#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;

/// The AMX-INT8 engine of the 32-wide types' quads.
#[cfg(target_arch = "x86_64")]
pub(crate) mod amx_quad;

/// The 512-bit four-group kernels of the k-quants (Q4_K, Q5_K, Q6_K).
#[cfg(target_arch = "x86_64")]
pub(crate) mod k_quad;

/// The f64 step of the AVX-512 VNNI kernels (two groups and four).
#[cfg(target_arch = "x86_64")]
pub(crate) mod f64_step;

#[doc(hidden)]
pub mod panel;

#[cfg(test)]
pub(crate) mod testing;
