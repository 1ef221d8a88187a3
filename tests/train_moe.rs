//! Training a Mixtral-style model (sparse MoE layers) with tensor and expert parallelism
//! against one process (issue 45: "EP training through autograd, with the gradients checked
//! against the dense layer"):
//!
//! - every parameter's gradient, routers included, at TP = 2 and 3 with each expert split
//!   column/row and with whole experts per rank (5 experts: 3 + 2, 2 + 2 + 1), at TP = 4 in 2
//!   expert groups of 2 ranks (`--ep 2`: 3 + 2 experts, each split in two), with and without
//!   sequence parallelism, and DP = 2 × EP = 2;
//! - the router's gradient against finite differences of the loss (the routing weights are
//!   differentiable, as in Hugging Face's `MixtralSparseMoeBlock`);
//! - a checkpoint saved at EP = 2 is a Mixtral checkpoint: candle-transformers' `mixtral`
//!   and the crate's inference model read it and give the trained model's logits;
//! - bad layouts are errors that name the sizes.
mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};
use candle_tp::models::CausalLm;
use candle_tp::train::{vocab_parallel_cross_entropy, Dropout, TrainConfig, TrainInit, TrainLlama};
use candle_tp::{run_threads, DeviceMesh, ReduceOp};
use common::max_abs_diff;
use common::train::{batch, cfg, compare, grads, reference, Layout};

const EXPERTS: usize = 5;

/// [`cfg`] with 5 experts of width 12 and top-2 routing in each of its 2 layers, and a
/// load-balancing loss weighed 0.1 (large enough that its gradient counts in the checks).
fn moe_cfg() -> TrainConfig {
    TrainConfig {
        intermediate_size: 12,
        num_local_experts: EXPERTS,
        num_experts_per_tok: 2,
        router_aux_loss_coef: 0.1,
        ..cfg(false)
    }
}

/// Sequence parallelism or not; whole experts on each rank, or every expert split.
/// [`moe_cfg`] that 4 ranks can split: width 32, 8 heads and 4 KV heads of 4.
fn moe_cfg4() -> TrainConfig {
    TrainConfig {
        hidden_size: 32,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        ..moe_cfg()
    }
}

fn layout(sp: bool, whole: bool) -> Layout {
    Layout {
        sp,
        ep: whole.then_some(0),
    }
}

/// The model of `init` on `pg`, laid out as `layout` (as `examples/train` builds it).
fn load(
    cfg: &TrainConfig,
    init: &TrainInit,
    pg: &candle_tp::ProcessGroup,
    layout: Layout,
) -> Result<TrainLlama> {
    let vb = init
        .var_builder(DType::F32, &Device::Cpu, pg.clone())
        .with_expert_parallel(layout.ep)?;
    TrainLlama::load(cfg, vb, layout.sp)
}

#[test]
fn moe_gradients_equal_one_process_with_experts_split_or_whole() -> Result<()> {
    let cfg = moe_cfg();
    let drop = Dropout {
        seed: 5,
        step: 1,
        hidden: 0.1,
        attention: 0.0,
        first_row: 0,
    };
    let one = reference(&cfg, drop)?;
    // Every expert is used by the batch, so every expert weight has a gradient to compare.
    for (name, g) in &one.1 {
        if name.contains(".experts.") || name.ends_with(".gate.weight") {
            let largest = g.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(largest > 1e-6, "{name}: gradient {largest} (unused?)");
        }
    }
    // TP 2 and 3 with every expert split or whole experts per rank (5 experts: 3 + 2,
    // 2 + 2 + 1); TP 4 in 2 expert groups of 2 ranks below.
    let mut layouts = Vec::new();
    for tp in [2, 3] {
        for sp in [false, true] {
            layouts.push((tp, layout(sp, false)));
            layouts.push((tp, layout(sp, true)));
        }
    }
    check_layouts(&cfg, drop, &one, layouts)?;
    // TP 4 ([`moe_cfg4`]) in 2 expert groups of 2 ranks: 3 + 2 experts, each
    // split in two over its group.
    let cfg4 = moe_cfg4();
    let four = (0..2).map(|i| {
        (
            4,
            Layout {
                sp: i == 1,
                ep: Some(2),
            },
        )
    });
    check_layouts(&cfg4, drop, &reference(&cfg4, drop)?, four.collect())
}

