//! The safetensors header: parsed and validated by the `safetensors` crate's own
//! [`SafeTensors::read_metadata`], plus the checks that crate does not make and error messages
//! that name the file and the tensor.
//!
//! What the crate checks (and so decides): the length prefix and its 100 MB limit, UTF-8 and
//! JSON, each entry's `dtype` / `shape` / `data_offsets`, that every tensor's byte size is its
//! shape times its dtype width without overflow, and that the tensors tile the data section
//! exactly (sorted by offset, no overlap, no hole, nothing after the last one).
//!
//! What is added here:
//! - A refusal the crate does not make: a tensor with a zero dimension and other dimensions
//!   whose product overflows (`[0, 2^40, 2^40]` holds 0 bytes, so the crate accepts it, but
//!   slicing it multiplies the non-zero dimensions; found by `examples/fuzz_checkpoint`, kept
//!   in `tests/hostile_headers.rs`).
//! - Readable errors: the crate's errors name neither the file nor, for most, the tensor
//!   (`TensorInvalidInfo`, `ValidationOverflow`, `MetadataIncompleteBuffer`, a serde message
//!   with a line and column). When it refuses a header, [`explain`] walks the header again and
//!   says which tensor is wrong and how; the crate's verdict stands either way.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use candle_core::{bail, DType, Result};
use memmap2::Mmap;
use safetensors::tensor::TensorInfo;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::mapped::{Entry, MappedFile};

/// Largest header accepted: the `safetensors` crate's limit (its `MAX_HEADER_SIZE`), checked
/// first here so that the error can say so. Real headers are a few hundred KiB at most.
const MAX_HEADER_LEN: u64 = 100_000_000;

/// The candle dtype of a safetensors dtype this source loads, or `None`.
fn loadable(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F64 => DType::F64,
        Dtype::I64 => DType::I64,
        Dtype::U32 => DType::U32,
        Dtype::U8 => DType::U8,
        _ => return None,
    })
}

/// Maps one file and validates its header. The entries' `file` field is left at 0.
pub(super) fn open_file(path: &Path) -> Result<(MappedFile, HashMap<String, Entry>)> {
    let p = path.display();
    let file =
        File::open(path).map_err(|e| candle_core::Error::Msg(format!("cannot open {p}: {e}")))?;
    let file_len = file
        .metadata()
        .map_err(|e| candle_core::Error::Msg(format!("cannot stat {p}: {e}")))?
        .len();
    if file_len < 8 {
        bail!(
            "{p} is truncated: {file_len} bytes, shorter than the 8-byte safetensors header length"
        );
    }
    // SAFETY: the map is read-only; the files must not be modified while mapped (documented
    // on `SafetensorsSource`).
    let mmap = unsafe { Mmap::map(&file) }
        .map_err(|e| candle_core::Error::Msg(format!("cannot memory-map {p}: {e}")))?;
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&mmap[..8]);
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_LEN {
        bail!("{p}: header length {header_len} bytes is absurd (limit {MAX_HEADER_LEN}); not a safetensors file?");
    }
    if header_len > file_len - 8 {
        bail!(
            "{p} is truncated: header length {header_len} bytes but only {} bytes follow",
            file_len - 8
        );
    }
    // Both fit in usize: they are bounded by the length of the map.
    let data_start = 8 + header_len as usize;
    let data_len = mmap.len() - data_start;
    let metadata = match SafeTensors::read_metadata(&mmap) {
        Ok((_, metadata)) => metadata,
        Err(e) => {
            let why = explain(&mmap[8..data_start], data_len)
                .unwrap_or_else(|| format!("not a valid safetensors header: {e}"));
            bail!("{p}: {why}")
        }
    };
    let tensors = metadata.tensors();
    let mut entries = HashMap::with_capacity(tensors.len());
    for (name, info) in tensors {
        // The crate checked the full product; the product of the non-zero dimensions must fit
        // too, since slicing multiplies sub-products of the shape.
        if nonzero_product_overflows(info) {
            bail!(
                "{p}: tensor '{name}' of shape {:?} and dtype {:?}: byte size overflows",
                info.shape,
                info.dtype
            );
        }
        let (begin, end) = info.data_offsets;
        entries.insert(
            name,
            Entry {
                file: 0,
                dtype: loadable(info.dtype).ok_or_else(|| format!("{:?}", info.dtype)),
                shape: info.shape.clone(),
                bytes: data_start + begin..data_start + end,
            },
        );
    }
    let file = MappedFile {
        path: path.to_path_buf(),
        mmap,
    };
    Ok((file, entries))
}

