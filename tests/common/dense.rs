//! The dense reference of the training tests: a Llama built from candle-nn pieces
//! (embedding, `rms_norm_slow`, linear, `rope_slow`, causal softmax attention, SiLU-gated MLP)
//! on the full weights `TrainInit` draws, sharing no code with `candle_tp::train`.

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Result, Tensor, Var, D};
use candle_tp::train::{TrainConfig, TrainInit};

/// The dense reference: logits `[b * s, vocab]`, loss, and the gradient of every parameter
/// (by checkpoint name).
pub struct Dense {
    /// Logits `[b * s, vocab]`.
    pub logits: Tensor,
    /// The mean cross-entropy.
    pub loss: f32,
    /// Every parameter's gradient.
    pub grads: HashMap<String, Tensor>,
}

pub fn dense(
    cfg: &TrainConfig,
    causal: bool,
    seed: u64,
    ids: &Tensor,
    tg: &Tensor,
) -> Result<Dense> {
    let (b, s) = ids.dims2()?;
    let init = TrainInit::new(seed);
    cfg.declare(&init)?;
    let mut w: HashMap<String, Var> = HashMap::new();
    for (name, _, _) in cfg.param_specs() {
        let t = init.full_tensor(&name, DType::F32, &Device::Cpu)?;
        w.insert(name, Var::from_tensor(&t)?);
    }
    let t = |n: &str| w[n].as_tensor().clone();
    let lin = |n: &str| candle_nn::Linear::new(t(n), None);
    let eps = cfg.rms_norm_eps as f32;
    let (h, nh, nkv, hd) = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim(),
    );
    // RoPE tables [s, hd / 2] as Hugging Face computes them, in f64 then f32.
    let angles: Vec<f32> = (0..s)
        .flat_map(|p| {
            (0..hd / 2)
                .map(move |i| (p as f64 / cfg.rope_theta.powf(2.0 * i as f64 / hd as f64)) as f32)
        })
        .collect();
    let angles = Tensor::from_vec(angles, (s, hd / 2), &Device::Cpu)?;
    let (cos, sin) = (angles.cos()?, angles.sin()?);
    let mask: Vec<f32> = (0..s)
        .flat_map(|i| {
            (0..s).map(move |j| {
                if causal && j > i {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (s, s), &Device::Cpu)?;

    let mut x = candle_nn::Embedding::new(t("model.embed_tokens.weight"), h).forward(ids)?;
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let n = candle_nn::ops::rms_norm_slow(&x, &t(&format!("{p}.input_layernorm.weight")), eps)?;
        let heads = |y: Tensor, k: usize| -> Result<Tensor> {
            y.reshape((b, s, k, hd))?.transpose(1, 2)?.contiguous()
        };
        let q = heads(
            lin(&format!("{p}.self_attn.q_proj.weight")).forward(&n)?,
            nh,
        )?;
        let k = heads(
            lin(&format!("{p}.self_attn.k_proj.weight")).forward(&n)?,
            nkv,
        )?;
        let v = heads(
            lin(&format!("{p}.self_attn.v_proj.weight")).forward(&n)?,
            nkv,
        )?;
        let q = candle_nn::rotary_emb::rope_slow(&q, &cos, &sin)?;
        let k = candle_nn::rotary_emb::rope_slow(&k, &cos, &sin)?;
        let k = candle_transformers::utils::repeat_kv(k, nh / nkv)?.contiguous()?;
        let v = candle_transformers::utils::repeat_kv(v, nh / nkv)?.contiguous()?;
        let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?.broadcast_add(&mask)?;
        let att = candle_nn::ops::softmax(&att, D::Minus1)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, s, nh * hd))?;
        x = (x + lin(&format!("{p}.self_attn.o_proj.weight")).forward(&y)?)?;
        let n = candle_nn::ops::rms_norm_slow(
            &x,
            &t(&format!("{p}.post_attention_layernorm.weight")),
            eps,
        )?;
        let g = candle_nn::Activation::Silu
            .forward(&lin(&format!("{p}.mlp.gate_proj.weight")).forward(&n)?)?;
        let u = lin(&format!("{p}.mlp.up_proj.weight")).forward(&n)?;
        x = (x + lin(&format!("{p}.mlp.down_proj.weight")).forward(&(g * u)?)?)?;
    }
    let x = candle_nn::ops::rms_norm_slow(&x, &t("model.norm.weight"), eps)?;
    let head = if cfg.tie_word_embeddings {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    };
    let logits = lin(head).forward(&x)?.reshape((b * s, cfg.vocab_size))?;
    let loss = candle_nn::loss::cross_entropy(&logits, tg)?;
    let g = loss.backward()?;
    let mut grads = HashMap::new();
    for (name, var) in &w {
        match g.get(var.as_tensor()) {
            Some(gr) => grads.insert(name.clone(), gr.clone()),
            None => candle_core::bail!("dense reference: no gradient for {name}"),
        };
    }
    Ok(Dense {
        logits,
        loss: loss.to_scalar()?,
        grads,
    })
}