/// [`compare`] of each `(tp, layout)` with one process's `reference`, and each rank's experts
/// those of its expert group.
fn check_layouts(
    cfg: &TrainConfig,
    drop: Dropout,
    reference: &(f32, HashMap<String, Tensor>),
    layouts: Vec<(usize, Layout)>,
) -> Result<()> {
    for (tp, layout) in layouts {
        let got = run_threads(tp, |pg| grads(cfg, &pg, None, layout, drop, 0..4))?;
        if let Some(ep) = layout.ep {
            // Each rank holds only its group's experts (whole, or a slice of each).
            let groups = if ep == 0 { tp } else { ep };
            let experts: Vec<usize> = got
                .iter()
                .map(|(_, g)| {
                    g.iter()
                        .filter(|(n, _, _)| n.ends_with("w1.weight"))
                        .count()
                })
                .collect();
            let per_group = candle_tp::Partition::new(EXPERTS, groups)
                .map_err(candle_core::Error::msg)?
                .sizes();
            let want: Vec<usize> = (0..tp)
                .map(|r| per_group[r / (tp / groups)] * cfg.num_hidden_layers)
                .collect();
            assert_eq!(experts, want, "tp {tp} {layout:?}: experts per rank");
        }
        compare(&format!("tp {tp} {layout:?}"), reference, got)?;
    }
    Ok(())
}

/// Data parallelism: each replica's load-balancing loss is that of its own tokens (as in
/// Megatron-core), not of the whole batch, so the reference is one process run on each
/// replica's half of the batch, the losses and gradients averaged.
#[test]
fn moe_gradients_equal_one_process_dp2_x_ep2() -> Result<()> {
    let cfg = moe_cfg();
    let half = |rows: std::ops::Range<usize>| -> Result<(f32, HashMap<String, Tensor>)> {
        let init = TrainInit::new(42);
        cfg.declare(&init)?;
        let pg = candle_tp::ProcessGroup::single();
        let model = TrainLlama::load(
            &cfg,
            init.var_builder(DType::F32, &Device::Cpu, pg.clone()),
            false,
        )?;
        let (ids, tg) = batch(4, 7);
        let ids = Tensor::from_vec(ids, (4, 7), &Device::Cpu)?.narrow(0, rows.start, rows.len())?;
        let tg = Tensor::from_vec(tg, (4, 7), &Device::Cpu)?
            .narrow(0, rows.start, rows.len())?
            .flatten_all()?;
        let logits = model.forward(&ids, &Dropout::off())?;
        let loss =
            vocab_parallel_cross_entropy(&logits, &tg, model.vocab_partition(), &pg, 0.0, None)?;
        let loss = (loss + model.take_aux_loss().expect("a load-balancing loss"))?;
        let g = loss.backward()?;
        let mut grads = HashMap::new();
        for p in init.params()? {
            // An expert no token of this half chose has no gradient: zeros.
            let t = match g.get(p.var.as_tensor()) {
                Some(t) => t.clone(),
                None => p.var.as_tensor().zeros_like()?,
            };
            grads.insert(p.name, t);
        }
        Ok((loss.to_scalar::<f32>()?, grads))
    };
    let (first, second) = (half(0..2)?, half(2..4)?);
    let mut mean = HashMap::new();
    for (name, a) in first.1 {
        mean.insert(name.clone(), ((a + &second.1[&name])? / 2.0)?);
    }
    let reference = ((first.0 + second.0) / 2.0, mean);
    let got = run_threads(4, |world| {
        let mesh = DeviceMesh::dp_tp(&world, 2)?;
        let (Some(dp), Some(tp)) = (mesh.group_along(0), mesh.group_along(1)) else {
            candle_core::bail!("mesh without dp/tp groups");
        };
        let d = mesh.coord()[0];
        let rows = 2 * d..2 * d + 2;
        let (loss, g) = grads(&cfg, tp, Some(dp), layout(true, true), Dropout::off(), rows)?;
        let l = dp.all_reduce(&Tensor::new(&[loss], &Device::Cpu)?, ReduceOp::Sum)?;
        Ok((l.to_vec1::<f32>()?[0] / dp.size() as f32, g))
    })?;
    compare("dp 2 x ep 2 sp", &reference, got)
}

