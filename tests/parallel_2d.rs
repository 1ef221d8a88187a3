//! 2D (SUMMA) layers against the dense layers, on q x q ranks as threads: forward output and
//! the gradients of the input, weights and biases, each sliced by the test itself with the
//! documented layout (rank = row * q + col; activation rows block `row`, features block `col`;
//! weight `[in, out]` block `(row, col)`; bias block `col`, part `row`).

mod common;

use candle_core::{backprop::GradStore, Module, Result, Tensor, Var};
use candle_nn::ops::layer_norm_slow;
use candle_nn::{Activation, Linear};
use candle_tp::{run_threads, DeviceMesh, LayerNorm2d, Linear2d, Mlp2d, Partition};
use common::{assert_loaded, builder_from, max_abs_diff, seeded, var, DenseMlpNorm};

const TOL: f32 = 1e-5;

struct Slicer {
    q: usize,
    row: usize,
    col: usize,
}

impl Slicer {
    fn new(mesh: &DeviceMesh) -> Self {
        Slicer {
            q: mesh.dims()[0],
            row: mesh.coord()[0],
            col: mesh.coord()[1],
        }
    }

    /// Rows block `row` of dim 0, features block `col` of the last dim.
    fn act(&self, t: &Tensor) -> Result<Tensor> {
        let last = t.rank() - 1;
        let (b, h) = (t.dims()[0] / self.q, t.dims()[last] / self.q);
        t.narrow(0, self.row * b, b)?
            .narrow(last, self.col * h, h)?
            .contiguous()
    }

    /// Block (row, col) of the `[in, out]` transpose of a candle `[out, in]` weight.
    fn weight(&self, w: &Tensor) -> Result<Tensor> {
        let wt = w.t()?;
        let (i, o) = (wt.dims()[0] / self.q, wt.dims()[1] / self.q);
        wt.narrow(0, self.row * i, i)?
            .narrow(1, self.col * o, o)?
            .contiguous()
    }

    /// Block `col` of a vector, part `row` of that block.
    fn vector(&self, v: &Tensor) -> Result<Tensor> {
        let n = v.dims1()? / self.q;
        let part = Partition::new(n, self.q).map_err(candle_core::Error::wrap)?;
        let r = part.range(self.row);
        v.narrow(0, self.col * n + r.start, r.len())?.contiguous()
    }
}

fn grad(g: &GradStore, v: &Var) -> Result<Tensor> {
    g.get(v)
        .cloned()
        .ok_or_else(|| candle_core::Error::msg("missing gradient"))
}

/// A dense linear layer's parameters: weight `[out, in]` scaled by 1/sqrt(in), bias `[out]`.
fn params(inp: usize, out: usize, seed: u64) -> Result<(Tensor, Tensor)> {
    let w = (seeded(&[out, inp], seed) / (inp as f64).sqrt())?;
    Ok((w, (seeded(&[out], seed + 1) * 0.1)?))
}

#[derive(Clone, Copy, Debug)]
enum Case {
    Linear,
    LinearNoBias,
    Chain,
    LayerNorm,
    Mlp,
}

