//! The repacked types' shared test checks, each against an independent reference.

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
pub fn prepared_activations_serve_every_weight<B: Interleave>(block: impl Fn(usize, usize) -> B) {
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

pub fn every_value_is_the_unpacked_rows_f64_dot<B: Interleave>(block: impl Fn(usize, usize) -> B) {
    values_are_the_unpacked_rows_f64_dot(&block, &[1, 3, 4, 5, 8, 9], &[1, 2, 3, 5, 18], 1..=9);
    if B::QUAD {
        // Quads of groups (sixteen weight rows) with groups and rows left over: one row,
        // tiles of 4, the last one to three rows, and each of these after tiles of 8.
        values_are_the_unpacked_rows_f64_dot(
            &block,
            &[16, 21, 35],
            &[1, 2, 18],
            [1, 2, 3, 4, 5, 6, 7, 10, 12, 13, 21, 39],
        );
    }
    if B::AMX {
        amx_tiles_are_the_quads(&block);
    }
}

/// What both AMX checks start from: `None` (and a line on stderr) without AVX-512 VNNI;
/// else whether the host runs the tiles (a line on stderr where it does not: `what` ran
/// emulated), `n` rows of `kb` blocks repacked, and `m` activation rows prepared for them.
fn amx_fixture<B: Interleave>(
    what: &str,
    block: impl Fn(usize, usize) -> B,
    (n, kb, m): (usize, usize, usize),
) -> Option<(bool, Repacked<B>, Prepared<B>)> {
    if !Kernel::Avx512Vnni.is_available() {
        eprintln!("{}: AMX {what} not run: no AVX-512 VNNI", B::NAME);
        return None;
    }
    let amx = Kernel::Amx.is_available();
    if !amx {
        eprintln!(
            "{}: AMX {what} not run: no AMX ({}); their layouts ran emulated",
            B::NAME,
            crate::kernel::amx_support()
        );
    }
    let k = kb * B::BLOCK;
    let w: Vec<B> = (0..n * kb).map(|i| block(i / kb, i % kb)).collect();
    let packed = Repacked::new(&w, n, k).unwrap();
    let prepared = packed
        .prepare(Kernel::Avx512Vnni, m, &activations(m, k))
        .unwrap();
    Some((amx, packed, prepared))
}

/// The AMX engine ([`Interleave::group_quad_dot_amx`]) gives the bits of the 512-bit quads and
/// of the scalar sum, for two quads of groups (the second partly padding) and tiles of eight
/// activation rows that lie one row apart (the tile loads them in place) and that do not (it
/// copies them): with its tile products emulated on every host with AVX-512 VNNI, and run on
/// the tiles where the host has AMX (elsewhere "not run: no AMX" on stderr).
pub fn amx_tiles_are_the_quads<B: Interleave>(block: impl Fn(usize, usize) -> B) {
    assert!(B::AMX, "{} has no AMX kernel", B::NAME);
    let kb = 3;
    let Some((amx, packed, prepared)) = amx_fixture("tiles", block, (27, kb, 12)) else {
        return;
    };
    let row = |i: usize| prepared.row(i);
    let bits = |v: &[[f64; 16]; 8]| v.map(|r| r.map(f64::to_bits));
    for rows in [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [4, 5, 6, 7, 8, 9, 10, 11],
        [0, 2, 1, 3, 11, 5, 6, 9],
    ] {
        let tile: [ActRow<'_, B::Act>; 8] = rows.map(row);
        for q in 0..packed.groups.len() / kb / 4 {
            let quad: [&[B::X4]; 4] =
                std::array::from_fn(|g| &packed.groups[(4 * q + g) * kb..(4 * q + g + 1) * kb]);
            // SAFETY: AVX-512 VNNI was checked above (AMX below); every slice has kb blocks.
            let (quads, emulated) = unsafe {
                (
                    B::group_quad_dot_avx512::<8>(quad, &tile),
                    B::group_quad_dot_amx::<true>(quad, &tile),
                )
            };
            for (g, group) in quad.iter().enumerate() {
                let scalar = group_dot_scalar::<B, 8>(group, tile);
                for i in 0..8 {
                    for r in 0..4 {
                        let want = scalar[i][r];
                        assert!(want.is_finite(), "{want}");
                        assert_eq!(quads[i][4 * g + r].to_bits(), want.to_bits(), "{}", B::NAME);
                    }
                }
            }
            let what = format!("{} quad {q} rows {rows:?}", B::NAME);
            assert_eq!(bits(&emulated), bits(&quads), "{what}: emulated AMX");
            if amx {
                // SAFETY: AMX was checked above.
                let tiles = unsafe { B::group_quad_dot_amx::<false>(quad, &tile) };
                assert_eq!(bits(&tiles), bits(&quads), "{what}: AMX tiles");
            }
        }
    }
}

/// [`every_value_is_the_unpacked_rows_f64_dot`] where the AVX-512 VNNI kernel runs panels of
/// sixteen weight rows ([`Interleave::PANEL`]): one and two panels with groups, pairs and rows
/// left over, five and six tiles of eight activation rows with rows left over.
pub fn panels_are_the_unpacked_rows_f64_dot<B: Interleave>(block: impl Fn(usize, usize) -> B) {
    assert!(B::PANEL, "{} runs no panels", B::NAME);
    values_are_the_unpacked_rows_f64_dot(&block, &[16, 21, 43], &[1, 3], [40, 41, 53]);
    amx_panels_are_the_vnni_panels(&block);
}

/// The panels' AMX engine gives the bits of their VNNI engine (which the test above holds to
/// the scalar sums), for a panel of two blocks and tiles whose activation rows lie one stride
/// apart and not: emulated on every host with AVX-512 VNNI, on the tiles where AMX runs.
fn amx_panels_are_the_vnni_panels<B: Interleave>(block: impl Fn(usize, usize) -> B) {
    let kb = 2;
    let Some((amx, packed, prepared)) = amx_fixture("panels", block, (16, kb, 11)) else {
        return;
    };
    let mut buf = vec![panel::PanelBlock::ZERO; kb];
    for (b, out) in buf.iter_mut().enumerate() {
        let quad: [&B::X4; 4] = std::array::from_fn(|g| &packed.groups[g * kb + b]);
        // SAFETY: AVX-512 VNNI was checked above.
        unsafe { B::unpack_panel_avx512(quad, out) };
    }
    let row = |i: usize| prepared.row(i);
    let bits = |v: [[f64; 16]; 8]| v.map(|r| r.map(f64::to_bits));
    for rows in [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [3, 4, 5, 6, 7, 8, 9, 10],
        [0, 2, 1, 3, 10, 5, 6, 9],
    ] {
        let tile: [ActRow<'_, B::Act>; 8] = rows.map(row);
        // SAFETY: AVX-512 VNNI was checked above (AMX below); every slice has kb blocks.
        let (vnni, emulated) = unsafe {
            (
                B::panel_dot_avx512::<{ panel::VNNI }>(&buf, &tile),
                B::panel_dot_avx512::<{ panel::AMX_EMULATED }>(&buf, &tile),
            )
        };
        assert!(vnni.iter().flatten().all(|v| v.is_finite()));
        let what = format!("{} panel rows {rows:?}", B::NAME);
        assert_eq!(bits(emulated), bits(vnni), "{what}: emulated AMX");
        if amx {
            // SAFETY: AMX was checked above.
            let tiles = unsafe { B::panel_dot_avx512::<{ panel::AMX }>(&buf, &tile) };
            assert_eq!(bits(tiles), bits(vnni), "{what}: AMX tiles");
        }
    }
}

fn values_are_the_unpacked_rows_f64_dot<B: Interleave>(
    block: impl Fn(usize, usize) -> B,
    ns: &[usize],
    kbs: &[usize],
    ms: impl IntoIterator<Item = usize> + Clone,
) {
    let kernels = Kernel::under_test();
    for &n in ns {
        for &kb in kbs {
            let w: Vec<B> = (0..n * kb).map(|i| block(i / kb, i % kb)).collect();
            let packed = Repacked::new(&w, n, kb * B::BLOCK).unwrap();
            for m in ms.clone() {
                let x = activations(m, kb * B::BLOCK);
                let mut xq = vec![B::ACT_ZERO; m * kb];
                B::quantize(&x, &mut xq);
                for &kernel in &kernels {
                    let mut y = vec![f64::NAN; m * n];
                    packed.matmul_f64(kernel, m, &x, &mut y).unwrap();
                    // The one-call form (repacking the blocks as GGUF lays them out) too.
                    let mut once = vec![f64::NAN; m * n];
                    super::matmul_f64(kernel, (m, kb * B::BLOCK, n), &x, &w, &mut once).unwrap();
                    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&once), bits(&y), "{} matmul_f64 n={n} m={m}", B::NAME);
                    let mut y32 = vec![f32::NAN; m * n];
                    packed.matmul_f32(kernel, m, &x, &mut y32).unwrap();
                    for i in 0..m {
                        for j in 0..n {
                            let want = dot_f64(&w[j * kb..(j + 1) * kb], &xq[i * kb..(i + 1) * kb]);
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
    // 5 rows, and 17: a quad of groups and a group left over, where the type has quads.
    for n in [17, 5] {
        let w: Vec<B> = (0..2 * n).map(|i| block(i / 2, i % 2)).collect();
        let packed = Repacked::new(&w, n, k).unwrap();
        for kernel in Kernel::under_test() {
            let mut x = activations(2, k);
            x[k + 6] = f32::NAN; // row 1, block 0
            let mut y = vec![0f32; 2 * n];
            packed.matmul_f32(kernel, 2, &x, &mut y).unwrap();
            assert!(y[..n].iter().all(|v| v.is_finite()), "{kernel:?}: {y:?}");
            assert!(y[n..].iter().all(|v| v.is_nan()), "{kernel:?}: {y:?}");
        }
    }
    let w: Vec<B> = (0..10).map(|i| block(i / 2, i % 2)).collect();
    let packed = Repacked::new(&w, 5, k).unwrap();
    for kernel in Kernel::under_test() {
        let x = activations(2, k);
        let mut y = vec![0f32; 10];
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
