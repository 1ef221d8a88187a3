//! One MLP (d → 4d → d, GELU) forward and backward in 1D (Megatron), 2D (SUMMA) and 3D
//! tensor parallelism, with measured memory and communication next to the seeds' formulas.
//!
//! ```text
//! cargo build --release --examples
//! scripts/tprun --nproc-per-node 4 target/release/examples/parallel_modes --hidden 256
//! scripts/tprun --nproc-per-node 8 target/release/examples/parallel_modes --batch 8
//! ```
//!
//! Every rank builds the same dense weights from a seed, keeps its blocks in each mode, runs
//! forward and backward, and checks output and every gradient against the dense MLP. It
//! prints, per rank and mode: parameter and activation memory, bytes its collectives moved
//! (the sum over every group of the mesh, from the groups' counters) in the forward and the
//! backward pass, and the seeds' predictions. A mode whose world size does not fit (2D needs
//! q², 3D q³ ranks) or whose sizes q does not divide is skipped with the reason. The last line
//! (rank 0) is one JSON object with the measured and predicted figures. See
//! `docs/PARALLEL_MODES.md` for what the numbers show.

use anyhow::Result;
use candle_core::{backprop::GradStore, Device, Module, Tensor, Var};
use candle_nn::{Activation, Linear};
use candle_tp::comm::{CommStats, OpStats};
use candle_tp::nn::parallel_2d::scatter_2d;
use candle_tp::nn::parallel_3d::scatter_3d;
use candle_tp::{
    ColumnParallelLinear, DeviceMesh, Layout3d, Linear2d, Linear3d, Mlp, Mlp2d, Mlp3d,
    ProcessGroup, ReduceOp, RowParallelLinear,
};
use clap::Parser;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(about = "MLP forward+backward in 1D, 2D and 3D tensor parallelism: memory and bytes")]
struct Args {
    /// Batch size (split over q in 2D, over q² in 3D).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Sequence length (never split).
    #[arg(long, default_value_t = 16)]
    seq_len: usize,
    /// Hidden size d (the MLP's inner layer has 4d units).
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Seed of the weights and inputs (the same on every rank).
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

fn seeded(shape: &[usize], seed: u64, scale: f32) -> Result<Tensor> {
    Ok(candle_tp::rng::seeded_uniform(
        shape,
        seed,
        scale,
        &Device::Cpu,
    )?)
}

fn max_err(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

fn bytes(ts: &[&Tensor]) -> usize {
    ts.iter()
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum()
}

fn grad(g: &GradStore, v: &Var) -> Result<Tensor> {
    g.get(v)
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("missing gradient"))
}

/// The dense problem, on every rank: weights `[out, in]`, input, probe and the gradients.
struct Dense {
    x: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    probe: Tensor,
    out: Tensor,
    /// Gradients of x, w1, b1, w2, b2.
    grads: Vec<Tensor>,
    act_bytes: usize,
    param_bytes: usize,
}

fn dense(a: &Args) -> Result<Dense> {
    let (d, h, s) = (a.hidden, 4 * a.hidden, a.seed);
    let x = seeded(&[a.batch, a.seq_len, d], s, 1.0)?;
    let w1 = seeded(&[h, d], s + 1, 1.0 / (d as f32).sqrt())?;
    let b1 = seeded(&[h], s + 2, 0.1)?;
    let w2 = seeded(&[d, h], s + 3, 1.0 / (h as f32).sqrt())?;
    let b2 = seeded(&[d], s + 4, 0.1)?;
    let probe = seeded(&[a.batch, a.seq_len, d], s + 5, 1.0)?;
    let v: Vec<Var> = [&x, &w1, &b1, &w2, &b2]
        .into_iter()
        .map(Var::from_tensor)
        .collect::<candle_core::Result<_>>()?;
    let t = |i: usize| v[i].as_tensor().clone();
    let pre = Linear::new(t(1), Some(t(2))).forward(&t(0))?;
    let post = Activation::Gelu.forward(&pre)?;
    let out = Linear::new(t(3), Some(t(4))).forward(&post)?;
    let g = (&out * &probe)?.sum_all()?.backward()?;
    let grads = v.iter().map(|v| grad(&g, v)).collect::<Result<_>>()?;
    Ok(Dense {
        act_bytes: bytes(&[&x, &pre, &post, &out]),
        param_bytes: bytes(&[&w1, &b1, &w2, &b2]),
        x,
        w1,
        b1,
        w2,
        b2,
        probe,
        out,
        grads,
    })
}

/// A parallel MLP: its output and the element count of this rank's hidden activation.
type ForwardFn<'a> = dyn Fn(&[Tensor]) -> candle_core::Result<(Tensor, usize)> + 'a;

/// What one mode measured on this rank.
struct Measured {
    param_bytes: usize,
    act_bytes: usize,
    fwd: OpStats,
    bwd: OpStats,
    err_out: f32,
    err_grads: f32,
}

/// The parallel run shared by every mode: `params` are the local parameters (x first),
/// `forward` the parallel MLP (its output and the elements of this rank's hidden activation,
/// held twice: before and after GELU), `slice` cuts a dense tensor the way each local one is laid
/// out (index as in `params`, 5 = the output), `stats` the counters of every group involved.
fn measure(
    params: Vec<Tensor>,
    forward: &ForwardFn<'_>,
    slice: &dyn Fn(usize, &Tensor) -> candle_core::Result<Tensor>,
    stats: &dyn Fn() -> CommStats,
    d: &Dense,
) -> Result<Measured> {
    let vars: Vec<Var> = params
        .iter()
        .map(Var::from_tensor)
        .collect::<candle_core::Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let s0 = stats();
    let (out, hidden) = forward(&ts)?;
    let s1 = stats();
    let g = (&out * &slice(5, &d.probe)?)?.sum_all()?.backward()?;
    let s2 = stats();
    let mut err_grads = 0f32;
    for (i, v) in vars.iter().enumerate() {
        err_grads = err_grads.max(max_err(&grad(&g, v)?, &slice(i, &d.grads[i])?)?);
    }
    Ok(Measured {
        param_bytes: bytes(&ts[1..].iter().collect::<Vec<_>>()),
        act_bytes: bytes(&[&ts[0], &out]) + 2 * hidden * out.dtype().size_in_bytes(),
        fwd: s1.since(&s0).total(),
        bwd: s2.since(&s1).total(),
        err_out: max_err(&out, &slice(5, &d.out)?)?,
        err_grads,
    })
}

fn run_1d(pg: &ProcessGroup, d: &Dense) -> Result<Measured> {
    let c = ColumnParallelLinear::from_dense(&d.w1, Some(&d.b1), pg.clone())?;
    let r = RowParallelLinear::from_dense(&d.w2, Some(&d.b2), pg.clone())?;
    let (part, inp) = (*c.out_partition(), d.w1.dims()[1]);
    let params = vec![
        d.x.clone(),
        c.weight()?.clone(),
        c.bias().cloned().unwrap_or(d.b1.clone()),
        r.weight()?.clone(),
        r.bias().cloned().unwrap_or(d.b2.clone()),
    ];
    let pg2 = pg.clone();
    let forward = move |t: &[Tensor]| {
        let fc1 =
            ColumnParallelLinear::new(t[1].clone(), Some(t[2].clone()), inp, part, pg2.clone())?;
        let fc2 = RowParallelLinear::new(t[3].clone(), Some(t[4].clone()), part, inp, pg2.clone())?;
        // fc1's local product (no communication) only for the hidden activation's size.
        let hidden = fc1.forward_local(&t[0])?.elem_count();
        Ok((Mlp::new(fc1, fc2, Activation::Gelu).forward(&t[0])?, hidden))
    };
    let rk = pg.rank();
    let slice = move |i: usize, t: &Tensor| -> candle_core::Result<Tensor> {
        let rg = part.range(rk);
        match i {
            1 | 2 => t.narrow(0, rg.start, rg.len()),
            3 => t.narrow(1, rg.start, rg.len()),
            _ => Ok(t.clone()),
        }
    };
    measure(params, &forward, &slice, &|| pg.stats(), d)
}

fn run_2d(mesh: &DeviceMesh, d: &Dense) -> Result<Measured> {
    let fc1 = Linear2d::from_dense(&d.w1, Some(&d.b1), mesh)?;
    let fc2 = Linear2d::from_dense(&d.w2, Some(&d.b2), mesh)?;
    let params = vec![
        scatter_2d(&d.x, mesh)?,
        fc1.weight().clone(),
        fc1.bias().cloned().unwrap_or(d.b1.clone()),
        fc2.weight().clone(),
        fc2.bias().cloned().unwrap_or(d.b2.clone()),
    ];
    let (dd, h) = (fc1.in_features(), fc1.out_features());
    let forward = |t: &[Tensor]| {
        let fc1 = Linear2d::new(t[1].clone(), Some(t[2].clone()), dd, h, mesh)?;
        let fc2 = Linear2d::new(t[3].clone(), Some(t[4].clone()), h, dd, mesh)?;
        let q = mesh.dims()[0];
        let hidden = t[0].elem_count() / (dd / q) * (h / q);
        Ok((
            Mlp2d::new(fc1, fc2, Activation::Gelu)?.forward(&t[0])?,
            hidden,
        ))
    };
    // The layers' own from_dense cut the dense gradients like the parameters.
    let slice = |i: usize, t: &Tensor| -> candle_core::Result<Tensor> {
        match i {
            1 => Ok(Linear2d::from_dense(t, None, mesh)?.weight().clone()),
            3 => Ok(Linear2d::from_dense(t, None, mesh)?.weight().clone()),
            2 => Ok(Linear2d::from_dense(&d.w1, Some(t), mesh)?
                .bias()
                .cloned()
                .unwrap_or(t.clone())),
            4 => Ok(Linear2d::from_dense(&d.w2, Some(t), mesh)?
                .bias()
                .cloned()
                .unwrap_or(t.clone())),
            _ => scatter_2d(t, mesh),
        }
    };
    measure(params, &forward, &slice, &|| mesh.stats(), d)
}

fn run_3d(mesh: &DeviceMesh, d: &Dense) -> Result<Measured> {
    let (l, m) = (Layout3d::JK, Layout3d::KJ);
    let fc1 = Linear3d::from_dense(&d.w1, Some(&d.b1), l, mesh)?;
    let fc2 = Linear3d::from_dense(&d.w2, Some(&d.b2), m, mesh)?;
    let params = vec![
        scatter_3d(&d.x, l, mesh)?,
        fc1.weight().clone(),
        fc1.bias().cloned().unwrap_or(d.b1.clone()),
        fc2.weight().clone(),
        fc2.bias().cloned().unwrap_or(d.b2.clone()),
    ];
    let (dd, h) = (fc1.in_features(), fc1.out_features());
    let forward = |t: &[Tensor]| {
        let fc1 = Linear3d::new(t[1].clone(), Some(t[2].clone()), dd, h, l, mesh)?;
        let fc2 = Linear3d::new(t[3].clone(), Some(t[4].clone()), h, dd, m, mesh)?;
        let q = mesh.dims()[0];
        let hidden = t[0].elem_count() / (dd / q) * (h / q);
        Ok((
            Mlp3d::new(fc1, fc2, Activation::Gelu)?.forward(&t[0])?,
            hidden,
        ))
    };
    let slice = |i: usize, t: &Tensor| -> candle_core::Result<Tensor> {
        match i {
            1 => Ok(Linear3d::from_dense(t, None, l, mesh)?.weight().clone()),
            3 => Ok(Linear3d::from_dense(t, None, m, mesh)?.weight().clone()),
            2 => Ok(Linear3d::from_dense(&d.w1, Some(t), l, mesh)?
                .bias()
                .cloned()
                .unwrap_or(t.clone())),
            4 => Ok(Linear3d::from_dense(&d.w2, Some(t), m, mesh)?
                .bias()
                .cloned()
                .unwrap_or(t.clone())),
            // The MLP's output is back in the input's layout.
            _ => scatter_3d(t, l, mesh),
        }
    };
    measure(params, &forward, &slice, &|| mesh.stats(), d)
}

/// The seeds' predictions for one mode: (parameter bytes, activation bytes, forward bytes,
/// backward bytes) per rank, and the O() factors as text.
struct Predicted {
    param_bytes: f64,
    act_bytes: f64,
    fwd_bytes: f64,
    bwd_bytes: f64,
    forms: &'static str,
}

fn predict(mode: &str, p: usize, a: &Args, d: &Dense) -> Predicted {
    let f = 4.0; // bytes per f32
    let (m, k, n) = (
        (a.batch * a.seq_len) as f64,
        a.hidden as f64,
        4.0 * a.hidden as f64,
    );
    let (pf, q) = (
        p as f64,
        (p as f64)
            .powf(if mode == "2d" { 0.5 } else { 1.0 / 3.0 })
            .round(),
    );
    let (params, acts) = (d.param_bytes as f64, d.act_bytes as f64);
    // Per linear layer X [m, k] W [k, n] Y [m, n], fc1 then fc2 (k and n exchanged).
    let (x, w, y) = (m * k * f, k * n * f, m * n * f);
    match mode {
        "1d" => Predicted {
            param_bytes: params / pf,
            act_bytes: acts,
            // One ring all-reduce of [m, k] each way: 2(P-1)/P of it per rank.
            fwd_bytes: 2.0 * (pf - 1.0) / pf * x,
            bwd_bytes: 2.0 * (pf - 1.0) / pf * x,
            forms: "params O(1/P), activations not partitioned, ring all-reduce 2(P-1)/P",
        },
        "2d" => Predicted {
            param_bytes: params / (q * q),
            act_bytes: acts / (q * q),
            // Each layer (fc1: X = x, W = w; fc2: X = y, W = w): q-1 foreign blocks of X and
            // of W (1/q² each) forward, twice that backward (broadcast + reduce for dX and for
            // dW): 3(q-1)/q² (|X| + |W|), i.e. 6(q-1)/q in units of a 1/q share when
            // |X| = |W|.
            fwd_bytes: (q - 1.0) / (q * q) * (x + w + y + w),
            bwd_bytes: 2.0 * (q - 1.0) / (q * q) * (x + w + y + w),
            forms: "compute, params, activations O(1/q^2), bandwidth 6(q-1)/q (Colossal-AI)",
        },
        _ => Predicted {
            param_bytes: params / (q * q * q),
            act_bytes: acts / (q * q * q),
            // Each of 2 layers: all-gather X and W, reduce-scatter Y ((q-1)/q³ of each)
            // forward, the same volume backward.
            fwd_bytes: (q - 1.0) / (q * q * q) * 2.0 * (x + w + y),
            bwd_bytes: (q - 1.0) / (q * q * q) * 2.0 * (x + w + y),
            forms: "compute, params, activations O(1/q^3)",
        },
    }
}

fn fits(mode: &str, p: usize) -> Option<usize> {
    let (root, pow) = match mode {
        "1d" => return Some(p),
        "2d" => (((p as f64).sqrt().round()) as usize, 2),
        _ => (((p as f64).cbrt().round()) as usize, 3),
    };
    (root.pow(pow) == p).then_some(root)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let pg = candle_tp::init_from_env(&Device::Cpu)?;
    let (rank, world) = (pg.rank(), pg.size());
    let d = dense(&args)?;
    let mut modes = Vec::new();
    for mode in ["1d", "2d", "3d"] {
        let Some(q) = fits(mode, world) else {
            let need = if mode == "2d" {
                "a square (q x q)"
            } else {
                "a cube (q x q x q)"
            };
            println!("{mode}: skipped, world size {world} is not {need}");
            modes.push(
                json!({"mode": mode, "skipped": format!("world size {world} is not {need}")}),
            );
            continue;
        };
        // Every rank takes the same branch: a size error is the same on all of them.
        let res = match mode {
            "1d" => run_1d(&pg, &d),
            "2d" => DeviceMesh::grid_2d(&pg)
                .map_err(anyhow::Error::from)
                .and_then(|mesh| run_2d(&mesh, &d)),
            _ => DeviceMesh::cube_3d(&pg)
                .map_err(anyhow::Error::from)
                .and_then(|mesh| run_3d(&mesh, &d)),
        };
        let m = match res {
            Ok(m) => m,
            Err(e) if e.to_string().contains("must be a positive multiple") => {
                println!("{mode}: skipped, {e}");
                modes.push(json!({"mode": mode, "skipped": e.to_string()}));
                continue;
            }
            Err(e) => return Err(e),
        };
        let p = predict(mode, world, &args, &d);
        println!(
            "rank {rank} {mode} (q = {q}): {:<12} {:>14} {:>14}",
            "", "measured", "predicted"
        );
        let kib = |b: f64| format!("{:.1} KiB", b / 1024.0);
        for (what, meas, pred) in [
            ("params", m.param_bytes as f64, p.param_bytes),
            ("activations", m.act_bytes as f64, p.act_bytes),
            ("fwd recv", m.fwd.received_bytes as f64, p.fwd_bytes),
            ("fwd sent", m.fwd.sent_bytes as f64, f64::NAN),
            ("bwd recv", m.bwd.received_bytes as f64, p.bwd_bytes),
            ("bwd sent", m.bwd.sent_bytes as f64, f64::NAN),
        ] {
            let pred = if pred.is_nan() { "-".into() } else { kib(pred) };
            println!(
                "rank {rank} {mode}   {what:<12} {:>14} {:>14}",
                kib(meas),
                pred
            );
        }
        println!(
            "rank {rank} {mode}   calls fwd {} bwd {}; formulas: {}; max error out {:.2e} grads {:.2e}",
            m.fwd.calls, m.bwd.calls, p.forms, m.err_out, m.err_grads
        );
        // The largest figures over all ranks (received bytes differ between roots and others).
        let mut v = [
            m.param_bytes as f64,
            m.act_bytes as f64,
            m.fwd.received_bytes as f64,
            m.fwd.sent_bytes as f64,
            m.bwd.received_bytes as f64,
            m.bwd.sent_bytes as f64,
            m.err_out as f64,
            m.err_grads as f64,
        ];
        pg.all_reduce_slice(&mut v, ReduceOp::Max)?;
        modes.push(json!({
            "mode": mode, "q": q,
            "measured_max_over_ranks": {
                "param_bytes": v[0], "activation_bytes": v[1],
                "fwd_received_bytes": v[2], "fwd_sent_bytes": v[3],
                "bwd_received_bytes": v[4], "bwd_sent_bytes": v[5],
            },
            "predicted": {
                "param_bytes": p.param_bytes, "activation_bytes": p.act_bytes,
                "fwd_bytes": p.fwd_bytes, "bwd_bytes": p.bwd_bytes, "forms": p.forms,
            },
            "max_abs_err_out": v[6], "max_abs_err_grads": v[7],
        }));
    }
    if rank == 0 {
        let out: Value = json!({
            "world_size": world, "batch": args.batch, "seq_len": args.seq_len,
            "hidden": args.hidden, "dense_param_bytes": d.param_bytes,
            "dense_activation_bytes": d.act_bytes, "modes": modes,
        });
        println!("{out}");
    }
    Ok(())
}
