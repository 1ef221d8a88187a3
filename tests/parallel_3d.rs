//! 3D layers against the dense layers, on q x q x q ranks as threads: forward output and the
//! gradients of the input, weights and biases, each sliced by the test itself with the
//! documented layout (rank = i q² + j q + k; in layout (features a, rows b) an activation is
//! rows block `i q + c[b]` of q² and features block `c[a]`; a layer's weight `[in, out]` is
//! block (c[a], c[b]), part c[i] of its columns; its bias block c[b], part c[a]).

mod common;

use candle_core::{backprop::GradStore, Module, Result, Tensor, Var};
use candle_nn::ops::layer_norm_slow;
use candle_nn::{Activation, Linear};
use candle_tp::{run_threads, DeviceMesh, LayerNorm3d, Layout3d, Linear3d, Mlp3d, Partition};
use common::{assert_loaded, max_abs_diff, seeded, var, DenseMlpNorm};

const TOL: f32 = 1e-5;

struct Slicer {
    q: usize,
    c: [usize; 3],
}

impl Slicer {
    fn new(mesh: &DeviceMesh) -> Self {
        let c = mesh.coord();
        Slicer {
            q: mesh.dims()[0],
            c: [c[0], c[1], c[2]],
        }
    }

    /// Rows block `i q + c[rows]` of q² (dim 0), features block `c[features]` (last dim).
    fn act(&self, t: &Tensor, l: Layout3d) -> Result<Tensor> {
        let last = t.rank() - 1;
        let q = self.q;
        let (b, h) = (t.dims()[0] / (q * q), t.dims()[last] / q);
        t.narrow(0, (self.c[0] * q + self.c[l.rows]) * b, b)?
            .narrow(last, self.c[l.features] * h, h)?
            .contiguous()
    }

    /// Of a layer taking layout `l`: block (c[a], c[b]) of the `[in, out]` transpose of a
    /// candle `[out, in]` weight, columns part c[i] of that block.
    fn weight(&self, w: &Tensor, l: Layout3d) -> Result<Tensor> {
        let wt = w.t()?;
        let (i, o) = (wt.dims()[0] / self.q, wt.dims()[1] / self.q);
        let part = Partition::new(o, self.q).map_err(candle_core::Error::wrap)?;
        let r = part.range(self.c[0]);
        wt.narrow(0, self.c[l.features] * i, i)?
            .narrow(1, self.c[l.rows] * o + r.start, r.len())?
            .contiguous()
    }

