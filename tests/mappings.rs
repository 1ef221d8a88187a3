//! Megatron-style exact tests of the autograd mappings: inputs built from the rank, so the
//! expected forward values and gradients are exact sums that can be written down.

use candle_core::{DType, Device, Tensor, Var};
use candle_tp::ops::{
    copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp, scatter_to_tp,
};
use candle_tp::{run_threads, Partition, ReduceOp};

fn full(shape: &[usize], v: f32) -> Tensor {
    Tensor::full(v, shape, &Device::Cpu).unwrap()
}

/// Values i * 10 + j + offset, for recognisable slices.
fn ramp(rows: usize, cols: usize, offset: f32) -> Tensor {
    let data: Vec<f32> = (0..rows * cols)
        .map(|k| (k / cols * 10 + k % cols) as f32 + offset)
        .collect();
    Tensor::from_vec(data, (rows, cols), &Device::Cpu).unwrap()
}

fn v2(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_vec2::<f32>().unwrap()
}

#[test]
fn copy_and_reduce_are_conjugate() {
    for world in 1..=4 {
        let ranks_sum: f32 = (0..world).map(|r| r as f32 + 1.0).sum();
        run_threads(world, |pg| {
            let r = pg.rank() as f32 + 1.0;
            // copy_to_tp: identity forward; the gradient (r on rank r) is all-reduced.
            let x = Var::from_tensor(&full(&[2, 3], 5.0))?;
            let y = copy_to_tp(x.as_tensor(), &pg)?;
            assert_eq!(v2(&y), vec![vec![5.0; 3]; 2]);
            let g = (y * r as f64)?.sum_all()?.backward()?;
            assert_eq!(v2(g.get(&x).unwrap()), vec![vec![ranks_sum; 3]; 2]);
            // reduce_from_tp: all-reduce forward; the gradient passes unchanged.
            let x = Var::from_tensor(&full(&[2, 3], r))?;
            let y = reduce_from_tp(x.as_tensor(), &pg)?;
            assert_eq!(v2(&y), vec![vec![ranks_sum; 3]; 2]);
            let g = (y * 3.0)?.sum_all()?.backward()?;
            assert_eq!(v2(g.get(&x).unwrap()), vec![vec![3.0; 3]; 2]);
            // Inputs that do not track gradients skip the copy.
            let plain = full(&[2], 1.0);
            assert!(copy_to_tp(&plain, &pg)?.same_storage_as(&plain));
            Ok(())
        })
        .unwrap();
    }
}

trait SameStorage {
    fn same_storage_as(&self, other: &Tensor) -> bool;
}
impl SameStorage for Tensor {
    fn same_storage_as(&self, other: &Tensor) -> bool {
        self.id() == other.id()
    }
}