/// The loss of one process with the weights of seed 42, one router weight moved by `delta`.
fn loss_with_router_moved(cfg: &TrainConfig, at: (usize, usize), delta: f64) -> Result<f64> {
    let init = TrainInit::new(42);
    cfg.declare(&init)?;
    let pg = candle_tp::ProcessGroup::single();
    let model = TrainLlama::load(
        cfg,
        init.var_builder(DType::F64, &Device::Cpu, pg.clone()),
        false,
    )?;
    let router = init.param("model.layers.1.block_sparse_moe.gate.weight")?;
    let mut w = router.var.as_tensor().to_vec2::<f64>()?;
    w[at.0][at.1] += delta;
    router.var.set(&Tensor::new(w, &Device::Cpu)?)?;
    let (ids, tg) = batch(4, 7);
    let ids = Tensor::from_vec(ids, (4, 7), &Device::Cpu)?;
    let tg = Tensor::from_vec(tg, 28, &Device::Cpu)?;
    let logits = model.forward(&ids, &Dropout::off())?;
    let loss = vocab_parallel_cross_entropy(&logits, &tg, model.vocab_partition(), &pg, 0.0, None)?;
    let aux = model.take_aux_loss().expect("a load-balancing loss");
    (loss + aux)?.to_dtype(DType::F64)?.to_scalar::<f64>()
}

/// The routing weights carry the gradient of the softmax, and the load-balancing loss that of
/// the mean probabilities: the router's gradient (from backward) equals central differences
/// of the loss with its load-balancing term (weighed 1 here), which use only forwards.
#[test]
fn router_gradient_equals_finite_differences() -> Result<()> {
    let cfg = TrainConfig {
        router_aux_loss_coef: 1.0,
        ..moe_cfg()
    };
    let init = TrainInit::new(42);
    cfg.declare(&init)?;
    let pg = candle_tp::ProcessGroup::single();
    let model = TrainLlama::load(
        &cfg,
        init.var_builder(DType::F64, &Device::Cpu, pg.clone()),
        false,
    )?;
    let (ids, tg) = batch(4, 7);
    let ids = Tensor::from_vec(ids, (4, 7), &Device::Cpu)?;
    let tg = Tensor::from_vec(tg, 28, &Device::Cpu)?;
    let logits = model.forward(&ids, &Dropout::off())?;
    let loss = vocab_parallel_cross_entropy(&logits, &tg, model.vocab_partition(), &pg, 0.0, None)?;
    let loss = (loss + model.take_aux_loss().expect("a load-balancing loss"))?;
    let router = init.param("model.layers.1.block_sparse_moe.gate.weight")?;
    let grads = loss.backward()?;
    let Some(g) = grads.get(router.var.as_tensor()) else {
        panic!("the router has no gradient");
    };
    let g = g.to_dtype(DType::F64)?.to_vec2::<f64>()?;
    // The routing weights' values are f32's (as in inference, also in an f64 model), so the
    // differences are taken over a step large enough for f32's rounding.
    let eps = 1e-3;
    let mut checked = 0;
    for (e, row) in g.iter().enumerate() {
        for c in [0, 7, 23] {
            let fd = (loss_with_router_moved(&cfg, (e, c), eps)?
                - loss_with_router_moved(&cfg, (e, c), -eps)?)
                / (2.0 * eps);
            let got = row[c];
            assert!(
                got.is_finite() && fd.is_finite(),
                "expert {e} col {c}: {got} vs {fd}"
            );
            let err = (got - fd).abs();
            assert!(
                err <= 2e-3 * fd.abs().max(1e-2),
                "router[{e}][{c}]: backward {got:.6e} vs finite differences {fd:.6e}"
            );
            checked += usize::from(fd.abs() > 1e-3);
        }
    }
    // Not a comparison of zeros: most entries move the loss.
    assert!(checked >= 8, "only {checked} router entries move the loss");
    Ok(())
}