    /// Block `c[block]` of a vector, part `c[part]` of that block.
    fn vector(&self, v: &Tensor, block: usize, part: usize) -> Result<Tensor> {
        let n = v.dims1()? / self.q;
        let p = Partition::new(n, self.q).map_err(candle_core::Error::wrap)?;
        let r = p.range(self.c[part]);
        v.narrow(0, self.c[block] * n + r.start, r.len())?
            .contiguous()
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

/// Runs `case` on q³ threads; returns every rank's largest error per compared quantity.
fn run(q: usize, case: Case) -> Vec<Vec<(String, f32)>> {
    let (batch, seq, d, h) = (8, 2, 8, 12);
    let l = Layout3d::JK;
    let m = l.swapped();
    run_threads(q * q * q, |pg| {
        let mesh = DeviceMesh::cube_3d(&pg)?;
        let s = Slicer::new(&mesh);
        let x = seeded(&[batch, seq, d], 1);
        let (w1, b1) = params(d, h, 10)?;
        let (w2, b2) = params(h, d, 20)?;
        let (g, beta) = (
            ((seeded(&[d], 30) * 0.5)? + 1.0)?,
            (seeded(&[d], 31) * 0.1)?,
        );
        let dense: Vec<Var> = [&x, &w1, &b1, &w2, &b2, &g, &beta]
            .into_iter()
            .map(var)
            .collect();
        // fc1 takes layout l, fc2 takes m = l.swapped(); biases: block c[rows], part c[features].
        let local = vec![
            var(&s.act(&x, l)?),
            var(&s.weight(&w1, l)?),
            var(&s.vector(&b1, l.rows, l.features)?),
            var(&s.weight(&w2, m)?),
            var(&s.vector(&b2, m.rows, m.features)?),
            var(&s.vector(&g, l.features, l.rows)?),
            var(&s.vector(&beta, l.features, l.rows)?),
        ];
        let t = |v: &Vec<Var>, i: usize| v[i].as_tensor().clone();
        let l1 = |bias: bool| {
            let b = bias.then(|| t(&local, 2));
            Linear3d::new(t(&local, 1), b, d, h, l, &mesh)
        };
        let l2 = || Linear3d::new(t(&local, 3), Some(t(&local, 4)), h, d, m, &mesh);
        let dl1 = |bias: bool| Linear::new(t(&dense, 1), bias.then(|| t(&dense, 2)));
        let dl2 = || Linear::new(t(&dense, 3), Some(t(&dense, 4)));
        let (y, yd, out_layout, used): (Tensor, Tensor, Layout3d, Vec<usize>) = match case {
            Case::Linear => (
                l1(true)?.forward(&t(&local, 0))?,
                dl1(true).forward(&t(&dense, 0))?,
                m,
                vec![0, 1, 2],
            ),
            Case::LinearNoBias => (
                l1(false)?.forward(&t(&local, 0))?,
                dl1(false).forward(&t(&dense, 0))?,
                m,
                vec![0, 1],
            ),
            Case::Chain => (
                l2()?.forward(&l1(true)?.forward(&t(&local, 0))?)?,
                dl2().forward(&dl1(true).forward(&t(&dense, 0))?)?,
                l,
                vec![0, 1, 2, 3, 4],
            ),
            Case::LayerNorm => {
                let ln = LayerNorm3d::new(t(&local, 5), Some(t(&local, 6)), d, 1e-5, l, &mesh)?;
                // candle-nn's fused layer_norm has no backward: its op-by-op twin.
                let dense_y = layer_norm_slow(&t(&dense, 0), &t(&dense, 5), &t(&dense, 6), 1e-5)?;
                (ln.forward(&t(&local, 0))?, dense_y, l, vec![0, 5, 6])
            }
            Case::Mlp => {
                let mlp = Mlp3d::new(l1(true)?, l2()?, Activation::Gelu)?;
                let dense_h = Activation::Gelu.forward(&dl1(true).forward(&t(&dense, 0))?)?;
                (
                    mlp.forward(&t(&local, 0))?,
                    dl2().forward(&dense_h)?,
                    l,
                    vec![0, 1, 2, 3, 4],
                )
            }
        };
        let probe = seeded(yd.dims(), 99);
        let gd = (&yd * &probe)?.sum_all()?.backward()?;
        let gl = (&y * &s.act(&probe, out_layout)?)?.sum_all()?.backward()?;
        let mut errs = vec![(
            "output".to_string(),
            max_abs_diff(&y, &s.act(&yd, out_layout)?)?,
        )];
        let names = ["x", "w1", "b1", "w2", "b2", "gamma", "beta"];
        for i in used {
            let want = grad(&gd, &dense[i])?;
            let want = match i {
                0 => s.act(&want, l)?,
                1 => s.weight(&want, l)?,
                2 => s.vector(&want, l.rows, l.features)?,
                3 => s.weight(&want, m)?,
                4 => s.vector(&want, m.rows, m.features)?,
                _ => s.vector(&want, l.features, l.rows)?,
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
    assert_eq!(all.len(), q * q * q);
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
fn linear3d_matches_dense_on_2x2x2() {
    check(2, Case::Linear);
    check(2, Case::LinearNoBias);
}

#[test]
fn chain_of_two_linear3d_matches_dense() {
    check(2, Case::Chain);
}

#[test]
fn layernorm3d_matches_dense() {
    check(2, Case::LayerNorm);
}

#[test]
fn mlp3d_matches_dense() {
    check(2, Case::Mlp);
}

#[test]
fn one_rank_is_the_dense_layer() {
    check(1, Case::Mlp);
}

#[test]
fn mesh_coordinates_and_groups() {
    let out = run_threads(8, |pg| {
        let mesh = DeviceMesh::cube_3d(&pg)?;
        let c = mesh.coord().to_vec();
        let axes: Vec<Vec<usize>> = (0..3)
            .map(|a| mesh.group_along(a).expect("axis").members().to_vec())
            .collect();
        let jk = mesh.plane(1, 2).expect("plane").members().to_vec();
        Ok((pg.rank(), c, axes, jk))
    })
    .unwrap();
    for (rank, c, axes, jk) in out {
        assert_eq!(rank, c[0] * 4 + c[1] * 2 + c[2]);
        for (a, members) in axes.iter().enumerate() {
            let want: Vec<usize> = (0..2)
                .map(|v| {
                    let mut cc = c.clone();
                    cc[a] = v;
                    cc[0] * 4 + cc[1] * 2 + cc[2]
                })
                .collect();
            assert_eq!(members, &want, "axis {a} of rank {rank}");
        }
        assert_eq!(jk, (0..4).map(|v| c[0] * 4 + v).collect::<Vec<_>>());
    }
}

#[test]
fn bad_sizes_are_clear_errors() {
    for n in [4, 9] {
        let err = run_threads(n, |pg| Ok(DeviceMesh::cube_3d(&pg).map(|_| ())?))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cubic number of ranks") && err.contains(&format!("got {n}")),
            "{err}"
        );
    }
    let errs = run_threads(8, |pg| {
        let mesh = DeviceMesh::cube_3d(&pg)?;
        let w = Tensor::zeros((6, 9), candle_core::DType::F32, &candle_core::Device::Cpu)?;
        let e1 = Linear3d::from_dense(&w, None, Layout3d::JK, &mesh)
            .err()
            .map(|e| e.to_string());
        let x = Tensor::zeros((6, 8), candle_core::DType::F32, &candle_core::Device::Cpu)?;
        let e2 = candle_tp::nn::parallel_3d::scatter_3d(&x, Layout3d::JK, &mesh)
            .err()
            .map(|e| e.to_string());
        Ok((e1, e2))
    })
    .unwrap();
    for (e1, e2) in errs {
        let e1 = e1.expect("in_features 9 on q = 2 must fail");
        assert!(
            e1.contains("in_features = 9") && e1.contains("multiple of 2"),
            "{e1}"
        );
        let e2 = e2.expect("batch 6 on q = 2 must fail");
        assert!(
            e2.contains("batch size (dim 0) = 6") && e2.contains("multiple of 4"),
            "{e2}"
        );
    }
}

/// `Mlp3d::load` / `LayerNorm3d::load` from the dense tensors under their dense names: every
/// rank's blocks equal the test's own slices, and the loaded MLP computes the dense MLP.
#[test]
fn load_from_dense_names_matches_slices_and_dense() -> Result<()> {
    let (batch, seq, d, h) = (8, 2, 8, 12);
    let l = Layout3d::JK;
    let p = DenseMlpNorm::new(d, h);
    let errs = run_threads(8, |pg| {
        let mesh = DeviceMesh::cube_3d(&pg)?;
        let s = Slicer::new(&mesh);
        let vb = p.builder(&pg);
        let mlp = Mlp3d::load(d, h, Activation::Gelu, "fc1", "fc2", l, &mesh, vb.pp("mlp"))?;
        let norm = LayerNorm3d::load(d, 1e-5, l, &mesh, vb.pp("norm"))?;
        let l2 = mlp.fc1().output_layout();
        let mut worst = 0f32;
        for (got, want) in [
            (mlp.fc1().weight(), s.weight(&p.w1, l)?),
            (
                mlp.fc1().bias().expect("bias"),
                s.vector(&p.b1, l.rows, l.features)?,
            ),
            (mlp.fc2().weight(), s.weight(&p.w2, l2)?),
            (
                mlp.fc2().bias().expect("bias"),
                s.vector(&p.b2, l2.rows, l2.features)?,
            ),
            (norm.weight(), s.vector(&p.g, l.features, l.rows)?),
            (
                norm.bias().expect("shift"),
                s.vector(&p.beta, l.features, l.rows)?,
            ),
        ] {
            worst = worst.max(max_abs_diff(got, &want)?);
        }
        let x = seeded(&[batch, seq, d], 1);
        let y = mlp.forward(&s.act(&x, l)?)?;
        let out = mlp.fc2().output_layout();
        Ok((worst, max_abs_diff(&y, &s.act(&p.mlp(&x)?, out)?)?))
    })
    .expect("run");
    assert_loaded(errs, TOL);
    Ok(())
}