/// Runs `case` on q*q threads; returns every rank's largest error per compared quantity.
fn run(q: usize, case: Case) -> Vec<Vec<(String, f32)>> {
    let (batch, seq, d, h) = (6, 2, 12, 18);
    run_threads(q * q, |pg| {
        let mesh = DeviceMesh::grid_2d(&pg)?;
        let s = Slicer::new(&mesh);
        let x = seeded(&[batch, seq, d], 1);
        let (w1, b1) = params(d, h, 10)?;
        let (w2, b2) = params(h, d, 20)?;
        let (g, beta) = (
            ((seeded(&[d], 30) * 0.5)? + 1.0)?,
            (seeded(&[d], 31) * 0.1)?,
        );
        // Dense parameters (as Vars) and this rank's slices (as Vars).
        let dense: Vec<Var> = [&x, &w1, &b1, &w2, &b2, &g, &beta]
            .into_iter()
            .map(var)
            .collect();
        let local = vec![
            var(&s.act(&x)?),
            var(&s.weight(&w1)?),
            var(&s.vector(&b1)?),
            var(&s.weight(&w2)?),
            var(&s.vector(&b2)?),
            var(&s.vector(&g)?),
            var(&s.vector(&beta)?),
        ];
        let t = |v: &Vec<Var>, i: usize| v[i].as_tensor().clone();
        let l1 = |bias: bool| {
            let b = bias.then(|| t(&local, 2));
            Linear2d::new(t(&local, 1), b, d, h, &mesh)
        };
        let l2 = || Linear2d::new(t(&local, 3), Some(t(&local, 4)), h, d, &mesh);
        let dl1 = |bias: bool| Linear::new(t(&dense, 1), bias.then(|| t(&dense, 2)));
        let dl2 = || Linear::new(t(&dense, 3), Some(t(&dense, 4)));
        let (y, yd, used): (Tensor, Tensor, Vec<usize>) = match case {
            Case::Linear => (
                l1(true)?.forward(&t(&local, 0))?,
                dl1(true).forward(&t(&dense, 0))?,
                vec![0, 1, 2],
            ),
            Case::LinearNoBias => (
                l1(false)?.forward(&t(&local, 0))?,
                dl1(false).forward(&t(&dense, 0))?,
                vec![0, 1],
            ),
            Case::Chain => (
                l2()?.forward(&l1(true)?.forward(&t(&local, 0))?)?,
                dl2().forward(&dl1(true).forward(&t(&dense, 0))?)?,
                vec![0, 1, 2, 3, 4],
            ),
            Case::LayerNorm => {
                let ln = LayerNorm2d::new(t(&local, 5), Some(t(&local, 6)), d, 1e-5, &mesh)?;
                // candle-nn's fused layer_norm has no backward: its op-by-op twin.
                let dense_y = layer_norm_slow(&t(&dense, 0), &t(&dense, 5), &t(&dense, 6), 1e-5)?;
                (ln.forward(&t(&local, 0))?, dense_y, vec![0, 5, 6])
            }
            Case::Mlp => {
                let mlp = Mlp2d::new(l1(true)?, l2()?, Activation::Gelu)?;
                let dense_h = Activation::Gelu.forward(&dl1(true).forward(&t(&dense, 0))?)?;
                (
                    mlp.forward(&t(&local, 0))?,
                    dl2().forward(&dense_h)?,
                    vec![0, 1, 2, 3, 4],
                )
            }
        };
        let probe = seeded(yd.dims(), 99);
        let gd = (&yd * &probe)?.sum_all()?.backward()?;
        let gl = (&y * &s.act(&probe)?)?.sum_all()?.backward()?;
        let mut errs = vec![("output".to_string(), max_abs_diff(&y, &s.act(&yd)?)?)];
        let names = ["x", "w1", "b1", "w2", "b2", "gamma", "beta"];
        for i in used {
            let want = grad(&gd, &dense[i])?;
            let want = match i {
                0 => s.act(&want)?,
                1 | 3 => s.weight(&want)?,
                _ => s.vector(&want)?,
            };
            let got = grad(&gl, &local[i])?;
            errs.push((format!("grad {}", names[i]), max_abs_diff(&got, &want)?));
        }
        Ok(errs)
    })
    .unwrap()
}

fn check(q: usize, case: Case) {
    let all = run(q, case);
    assert_eq!(all.len(), q * q);
    for (rank, errs) in all.iter().enumerate() {
        assert!(errs.len() >= 3, "{case:?}: too few comparisons {errs:?}");
        for (what, e) in errs {
            assert!(
                *e <= TOL,
                "{case:?} q={q} rank {rank}: {what} differs by {e}"
            );
        }
    }
}

#[test]
fn linear2d_matches_dense_on_2x2_and_3x3() {
    for q in [2, 3] {
        check(q, Case::Linear);
        check(q, Case::LinearNoBias);
    }
}

#[test]
fn chain_of_two_linear2d_matches_dense() {
    for q in [2, 3] {
        check(q, Case::Chain);
    }
}

#[test]
fn layernorm2d_matches_dense() {
    for q in [2, 3] {
        check(q, Case::LayerNorm);
    }
}

#[test]
fn mlp2d_matches_dense() {
    for q in [2, 3] {
        check(q, Case::Mlp);
    }
}

#[test]
fn one_rank_is_the_dense_layer() {
    check(1, Case::Mlp);
}

#[test]
fn mesh_coordinates_and_groups() {
    let out = run_threads(9, |pg| {
        let mesh = DeviceMesh::grid_2d(&pg)?;
        let (row, col) = (mesh.coord()[0], mesh.coord()[1]);
        let rg = mesh.row_group().expect("2D");
        let cg = mesh.col_group().expect("2D");
        Ok((
            pg.rank(),
            row,
            col,
            rg.members().to_vec(),
            cg.members().to_vec(),
            rg.rank(),
            cg.rank(),
        ))
    })
    .unwrap();
    for (rank, row, col, rm, cm, rr, cr) in out {
        assert_eq!(rank, row * 3 + col);
        assert_eq!(rm, (0..3).map(|c| row * 3 + c).collect::<Vec<_>>());
        assert_eq!(cm, (0..3).map(|r| r * 3 + col).collect::<Vec<_>>());
        assert_eq!((rr, cr), (col, row));
    }
}