/// With every router weight zero, the probabilities are uniform and the top-2 ties go to
/// experts 0 and 1: each gets half of the choices and mean probability 1/5, so each layer's
/// loss is `5 · 2 · (1/2 · 1/5)` = 1, and the whole `0.1 · 2 layers` = 0.2, at every layout.
#[test]
fn load_balancing_loss_of_a_uniform_router_is_the_number_of_layers() -> Result<()> {
    let cfg = moe_cfg();
    for (tp, sp, ep) in [
        (1, false, false),
        (2, false, true),
        (3, true, true),
        (2, true, false),
    ] {
        let got = run_threads(tp, |pg| {
            let init = TrainInit::new(3);
            cfg.declare(&init)?;
            let model = load(&cfg, &init, &pg, layout(sp, ep))?;
            for l in 0..cfg.num_hidden_layers {
                let router =
                    init.param(&format!("model.layers.{l}.block_sparse_moe.gate.weight"))?;
                router.var.set(&router.var.as_tensor().zeros_like()?)?;
            }
            let (ids, _) = batch(4, 7);
            let ids = Tensor::from_vec(ids, (4, 7), &Device::Cpu)?;
            model.forward(&ids, &Dropout::off())?;
            let aux = model.take_aux_loss().expect("a load-balancing loss");
            assert!(model.take_aux_loss().is_none(), "taken twice");
            aux.to_scalar::<f32>()
        })?;
        for (rank, aux) in got.into_iter().enumerate() {
            assert!(
                (aux - 0.2).abs() <= 1e-6,
                "tp {tp} sp {sp} ep {ep} rank {rank}: load-balancing loss {aux}, want 0.2"
            );
        }
    }
    // Without the coefficient there is none.
    let model_cfg = TrainConfig {
        router_aux_loss_coef: 0.0,
        ..cfg
    };
    let init = TrainInit::new(3);
    model_cfg.declare(&init)?;
    let pg = candle_tp::ProcessGroup::single();
    let model = TrainLlama::load(
        &model_cfg,
        init.var_builder(DType::F32, &Device::Cpu, pg),
        false,
    )?;
    model.forward(
        &Tensor::new(&[[1u32, 2, 3]], &Device::Cpu)?,
        &Dropout::off(),
    )?;
    assert!(model.take_aux_loss().is_none());
    Ok(())
}

#[test]
fn a_checkpoint_trained_expert_parallel_is_a_mixtral_checkpoint() -> Result<()> {
    // Whole experts on each of 2 ranks; and 2 expert groups of 2 ranks each ([`moe_cfg4`]),
    // whose experts' slices are gathered from their group only.
    trained_checkpoint_is_mixtral(&moe_cfg(), 2, layout(false, true))?;
    trained_checkpoint_is_mixtral(
        &moe_cfg4(),
        4,
        Layout {
            sp: false,
            ep: Some(2),
        },
    )
}

