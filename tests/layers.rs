//! Parallel layers against the dense candle-nn layers built from the same full weights:
//! forward output, input gradient, weight and bias gradients, for 1 to 4 ranks and uneven
//! splits. The dense reference runs on each rank thread; the parallel result is compared with
//! the dense one sliced the way the layer splits it.

mod common;

use candle_core::{Module, Result, Tensor};
use candle_nn::{Activation, Linear};
use candle_tp::{run_threads, ColumnParallelLinear, GatedMlp, Mlp, Partition, RowParallelLinear};
use common::{max_abs_diff, seeded, var};

const TOL: f32 = 1e-5;

fn narrow(t: &Tensor, dim: usize, part: &Partition, rank: usize) -> Result<Tensor> {
    let r = part.range(rank);
    t.narrow(dim, r.start, r.len())
}

fn assert_close(what: &str, world: usize, rank: usize, a: &Tensor, b: &Tensor) {
    let d = max_abs_diff(a, b).unwrap();
    assert!(
        d <= TOL,
        "{what}: world {world} rank {rank}: max abs error {d}"
    );
}

#[test]
fn column_parallel_linear_matches_dense_forward_and_backward() {
    let (inp, out) = (6, 10); // 10 over 3 or 4 ranks is uneven
    let w = seeded(&[out, inp], 1);
    let b = seeded(&[out], 2);
    let x = seeded(&[2, 3, inp], 3);
    let probe = seeded(&[2, 3, out], 4);
    for world in 1..=4 {
        for gather in [false, true] {
            run_threads(world, |pg| {
                let rank = pg.rank();
                let part = Partition::new(out, world)?;
                // Dense reference.
                let (xd, wd, bd) = (var(&x), var(&w), var(&b));
                let yd = Linear::new(wd.as_tensor().clone(), Some(bd.as_tensor().clone()))
                    .forward(xd.as_tensor())?;
                let gd = (&yd * &probe)?.sum_all()?.backward()?;
                // Parallel layer from this rank's shards.
                let (xp, wp, bp) = (
                    var(&x),
                    var(&narrow(&w, 0, &part, rank)?),
                    var(&narrow(&b, 0, &part, rank)?),
                );
                let layer = ColumnParallelLinear::new(
                    wp.as_tensor().clone(),
                    Some(bp.as_tensor().clone()),
                    inp,
                    part,
                    pg.clone(),
                )?
                .with_gather_output(gather);
                let yp = layer.forward(xp.as_tensor())?;
                let probe_p = if gather {
                    probe.clone()
                } else {
                    narrow(&probe, 2, &part, rank)?
                };
                let gp = (&yp * &probe_p)?.sum_all()?.backward()?;
                let yd_cmp = if gather {
                    yd.clone()
                } else {
                    narrow(&yd, 2, &part, rank)?
                };
                assert_close("column output", world, rank, &yp, &yd_cmp);
                assert_close(
                    "column grad input",
                    world,
                    rank,
                    gp.get(&xp).unwrap(),
                    gd.get(&xd).unwrap(),
                );
                assert_close(
                    "column grad weight",
                    world,
                    rank,
                    gp.get(&wp).unwrap(),
                    &narrow(gd.get(&wd).unwrap(), 0, &part, rank)?,
                );
                assert_close(
                    "column grad bias",
                    world,
                    rank,
                    gp.get(&bp).unwrap(),
                    &narrow(gd.get(&bd).unwrap(), 0, &part, rank)?,
                );
                Ok(())
            })
            .unwrap();
        }
    }
}

