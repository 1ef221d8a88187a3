//! Which implementation of the inner loops runs: [`Kernel::Scalar`] (portable, the reference),
//! [`Kernel::Avx2`] (x86-64 AVX2 + FMA + F16C) or [`Kernel::Avx512Vnni`] (AVX2 plus
//! AVX-512 F/BW/VL and VNNI's `vpdpbusd`), chosen at run time, and the environment switch
//! `CANDLE_TP_KERNEL` that forces one.
//!
//! | `CANDLE_TP_KERNEL` | [`Kernel::detect`] gives |
//! |---|---|
//! | unset, empty or `auto` | the fastest kernel this CPU runs |
//! | `scalar` | [`Kernel::Scalar`] |
//! | `avx2` | [`Kernel::Avx2`] where the CPU has it; elsewhere the fastest available, with one warning on stderr |
//! | `avx512vnni` | [`Kernel::Avx512Vnni`] where the CPU has it; elsewhere likewise |
//!
//! Every caller of the crate's kernels (the quantized matmuls, the small-m dense product)
//! takes its kernel from [`Kernel::detect`], so forcing `scalar` runs the whole model on the
//! portable code: that is how the scalar path is tested on a host that has AVX2.
//!
//! [`Kernel::Avx512Vnni`] runs VNNI code where the crate has it (the repacked products of every
//! type, whose byte dot products become `vpdpbusd` and Q6_K's scaling `vpdpwssd`: the 32-wide
//! types on 512-bit vectors, sixteen weight rows at once, [`crate::repack`]; the k-quants in
//! tiles of 8 activation rows) and the AVX2 code everywhere else (the per-row f32 kernels, the
//! small-m product); its results are bit for bit the AVX2 kernel's (tested). candle 0.11.1's own
//! `QMatMul` also has AVX-512 VNNI and AVX-VNNI paths, see [`cpu_features`].

use std::sync::OnceLock;

/// The environment variable that forces a kernel (`scalar`, `avx2` or `auto`).
pub const KERNEL_ENV: &str = "CANDLE_TP_KERNEL";

/// Which implementation of the quantized dot products and the small-m product runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Portable Rust, the reference every SIMD kernel is tested against.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (Haswell / Zen and later), checked at run time.
    Avx2,
    /// [`Kernel::Avx2`] plus AVX-512 F, BW, VL and VNNI (Ice Lake, Zen 4 and later), checked
    /// at run time: `vpdpbusd` for the byte dot products where the crate has such a kernel,
    /// the AVX2 code elsewhere.
    Avx512Vnni,
}

impl Kernel {
    /// Every kernel the crate has, the reference first.
    pub const ALL: [Kernel; 3] = [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512Vnni];

