//! `candle_tp::quant`: the Q4_1 × Q8_1 and Q5_1 × Q8_1 matmuls against independent references
//! (and Q4_0, Q5_0, Q8_0, Q4_K against the exact product of their quantized operands, below).
//!
//! - candle's own `QMatMul` on the same `QTensor` (same activation quantization, so only the
//!   summation order differs): tight, bit for bit for Q4_1's scalar kernel. Candle's Q4_1 and
//!   Q5_1 dot products assert an even block count per row in debug builds, so odd counts are
//!   compared with the next reference instead.
//! - The exact product of what is multiplied: candle's `QTensor::dequantize` of W times the
//!   activations quantized to Q8_1 and dequantized by candle (`QTensor::quantize(x, Q8_1)`),
//!   summed in f64. Differs only by f32 rounding and the f16 rounding of Q8_1's `s`.
//! - The plain f32 product `x · dequantize(W)ᵀ`: differs by the Q8_1 rounding of x (stated).
//! - Both kernels, `Kernel::Scalar` and `Kernel::Avx2`, called explicitly, must agree.
//!
//! Weights: random, and real tensors of SmolLM2's Q4_1 GGUF (fetched by
//! `scripts/fetch-models.sh`; the test fails without it), whole and cut to an odd number of
//! blocks per row the way a row-parallel shard is.
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use candle_tp::quant::{matmul_q4_1, BlockQ4_1, Kernel, QuantMatMul};
use candle_tp::rng::seeded_uniform;

mod common;

const GGUF_NAME: &str = "smollm2-135m-instruct.Q4_1.gguf";

/// Max |a - b| after checking both are finite and of the same shape.
fn max_abs_diff(a: &Tensor, b: &Tensor, what: &str) -> Result<f32> {
    if a.dims() != b.dims() {
        bail!("{what}: shapes {:?} vs {:?}", a.dims(), b.dims());
    }
    for (t, name) in [(a, "left"), (b, "right")] {
        let v = t.flatten_all()?.to_vec1::<f32>()?;
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            bail!("{what}: {name} value {i} is {}", v[i]);
        }
    }
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