#[test]
fn row_parallel_linear_matches_dense_forward_and_backward() {
    let (inp, out) = (10, 6);
    let w = seeded(&[out, inp], 5);
    let b = seeded(&[out], 6);
    let x = seeded(&[2, 3, inp], 7);
    let probe = seeded(&[2, 3, out], 8);
    for world in 1..=4 {
        for input_is_parallel in [true, false] {
            run_threads(world, |pg| {
                let rank = pg.rank();
                let part = Partition::new(inp, world)?;
                let (xd, wd, bd) = (var(&x), var(&w), var(&b));
                let yd = Linear::new(wd.as_tensor().clone(), Some(bd.as_tensor().clone()))
                    .forward(xd.as_tensor())?;
                let gd = (&yd * &probe)?.sum_all()?.backward()?;
                let x_local = if input_is_parallel {
                    narrow(&x, 2, &part, rank)?
                } else {
                    x.clone()
                };
                let (xp, wp, bp) = (var(&x_local), var(&narrow(&w, 1, &part, rank)?), var(&b));
                let layer = RowParallelLinear::new(
                    wp.as_tensor().clone(),
                    Some(bp.as_tensor().clone()),
                    part,
                    out,
                    pg.clone(),
                )?
                .with_input_is_parallel(input_is_parallel);
                let yp = layer.forward(xp.as_tensor())?;
                let gp = (&yp * &probe)?.sum_all()?.backward()?;
                assert_close("row output", world, rank, &yp, &yd);
                let gx_d = gd.get(&xd).unwrap();
                let gx_d = if input_is_parallel {
                    narrow(gx_d, 2, &part, rank)?
                } else {
                    gx_d.clone()
                };
                assert_close("row grad input", world, rank, gp.get(&xp).unwrap(), &gx_d);
                assert_close(
                    "row grad weight",
                    world,
                    rank,
                    gp.get(&wp).unwrap(),
                    &narrow(gd.get(&wd).unwrap(), 1, &part, rank)?,
                );
                assert_close(
                    "row grad bias",
                    world,
                    rank,
                    gp.get(&bp).unwrap(),
                    gd.get(&bd).unwrap(),
                );
                Ok(())
            })
            .unwrap();
        }
    }
}