    /// The kernel to run: the one `CANDLE_TP_KERNEL` forces if this CPU has it, else the
    /// fastest this CPU supports. The variable is read once per process.
    pub fn detect() -> Self {
        static CHOSEN: OnceLock<Kernel> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let best = Self::fastest();
            match Self::forced() {
                Ok(Some(k)) if k.is_available() => k,
                Ok(Some(k)) => {
                    eprintln!(
                        "candle-tp: {KERNEL_ENV}={} asks for a kernel this CPU cannot run \
                         ({}); running {} instead",
                        k.name(),
                        cpu_features(),
                        best.name()
                    );
                    best
                }
                Ok(None) => best,
                Err(e) => {
                    eprintln!("candle-tp: {e}; running {}", best.name());
                    best
                }
            }
        })
    }

    /// The fastest kernel this CPU supports, whatever the environment says.
    pub fn fastest() -> Self {
        if Self::Avx512Vnni.is_available() {
            Self::Avx512Vnni
        } else if Self::Avx2.is_available() {
            Self::Avx2
        } else {
            Self::Scalar
        }
    }

    /// The kernel `CANDLE_TP_KERNEL` names: `None` when it is unset, empty or `auto`; an
    /// error naming the value when it is none of the kernels' names.
    pub fn forced() -> Result<Option<Self>, String> {
        match std::env::var(KERNEL_ENV) {
            Err(_) => Ok(None),
            Ok(v) => Self::parse(&v),
        }
    }

    /// Parses a kernel name as `CANDLE_TP_KERNEL` takes it (case-insensitive): `scalar`,
    /// `avx2`, or `auto` / empty for none.
    ///
    /// ```
    /// use candle_tp_kernels::kernel::Kernel;
    /// assert_eq!(Kernel::parse("AVX2"), Ok(Some(Kernel::Avx2)));
    /// assert_eq!(Kernel::parse("auto"), Ok(None));
    /// assert!(Kernel::parse("avx512").unwrap_err().contains("avx512"));
    /// ```
    pub fn parse(v: &str) -> Result<Option<Self>, String> {
        let v = v.trim().to_ascii_lowercase();
        match v.as_str() {
            "" | "auto" => Ok(None),
            _ => Self::ALL
                .into_iter()
                .find(|k| k.name() == v)
                .map(Some)
                .ok_or_else(|| {
                    format!("{KERNEL_ENV}={v} is not a kernel (scalar, avx2, avx512vnni or auto)")
                }),
        }
    }

    /// The kernel's name as `CANDLE_TP_KERNEL` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::Avx512Vnni => "avx512vnni",
        }
    }

    /// Whether the kernel runs the AVX2 code (where it has no code of its own).
    pub fn has_avx2(self) -> bool {
        matches!(self, Self::Avx2 | Self::Avx512Vnni)
    }

    /// Whether this CPU can run the kernel.
    pub fn is_available(self) -> bool {
        // Asked before every group of every product: the answers, detected once.
        static AVAILABLE: OnceLock<[bool; 3]> = OnceLock::new();
        let available = AVAILABLE.get_or_init(|| Self::ALL.map(Self::detect_available));
        available[self as usize]
    }

    /// Whether this CPU has the kernel's features (asks the CPU).
    fn detect_available(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Vnni => {
                Self::Avx2.detect_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx2 | Self::Avx512Vnni => false,
        }
    }

    /// The kernels a test of the SIMD code must cover, printed on stderr with the CPU's
    /// features, so that a test log says which paths ran:
    /// - `CANDLE_TP_KERNEL` names one kernel: that one alone (and a panic if this CPU cannot
    ///   run it: a forced path that is absent must fail, not pass vacuously);
    /// - otherwise every kernel this CPU runs, and a panic on an x86-64 CPU without AVX2
    ///   (whose tests would otherwise pass without the path they mean to test), which names
    ///   the switch that restricts them to the scalar kernel. [`Kernel::Avx512Vnni`] is
    ///   tested where the CPU has it; elsewhere the printed list shows it absent (force it
    ///   with the switch to make its absence a failure).
    ///
    /// # Panics
    /// As above, and on a `CANDLE_TP_KERNEL` value that names no kernel.
    pub fn under_test() -> Vec<Self> {
        let ks = match Self::forced() {
            Err(e) => panic!("{e}"),
            Ok(Some(k)) => {
                assert!(
                    k.is_available(),
                    "{KERNEL_ENV}={} forces a kernel this CPU cannot run ({})",
                    k.name(),
                    cpu_features()
                );
                vec![k]
            }
            Ok(None) if cfg!(target_arch = "x86_64") => {
                assert!(
                    Self::Avx2.is_available(),
                    "the AVX2 kernel cannot run on this CPU ({}): its tests would pass without \
                     it; set {KERNEL_ENV}=scalar to test the scalar kernel alone",
                    cpu_features()
                );
                Self::ALL.into_iter().filter(|k| k.is_available()).collect()
            }
            Ok(None) => vec![Self::Scalar],
        };
        let names: Vec<_> = ks.iter().map(|k| k.name()).collect();
        eprintln!(
            "kernels under test: {} (CPU: {})",
            names.join(", "),
            cpu_features()
        );
        ks
    }
}

