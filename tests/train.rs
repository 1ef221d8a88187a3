//! Training with tensor parallelism against one process: gradients of every parameter of a
//! 2-layer model (TP = 2, 3, with and without sequence parallelism, DP × TP), and a
//! checkpoint saved at TP = 2 loaded at TP = 1 and 3.
mod common;

use candle_core::{DType, Device, Result, Tensor};
use candle_tp::models::llama::Llama;
use candle_tp::models::FromCheckpoint;
use candle_tp::train::{
    all_reduce_grads, vocab_parallel_cross_entropy, Dropout, TrainConfig, TrainInit, TrainLlama,
};
use candle_tp::{run_threads, DeviceMesh, ProcessGroup, ShardedVarBuilder};
use common::max_abs_diff;
use common::train::{batch, cfg, compare, grads, reference, Layout};

fn sp_layout(sp: bool) -> Layout {
    Layout { sp, ep: None }
}

/// Residual dropout with a shared seed: part of the comparisons with one process.
const HIDDEN_DROPOUT: Dropout = Dropout {
    seed: 5,
    step: 1,
    hidden: 0.1,
    attention: 0.0,
    first_row: 0,
};

#[test]
fn gradients_equal_one_process_tp_2_3_with_and_without_sp() -> Result<()> {
    for tie in [false, true] {
        let cfg = cfg(tie);
        // Residual dropout uses a shared seed, so it is part of the comparison.
        let drop = HIDDEN_DROPOUT;
        let reference = reference(&cfg, drop)?;
        for tp in [2, 3] {
            for sp in [false, true] {
                let got = run_threads(tp, |pg| grads(&cfg, &pg, None, sp_layout(sp), drop, 0..4))?;
                compare(&format!("tie {tie} tp {tp} sp {sp}"), &reference, got)?;
            }
        }
    }
    Ok(())
}

#[test]
fn gradients_equal_one_process_dp2_x_tp2() -> Result<()> {
    let cfg = cfg(false);
    // Residual dropout (issue 44, defect 16): each data-parallel rank's masks are those of
    // its rows of the batch (they were the same masks on every rank).
    let drop = HIDDEN_DROPOUT;
    let reference = reference(&cfg, drop)?;
    let got = run_threads(4, |world| {
        let mesh = DeviceMesh::dp_tp(&world, 2)?;
        let (Some(dp), Some(tp)) = (mesh.group_along(0), mesh.group_along(1)) else {
            candle_core::bail!("mesh without dp/tp groups");
        };
        let d = mesh.coord()[0];
        let drop = drop.skip_rows(2 * d);
        let (loss, g) = grads(&cfg, tp, Some(dp), sp_layout(true), drop, 2 * d..2 * d + 2)?;
        // The logged loss is the DP average.
        let l = dp.all_reduce(
            &Tensor::new(&[loss], &Device::Cpu)?,
            candle_tp::ReduceOp::Sum,
        )?;
        let l = l.to_vec1::<f32>()?[0] / dp.size() as f32;
        Ok((l, g))
    })?;
    compare("dp 2 x tp 2 sp", &reference, got)
}

#[test]
fn checkpoint_saved_at_tp2_loads_at_tp1_and_tp3() -> Result<()> {
    let dir = tempfile::tempdir().map_err(candle_core::Error::wrap)?;
    let cfg = cfg(false);
    let (b, s) = (2, 5);
    let (ids, _) = batch(b, s);
    let ids = Tensor::from_vec(ids[..b * s].to_vec(), (b, s), &Device::Cpu)?;
    let full_logits = |model: &TrainLlama, pg: &ProcessGroup| -> Result<Tensor> {
        let l = model.forward(&ids, &Dropout::off())?;
        pg.all_gather(&l, 1)
    };
    let saved = run_threads(2, |pg| {
        let init = TrainInit::new(9);
        cfg.declare(&init)?;
        let model = TrainLlama::load(
            &cfg,
            init.var_builder(DType::F32, &Device::Cpu, pg.clone()),
            true,
        )?;
        // One optimizer step so the weights are no longer the initial draw.
        let logits = model.forward(&ids, &Dropout::off())?;
        let tg = ids.flatten_all()?;
        let loss =
            vocab_parallel_cross_entropy(&logits, &tg, model.vocab_partition(), &pg, 0.0, None)?;
        let mut g = loss.backward()?;
        let params = init.params()?;
        let norms: Vec<_> = params
            .iter()
            .filter(|p| model.sequence_parallel_params().contains(&p.name))
            .map(|p| p.var.clone())
            .collect();
        all_reduce_grads(&mut g, &norms, &pg, false)?;
        let mut opt = candle_nn::AdamW::new_lr(init.vars()?, 1e-2)?;
        candle_nn::Optimizer::step(&mut opt, &g)?;
        init.save_safetensors_dir(dir.path(), &cfg.hf_config_json(None, None)?, &pg, true)?;
        full_logits(&model, &pg)
    })?;
    assert!(
        dir.path().join("model.safetensors").exists() && dir.path().join("config.json").exists()
    );
    let text = std::fs::read_to_string(dir.path().join("config.json"))
        .map_err(candle_core::Error::wrap)?;
    let back: TrainConfig = serde_json::from_str(&text).map_err(candle_core::Error::wrap)?;
    assert_eq!(back, cfg);
    for world in [1, 3] {
        let got = run_threads(world, |pg| {
            let vb = ShardedVarBuilder::from_safetensors_dir(
                dir.path(),
                DType::F32,
                &Device::Cpu,
                pg.clone(),
            )?;
            let model = TrainLlama::load(&cfg, vb, false)?;
            full_logits(&model, &pg)
        })?;
        for (rank, l) in got.iter().enumerate() {
            let d = max_abs_diff(l, &saved[0])?;
            assert!(
                d <= 1e-5,
                "world {world} rank {rank}: logits differ by {d} from the TP = 2 model"
            );
        }
        // The inference model (models::Llama: KV cache, its own RoPE and RMSNorm) reads the
        // same checkpoint: last-position logits.
        let last = Tensor::new(&[(s - 1) as u32, (2 * s - 1) as u32], &Device::Cpu)?;
        let want = saved[0].index_select(&last, 0)?;
        common::train::logits_at_worlds("Llama", &[world], &want, 1e-4, |pg| {
            let mut m = Llama::from_dir(dir.path(), DType::F32, &Device::Cpu, pg)?;
            m.forward_gathered(&ids, 0)
        })?;
    }
    Ok(())
}