fn max_abs(t: &Tensor) -> Result<f32> {
    Ok(t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// The kernels to test: every kernel of the crate, or the one `CANDLE_TP_KERNEL` forces
/// (`Kernel::under_test` prints which, and fails where a path meant to be tested is absent).
fn kernels() -> Vec<Kernel> {
    Kernel::under_test()
}

/// Errors of one case, relative to the output's largest magnitude.
struct Errors {
    vs_qmatmul: Option<f32>,
    vs_exact: f32,
    vs_f32: f32,
    scalar_vs_avx2: f32,
}

/// Runs every check for weight `w` ([n, k] Q4_1 or Q5_1: Q8_1 activations) and input `x`
/// ([.., k] f32).
fn check(w: impl Into<Arc<QTensor>>, x: &Tensor, label: &str) -> Result<Errors> {
    let w: Arc<QTensor> = w.into();
    assert!(
        matches!(w.dtype(), GgmlDType::Q4_1 | GgmlDType::Q5_1),
        "{label}: {:?}",
        w.dtype()
    );
    let (n, k) = w.shape().dims2()?;
    let dev = Device::Cpu;
    let x2 = x.flatten_to(x.rank() - 2)?; // [m, k]

    // References.
    let w_f32 = w.dequantize(&dev)?; // [n, k]
    let plain = x2.matmul(&w_f32.t()?)?;
    let xq = QTensor::quantize(&x2, GgmlDType::Q8_1)?.dequantize(&dev)?;
    let exact = xq
        .to_dtype(DType::F64)?
        .matmul(&w_f32.to_dtype(DType::F64)?.t()?)?
        .to_dtype(DType::F32)?;
    let even = (k / 32) % 2 == 0;
    let candle = if even {
        Some(QMatMul::from_arc(w.clone())?.forward(&x2)?)
    } else {
        None
    };
    let scale = max_abs(&plain)?.max(1e-6);

    let mut outs = Vec::new();
    let under_test = kernels();
    for &kernel in &under_test {
        let mm = QuantMatMul::with_kernel(w.clone(), kernel)?;
        assert_eq!(mm.kernel(), Some(kernel), "{label}");
        assert_eq!(mm.dims(), (n, k), "{label}");
        let y = mm.forward(x)?;
        let mut want = x.dims().to_vec();
        *want.last_mut().unwrap() = n;
        assert_eq!(y.dims(), &want[..], "{label}: output shape");
        outs.push(y.flatten_to(x.rank() - 2)?);
    }
    let y = outs.last().unwrap();
    if let (Some(c), GgmlDType::Q4_1) = (&candle, w.dtype()) {
        // The crate's f32 Q4_1 kernel (`quant::matmul_q4_1`, scalar): the same blocks and the
        // same arithmetic in the same order as candle's: bit-identical. (The Q5_1 scalar
        // kernel rounds `Σq·q' · (d·d')` once, as ggml does, candle's `(Σq·q' · d) · d'`
        // twice: within f32 rounding, checked below.)
        let data = w.data()?;
        let blocks = candle_tp_kernels::f64_dot::blocks_from_bytes::<BlockQ4_1>(&data)?;
        let m = x2.dim(0)?;
        let mut f32_kernel = vec![0f32; m * n];
        let xv = x2.flatten_all()?.to_vec1::<f32>()?;
        matmul_q4_1(Kernel::Scalar, (m, k, n), &xv, blocks, &mut f32_kernel)?;
        let f32_kernel = Tensor::from_vec(f32_kernel, (m, n), &dev)?;
        let d = max_abs_diff(&f32_kernel, c, label)?;
        assert_eq!(d, 0.0, "{label}: scalar f32 kernel vs candle QMatMul");
    }
    {
        // QuantMatMul repacks Q4_1 and Q5_1 and sums in f64: every kernel gives the same bits.
        for (o, kernel) in outs.iter().zip(&under_test) {
            let d = max_abs_diff(o, y, label)?;
            assert_eq!(
                d,
                0.0,
                "{label}: {kernel:?} against {:?}",
                under_test.last()
            );
        }
    }
    let errs = Errors {
        vs_qmatmul: match &candle {
            Some(c) => Some(max_abs_diff(y, c, label)? / scale),
            None => None,
        },
        vs_exact: max_abs_diff(y, &exact, label)? / scale,
        vs_f32: max_abs_diff(y, &plain, label)? / scale,
        scalar_vs_avx2: max_abs_diff(&outs[0], y, label)? / scale,
    };
    eprintln!(
        "{label} {:?}: n={n} k={k} ({} blocks) m={} |y|max={scale:.3}: rel err vs QMatMul {:?}, \
         vs exact {:.2e}, vs f32 {:.2e}, scalar vs avx2 {:.2e}",
        w.dtype(),
        k / 32,
        x2.dim(0)?,
        errs.vs_qmatmul,
        errs.vs_exact,
        errs.vs_f32,
        errs.scalar_vs_avx2
    );
    // Tolerances near the measured maxima (relative to max |y|), on this file's cases:
    // vs QMatMul and scalar vs AVX2 6.4e-7 (f32 summation order), vs the exact product
    // 9.6e-4 (Q8_1 stores s = d·Σq in f16), vs the f32 product 7.2e-3 (Q8_1 rounding of x)
    // for Q4_1; Q5_1 (measured below) within the same bounds.
    if let Some(e) = errs.vs_qmatmul {
        assert!(e <= 1e-6, "{label}: {e} vs candle QMatMul");
    }
    assert!(
        errs.vs_exact <= 1.5e-3,
        "{label}: {} vs exact product",
        errs.vs_exact
    );
    assert!(
        errs.vs_f32 <= 1e-2,
        "{label}: {} vs f32 product",
        errs.vs_f32
    );
    assert!(
        errs.scalar_vs_avx2 <= 1e-6,
        "{label}: scalar vs avx2 {}",
        errs.scalar_vs_avx2
    );
    Ok(errs)
}

fn random_q4_1(n: usize, k: usize, seed: u64) -> Result<QTensor> {
    random_q(GgmlDType::Q4_1, n, k, seed)
}

fn random_q(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> Result<QTensor> {
    // Rows with an offset, as real weights have: Q4_1's and Q5_1's m term matters.
    let w = (seeded_uniform(&[n, k], seed, 0.08, &Device::Cpu)? + 0.01)?;
    Ok(QTensor::quantize(&w, dtype)?)
}

#[test]
fn random_weights_even_and_odd_blocks() -> Result<()> {
    let dev = Device::Cpu;
    for &(n, k) in &[
        (64usize, 576usize),
        (37, 96),
        (130, 32),
        (9, 1536),
        (576, 288),
    ] {
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q5_1] {
            let w = random_q(dtype, n, k, n as u64 * 7 + k as u64)?;
            for m in [1usize, 7] {
                let x = seeded_uniform(&[m, k], (m * n) as u64, 1.0, &dev)?;
                check(
                    QTensor::new(QStorage::from_data(w.data()?, &dev, dtype)?, (n, k))?,
                    &x,
                    &format!("random [{n}, {k}] m={m}"),
                )?;
            }
        }
    }
    // Leading batch dims: [2, 3, k] is 6 rows.
    for dtype in [GgmlDType::Q4_1, GgmlDType::Q5_1] {
        let w = random_q(dtype, 40, 160, 3)?;
        let x = seeded_uniform(&[2, 3, 160], 11, 1.0, &dev)?;
        check(w, &x, "random [40, 160] x [2, 3, 160]")?;
    }
    Ok(())
}

#[test]
fn zero_and_constant_inputs() -> Result<()> {
    let dev = Device::Cpu;
    let w = Arc::new(random_q4_1(16, 64, 5)?);
    for kernel in kernels() {
        let mm = QuantMatMul::with_kernel(w.clone(), kernel)?;
        let y = mm.forward(&Tensor::zeros((3, 64), DType::F32, &dev)?)?;
        assert_eq!(max_abs(&y)?, 0.0, "{kernel:?}: zero input");
    }
    // A constant input exercises the m·s term alone for each block's offset.
    check(
        random_q4_1(16, 64, 6)?,
        &Tensor::ones((1, 64), DType::F32, &dev)?,
        "constant x",
    )?;
    Ok(())
}

#[test]
fn bad_shapes_are_errors_naming_them() -> Result<()> {
    let dev = Device::Cpu;
    let mm = QuantMatMul::new(random_q4_1(8, 64, 1)?)?;
    let err = mm
        .forward(&Tensor::zeros((2, 96), DType::F32, &dev)?)
        .unwrap_err()
        .to_string();
    assert!(err.contains("96") && err.contains("[8, 64]"), "{err}");
    let w3 = QTensor::quantize(
        &Tensor::zeros((2, 4, 64), DType::F32, &dev)?,
        GgmlDType::Q4_1,
    )?;
    let err = QuantMatMul::new(w3).unwrap_err().to_string();
    assert!(
        err.contains("[2, 4, 64]") && err.contains("not a matrix"),
        "{err}"
    );
    Ok(())
}

#[test]
fn other_types_fall_back_to_candle_qmatmul() -> Result<()> {
    let dev = Device::Cpu;
    let w = seeded_uniform(&[32, 256], 1, 1.0, &dev)?;
    let x = seeded_uniform(&[3, 256], 2, 1.0, &dev)?;
    for dtype in [GgmlDType::Q2K, GgmlDType::Q3K] {
        let q = Arc::new(QTensor::quantize(&w, dtype)?);
        let mm = QuantMatMul::from_arc(q.clone())?;
        assert_eq!(mm.kernel(), None);
        let d = max_abs_diff(
            &mm.forward(&x)?,
            &QMatMul::from_arc(q)?.forward(&x)?,
            "fallback",
        )?;
        assert_eq!(d, 0.0, "{dtype:?}");
    }
    Ok(())
}

/// Q4_0, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K (repacked four rows at a time) run the crate's f64-summing
/// kernels rounded to f32, for decode and prefill shapes, with every kernel under test
/// (`CANDLE_TP_KERNEL` forces one), on a shape of 24 blocks and 48 rows and one of 9 blocks and 37 rows (an odd
/// block count, rows not a multiple of 4):
/// - against the exact product of the quantized operands (above): within the f32 rounding of
///   the result and of candle's dequantized weight;
/// - against candle's `QMatMul`, loosely: candle 0.11.1 quantizes the activations of a
///   repacked Q8_0 weight (rows a multiple of 16, columns of 256) to Q8K, one scale per 256
///   values, on AVX-512 VNNI and AVX-VNNI CPUs (`candle_tp_kernels::kernel::cpu_features`),
///   which moves its result by ~0.4 % of the output's magnitude there; elsewhere it uses
///   ggml's Q8_0 activations and agrees to f32 rounding;
/// - and each row's result does not depend on how many rows are in the batch.
#[test]
fn q4_0_q5_0_q8_0_and_k_quants_run_the_crates_kernel() -> Result<()> {
    let dev = Device::Cpu;
    // 48 rows × 768 columns: the shape candle repacks (a multiple of 16 × 256).
    let w = seeded_uniform(&[48, 768], 3, 1.0, &dev)?;
    let x = seeded_uniform(&[5, 768], 4, 2.0, &dev)?;
    let w_odd = seeded_uniform(&[37, 288], 5, 1.0, &dev)?;
    let x_odd = seeded_uniform(&[3, 288], 6, 2.0, &dev)?;
    let cases = [
        (GgmlDType::Q4_0, &w, &x),
        (GgmlDType::Q5_0, &w, &x),
        (GgmlDType::Q8_0, &w, &x),
        (GgmlDType::Q4K, &w, &x),
        (GgmlDType::Q5K, &w, &x),
        (GgmlDType::Q6K, &w, &x),
        (GgmlDType::Q4_0, &w_odd, &x_odd),
        (GgmlDType::Q5_0, &w_odd, &x_odd),
        (GgmlDType::Q8_0, &w_odd, &x_odd),
    ];
    for (dtype, w, x) in cases {
        let q = Arc::new(QTensor::quantize(w, dtype)?);
        let blocks_per_row = q.shape().dims2()?.1 / 32;
        let (exact, mag) = common::quantized::exact_product(&q, x)?;
        let scale = exact.iter().fold(0f64, |a, v| a.max(v.abs()));
        anyhow::ensure!(scale > 1.0, "{dtype:?}: the reference is trivially small");
        for kernel in kernels() {
            let mm = QuantMatMul::with_kernel(q.clone(), kernel)?;
            anyhow::ensure!(mm.kernel() == Some(kernel), "{dtype:?}: {mm:?}");
            let got = mm.forward(x)?;
            let v = got.flatten_all()?.to_vec1::<f32>()?;
            anyhow::ensure!(v.len() == exact.len(), "{dtype:?}: {} outputs", v.len());
            let mut worst = 0f64;
            for (i, ((&g, &e), &a)) in v.iter().zip(&exact).zip(&mag).enumerate() {
                anyhow::ensure!(g.is_finite(), "{dtype:?} {kernel:?}: output {i} is {g}");
                // One f32 rounding of the result, and f32 rounding of each dequantized weight.
                let bound = f32::EPSILON as f64 * (e.abs() + a);
                let d = (g as f64 - e).abs();
                anyhow::ensure!(
                    d <= bound,
                    "{dtype:?} {kernel:?}: output {i} = {g}, exact product {e} (bound {bound:.2e})"
                );
                worst = worst.max(d / scale);
            }
            eprintln!(
                "{dtype:?} {:?} {kernel:?}: {worst:.2e} of |y|max = {scale:.2} from the exact product",
                q.shape().dims()
            );
            let alone = mm.forward(&x.narrow(0, 2, 1)?)?;
            assert_eq!(
                alone.flatten_all()?.to_vec1::<f32>()?,
                got.narrow(0, 2, 1)?.flatten_all()?.to_vec1::<f32>()?,
                "{dtype:?} {kernel:?}: a row alone differs from the same row in a batch"
            );
        }
        if blocks_per_row % 2 != 0 && dtype == GgmlDType::Q5_0 {
            // Candle's Q5_0 dot product asserts an even block count in debug builds.
            continue;
        }
        let candle = QMatMul::from_arc(q)?.forward(x)?;
        let c = candle.flatten_all()?.to_vec1::<f32>()?;
        let worst = c
            .iter()
            .zip(&exact)
            .map(|(&c, &e)| {
                if c.is_finite() {
                    (c as f64 - e).abs()
                } else {
                    f64::INFINITY
                }
            })
            .fold(0f64, f64::max);
        eprintln!(
            "{dtype:?}: candle's QMatMul {:.2e} of |y|max from the exact product (CPU: {})",
            worst / scale,
            candle_tp_kernels::kernel::cpu_features()
        );
        anyhow::ensure!(
            worst <= 1e-2 * scale,
            "{dtype:?}: candle's QMatMul is {worst} from the exact product (outputs up to {scale})"
        );
    }
    Ok(())
}

/// Rows `0..n` of `w` ([n, k], 32-wide blocks), blocks `b0..b1` of each: a row-parallel shard,
/// built the way the GGUF loader builds one (a byte range per row, `QStorage::from_data`).
fn block_range(w: &QTensor, b0: usize, b1: usize) -> Result<QTensor> {
    let (n, k) = w.shape().dims2()?;
    let kb = k / 32;
    let size = w.dtype().type_size();
    let data = w.data()?;
    let mut bytes = Vec::with_capacity(n * (b1 - b0) * size);
    for r in 0..n {
        bytes.extend_from_slice(&data[(r * kb + b0) * size..(r * kb + b1) * size]);
    }
    Ok(QTensor::new(
        QStorage::from_data(bytes.into(), &Device::Cpu, w.dtype())?,
        (n, (b1 - b0) * 32),
    )?)
}

/// SmolLM2's shipped Q4_1 file, and its Q5_1 requantization (written once into the model
/// cache by `common::smollm2_gguf`).
#[test]
fn smollm2_gguf_tensors() -> Result<()> {
    let path = candle_tp::models::models_dir()?.join(GGUF_NAME);
    if !path.is_file() {
        bail!(
            "{} is missing: run scripts/fetch-models.sh first",
            path.display()
        );
    }
    gguf_tensors(&path, GgmlDType::Q4_1)?;
    gguf_tensors(&common::smollm2_gguf(GgmlDType::Q5_1)?, GgmlDType::Q5_1)
}

/// Three weights of a SmolLM2 GGUF file of type `dtype`, whole and cut to an odd number of
/// blocks per row.
fn gguf_tensors(path: &std::path::Path, dtype: GgmlDType) -> Result<()> {
    let mut file = std::fs::File::open(path)?;
    let content =
        gguf_file::Content::read(&mut file).with_context(|| path.display().to_string())?;
    let dev = Device::Cpu;
    for (checked, name) in [
        "blk.0.attn_q.weight",    // [576, 576]: 18 blocks
        "blk.0.ffn_up.weight",    // [1536, 576]
        "blk.29.ffn_down.weight", // [576, 1536]: 48 blocks
    ]
    .into_iter()
    .enumerate()
    {
        let w = content.tensor(&mut file, name, &dev)?;
        if w.dtype() != dtype {
            bail!("{name} is {:?}, expected {dtype:?}", w.dtype());
        }
        let (_, k) = w.shape().dims2()?;
        for m in [1usize, 7] {
            let x = seeded_uniform(&[m, k], (checked * 10 + m) as u64, 1.0, &dev)?;
            let w_copy = block_range(&w, 0, k / 32)?;
            check(w_copy, &x, &format!("{name} m={m}"))?;
            // An odd block range, as rank 1 of 2 gets for 18 blocks cut 9 + 9.
            let (b0, b1) = (k / 64, k / 32);
            let shard = block_range(&w, b0, b1)?;
            // A view with a start offset goes into the kernel as it is (for m = 1 the narrow
            // stays contiguous); the references get a fresh tensor (candle 0.11.1's
            // `QTensor::quantize` reads the whole storage from offset 0, ignoring the layout).
            let view = x.narrow(1, b0 * 32, (b1 - b0) * 32)?;
            let xs = Tensor::from_vec(view.flatten_all()?.to_vec1::<f32>()?, view.dims(), &dev)?;
            let label = format!("{name}[:, blocks {b0}..{b1}] m={m}");
            let shard = Arc::new(shard);
            let (y_view, y_copy) = {
                let mm = QuantMatMul::from_arc(shard.clone())?;
                (mm.forward(&view)?, mm.forward(&xs)?)
            };
            assert_eq!(
                max_abs_diff(&y_view, &y_copy, &label)?,
                0.0,
                "{label}: view vs copy"
            );
            check(shard, &xs, &label)?;
        }
    }
    Ok(())
}

#[test]
fn any_thread_count_gives_the_same_bits() -> Result<()> {
    // The rows are split over the rayon pool (on the caller with one thread): every split
    // must compute each output the same way.
    let w = Arc::new(random_q4_1(1000, 96, 9)?);
    let x = seeded_uniform(&[7, 96], 4, 1.0, &Device::Cpu)?;
    let mm = QuantMatMul::from_arc(w)?;
    let run = |threads: usize| -> Result<Tensor> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()?;
        Ok(pool.install(|| mm.forward(&x))?)
    };
    let one = run(1)?;
    assert!(max_abs(&one)? > 0.1, "the output is not trivially zero");
    for threads in [2, 3, 5] {
        assert_eq!(
            max_abs_diff(&one, &run(threads)?, "threads")?,
            0.0,
            "{threads} threads"
        );
    }
    Ok(())
}

#[test]
fn empty_inner_dimension_gives_zeros() -> Result<()> {
    // k = 0: every output is an empty sum. This panicked (chunks of zero blocks) before.
    let mut dst = vec![f32::NAN; 6];
    candle_tp::quant::matmul_q4_1(Kernel::detect(), (2, 0, 3), &[], &[], &mut dst)?;
    assert_eq!(dst, vec![0.0; 6]);
    Ok(())
}

/// A Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 `QuantMatMul` keeps its weight repacked and drops the `QTensor` it was
/// built from (the model holds its weights once): its rows read back as candle's
/// `QTensor::embedding` gives them (a tied LM head's embedding lookups), bad row ids are
/// errors naming the weight, and its f64 product (row-parallel layers) rounds to its f32
/// product.
#[test]
fn repacked_types_hold_their_weight_once_and_read_rows_back() -> Result<()> {
    let dev = Device::Cpu;
    // 512 columns: two Q4_K super-blocks, sixteen 32-wide blocks.
    let w = seeded_uniform(&[37, 512], 8, 1.0, &dev)?;
    for (dtype, name) in [
        (GgmlDType::Q4_0, "Q4_0"),
        (GgmlDType::Q4_1, "Q4_1"),
        (GgmlDType::Q5_0, "Q5_0"),
        (GgmlDType::Q5_1, "Q5_1"),
        (GgmlDType::Q8_0, "Q8_0"),
        (GgmlDType::Q4K, "Q4_K"),
        (GgmlDType::Q5K, "Q5_K"),
        (GgmlDType::Q6K, "Q6_K"),
    ] {
        let q = Arc::new(QTensor::quantize(&w, dtype)?);
        for kernel in kernels() {
            let mm = QuantMatMul::with_kernel(q.clone(), kernel)?;
            anyhow::ensure!(mm.holds_weight(), "{mm:?}");
            anyhow::ensure!(Arc::strong_count(&q) == 1, "{mm:?} keeps the QTensor too");
            let ids = Tensor::new(&[[0u32, 36], [5, 5]], &dev)?;
            let got = mm.dequantize_rows(&ids)?;
            let want = q.embedding(&ids)?;
            anyhow::ensure!(got.dims() == [2, 2, 512], "{:?}", got.dims());
            assert_eq!(
                got.flatten_all()?.to_vec1::<f32>()?,
                want.flatten_all()?.to_vec1::<f32>()?,
                "{dtype:?}"
            );
            let err = mm
                .dequantize_rows(&Tensor::new(&[37u32], &dev)?)
                .unwrap_err()
                .to_string();
            anyhow::ensure!(err.contains("row 37") && err.contains(name), "{err}");
            let x = seeded_uniform(&[3, 512], 9, 2.0, &dev)?;
            let y = mm.forward(&x)?.flatten_all()?.to_vec1::<f32>()?;
            let y64 = mm.forward_f64(&x)?.context("an f64 product")?;
            anyhow::ensure!(y64.dtype() == DType::F64);
            let y64: Vec<f32> = y64
                .flatten_all()?
                .to_vec1::<f64>()?
                .iter()
                .map(|&v| v as f32)
                .collect();
            anyhow::ensure!(y.iter().all(|v| v.is_finite()));
            assert_eq!(y, y64, "{dtype:?} {kernel:?}");
        }
    }
    Ok(())
}

/// Inside `share_activations`, products of one input by several weights quantize it once per
/// weight type (the count says so) and give the bits of separate calls, in f32 and in f64,
/// at decode and prefill sizes (the eight-row tiles from 8 rows).
#[test]
fn shared_activations_are_prepared_once_per_type_and_change_no_bit() -> Result<()> {
    use candle_tp::quant::{prepared_in_scope, share_activations};
    let (k, n) = (512, 40);
    let weights = [
        (GgmlDType::Q4_0, 1),
        (GgmlDType::Q4_0, 2),
        (GgmlDType::Q4K, 3),
        (GgmlDType::Q8_0, 4),
        (GgmlDType::Q4K, 5),
    ]
    .map(|(t, seed)| Ok(QuantMatMul::new(random_q(t, n, k, seed)?)?));
    let weights: Vec<QuantMatMul> = weights.into_iter().collect::<Result<_>>()?;
    assert_eq!(
        prepared_in_scope(),
        None,
        "a scope outside share_activations"
    );
    for m in [1, 9, 17] {
        let x = seeded_uniform(&[m, k], 7 + m as u64, 1.0, &Device::Cpu)?;
        let alone: Vec<Tensor> = weights
            .iter()
            .map(|w| w.forward(&x))
            .collect::<candle_core::Result<_>>()?;
        let alone64: Vec<Tensor> = weights
            .iter()
            .map(|w| w.forward_f64(&x)?.context("an f64 kernel"))
            .collect::<Result<_>>()?;
        let (shared, shared64, count) = share_activations(|| -> Result<_> {
            let y: Vec<Tensor> = weights
                .iter()
                .map(|w| w.forward(&x))
                .collect::<candle_core::Result<_>>()?;
            let y64: Vec<Tensor> = weights
                .iter()
                .map(|w| w.forward_f64(&x)?.context("an f64 kernel"))
                .collect::<Result<_>>()?;
            Ok((y, y64, prepared_in_scope()))
        })?;
        // Q4_0 (two weights), Q4_K (two) and Q8_0: three preparations for ten products.
        assert_eq!(count, Some(3), "m = {m}");
        assert_eq!(prepared_in_scope(), None, "the scope outlived its closure");
        for (i, (a, b)) in alone.iter().zip(&shared).enumerate() {
            let (a, b) = (
                a.flatten_all()?.to_vec1::<f32>()?,
                b.flatten_all()?.to_vec1::<f32>()?,
            );
            assert!(a.iter().all(|v| v.is_finite()), "weight {i}, m = {m}");
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "weight {i}, m = {m}");
        }
        for (i, (a, b)) in alone64.iter().zip(&shared64).enumerate() {
            let (a, b) = (
                a.flatten_all()?.to_vec1::<f64>()?,
                b.flatten_all()?.to_vec1::<f64>()?,
            );
            let bits = |v: &[f64]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "weight {i}, m = {m}, f64");
        }
    }
    Ok(())
}