#[test]
fn tensor_parallel_mlps_match_dense() {
    let d = 8;
    let (d_ff, inter) = (4 * d, 20); // 32 and 20 hidden units: uneven over 3 ranks
    let w1 = seeded(&[d_ff, d], 11);
    let b1 = seeded(&[d_ff], 12);
    let w2 = seeded(&[d, d_ff], 13);
    let b2 = seeded(&[d], 14);
    let (wg, wu, wdn) = (
        seeded(&[inter, d], 15),
        seeded(&[inter, d], 16),
        seeded(&[d, inter], 17),
    );
    let x = seeded(&[2, 5, d], 18);
    let probe = seeded(&[2, 5, d], 19);
    for world in 1..=4 {
        run_threads(world, |pg| {
            let rank = pg.rank();
            // Two-layer GELU MLP.
            let vars: Vec<_> = [&x, &w1, &b1, &w2, &b2].iter().map(|t| var(t)).collect();
            let t = |i: usize| vars[i].as_tensor().clone();
            let dense = Linear::new(t(3), Some(t(4)))
                .forward(&Linear::new(t(1), Some(t(2))).forward(&t(0))?.gelu_erf()?)?;
            let gd = (&dense * &probe)?.sum_all()?.backward()?;
            let pvars: Vec<_> = [&x, &w1, &b1, &w2, &b2].iter().map(|t| var(t)).collect();
            let p = |i: usize| pvars[i].as_tensor().clone();
            let mlp = Mlp::new(
                ColumnParallelLinear::from_dense(&p(1), Some(&p(2)), pg.clone())?,
                RowParallelLinear::from_dense(&p(3), Some(&p(4)), pg.clone())?,
                Activation::Gelu,
            );
            let yp = mlp.forward(&p(0))?;
            let gp = (&yp * &probe)?.sum_all()?.backward()?;
            assert_close("mlp output", world, rank, &yp, &dense);
            // from_dense narrows the full vars, so their gradients are zero outside this
            // rank's slice: compare the slice, and check the rest is zero.
            let hid = Partition::new(d_ff, world)?;
            assert_close(
                "mlp grad input",
                world,
                rank,
                gp.get(&pvars[0]).unwrap(),
                gd.get(&vars[0]).unwrap(),
            );
            for (i, dim) in [(1usize, 0usize), (2, 0), (3, 1)] {
                let got = narrow(gp.get(&pvars[i]).unwrap(), dim, &hid, rank)?;
                let want = narrow(gd.get(&vars[i]).unwrap(), dim, &hid, rank)?;
                assert_close(&format!("mlp grad of tensor {i}"), world, rank, &got, &want);
                let total = gp
                    .get(&pvars[i])
                    .unwrap()
                    .abs()?
                    .sum_all()?
                    .to_scalar::<f32>()?;
                let local = got.abs()?.sum_all()?.to_scalar::<f32>()?;
                assert!(
                    (total - local).abs() <= 1e-4,
                    "gradient leaked outside the shard"
                );
            }
            assert_close(
                "mlp grad fc2 bias",
                world,
                rank,
                gp.get(&pvars[4]).unwrap(),
                gd.get(&vars[4]).unwrap(),
            );

            // Gated SwiGLU MLP.
            let (xg, g, u, dn) = (var(&x), var(&wg), var(&wu), var(&wdn));
            let dense = Linear::new(dn.as_tensor().clone(), None).forward(
                &(Linear::new(g.as_tensor().clone(), None)
                    .forward(xg.as_tensor())?
                    .silu()?
                    * Linear::new(u.as_tensor().clone(), None).forward(xg.as_tensor())?)?,
            )?;
            let gd = (&dense * &probe)?.sum_all()?.backward()?;
            let ipart = Partition::new(inter, world)?;
            let (xq, gq, uq, dq) = (
                var(&x),
                var(&narrow(&wg, 0, &ipart, rank)?),
                var(&narrow(&wu, 0, &ipart, rank)?),
                var(&narrow(&wdn, 1, &ipart, rank)?),
            );
            let gated = GatedMlp::new(
                ColumnParallelLinear::new(gq.as_tensor().clone(), None, d, ipart, pg.clone())?,
                ColumnParallelLinear::new(uq.as_tensor().clone(), None, d, ipart, pg.clone())?,
                RowParallelLinear::new(dq.as_tensor().clone(), None, ipart, d, pg.clone())?,
                Activation::Silu,
            )?;
            let yq = gated.forward(xq.as_tensor())?;
            let gq_store = (&yq * &probe)?.sum_all()?.backward()?;
            assert_close("gated output", world, rank, &yq, &dense);
            assert_close(
                "gated grad input",
                world,
                rank,
                gq_store.get(&xq).unwrap(),
                gd.get(&xg).unwrap(),
            );
            assert_close(
                "gated grad gate",
                world,
                rank,
                gq_store.get(&gq).unwrap(),
                &narrow(gd.get(&g).unwrap(), 0, &ipart, rank)?,
            );
            assert_close(
                "gated grad up",
                world,
                rank,
                gq_store.get(&uq).unwrap(),
                &narrow(gd.get(&u).unwrap(), 0, &ipart, rank)?,
            );
            assert_close(
                "gated grad down",
                world,
                rank,
                gq_store.get(&dq).unwrap(),
                &narrow(gd.get(&dn).unwrap(), 1, &ipart, rank)?,
            );
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn one_rank_is_bit_identical_to_candle_nn() {
    let w = seeded(&[7, 5], 21);
    let b = seeded(&[7], 22);
    let w2 = seeded(&[5, 7], 23);
    for shape in [vec![3, 5], vec![2, 3, 5], vec![2, 2, 3, 5]] {
        let x = seeded(&shape, 24);
        run_threads(1, |pg| {
            let dense = Linear::new(w.clone(), Some(b.clone()));
            let col = ColumnParallelLinear::from_dense(&w, Some(&b), pg.clone())?;
            let col_g = col.clone().with_gather_output(true);
            let y = dense.forward(&x)?;
            for got in [col.forward(&x)?, col_g.forward(&x)?] {
                assert_eq!(
                    got.flatten_all()?.to_vec1::<f32>()?,
                    y.flatten_all()?.to_vec1::<f32>()?
                );
            }
            let dense2 = Linear::new(w2.clone(), Some(b.narrow(0, 0, 5)?));
            let row = RowParallelLinear::from_dense(&w2, Some(&b.narrow(0, 0, 5)?), pg.clone())?;
            assert_eq!(
                row.forward(&y)?.flatten_all()?.to_vec1::<f32>()?,
                dense2.forward(&y)?.flatten_all()?.to_vec1::<f32>()?
            );
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn bad_shapes_are_clear_errors() {
    let w = seeded(&[4, 6], 31);
    run_threads(2, |pg| {
        let col = ColumnParallelLinear::from_dense(&w, None, pg.clone())?;
        let e = col.forward(&seeded(&[2, 5], 1)).unwrap_err().to_string();
        assert!(
            e.contains("ColumnParallelLinear on rank")
                && e.contains("[2, 5]")
                && e.contains("must be 6"),
            "{e}"
        );
        let row = RowParallelLinear::from_dense(&w, None, pg.clone())?;
        let e = row.forward(&seeded(&[2, 6], 1)).unwrap_err().to_string();
        assert!(
            e.contains("RowParallelLinear on rank") && e.contains("must be 3"),
            "{e}"
        );
        Ok(())
    })
    .unwrap();
    // A dimension smaller than the world size.
    let e = run_threads(3, |pg| {
        ColumnParallelLinear::from_dense(&seeded(&[2, 6], 1), None, pg)?;
        Ok(())
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("cannot split out_features = 2 over the 3 ranks"),
        "{e}"
    );
    assert!(e.contains("fewer units than ranks"), "{e}");
}

/// The comparison the whole suite relies on must not be blind to NaN: a NaN injected into one
/// element of a parallel layer's weight reaches its output, and `max_abs_diff` against the
/// dense output (NaN in the same place) must be an error, not a small number. Candle's CPU
/// `max` skips NaN after the first element, so a max-based check alone passes.
#[test]
fn a_nan_in_a_layer_output_is_caught_by_the_comparison() {
    let (inp, out) = (6, 10);
    let mut wv = seeded(&[out, inp], 1)
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    wv[3 * inp + 2] = f32::NAN; // row 3: on rank 0 at world 2
    let w = Tensor::from_vec(wv, (out, inp), &candle_core::Device::Cpu).unwrap();
    let x = seeded(&[2, 3, inp], 3);
    let errs = run_threads(2, |pg| {
        let part = Partition::new(out, 2)?;
        let dense = Linear::new(w.clone(), None).forward(&x)?;
        let layer = ColumnParallelLinear::new(
            narrow(&w, 0, &part, pg.rank())?,
            None,
            inp,
            part,
            pg.clone(),
        )?
        .with_gather_output(true);
        let got = layer.forward(&x)?;
        // Candle's own max of the difference misses the NaN (the reason for the check).
        let blind = (&got - &dense)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        Ok((blind, max_abs_diff(&got, &dense).map_err(|e| e.to_string())))
    })
    .unwrap();
    for (rank, (blind, checked)) in errs.into_iter().enumerate() {
        assert!(
            !blind.is_nan(),
            "rank {rank}: candle's max now propagates NaN ({blind})"
        );
        let e = checked.expect_err("a NaN output must fail the comparison");
        assert!(e.contains("non-finite"), "rank {rank}: {e}");
    }
}

/// `RowParallelLinear` with `input_is_parallel = false` on an input without gradients splits
/// it locally; the split must be a contiguous tensor, because Candle's CUDA and MKL matmuls
/// reject the strided `narrow` view for more than one row (the default gemm backend accepts
/// it, so the contiguity is asserted directly, and the layer is checked against dense).
#[test]
fn row_parallel_with_a_full_input_splits_it_contiguously() {
    let (inp, out) = (10, 4);
    let w = seeded(&[out, inp], 1);
    let b = seeded(&[out], 2);
    let x = seeded(&[3, 5, inp], 3); // 15 rows, no gradient
    for world in 2..=3 {
        run_threads(world, |pg| {
            let part = Partition::new(inp, world)?;
            let split = candle_tp::ops::scatter_to_tp(&x, &pg, &part)?;
            assert!(
                split.is_contiguous(),
                "world {world}: split of shape {:?} is a strided view",
                split.dims()
            );
            let layer = RowParallelLinear::new(
                narrow(&w, 1, &part, pg.rank())?,
                Some(b.clone()),
                part,
                out,
                pg.clone(),
            )?
            .with_input_is_parallel(false);
            let dense = Linear::new(w.clone(), Some(b.clone())).forward(&x)?;
            assert_close(
                "row full input",
                world,
                pg.rank(),
                &layer.forward(&x)?,
                &dense,
            );
            Ok(())
        })
        .unwrap();
    }
}

/// The gated MLP split against the attention's uneven groups (`GatedMlp::load_balanced` with
/// `AttentionConfig::uneven_groups`), loaded by name from full dense tensors: on 2 ranks of a
/// model with 9 heads of 4 in 3 KV groups, the rank that holds 2 groups gets fewer of the 48
/// intermediate columns (19 + 29, by `Partition::balancing`'s rule, written out here), and
/// the output is the dense `down(silu(gate x) · up x)`; on 3 ranks the groups split evenly and
/// so does the MLP.
#[test]
fn a_gated_mlp_evens_out_the_attentions_extra_group() -> Result<()> {
    use candle_core::{DType, Device};
    use candle_tp::loader::ShardedVarBuilder;
    use candle_tp::nn::AttentionConfig;
    let (hidden, inter) = (8, 48);
    let attention = AttentionConfig::new(hidden, 9, 3, 4, 1e4, 64);
    let (wg, wu, wd) = (
        seeded(&[inter, hidden], 21),
        seeded(&[inter, hidden], 22),
        seeded(&[hidden, inter], 23),
    );
    let x = seeded(&[2, 3, hidden], 24);
    let dense = Linear::new(wd.clone(), None).forward(
        &(Linear::new(wg.clone(), None).forward(&x)?.silu()?
            * Linear::new(wu.clone(), None).forward(&x)?)?,
    )?;
    // Rank 0's extra group: q and o rows 3 heads x 4, k and v 4 each, 32 rows per feature
    // (= 32 / 3 intermediate columns): 19 columns + 10.7 against 29.
    assert_eq!(attention.uneven_groups(2), (1, 32.0));
    assert_eq!(attention.uneven_groups(3), (0, 0.0));
    for (world, sizes) in [(2, vec![19, 29]), (3, vec![16, 16, 16])] {
        run_threads(world, |pg| {
            let tensors = [
                ("gate_proj.weight", &wg),
                ("up_proj.weight", &wu),
                ("down_proj.weight", &wd),
            ]
            .into_iter()
            .map(|(n, t)| (n.to_string(), t.clone()))
            .collect();
            let vb = ShardedVarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu, pg.clone());
            let (lead, extra) = attention.uneven_groups(world);
            let mlp = GatedMlp::load_balanced(
                hidden,
                inter,
                Activation::Silu,
                ["gate_proj", "up_proj", "down_proj"],
                (lead, extra / 3.0),
                vb,
            )?;
            assert_eq!(
                mlp.gate_proj().out_partition().sizes(),
                sizes,
                "world {world}"
            );
            assert_close(
                "balanced gated mlp",
                world,
                pg.rank(),
                &mlp.forward(&x)?,
                &dense,
            );
            Ok(())
        })?;
    }
    Ok(())
}
