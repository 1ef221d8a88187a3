//! Writing other quantizations of a Llama GGUF: the same metadata (configuration, tokenizer,
//! chat template), every matrix requantized with Candle's `QTensor::quantize`, written with
//! Candle's GGUF writer. Tests and benchmarks use it to cover several block types on a real
//! model (SmolLM2 ships only as Q4_1).
//!
//! The weights are the f32 values of the checkpoint: the source GGUF's tensors dequantized,
//! which is exactly what the converted `model.safetensors` holds (there in Hugging Face row
//! order; here the rows stay in llama.cpp's rotary order, as a GGUF expects). Vectors (norms)
//! stay f32. A matrix whose rows are not whole blocks of the target type (SmolLM2's hidden
//! size 576 is not a multiple of the k-quants' 256) is written as Q8_0 instead, as llama.cpp's
//! quantizer also falls back for such rows; the summary lists the types written.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Error, Result};

/// llama.cpp's `general.file_type` (`LLAMA_FTYPE_*`) for a whole-model type.
pub(crate) fn file_type(dtype: GgmlDType) -> Option<u32> {
    Some(match dtype {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q8_0 => 7,
        GgmlDType::Q5_0 => 8,
        GgmlDType::Q5_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 14,
        GgmlDType::Q5K => 16,
        GgmlDType::Q6K => 18,
        _ => return None,
    })
}

/// Parses a type name as llama.cpp spells it (`Q8_0`, `Q4_K`, `q6_k`, ...).
pub fn parse_ggml_dtype(s: &str) -> Result<GgmlDType> {
    Ok(match s.to_ascii_uppercase().as_str() {
        "F32" => GgmlDType::F32,
        "F16" => GgmlDType::F16,
        "Q4_0" => GgmlDType::Q4_0,
        "Q4_1" => GgmlDType::Q4_1,
        "Q5_0" => GgmlDType::Q5_0,
        "Q5_1" => GgmlDType::Q5_1,
        "Q8_0" => GgmlDType::Q8_0,
        "Q2_K" => GgmlDType::Q2K,
        "Q3_K" => GgmlDType::Q3K,
        "Q4_K" => GgmlDType::Q4K,
        "Q5_K" => GgmlDType::Q5K,
        "Q6_K" => GgmlDType::Q6K,
        _ => candle_core::bail!(
            "unknown quantization type {s:?} (F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K)"
        ),
    })
}

/// Requantizes the GGUF `src` to `dtype` into `out` (written to a temporary name, then
/// renamed). Returns how many tensors of each type were written.
pub fn requantize_gguf(
    src: &Path,
    dtype: GgmlDType,
    out: &Path,
) -> Result<BTreeMap<String, usize>> {
    let ftype = file_type(dtype).ok_or_else(|| {
        Error::Msg(format!(
            "{dtype:?} is not a type a whole model is quantized to"
        ))
    })?;
    let mut reader = BufReader::new(
        File::open(src).map_err(|e| Error::Msg(format!("cannot open {}: {e}", src.display())))?,
    );
    let content = gguf_file::Content::read(&mut reader)
        .map_err(|e| Error::Msg(format!("{}: not a readable GGUF file: {e}", src.display())))?;
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort_by_key(|n| content.tensor_infos[*n].offset);
    let mut tensors = Vec::with_capacity(names.len());
    let mut counts = BTreeMap::new();
    for name in names {
        let q = content.tensor(&mut reader, name, &Device::Cpu)?;
        let w = q.dequantize(&Device::Cpu)?;
        let q = quantize_as(name, &w, dtype, false)
            .map_err(|e| Error::Msg(format!("{}: tensor {name}: {e}", src.display())))?;
        let target = q.dtype();
        *counts.entry(format!("{target:?}")).or_insert(0) += 1;
        tensors.push((name.clone(), q));
    }
    let mut metadata: Vec<(String, Value)> = content
        .metadata
        .iter()
        .filter(|(k, _)| k.as_str() != "general.file_type")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    metadata.push(("general.file_type".to_string(), Value::U32(ftype)));
    write_gguf_file(out, metadata, &tensors)?;
    Ok(counts)
}

/// The GGUF tensor `name`, `w`, as `dtype`, or as Q8_0 when its rows are not whole blocks of
/// `dtype` (the fallback llama.cpp's quantizer also takes), or f32 when they are not whole
/// Q8_0 blocks either. What llama.cpp's quantizer never quantizes stays f32: vectors (norms,
/// biases) and, unless `quantize_router`, a mixture-of-experts router (`ffn_gate_inp`, whose
/// product picks the experts; some third-party converters quantize it). A 3-D tensor of
/// experts is quantized row by row like a matrix.
pub(crate) fn quantize_as(
    name: &str,
    w: &candle_core::Tensor,
    dtype: GgmlDType,
    quantize_router: bool,
) -> Result<QTensor> {
    let target = match w.dims() {
        _ if !quantize_router && name.contains("ffn_gate_inp.weight") => GgmlDType::F32,
        [_] => GgmlDType::F32,
        [.., cols] if cols % dtype.block_size() == 0 => dtype,
        [.., cols] if cols % GgmlDType::Q8_0.block_size() == 0 => GgmlDType::Q8_0,
        _ => GgmlDType::F32,
    };
    QTensor::quantize(w, target)
}

/// Writes a GGUF file (metadata sorted by key, tensors in the order given) to a temporary
/// name next to `out`, then renames it, so that a reader never sees half a file.
pub(crate) fn write_gguf_file(
    out: &Path,
    mut metadata: Vec<(String, Value)>,
    tensors: &[(String, QTensor)],
) -> Result<()> {
    metadata.sort_by(|a, b| a.0.cmp(&b.0));
    let tmp = out.with_extension(format!("gguf.{}.partial", std::process::id()));
    {
        let mut w = BufWriter::new(
            File::create(&tmp)
                .map_err(|e| Error::Msg(format!("cannot create {}: {e}", tmp.display())))?,
        );
        let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut w, &md, &ts)
            .map_err(|e| Error::Msg(format!("writing {}: {e}", tmp.display())))?;
    }
    std::fs::rename(&tmp, out).map_err(|e| {
        Error::Msg(format!(
            "cannot rename {} to {}: {e}",
            tmp.display(),
            out.display()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// llama.cpp's quantizer keeps the router and the vectors in f32 and falls back to Q8_0
    /// for rows that are not whole blocks of the type.
    #[test]
    fn the_router_and_vectors_stay_f32() -> Result<()> {
        let w = |shape: &[usize]| Tensor::ones(shape, candle_core::DType::F32, &Device::Cpu);
        let q4k = GgmlDType::Q4K;
        for (name, shape, want) in [
            ("blk.0.ffn_gate_inp.weight", &[16, 256][..], GgmlDType::F32),
            ("blk.0.ffn_gate_exps.weight", &[16, 128, 256], q4k),
            ("blk.0.attn_q.weight", &[256, 256], q4k),
            ("blk.0.ffn_down.weight", &[256, 96], GgmlDType::Q8_0),
            ("blk.0.attn_norm.weight", &[256], GgmlDType::F32),
        ] {
            assert_eq!(
                quantize_as(name, &w(shape)?, q4k, false)?.dtype(),
                want,
                "{name}"
            );
        }
        // Asked to, the router is quantized like any matrix.
        let router = quantize_as("blk.0.ffn_gate_inp.weight", &w(&[16, 256])?, q4k, true)?;
        assert_eq!(router.dtype(), q4k);
        Ok(())
    }
}