/// The CPU features that choose a path here or in candle, e.g. `avx2 fma f16c -avx512f
/// -avx512bw -avx512vl -avx512vnni -avxvnni`, a `-` marking an absent one.
///
/// candle 0.11.1's `QMatMul` takes a different path on AVX-512 VNNI or AVX-VNNI CPUs: it
/// repacks Q8_0 weights whose shape is a multiple of 16 rows × 256 columns and quantizes the
/// activations to Q8K (one scale per 256 values instead of one per 32), so its Q8_0 products
/// there differ from ggml's by that coarser rounding (~0.4 % of the output's magnitude
/// measured on a Zen 4 host), not by f32 summation order.
pub fn cpu_features() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let f = [
            ("avx2", is_x86_feature_detected!("avx2")),
            ("fma", is_x86_feature_detected!("fma")),
            ("f16c", is_x86_feature_detected!("f16c")),
            ("avx512f", is_x86_feature_detected!("avx512f")),
            ("avx512bw", is_x86_feature_detected!("avx512bw")),
            ("avx512vl", is_x86_feature_detected!("avx512vl")),
            ("avx512vnni", is_x86_feature_detected!("avx512vnni")),
            ("avxvnni", is_x86_feature_detected!("avxvnni")),
        ];
        f.iter()
            .map(|(n, on)| if *on { n.to_string() } else { format!("-{n}") })
            .collect::<Vec<_>>()
            .join(" ")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        format!("{}: no SIMD kernel of this crate", std::env::consts::ARCH)
    }
}