#[test]
fn bad_sizes_are_clear_errors() {
    let err = run_threads(3, |pg| Ok(DeviceMesh::grid_2d(&pg).map(|_| ())?))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("square number of ranks") && err.contains("got 3"),
        "{err}"
    );
    let errs = run_threads(4, |pg| {
        let mesh = DeviceMesh::grid_2d(&pg)?;
        let w = Tensor::zeros((6, 9), candle_core::DType::F32, &candle_core::Device::Cpu)?;
        let e1 = Linear2d::from_dense(&w, None, &mesh)
            .err()
            .map(|e| e.to_string());
        let x = Tensor::zeros((5, 8), candle_core::DType::F32, &candle_core::Device::Cpu)?;
        let e2 = candle_tp::nn::parallel_2d::scatter_2d(&x, &mesh)
            .err()
            .map(|e| e.to_string());
        Ok((e1, e2))
    })
    .unwrap();
    for (e1, e2) in errs {
        let e1 = e1.expect("in_features 9 on q = 2 must fail");
        assert!(
            e1.contains("in_features = 9") && e1.contains("multiple of q = 2"),
            "{e1}"
        );
        let e2 = e2.expect("batch 5 on q = 2 must fail");
        assert!(
            e2.contains("batch size (dim 0) = 5") && e2.contains("multiple of q = 2"),
            "{e2}"
        );
    }
}

#[test]
fn dp_tp_mesh_groups_consecutive_tp_ranks() {
    let out = run_threads(6, |pg| {
        let mesh = DeviceMesh::dp_tp(&pg, 3)?;
        let tp = mesh.group_along(1).expect("tp").members().to_vec();
        let dp = mesh.group_along(0).expect("dp").members().to_vec();
        Ok((pg.rank(), tp, dp))
    })
    .unwrap();
    for (rank, tp, dp) in out {
        let (d, t) = (rank / 3, rank % 3);
        assert_eq!(tp, vec![d * 3, d * 3 + 1, d * 3 + 2]);
        assert_eq!(dp, vec![t, 3 + t]);
    }
    let err = run_threads(6, |pg| Ok(DeviceMesh::dp_tp(&pg, 4).map(|_| ())?))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tensor-parallel size 4 must divide the 6 ranks"),
        "{err}"
    );
}

/// `Mlp2d::load` / `LayerNorm2d::load` from the dense tensors under their dense names: every
/// rank's blocks equal the test's own slices, and the loaded MLP computes the dense MLP.
#[test]
fn load_from_dense_names_matches_slices_and_dense() -> Result<()> {
    let (batch, seq, d, h) = (6, 2, 12, 18);
    let p = DenseMlpNorm::new(d, h);
    let errs = run_threads(9, |pg| {
        let mesh = DeviceMesh::grid_2d(&pg)?;
        let s = Slicer::new(&mesh);
        let vb = p.builder(&pg);
        let mlp = Mlp2d::load(d, h, Activation::Gelu, "fc1", "fc2", &mesh, vb.pp("mlp"))?;
        let norm = LayerNorm2d::load(d, 1e-5, &mesh, vb.pp("norm"))?;
        let mut worst = 0f32;
        for (got, want) in [
            (mlp.fc1().weight(), s.weight(&p.w1)?),
            (mlp.fc1().bias().expect("bias"), s.vector(&p.b1)?),
            (mlp.fc2().weight(), s.weight(&p.w2)?),
            (mlp.fc2().bias().expect("bias"), s.vector(&p.b2)?),
            (norm.weight(), s.vector(&p.g)?),
            (norm.bias().expect("shift"), s.vector(&p.beta)?),
        ] {
            worst = worst.max(max_abs_diff(got, &want)?);
        }
        let x = seeded(&[batch, seq, d], 1);
        let y = mlp.forward(&s.act(&x)?)?;
        Ok((worst, max_abs_diff(&y, &s.act(&p.mlp(&x)?)?)?))
    })
    .expect("run");
    assert_loaded(errs, TOL);
    Ok(())
}

/// A checkpoint tensor of the wrong shape is an error that names it.
#[test]
fn load_checks_checkpoint_shapes() {
    let err = run_threads(4, |pg| {
        let mesh = DeviceMesh::grid_2d(&pg)?;
        let vb = builder_from(&[("w.weight", &seeded(&[8, 6], 1))], &pg);
        Linear2d::load(8, 6, false, &mesh, vb.pp("w")).map(|_| ())
    })
    .expect_err("a [8, 6] tensor cannot be loaded as [6, 8]")
    .to_string();
    assert!(err.contains("w.weight") && err.contains("[8, 6]"), "{err}");
}