/// Whether the bit count of the non-zero dimensions overflows `usize`.
fn nonzero_product_overflows(info: &TensorInfo) -> bool {
    info.shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(info.dtype.bitsize(), |acc, &d| acc.checked_mul(d))
        .is_none()
}

/// Says which entry of a header that the crate refused is wrong, naming the tensor and the
/// numbers; `None` when no reason is found here (the crate's own message is used then).
fn explain(header: &[u8], data_len: usize) -> Option<String> {
    let map: serde_json::Map<String, Value> = match serde_json::from_slice(header) {
        Ok(map) => map,
        Err(e) => return Some(format!("header is not a JSON object: {e}")),
    };
    let mut spans: Vec<(usize, usize, &str)> = Vec::with_capacity(map.len());
    for (name, value) in &map {
        if name == "__metadata__" {
            if serde_json::from_value::<HashMap<String, String>>(value.clone()).is_err() {
                return Some(format!(
                    "\"__metadata__\" must map strings to strings, found {value}"
                ));
            }
            continue;
        }
        let info: TensorInfo = match serde_json::from_value(value.clone()) {
            Ok(info) => info,
            Err(e) => {
                return Some(format!(
                    "header entry of tensor '{name}' is not {{dtype, shape, data_offsets}}: {e}"
                ))
            }
        };
        let (begin, end) = info.data_offsets;
        let (shape, dtype) = (&info.shape, info.dtype);
        if begin > end {
            return Some(format!(
                "tensor '{name}' has reversed data_offsets [{begin}, {end}]"
            ));
        }
        if end > data_len {
            return Some(format!("tensor '{name}' data_offsets [{begin}, {end}] run past the end of the data section ({data_len} bytes); file truncated?"));
        }
        let bits = shape
            .iter()
            .try_fold(dtype.bitsize(), |acc, &d| acc.checked_mul(d))
            .filter(|b| b % 8 == 0);
        let Some(bits) = bits.filter(|_| !nonzero_product_overflows(&info)) else {
            return Some(format!("tensor '{name}' of shape {shape:?} and dtype {dtype:?}: byte size overflows or is not a whole number of bytes"));
        };
        if bits / 8 != end - begin {
            return Some(format!(
                "tensor '{name}' of shape {shape:?} and dtype {dtype:?} needs {} bytes but data_offsets [{begin}, {end}] hold {}",
                bits / 8,
                end - begin
            ));
        }
        spans.push((begin, end, name));
    }
    // Sorted by offsets, the tensors must tile the data section: each starts where the
    // previous one ended (an empty tensor included), the last ends at the end of the data.
    spans.sort_unstable();
    let nonempty: Vec<_> = spans.iter().filter(|s| s.0 < s.1).collect();
    for w in nonempty.windows(2) {
        let ((b0, e0, n0), (b1, e1, n1)) = (w[0], w[1]);
        if b1 < e0 {
            return Some(format!(
                "tensors '{n0}' [{b0}, {e0}] and '{n1}' [{b1}, {e1}] overlap"
            ));
        }
    }
    let mut at = 0;
    for &(begin, end, name) in &spans {
        if begin != at {
            return Some(format!("tensor '{name}' starts at byte {begin} of the data section, but the tensors before it end at {at}: safetensors data must have no holes and no overlaps"));
        }
        at = end;
    }
    if at != data_len {
        return Some(format!("the tensors cover {at} bytes, but the data section holds {data_len}: bytes after the last tensor"));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[0, 2^40, 2^40]` holds 0 bytes: the crate's validation (full product only) accepts it,
    /// so the non-zero-dimension check above is what refuses it. If a new crate version starts
    /// refusing it, this test says the extra check can go.
    #[test]
    fn the_crate_alone_accepts_a_zero_size_tensor_with_overflowing_dimensions() {
        let header = br#"{"w":{"dtype":"F32","shape":[0,1099511627776,1099511627776],"data_offsets":[0,0]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        let (_, metadata) = SafeTensors::read_metadata(&file).expect("the crate accepts it");
        let info = metadata.info("w").expect("tensor w");
        assert!(nonzero_product_overflows(info));
    }

    /// The crate's errors name neither the file nor the tensor; `explain` does.
    #[test]
    fn explain_names_the_tensor_the_crate_does_not() {
        let header = br#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(&[0; 16]);
        let crate_msg = SafeTensors::read_metadata(&file).unwrap_err().to_string();
        assert!(
            !crate_msg.contains("'w'") && !crate_msg.contains("`w`"),
            "{crate_msg}"
        );
        let ours = explain(header, 16).expect("a reason");
        assert!(
            ours.contains("'w'") && ours.contains("needs 12 bytes"),
            "{ours}"
        );
    }
}
