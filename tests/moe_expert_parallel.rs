//! Expert parallelism (issue 45, item 2 in part): `SparseMoe::load_expert_parallel` on 1-4
//! ranks against the MoE computed here by hand from the same weights (softmax over the
//! router's logits, top-k, renormalised, each expert's `down(silu(gate x) ⊙ up x)`), for the
//! replicated forward and for each rank's own tokens, and its gradients against those of the
//! layer on one rank with every expert.

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::Activation;
use candle_tp::comm::{run_threads, ProcessGroup, ReduceOp};
use candle_tp::nn::{MoeConfig, SparseMoe};
use candle_tp::ShardedVarBuilder;

const HIDDEN: usize = 8;
const INTER: usize = 12;
const EXPERTS: usize = 6;
/// The router's weight.
const ROUTER: &str = "gate.weight";

fn config() -> MoeConfig {
    MoeConfig {
        hidden_size: HIDDEN,
        intermediate_size: INTER,
        num_experts: EXPERTS,
        num_experts_per_tok: 2,
        norm_topk_prob: true,
        act: Activation::Silu,
        router: "gate".into(),
        expert_names: ["w1".into(), "w3".into(), "w2".into()],
    }
}

fn values(n: usize, seed: usize, scale: f64) -> Vec<f64> {
    (0..n)
        .map(|i| ((i * 7919 + seed * 104_729) % 1009) as f64 / 1009.0 * 2.0 - 1.0)
        .map(|v| v * scale)
        .collect()
}

/// The layer's weights, the same on every rank.
fn weights() -> HashMap<String, Tensor> {
    let t = |shape: (usize, usize), seed| {
        Tensor::from_vec(values(shape.0 * shape.1, seed, 0.5), shape, &Device::Cpu).unwrap()
    };
    let mut w = HashMap::new();
    w.insert("gate.weight".to_string(), t((EXPERTS, HIDDEN), 1));
    for e in 0..EXPERTS {
        w.insert(format!("experts.{e}.w1.weight"), t((INTER, HIDDEN), 10 + e));
        w.insert(format!("experts.{e}.w3.weight"), t((INTER, HIDDEN), 20 + e));
        w.insert(format!("experts.{e}.w2.weight"), t((HIDDEN, INTER), 30 + e));
    }
    w
}

