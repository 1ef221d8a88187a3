//! GGUF → Hugging Face: the weights.
//!
//! Tensor names are mapped by [`crate::gguf::checked_hf_target`] (a 3-D tensor of experts
//! becomes one matrix per expert). llama.cpp's converter permutes the rows
//! of `q_proj` and `k_proj` (`LlamaModel.permute`) so that its interleaved rotary kernel sees
//! each (x, y) rotation pair side by side; [`unpermute_rotary`] undoes it so that the
//! half-split rotary embedding of Hugging Face (and candle-transformers' `llama`) applies.
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, TensorInfo};
use candle_core::{Device, Error, Result, Tensor};

use crate::gguf::{checked_hf_target, layer_index, rotary_heads, HfTarget, LlamaGgufConfig};

/// Undoes llama.cpp's rotary row permutation of a q or k projection (weight `[n_head *
/// head_dim, in]` or bias `[n_head * head_dim]`).
///
/// llama.cpp writes `w.reshape(n_head, 2, head_dim / 2, ...).swapaxes(1, 2)`, which puts row
/// `j * head_dim / 2 + i` of each head at `2 * i + j`; the inverse is
/// `w.reshape(n_head, head_dim / 2, 2, ...).swapaxes(1, 2)`. Pass the number of query heads for
/// q and the number of KV heads for k.
pub fn unpermute_rotary(t: &Tensor, n_head: usize) -> Result<Tensor> {
    let dims = t.dims();
    let rows = dims.first().copied().unwrap_or(0);
    if n_head == 0 || rows == 0 || rows % (2 * n_head) != 0 {
        candle_core::bail!(
            "rotary unpermute: {rows} rows cannot be split into {n_head} heads of an even size \
             (shape {dims:?})"
        );
    }
    let half = rows / n_head / 2;
    let mut split = vec![n_head, half, 2];
    split.extend_from_slice(&dims[1..]);
    t.reshape(split)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

/// Reads every tensor of the GGUF, dequantizes it to f32 and returns it under its Hugging
/// Face name with the Hugging Face row order. Every tensor must be known and have the shape
/// the configuration implies; every required tensor must be present. `progress(done, total,
/// hf_name)` is called after each tensor.
pub fn convert_weights<R: Read + Seek>(
    content: &Content,
    reader: &mut R,
    cfg: &LlamaGgufConfig,
    path: &Path,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<HashMap<String, Tensor>> {
    let file = path.display().to_string();
    let by_name: BTreeMap<&String, &TensorInfo> = content.tensor_infos.iter().collect();
    // Hugging Face tensors: a 3-D tensor of experts is one per expert.
    let total = by_name
        .values()
        .map(|i| match i.shape.dims() {
            [experts, _, _] => *experts,
            _ => 1,
        })
        .sum();
    let mut out = HashMap::with_capacity(by_name.len());
    for (name, info) in by_name {
        let target = checked_hf_target(cfg, &file, name, info.shape.dims())?;
        let first = match &target {
            HfTarget::One(hf) => hf,
            HfTarget::Experts(names) => &names[0],
        };
        if let Some(layer) = layer_index(first) {
            if layer >= cfg.num_hidden_layers {
                candle_core::bail!(
                    "{file}: tensor {name} belongs to layer {layer} but {}.block_count is {}",
                    cfg.family.arch(),
                    cfg.num_hidden_layers
                );
            }
        }
        let ctx = |e: Error| {
            Error::Msg(format!(
                "{file}: tensor {name} ({:?}, shape {:?}): {e}",
                info.ggml_dtype,
                info.shape.dims()
            ))
        };
        let qt = content.tensor(reader, name, &Device::Cpu).map_err(ctx)?;
        let t = qt
            .dequantize(&Device::Cpu)
            .and_then(|t| t.to_dtype(candle_core::DType::F32))
            .map_err(ctx)?;
        // Stacked experts become one matrix per expert.
        let parts = match target {
            HfTarget::One(hf) => vec![(hf, t)],
            HfTarget::Experts(names) => names
                .into_iter()
                .enumerate()
                .map(|(e, hf)| Ok((hf, t.get(e)?)))
                .collect::<Result<Vec<_>>>()
                .map_err(ctx)?,
        };
        for (hf, mut t) in parts {
            if let Some(heads) = rotary_heads(cfg, &hf) {
                t = unpermute_rotary(&t, heads).map_err(ctx)?;
            }
            if out.insert(hf.clone(), t).is_some() {
                candle_core::bail!("{file}: two tensors map to {hf}");
            }
            progress(out.len(), total, &hf);
        }
    }
    cfg.check_required(&file, |hf| out.contains_key(hf))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's `LlamaModel.permute`, written the way `convert_hf_to_gguf.py` does it.
    #[test]
    fn unpermute_inverts_llama_cpp_permute() -> Result<()> {
        let w = Tensor::arange(0f32, 3.0 * 8.0 * 5.0, &Device::Cpu)?.reshape((24, 5))?;
        let p = crate::convert::to_gguf::permute_rotary(&w, 3)?;
        assert_ne!(p.to_vec2::<f32>()?, w.to_vec2::<f32>()?);
        let back = unpermute_rotary(&p, 3)?;
        assert_eq!(back.to_vec2::<f32>()?, w.to_vec2::<f32>()?);
        // Head 0, head_dim 8: gguf row 2i + j holds hf row j * 4 + i.
        let rows: Vec<f32> = p.get_on_dim(1, 0)?.to_vec1()?;
        assert_eq!(&rows[..8], &[0., 20., 5., 25., 10., 30., 15., 35.]);
        let b = Tensor::arange(0f32, 12.0, &Device::Cpu)?;
        let pb = crate::convert::to_gguf::permute_rotary(&b, 2)?;
        assert_eq!(
            unpermute_rotary(&pb, 2)?.to_vec1::<f32>()?,
            b.to_vec1::<f32>()?
        );
        Ok(())
    }

    #[test]
    fn unpermute_rejects_bad_sizes() {
        let w = Tensor::zeros((10, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = unpermute_rotary(&w, 3).unwrap_err().to_string();
        assert!(err.contains("10 rows") && err.contains("3 heads"), "{err}");
    }
}