/// `CANDLE_TP_KERNEL=amx` where the host cannot run AMX tiles: loading a quantized weight is an
/// error naming AMX and the switch (not a silent fallback to another kernel); where it can,
/// the weight loads. The switch is read once per process, so the check runs in a child
/// process of this test binary with the switch set.
#[test]
fn amx_forced_where_absent_is_an_error_naming_amx() -> Result<()> {
    const CHILD: &str = "CANDLE_TP_TEST_AMX_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let w = QTensor::quantize(
            &Tensor::ones((16, 64), DType::F32, &Device::Cpu)?,
            GgmlDType::Q4_0,
        )?;
        match QuantMatMul::new(w) {
            Ok(_) => assert!(
                Kernel::Amx.is_available(),
                "amx forced without AMX was accepted"
            ),
            Err(e) => {
                let e = e.to_string();
                assert!(!Kernel::Amx.is_available(), "{e}");
                assert!(
                    e.contains("AMX") && e.contains("CANDLE_TP_KERNEL=amx"),
                    "{e}"
                );
            }
        }
        println!("the child checked the switch");
        return Ok(());
    }
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "amx_forced_where_absent_is_an_error_naming_amx",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env("CANDLE_TP_KERNEL", "amx")
        .output()?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("the child checked the switch"), "{text}");
    Ok(())
}