fn tokens(n: usize, seed: usize) -> Tensor {
    Tensor::from_vec(values(n * HIDDEN, seed, 1.0), (n, HIDDEN), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
}

/// The MoE by hand, in f64, one token at a time.
fn by_hand(w: &HashMap<String, Tensor>, x: &Tensor) -> Vec<Vec<f64>> {
    let m = |name: &str| {
        w[name]
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec2::<f64>()
            .unwrap()
    };
    let mv = |a: &[Vec<f64>], v: &[f64]| -> Vec<f64> {
        a.iter()
            .map(|r| r.iter().zip(v).map(|(p, q)| p * q).sum())
            .collect()
    };
    let router = m("gate.weight");
    let xs = x.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
    xs.iter()
        .map(|t| {
            let logits = mv(&router, t);
            let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            let p: Vec<f64> = e.iter().map(|v| v / sum).collect();
            let mut order: Vec<usize> = (0..EXPERTS).collect();
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
            let top = &order[..2];
            let norm: f64 = top.iter().map(|&i| p[i]).sum();
            let mut out = vec![0.0; HIDDEN];
            for &i in top {
                let g = mv(&m(&format!("experts.{i}.w1.weight")), t);
                let u = mv(&m(&format!("experts.{i}.w3.weight")), t);
                let h: Vec<f64> = g
                    .iter()
                    .zip(&u)
                    .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                let y = mv(&m(&format!("experts.{i}.w2.weight")), &h);
                for (o, v) in out.iter_mut().zip(y) {
                    *o += p[i] / norm * v;
                }
            }
            out
        })
        .collect()
}

fn layer(pg: &ProcessGroup, expert_parallel: bool) -> Result<SparseMoe> {
    let vb = ShardedVarBuilder::from_tensors(weights(), DType::F32, &Device::Cpu, pg.clone());
    if expert_parallel {
        SparseMoe::load_expert_parallel(&config(), vb, pg.clone())
    } else {
        SparseMoe::load(&config(), vb)
    }
}

fn assert_close(got: &Tensor, want: &[Vec<f64>], what: &str) {
    let got = got.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
    assert_eq!(got.len(), want.len(), "{what}: rows");
    for (r, (g, w)) in got.iter().zip(want).enumerate() {
        for (a, b) in g.iter().zip(w) {
            assert!(a.is_finite() && b.is_finite(), "{what}: row {r}: {a} {b}");
            assert!((a - b).abs() <= 1e-5, "{what}: row {r}: {a} against {b}");
        }
    }
}

#[test]
fn replicated_tokens_give_the_moe_on_every_rank() {
    let w = weights();
    for p in 1..=4 {
        for n in [1usize, 3, 7] {
            let x = tokens(n, n);
            let want = by_hand(&w, &x);
            let outs = run_threads(p, |pg| {
                let moe = layer(&pg, true)?;
                // Rank r holds experts Partition(6, p).range(r), whole.
                let owners = moe.expert_owners().expect("expert-parallel");
                assert_eq!(moe.experts().len(), owners.size(pg.rank()));
                moe.forward(&x)
            })
            .unwrap();
            for (r, y) in outs.iter().enumerate() {
                assert_close(y, &want, &format!("{p} ranks, {n} tokens, rank {r}"));
            }
        }
    }
}

#[test]
fn each_ranks_own_tokens_go_to_their_experts_and_back() {
    let w = weights();
    for p in [2usize, 3, 4] {
        let outs = run_threads(p, |pg| {
            // Rank r has r + 1 tokens, but rank 1 has none.
            let n = if pg.rank() == 1 { 0 } else { pg.rank() + 1 };
            let x = tokens(n, 100 + pg.rank());
            let moe = layer(&pg, true)?;
            Ok((x.clone(), moe.forward_local(&x)?))
        })
        .unwrap();
        for (r, (x, y)) in outs.iter().enumerate() {
            assert_eq!(y.dims(), x.dims(), "{p} ranks, rank {r}");
            if x.dim(0).unwrap() > 0 {
                assert_close(y, &by_hand(&w, x), &format!("{p} ranks, rank {r}"));
            }
        }
    }
}

/// Gradients of `sum(c ⊙ y)` with respect to the input and to every expert weight a rank
/// holds, from a layer whose weights are variables.
fn gradients(
    pg: &ProcessGroup,
    expert_parallel: bool,
    x: &Tensor,
) -> Result<(Tensor, HashMap<String, Tensor>)> {
    let ep = if expert_parallel {
        Some(ProcessGroup::single())
    } else {
        None
    };
    gradients_of(pg, ep, x)
}

/// [`gradients`] of the layer loaded tensor-parallel (`expert_tp` `None`) or expert-parallel
/// with each expert split over `expert_tp` (this rank's run of consecutive ranks).
fn gradients_of(
    pg: &ProcessGroup,
    expert_tp: Option<ProcessGroup>,
    x: &Tensor,
) -> Result<(Tensor, HashMap<String, Tensor>)> {
    // The weights as variables, read through the loader: its reads of them are differentiable.
    let mut vars = HashMap::new();
    for (name, t) in weights() {
        vars.insert(name, Var::from_tensor(&t.to_dtype(DType::F64)?)?);
    }
    let map = vars
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    let vb = ShardedVarBuilder::from_tensors(map, DType::F64, &Device::Cpu, pg.clone());
    let moe = match expert_tp {
        Some(etp) => SparseMoe::load_expert_tensor_parallel(&config(), vb, pg.clone(), etp)?,
        None => SparseMoe::load(&config(), vb)?,
    };
    let xv = Var::from_tensor(x)?;
    let y = moe.forward(xv.as_tensor())?;
    let c = Tensor::from_vec(values(y.elem_count(), 7, 1.0), y.dims(), &Device::Cpu)?;
    let grads = (y * c)?.sum_all()?.backward()?;
    let mut out = HashMap::new();
    for (name, var) in &vars {
        if let Some(g) = grads.get(var.as_tensor()) {
            out.insert(name.clone(), g.clone());
        }
    }
    Ok((
        grads.get(xv.as_tensor()).expect("input gradient").clone(),
        out,
    ))
}

#[test]
fn gradients_equal_the_layer_on_one_rank() {
    let x = tokens(5, 3).to_dtype(DType::F64).unwrap();
    let (gx, gw) = gradients(&ProcessGroup::single(), false, &x).unwrap();
    // The routing weights are differentiable: the router is trained too.
    assert!(
        gw.contains_key(ROUTER),
        "no router gradient: {:?}",
        gw.keys()
    );
    let max_diff = |a: &Tensor, b: &Tensor| -> f64 {
        let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
        let v = d.to_vec1::<f64>().unwrap();
        assert!(v.iter().all(|x| x.is_finite()));
        v.into_iter().fold(0.0, f64::max)
    };
    for p in [2usize, 3, 4] {
        let got = run_threads(p, |pg| {
            let (gx, mut gw) = gradients(&pg, true, &x)?;
            // Each rank's router gradient is the part through its own experts: summed over
            // the group, as the trainer sums it.
            let router = gw.get_mut(ROUTER).expect("router gradient");
            *router = pg.all_reduce(router, ReduceOp::Sum)?;
            // Every expert's weights have their gradient on exactly one rank.
            let names: Vec<String> = gw.keys().cloned().collect();
            let mut held = Tensor::new(
                &[names.iter().filter(|n| n.starts_with("experts")).count() as f64],
                &Device::Cpu,
            )?;
            held = pg.all_reduce(&held, ReduceOp::Sum)?;
            Ok((gx, gw, held.to_vec1::<f64>()?[0]))
        })
        .unwrap();
        for (r, (gx_r, gw_r, held)) in got.iter().enumerate() {
            assert_eq!(
                *held as usize,
                3 * EXPERTS,
                "{p} ranks: expert weights with a gradient"
            );
            let d = max_diff(gx_r, &gx);
            assert!(
                d <= 1e-10,
                "{p} ranks, rank {r}: input gradient differs by {d}"
            );
            for (name, g) in gw_r {
                let d = max_diff(g, &gw[name]);
                assert!(
                    d <= 1e-10,
                    "{p} ranks, rank {r}: {name} gradient differs by {d}"
                );
            }
        }
    }
}

#[test]
fn more_ranks_than_experts_is_an_error_naming_both() {
    let errs = run_threads(2, |pg| {
        let mut cfg = config();
        cfg.num_experts = 1;
        cfg.num_experts_per_tok = 1;
        let vb = ShardedVarBuilder::from_tensors(weights(), DType::F32, &Device::Cpu, pg.clone());
        Ok(SparseMoe::load_expert_parallel(&cfg, vb, pg.clone())
            .expect_err("1 expert on 2 ranks")
            .to_string())
    })
    .unwrap();
    assert!(
        errs[0].contains("1 experts over 2 expert-parallel groups (1 ranks each)"),
        "{}",
        errs[0]
    );
}

/// Expert-tensor parallelism (ep groups of consecutive ranks, each expert split column/row
/// over its group): the forward equals the MoE by hand, every rank's input gradient equals
/// the one-rank layer's, and each expert weight's gradient slices (and each rank's part of
/// the router's gradient), summed over the ranks,
/// give the one-rank gradient (the slices are disjoint).
#[test]
fn expert_tensor_parallel_matches_the_layer_on_one_rank() {
    let x = tokens(5, 3).to_dtype(DType::F64).unwrap();
    let want = by_hand(&weights(), &tokens(5, 3));
    let (gx, gw) = gradients(&ProcessGroup::single(), false, &x).unwrap();
    for (p, tp) in [(4usize, 2usize), (6, 2), (6, 3)] {
        let got = run_threads(p, |pg| {
            let r = pg.rank();
            let run: Vec<usize> = (r - r % tp..r - r % tp + tp).collect();
            let etp = pg.new_group(&run)?.expect("a member of its run");
            let vb =
                ShardedVarBuilder::from_tensors(weights(), DType::F32, &Device::Cpu, pg.clone());
            let moe =
                SparseMoe::load_expert_tensor_parallel(&config(), vb, pg.clone(), etp.clone())?;
            assert_eq!(moe.expert_tp(), tp);
            assert_eq!(moe.ep_rank(), r / tp);
            let y = moe.forward(&tokens(5, 3))?;
            let (gx, gw) = gradients_of(&pg, Some(etp), &x)?;
            // Each weight's gradient summed over the ranks (zeros where a rank holds none), in
            // the same order on every rank.
            let mut summed = HashMap::new();
            let mut names: Vec<String> = weights().into_keys().collect();
            names.sort();
            for name in names
                .iter()
                .filter(|n| n.starts_with("experts") || *n == ROUTER)
            {
                let g = match gw.get(name) {
                    Some(g) => g.clone(),
                    None => weights()[name.as_str()]
                        .to_dtype(DType::F64)?
                        .zeros_like()?,
                };
                summed.insert(name.clone(), pg.all_reduce(&g, ReduceOp::Sum)?);
            }
            Ok((y, gx, summed))
        })
        .unwrap();
        for (r, (y, gx_r, summed)) in got.iter().enumerate() {
            let at = format!("{p} ranks in runs of {tp}, rank {r}");
            assert_close(y, &want, &at);
            let d = (gx_r - &gx).unwrap().abs().unwrap().max_all().unwrap();
            let d = d.to_scalar::<f64>().unwrap();
            assert!(
                d.is_finite() && d <= 1e-10,
                "{at}: input gradient differs by {d}"
            );
            assert_eq!(summed.len(), 3 * EXPERTS + 1, "{at}");
            for (name, g) in summed {
                let v = (g - &gw[name])
                    .unwrap()
                    .abs()
                    .unwrap()
                    .flatten_all()
                    .unwrap();
                let v = v.to_vec1::<f64>().unwrap();
                assert!(
                    v.iter().all(|d| d.is_finite() && *d <= 1e-10),
                    "{at}: {name} gradient differs by up to {:?}",
                    v.iter().cloned().fold(0.0, f64::max)
                );
            }
        }
    }
}