/// `$scalar` for [`Kernel::Scalar`]; for [`Kernel::Avx2`], after asserting that this CPU runs
/// it, `$avx2` in an `unsafe` block on x86-64 (it may call `#[target_feature(enable =
/// "avx2,fma,f16c")]` functions: the assertion checked those features; any other requirement
/// of theirs is the caller's to meet); for [`Kernel::Avx512Vnni`] likewise `$avx512`, which
/// may also use AVX-512 F/BW/VL and VNNI, or `$avx2` where no `avx512` arm is given.
macro_rules! by_kernel {
    ($kernel:expr, scalar => $scalar:expr, avx2 => $avx2:expr $(,)?) => {
        $crate::kernel::by_kernel!($kernel, scalar => $scalar, avx2 => $avx2, avx512 => $avx2)
    };
    ($kernel:expr, scalar => $scalar:expr, avx2 => $avx2:expr, avx512 => $avx512:expr $(,)?) => {
        match $kernel {
            $crate::kernel::Kernel::Scalar => $scalar,
            kernel @ $crate::kernel::Kernel::Avx2 => {
                assert!(
                    kernel.is_available(),
                    "the AVX2 kernel needs avx2, fma and f16c"
                );
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the CPU features were checked just above.
                unsafe {
                    $avx2
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("is_available is false off x86-64")
            }
            kernel @ $crate::kernel::Kernel::Avx512Vnni => {
                assert!(
                    kernel.is_available(),
                    "the AVX-512 VNNI kernel needs avx2, fma, f16c, avx512f, avx512bw, \
                     avx512vl and avx512vnni"
                );
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the CPU features were checked just above.
                unsafe {
                    $avx512
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("is_available is false off x86-64")
            }
        }
    };
}
pub(crate) use by_kernel;

/// A weight block type with f32 kernels over whole rows (what column-parallel and dense layers
/// run): a scalar reference, one row's blocks added one after the other, and an AVX2 kernel
/// over `R` rows at once that loads each activation block once for all of them.
pub(crate) trait RowDot: crate::f64_dot::F64Dot {
    /// One row, in f32, block after block (ggml's generic `vec_dot`).
    fn dot_scalar(w: &[Self], x: &[Self::Act]) -> f32;

    /// `R` rows.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; every row must have `xs.len()` blocks.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_rows_avx2<const R: usize>(ws: [&[Self]; R], xs: &[Self::Act]) -> [f32; R];

    /// `R` weight rows against `M` activation rows (prefill): `out[i][r]` is row `r` against
    /// activation row `i`, bit for bit what [`Self::dot_rows_avx2`] gives for that pair. This
    /// default calls it once per activation row; a block type whose weight decoding is worth
    /// sharing overrides it to decode each weight block once for all `M` activation rows.
    ///
    /// # Safety
    /// As [`Self::dot_rows_avx2`]: avx2, fma and f16c; every row of `ws` and `xs` has the same
    /// number of blocks.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_tile_avx2<const R: usize, const M: usize>(
        ws: [&[Self]; R],
        xs: [&[Self::Act]; M],
    ) -> [[f32; R]; M] {
        xs.map(|x| Self::dot_rows_avx2(ws, x))
    }
}

/// Dot products of `R` weight rows with one activation row in f32, with the chosen kernel.
///
/// # Panics
/// If a row's length differs from `xs`'s, or `kernel` is not available on this CPU.
pub(crate) fn dot_rows_by<B: RowDot, const R: usize>(
    kernel: Kernel,
    ws: [&[B]; R],
    xs: &[B::Act],
    out: &mut [f32; R],
) {
    for w in ws {
        assert_eq!(
            w.len(),
            xs.len(),
            "{} row of {} blocks against {} activation blocks",
            B::NAME,
            w.len(),
            xs.len()
        );
    }
    by_kernel!(kernel,
        scalar => for (o, w) in out.iter_mut().zip(ws) {
            *o = B::dot_scalar(w, xs);
        },
        // The rows' lengths were checked above.
        avx2 => *out = B::dot_rows_avx2(ws, xs))
}

/// Dot products of `R` weight rows with `M` activation rows in f32 (`out[i][r]`: row `r`
/// against activation row `i`), each bit for bit what [`dot_rows_by`] gives for that pair.
///
/// # Panics
/// If a row's length differs from the first activation row's, or `kernel` is not available.
pub(crate) fn dot_tile_by<B: RowDot, const R: usize, const M: usize>(
    kernel: Kernel,
    ws: [&[B]; R],
    xs: [&[B::Act]; M],
    out: &mut [[f32; R]; M],
) {
    let kb = xs.first().map_or(0, |x| x.len());
    let lens = ws.iter().map(|w| w.len()).chain(xs.iter().map(|x| x.len()));
    for len in lens {
        assert_eq!(len, kb, "{} tile: rows of {len} and {kb} blocks", B::NAME);
    }
    by_kernel!(kernel,
        scalar => for (o, x) in out.iter_mut().zip(xs) {
            for (o, w) in o.iter_mut().zip(ws) {
                *o = B::dot_scalar(w, x);
            }
        },
        // The rows' lengths were checked above.
        avx2 => *out = B::dot_tile_avx2(ws, xs))
}

/// Activation rows per tile in [`rows_dot_by`], with four weight rows: 16 accumulators, as
/// many as AVX2 has ymm registers, so a few spill to L1; measured on a Zen 3 core (one
/// thread, SmolLM2's 1536×576 and 576×1536, 120 activation rows) 4×4 was the fastest of 4×1,
/// 4×2, 4×3, 4×4, 2×4, 2×6, 1×8 and 3×4 for Q4_1 and within noise of the fastest (2×6) for
/// Q4_0: against the one-row kernel 1.6-1.8× for Q4_0, 1.2-1.3× for Q4_1.
pub(crate) const TILE_M: usize = 4;

/// Weight rows `row0..row0 + out.len() / m` of `w` (rows of `kb` blocks) against all `m`
/// activation rows `xq` (rows of `kb` blocks), into `out[(row - row0) * m + i]`: four weight
/// rows at a time against [`TILE_M`] activation rows at a time ([`dot_tile_by`]: each weight
/// block decoded once for them all), the activation rows left over against the four rows
/// ([`dot_rows_by`]: each activation load shared), the weight rows left over one at a time.
/// Every value is the same whichever path computes it, so the result does not depend on `m`.
pub(crate) fn rows_dot_by<B: RowDot>(
    kernel: Kernel,
    (w, kb): (&[B], usize),
    (xq, m): (&[B::Act], usize),
    row0: usize,
    out: &mut [f32],
) {
    let w_row = |r: usize| &w[(row0 + r) * kb..(row0 + r + 1) * kb];
    let x_row = |i: usize| &xq[i * kb..(i + 1) * kb];
    let rows = out.len() / m;
    let quads = rows / 4 * 4;
    let tiled = m / TILE_M * TILE_M;
    for r in (0..quads).step_by(4) {
        let ws = [w_row(r), w_row(r + 1), w_row(r + 2), w_row(r + 3)];
        for i in (0..tiled).step_by(TILE_M) {
            let mut o = [[0f32; 4]; TILE_M];
            dot_tile_by(kernel, ws, std::array::from_fn(|j| x_row(i + j)), &mut o);
            for (j, o) in o.into_iter().enumerate() {
                for (t, v) in o.into_iter().enumerate() {
                    out[(r + t) * m + i + j] = v;
                }
            }
        }
        for i in tiled..m {
            let mut o = [0f32; 4];
            dot_rows_by(kernel, ws, x_row(i), &mut o);
            for (t, v) in o.into_iter().enumerate() {
                out[(r + t) * m + i] = v;
            }
        }
    }
    for r in quads..rows {
        for (i, x) in xq.chunks_exact(kb).enumerate() {
            let mut o = [0f32];
            dot_rows_by(kernel, [w_row(r)], x, &mut o);
            out[r * m + i] = o[0];
        }
    }
}

/// Checks of a block type's f32 row kernels that every block type's tests share.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::f64_dot::dot_f64;

    /// Whether `tile` gives, for every pair, the bits [`dot_rows_by`] gives for one weight row.
    fn check_tile<B: RowDot, const R: usize, const M: usize>(
        kernel: Kernel,
        ws: [&[B]; R],
        xs: [&[B::Act]; M],
    ) {
        let mut tile = [[f32::NAN; R]; M];
        dot_tile_by(kernel, ws, xs, &mut tile);
        for (i, x) in xs.into_iter().enumerate() {
            let mut rows = [0f32; R];
            dot_rows_by(kernel, ws, x, &mut rows);
            for (r, w) in ws.into_iter().enumerate() {
                let mut one = [0f32];
                dot_rows_by(kernel, [w], x, &mut one);
                let (got, want) = (tile[i][r], one[0]);
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{} {kernel:?} tile {R}x{M}, {} blocks, weight row {r}, activation row {i}: \
                     {got} against one row's {want}",
                    B::NAME,
                    x.len()
                );
                assert_eq!(rows[r].to_bits(), want.to_bits(), "{R} rows against 1");
            }
        }
    }

    /// For every kernel under test ([`Kernel::under_test`], named on stderr): tiles of several
    /// shapes ([`dot_tile_by`]) against one row at a time ([`dot_rows_by`]), bit for bit, and
    /// [`rows_dot_by`] over `rows` against 1..=9 activation rows of `xs` (with a weight row
    /// offset, rows left over after the quads and activation rows left over after the tiles),
    /// every value bit for bit the one-row kernel's, finite, and within f32 rounding of the
    /// exact f64 sum: `4 ε · Σ |w·x|`, the sum of the values' products' magnitudes
    /// (`abs_dot` gives it for one block pair; with `|Σ w·x|` instead, a sum that cancels
    /// would fail for lack of the f32 rounding of its partial sums). `rows` must have at least
    /// 5 rows and `xs` at least 9, all of one length.
    fn check_rows_dot<B: RowDot>(
        rows: &[Vec<B>],
        xs: &[Vec<B::Act>],
        abs_dot: fn(&B, &B::Act) -> f64,
    ) {
        let kb = xs[0].len();
        let ws: [&[B]; 4] = std::array::from_fn(|r| &rows[r][..]);
        let x = |i: usize| &xs[i][..];
        for kernel in Kernel::under_test() {
            check_tile(kernel, ws, [x(0), x(1)]);
            check_tile(kernel, ws, [x(2)]);
            check_tile(kernel, ws, [x(3), x(4), x(5)]);
            check_tile(kernel, ws, [x(6), x(7), x(8), x(0)]);
            check_tile(kernel, [ws[1], ws[3]], [x(1), x(5)]);
            check_tile(kernel, [ws[2]], [x(4), x(8), x(3)]);

            let w: Vec<B> = rows.iter().flatten().copied().collect();
            let row0 = 1;
            let n = rows.len() - row0;
            for m in 1..=9 {
                let xq: Vec<B::Act> = xs[..m].iter().flatten().copied().collect();
                let mut out = vec![f32::NAN; n * m];
                rows_dot_by(kernel, (&w, kb), (&xq, m), row0, &mut out);
                for (r, w) in rows[row0..].iter().enumerate() {
                    for (i, x) in xs[..m].iter().enumerate() {
                        let got = out[r * m + i];
                        let mut one = [0f32];
                        dot_rows_by(kernel, [&w[..]], x, &mut one);
                        let exact = dot_f64(Kernel::Scalar, w, x);
                        let mag: f64 = w.iter().zip(x).map(|(w, x)| abs_dot(w, x)).sum();
                        let what = format!(
                            "{} {kernel:?} {kb} blocks, m = {m}, weight row {r}, activation row {i}",
                            B::NAME
                        );
                        assert_eq!(
                            got.to_bits(),
                            one[0].to_bits(),
                            "{what}: {got} vs {}",
                            one[0]
                        );
                        assert!(
                            got.is_finite() && exact.is_finite(),
                            "{what}: {got} {exact}"
                        );
                        assert!(
                            (got as f64 - exact).abs() <= 4.0 * f32::EPSILON as f64 * mag,
                            "{what}: f32 {got}, exact {exact}"
                        );
                    }
                }
            }
        }
    }

    /// [`check_rows_dot`] at 1, 2, 3, 5, 18 and 19 blocks per row: 7 weight rows, block `b` of
    /// row `r` being `block(r, b)`, against 9 activation rows of pseudo-random values (scaled
    /// differently per row), quantized as the type's kernels quantize them.
    pub(crate) fn check_rows_dot_sizes<B: RowDot>(
        block: impl Fn(usize, usize) -> B,
        abs_dot: fn(&B, &B::Act) -> f64,
    ) {
        use crate::f64_dot::testing::pseudo;
        for nb in [1usize, 2, 3, 5, 18, 19] {
            let rows: Vec<Vec<B>> = (0..7)
                .map(|r| (0..nb).map(|b| block(r, b)).collect())
                .collect();
            let xs: Vec<Vec<B::Act>> = (0..9)
                .map(|i| {
                    let x: Vec<f32> = (0..nb * B::BLOCK)
                        .map(|j| pseudo(i * 7919 + j + 1000) * (1.0 + i as f32))
                        .collect();
                    let mut xs = vec![B::ACT_ZERO; nb];
                    B::quantize(&x, &mut xs);
                    xs
                })
                .collect();
            check_rows_dot(&rows, &xs, abs_dot);
        }
    }

    /// A NaN or an infinity in the activations gives NaN from the f32 kernels ([`dot_rows_by`])
    /// with every kernel under test, as from the f64 ones.
    pub(crate) fn f32_kernels_propagate_nan<B: RowDot>(w: B) {
        for bad in [f32::NAN, f32::INFINITY] {
            let mut x = vec![0.5f32; B::BLOCK];
            x[3] = bad;
            let mut xs = [B::ACT_ZERO];
            B::quantize(&x, &mut xs);
            for kernel in Kernel::under_test() {
                let mut y = [0f32];
                dot_rows_by(kernel, [&[w][..]], &xs, &mut y);
                assert!(
                    y[0].is_nan(),
                    "{} {kernel:?}: activation {bad} gave {}",
                    B::NAME,
                    y[0]
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_values_are_named() {
        for k in Kernel::ALL {
            assert_eq!(Kernel::parse(k.name()), Ok(Some(k)));
        }
        assert_eq!(Kernel::parse(" Scalar "), Ok(Some(Kernel::Scalar)));
        assert_eq!(Kernel::parse(""), Ok(None));
        let e = Kernel::parse("avx512").unwrap_err();
        assert!(e.contains(KERNEL_ENV) && e.contains("avx512"), "{e}");
    }

    #[test]
    fn availability_is_looked_up_at_each_kernels_index() {
        for (i, k) in Kernel::ALL.into_iter().enumerate() {
            assert_eq!(k as usize, i, "{k:?}");
            assert_eq!(k.is_available(), k.detect_available(), "{k:?}");
        }
    }

    #[test]
    fn detect_honours_the_switch() {
        // The test process's own environment decides: whatever it forces is what runs.
        match Kernel::forced() {
            Ok(Some(k)) if k.is_available() => assert_eq!(Kernel::detect(), k),
            _ => assert_eq!(Kernel::detect(), Kernel::fastest()),
        }
        assert!(Kernel::detect().is_available());
        assert!(Kernel::under_test().contains(&Kernel::detect()));
    }
}