#[test]
fn too_many_ranks_for_kv_heads_is_an_error() -> Result<()> {
    let cfg = cfg(false);
    let out = run_threads(4, |pg| {
        let init = TrainInit::new(1);
        cfg.declare(&init)?;
        Ok(
            TrainLlama::load(&cfg, init.var_builder(DType::F32, &Device::Cpu, pg), false)
                .err()
                .map(|e| e.to_string()),
        )
    })?;
    for e in out {
        assert!(e.is_some_and(|e| e.contains("exceeds num_key_value_heads 3")));
    }
    Ok(())
}

/// Attention with more ranks than KV heads replicates KV heads; a backward through them would
/// give each rank a partial gradient. With trainable weights the forward refuses with the
/// sizes (on every rank, so no rank waits for another); with plain weights it runs.
#[test]
fn training_through_replicated_kv_heads_is_refused_with_the_sizes() -> Result<()> {
    use candle_tp::{AttentionConfig, ParallelAttention, RotaryEmbedding};
    let cfg = AttentionConfig::new(12, 6, 2, 2, 10000.0, 8);
    let names = [("q_proj", 12), ("k_proj", 4), ("v_proj", 4), ("o_proj", 12)];
    let x = common::seeded(&[1, 3, 12], 9);
    let out = run_threads(3, |pg| {
        let run = |trainable: bool| -> Result<Option<String>> {
            let map = names
                .iter()
                .enumerate()
                .map(|(i, (n, rows))| {
                    let w = common::seeded(&[*rows, 12], i as u64);
                    let w = if trainable {
                        common::var(&w).as_tensor().clone()
                    } else {
                        w
                    };
                    (format!("{n}.weight"), w)
                })
                .collect();
            let vb = ShardedVarBuilder::from_tensors(map, DType::F32, &Device::Cpu, pg.clone());
            let mut attn = ParallelAttention::load(&cfg, vb)?;
            let rope = RotaryEmbedding::new(&cfg, DType::F32, &Device::Cpu)?;
            Ok(attn.forward(&x, 0, &rope).err().map(|e| e.to_string()))
        };
        Ok((run(true)?, run(false)?))
    })?;
    for (rank, (trainable, plain)) in out.into_iter().enumerate() {
        let e =
            trainable.unwrap_or_else(|| panic!("rank {rank}: trainable replicated KV heads ran"));
        assert!(
            e.contains("replicated on several ranks") && e.contains("num_key_value_heads"),
            "rank {rank}: {e}"
        );
        assert!(plain.is_none(), "rank {rank}: inference refused: {plain:?}");
    }
    Ok(())
}

/// The trainer's vocabulary-parallel lookup zeroes foreign ids by selection: an Inf in a
/// rank's local row 0 (a token no sequence uses) must not turn every other rank's rows into
/// NaN through `Inf * 0` and the all-reduce (issue 14, item 8, trainer side).
#[test]
fn an_inf_in_an_unused_embedding_row_leaves_the_loss_finite() -> Result<()> {
    let cfg = cfg(false);
    let out = run_threads(2, |pg| {
        let init = TrainInit::new(42);
        cfg.declare(&init)?;
        let model = TrainLlama::load(
            &cfg,
            init.var_builder(DType::F32, &Device::Cpu, pg.clone()),
            false,
        )?;
        let range = model.vocab_partition().range(pg.rank());
        let emb = init
            .params()?
            .into_iter()
            .find(|p| p.name == "model.embed_tokens.weight")
            .expect("embedding parameter");
        // Row 0 of each rank's shard: global ids 0 and 19 (37 over 2 ranks), neither used.
        let mut rows = emb.var.as_tensor().to_vec2::<f32>()?;
        rows[0][1] = f32::INFINITY;
        emb.var.set(&Tensor::new(rows, &Device::Cpu)?)?;
        let ids: Vec<u32> = (0..14).map(|i| 1 + (i * 5) % 17).collect(); // 1..=17
        assert!(!ids.contains(&(range.start as u32)));
        let ids = Tensor::from_vec(ids, (2, 7), &Device::Cpu)?;
        let tg = Tensor::from_vec((0..14u32).map(|i| 2 + i).collect(), 14, &Device::Cpu)?;
        let logits = model.forward(&ids, &Dropout::off())?;
        common::assert_finite("logits", &logits)?;
        let loss =
            vocab_parallel_cross_entropy(&logits, &tg, model.vocab_partition(), &pg, 0.0, None)?;
        common::assert_finite("loss", &loss)?;
        Ok(range.start)
    })?;
    assert_eq!(out, vec![0, 19]);
    Ok(())
}