/// One optimizer step at `tp` ranks laid out as `layout`, saved: candle-transformers' Mixtral
/// and the crate's inference model read the checkpoint and give the trained model's logits.
fn trained_checkpoint_is_mixtral(cfg: &TrainConfig, tp: usize, layout: Layout) -> Result<()> {
    let dir = tempfile::tempdir().map_err(candle_core::Error::wrap)?;
    let (b, s) = (2, 5);
    let (ids, _) = batch(b, s);
    let ids = Tensor::from_vec(ids[..b * s].to_vec(), (b, s), &Device::Cpu)?;
    let trained = run_threads(tp, |pg| {
        let init = TrainInit::new(9);
        cfg.declare(&init)?;
        let model = load(cfg, &init, &pg, layout)?;
        // One optimizer step so the weights are no longer the initial draw.
        let logits = model.forward(&ids, &Dropout::off())?;
        let loss = vocab_parallel_cross_entropy(
            &logits,
            &ids.flatten_all()?,
            model.vocab_partition(),
            &pg,
            0.0,
            None,
        )?;
        let mut g = loss.backward()?;
        let names = model.partial_gradient_params();
        let params = init.params()?;
        let routers: Vec<_> = params
            .iter()
            .filter(|p| names.contains(&p.name))
            .map(|p| p.var.clone())
            .collect();
        assert_eq!(
            routers.len(),
            cfg.num_hidden_layers,
            "rank {}: routers",
            pg.rank()
        );
        candle_tp::train::all_reduce_grads(&mut g, &routers, &pg, false)?;
        let mut opt = candle_nn::AdamW::new_lr(init.vars()?, 1e-2)?;
        candle_nn::Optimizer::step(&mut opt, &g)?;
        init.save_safetensors_dir(dir.path(), &cfg.hf_config_json(None, None)?, &pg, true)?;
        let l = model.forward(&ids, &Dropout::off())?;
        pg.all_gather(&l, 1)
    })?;
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("config.json"))
            .map_err(candle_core::Error::wrap)?,
    )
    .map_err(candle_core::Error::wrap)?;
    assert_eq!(config["architectures"][0], "MixtralForCausalLM", "{config}");
    assert_eq!(config["num_local_experts"], EXPERTS, "{config}");
    // The last position of each sequence, as the inference models return it.
    let last = Tensor::new(&[(s - 1) as u32, (2 * s - 1) as u32], &Device::Cpu)?;
    let want = trained[0].index_select(&last, 0)?;
    // candle-transformers' Mixtral.
    let mut reference_cfg = config.clone();
    // candle-transformers' own field, not Hugging Face's.
    reference_cfg["use_flash_attn"] = false.into();
    let reference_cfg: candle_transformers::models::mixtral::Config =
        serde_json::from_value(reference_cfg).map_err(candle_core::Error::wrap)?;
    let weights = [dir.path().join("model.safetensors")];
    // SAFETY: the file is this test's own and is not modified while mapped.
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(&weights, DType::F32, &Device::Cpu)?
    };
    let mut reference = candle_transformers::models::mixtral::Model::new(&reference_cfg, vb)?;
    let got = reference.forward(&ids, 0)?.reshape(want.dims())?;
    let d = max_abs_diff(&got, &want)?;
    assert!(
        d <= 1e-4,
        "candle-transformers' mixtral: logits differ by {d}"
    );
    // The crate's inference model (`CausalLm`, Mixtral read from config.json) at worlds 1
    // and 2 (every expert split, KV cache).
    common::train::logits_at_worlds("Mixtral", &[1, 2], &want, 1e-4, |pg| {
        let mut m = CausalLm::from_dir(dir.path(), DType::F32, &Device::Cpu, pg)?;
        m.forward_gathered(&ids, 0)
    })
}

#[test]
fn bad_expert_layouts_are_errors_with_the_sizes() -> Result<()> {
    let dense = cfg(false);
    let out = run_threads(2, |pg| {
        let mut errs = Vec::new();
        for (cfg, ep) in [
            (dense.clone(), Some(0)),
            (
                TrainConfig {
                    num_local_experts: 1,
                    num_experts_per_tok: 1,
                    ..moe_cfg()
                },
                Some(0),
            ),
            (
                TrainConfig {
                    num_experts_per_tok: 6,
                    ..moe_cfg()
                },
                None,
            ),
            (moe_cfg(), Some(3)),
        ] {
            let init = TrainInit::new(1);
            cfg.declare(&init)?;
            errs.push(match load(&cfg, &init, &pg, Layout { sp: false, ep }) {
                Ok(_) => "loaded".to_string(),
                Err(e) => e.to_string(),
            });
        }
        Ok(errs)
    })?;
    for errs in out {
        assert!(
            errs[0].contains("num_local_experts = 0") && errs[0].contains("2 expert groups"),
            "{}",
            errs[0]
        );
        assert!(errs[1].contains("1 experts over 2"), "{}", errs[1]);
        assert!(
            errs[2].contains("num_experts_per_tok 6") && errs[2].contains("num_local_experts 5"),
            "{}",
            errs[2]
        );
        assert!(
            errs[3].contains("3 expert groups do not divide the 2 ranks"),
            "{}",
            errs[3]
        );
    }
    Ok(())
}