#[test]
fn gather_and_scatter_on_the_last_dim_with_uneven_shares() {
    for world in 1..=4 {
        let total = 7; // 7 columns: uneven over 2, 3, 4 ranks
        let part = Partition::new(total, world).unwrap();
        run_threads(world, |pg| {
            let me = pg.rank();
            let range = part.range(me);
            // Each rank holds its columns of ramp(2, 7).
            let local = ramp(2, total, 0.0).narrow(1, range.start, range.len())?;
            let x = Var::from_tensor(&local)?;
            let y = gather_from_tp(x.as_tensor(), &pg, &part)?;
            assert_eq!(v2(&y), v2(&ramp(2, total, 0.0)));
            // Backward: each rank keeps its slice of the gradient (here ramp + 100).
            let g = (y * ramp(2, total, 100.0))?.sum_all()?.backward()?;
            let want = ramp(2, total, 100.0).narrow(1, range.start, range.len())?;
            assert_eq!(v2(g.get(&x).unwrap()), v2(&want));
            // scatter_to_tp: split forward, all-gather backward.
            let xf = Var::from_tensor(&ramp(2, total, 0.0))?;
            let y = scatter_to_tp(xf.as_tensor(), &pg, &part)?;
            assert_eq!(v2(&y), v2(&local));
            let g = (y * (me as f64 + 1.0))?.sum_all()?.backward()?;
            // Column c's gradient is (owner of c) + 1.
            let got = v2(g.get(&xf).unwrap());
            for (c, g) in got[1].iter().enumerate() {
                assert_eq!(*g, part.owner(c).unwrap() as f32 + 1.0, "column {c}");
            }
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn sequence_parallel_pair_on_dim_0_and_dim_1() {
    for world in 1..=4 {
        let seq = 5;
        let part = Partition::new(seq, world).unwrap();
        let n: f32 = world as f32;
        run_threads(world, |pg| {
            let me = pg.rank();
            let rg = part.range(me);
            // gather_from_sp along dim 0 of a [seq, 3] activation.
            let local = ramp(seq, 3, 0.0).narrow(0, rg.start, rg.len())?;
            let x = Var::from_tensor(&local)?;
            let y = gather_from_sp(x.as_tensor(), &pg, &part, 0)?;
            assert_eq!(v2(&y), v2(&ramp(seq, 3, 0.0)));
            // Backward reduce-scatters: every rank's gradient is ramp, so the sum is n * ramp.
            let g = (y * ramp(seq, 3, 0.0))?.sum_all()?.backward()?;
            let want = (ramp(seq, 3, 0.0).narrow(0, rg.start, rg.len())? * n as f64)?;
            assert_eq!(v2(g.get(&x).unwrap()), v2(&want));
            // reduce_scatter_to_sp along dim 0: sum of every rank's (rank + 1) * ramp, my rows.
            let xf = Var::from_tensor(&(ramp(seq, 3, 0.0) * (me as f64 + 1.0))?)?;
            let y = reduce_scatter_to_sp(xf.as_tensor(), &pg, &part, 0)?;
            let tri = (world * (world + 1) / 2) as f64;
            assert_eq!(
                v2(&y),
                v2(&(ramp(seq, 3, 0.0).narrow(0, rg.start, rg.len())? * tri)?)
            );
            // Backward all-gathers: row i's gradient is (owner of row i) + 1.
            let g = (y * (me as f64 + 1.0))?.sum_all()?.backward()?;
            let got = v2(g.get(&xf).unwrap());
            for (i, row) in got.iter().enumerate() {
                assert_eq!(row[0], part.owner(i).unwrap() as f32 + 1.0, "row {i}");
            }
            // Along dim 1 of a [2, seq, 3] batch-first activation, forward and backward.
            let b = Tensor::stack(&[ramp(seq, 3, 0.0), ramp(seq, 3, 50.0)], 0)?;
            let xb = Var::from_tensor(&b.narrow(1, rg.start, rg.len())?)?;
            let y = gather_from_sp(xb.as_tensor(), &pg, &part, 1)?;
            assert_eq!(y.to_vec3::<f32>()?, b.to_vec3::<f32>()?);
            // Backward reduce-scatters along dim 1: rank r's upstream gradient is (r + 1) * b,
            // so this rank gets tri * b at its sequence positions (position-dependent values
            // catch a block taken from the wrong place or along the wrong dim).
            let g = (y * (&b * (me as f64 + 1.0))?)?.sum_all()?.backward()?;
            let want = (b.narrow(1, rg.start, rg.len())? * tri)?;
            assert_eq!(
                g.get(&xb).unwrap().to_vec3::<f32>()?,
                want.to_vec3::<f32>()?
            );
            // reduce_scatter_to_sp along dim 1: forward sums, backward all-gathers.
            let xf = Var::from_tensor(&(&b * (me as f64 + 1.0))?)?;
            let y = reduce_scatter_to_sp(xf.as_tensor(), &pg, &part, 1)?;
            assert_eq!(
                y.to_vec3::<f32>()?,
                (b.narrow(1, rg.start, rg.len())? * tri)?.to_vec3::<f32>()?
            );
            let probe = (Tensor::ones(y.dims(), DType::F32, &Device::Cpu)? * (me as f64 + 1.0))?;
            let g = (y * probe)?.sum_all()?.backward()?;
            let got = g.get(&xf).unwrap().to_vec3::<f32>()?;
            for (k, batch) in got.iter().enumerate() {
                for (i, row) in batch.iter().enumerate() {
                    let owner = part.owner(i).unwrap() as f32 + 1.0;
                    assert_eq!(row, &vec![owner; 3], "batch {k} position {i}");
                }
            }
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn tensor_collectives_on_every_dim_and_dtype() {
    for world in 1..=4 {
        run_threads(world, |pg| {
            let me = pg.rank();
            let t = Tensor::full(me as f32 + 1.0, (2, 3), &Device::Cpu)?;
            let tri = (world * (world + 1) / 2) as f32;
            assert_eq!(
                v2(&pg.all_reduce(&t, ReduceOp::Sum)?),
                vec![vec![tri; 3]; 2]
            );
            assert_eq!(
                v2(&pg.all_reduce(&t, ReduceOp::Max)?),
                vec![vec![world as f32; 3]; 2]
            );
            let tb = t.to_dtype(DType::BF16)?;
            let s = pg.all_reduce(&tb, ReduceOp::Sum)?.to_dtype(DType::F32)?;
            assert_eq!(v2(&s), vec![vec![tri; 3]; 2]);
            // all_gather with unequal sizes along dim 1 (rank r holds r + 1 columns).
            let mine = Tensor::full(me as f32, (2, me + 1), &Device::Cpu)?;
            let g = pg.all_gather(&mine, 1)?;
            let want: Vec<f32> = (0..world).flat_map(|r| vec![r as f32; r + 1]).collect();
            assert_eq!(v2(&g), vec![want.clone(); 2]);
            // reduce_scatter along dim 1 of [2, 7]: rank me keeps its columns of the sum.
            let x = ramp(2, 7, 0.0);
            if world <= 7 {
                let rs = pg.reduce_scatter(&x, 1, ReduceOp::Sum)?;
                let part = Partition::new(7, world)?;
                let rg = part.range(me);
                assert_eq!(
                    v2(&rs),
                    v2(&(x.narrow(1, rg.start, rg.len())? * world as f64)?)
                );
            }
            // broadcast of integers from the last rank.
            let ids = Tensor::new(&[me as u32, 7], &Device::Cpu)?;
            assert_eq!(
                pg.broadcast(&ids, world - 1)?.to_vec1::<u32>()?,
                vec![world as u32 - 1, 7]
            );
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn mappings_refuse_shapes_that_do_not_match_the_partition() {
    run_threads(2, |pg| {
        let part = Partition::new(8, 2)?;
        let e = gather_from_tp(&full(&[2, 3], 0.0), &pg, &part)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("gather_from_tp on rank")
                && e.contains("expected this rank's share of 4")
                && e.contains("[2, 3]"),
            "{e}"
        );
        let e = scatter_to_tp(&full(&[2, 3], 0.0), &pg, &part)
            .unwrap_err()
            .to_string();
        assert!(e.contains("the full size 8"), "{e}");
        let three = Partition::new(9, 3)?;
        let e = gather_from_sp(&full(&[3, 2], 0.0), &pg, &three, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 parts but group 'world' has 2 ranks"), "{e}");
        Ok(())
    })
    .unwrap();
}
