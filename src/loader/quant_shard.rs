//! Cutting a rank's shard out of a quantized (GGUF) tensor by copying whole blocks.
//!
//! A ggml tensor `[rows, cols]` is `rows` runs of `cols / block_size` blocks. So:
//! - a column-parallel shard (a range of rows, dim 0) is a byte range per row, in any order:
//!   the q/k rows that llama.cpp permuted for its rotary kernel are put back here by copying
//!   rows ([`RowOrder::Rotary`]);
//! - a row-parallel shard (a range of columns, dim 1) is a range of blocks of every row, when
//!   the range starts and ends on block boundaries.
//!
//! When a column range does not fall on whole blocks (a k-quant tensor whose uneven split is
//! not a multiple of 256, say), or when Candle's kernel would refuse the shard's width (its
//! Q5_0 and Q5_1 dot products need an even number of blocks per row; Q4_1 runs through the
//! crate's own kernel, which takes any count), the fallback is:
//! copy the blocks that cover the range, dequantize only those, cut the exact columns, and
//! requantize the rank's slice to Q8_0 (block 32, a SIMD kernel in Candle) — or keep it in f32
//! when its width is not a multiple of 32. It is logged once per tensor.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::ops::Range;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use candle_core::quantized::{GgmlDType, GgmlType, QStorage, QTensor, QuantizedType};
use candle_core::{Device, Result, Tensor};

use super::source::WeightShard;
use crate::quant::QuantType;

/// Names of the tensor being cut, for errors and the fallback log.
#[derive(Debug, Clone, Copy)]
pub struct Named<'a> {
    /// The GGUF file.
    pub file: &'a Path,
    /// The tensor's GGUF name.
    pub tensor: &'a str,
    /// Its Hugging Face name.
    pub hf: &'a str,
}

/// Which stored row holds each logical (Hugging Face order) row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowOrder {
    /// Row `r` is stored at `r`.
    Identity,
    /// llama.cpp's rotary order: within each head of `head_dim` rows, logical row
    /// `j * head_dim / 2 + i` is stored at `2 * i + j`.
    Rotary {
        /// Rows per head.
        head_dim: usize,
    },
}

impl RowOrder {
    /// The rotary order of a q or k projection with `rows` rows in `heads` heads.
    pub fn rotary(rows: usize, heads: usize) -> std::result::Result<Self, String> {
        if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
            return Err(format!(
                "{rows} rows cannot be split into {heads} heads of an even size (rotary order)"
            ));
        }
        Ok(Self::Rotary {
            head_dim: rows / heads,
        })
    }

    /// The stored row of logical row `r`.
    pub fn source_row(&self, r: usize) -> usize {
        match *self {
            Self::Identity => r,
            Self::Rotary { head_dim } => {
                let (head, l) = (r / head_dim, r % head_dim);
                let half = head_dim / 2;
                head * head_dim + 2 * (l % half) + l / half
            }
        }
    }
}

/// The number of columns a row-parallel split of a `dtype` tensor keeps together: the block
/// size, twice it where Candle's dot product needs an even number of blocks per row (Q5_0,
/// Q5_1; Q4_1 runs through the crate's kernel, which takes any block count): the type's
/// [`QuantType::split_unit`].
pub fn kernel_unit(dtype: GgmlDType) -> usize {
    QuantType::of(dtype).split_unit()
}

/// Whether Candle's kernels accept rows of `cols` columns of `dtype`.
fn kernel_accepts(dtype: GgmlDType, cols: usize) -> bool {
    cols.is_multiple_of(kernel_unit(dtype))
}

/// The tensors whose shard took the fallback in this process (each logged once).
pub fn fallbacks_logged() -> Vec<String> {
    logged()
        .lock()
        .map(|s| s.iter().cloned().collect())
        .unwrap_or_default()
}

fn logged() -> &'static Mutex<BTreeSet<String>> {
    static LOGGED: OnceLock<Mutex<BTreeSet<String>>> = OnceLock::new();
    LOGGED.get_or_init(|| Mutex::new(BTreeSet::new()))
}

/// A `[rows, cols]` `QTensor` of `dtype` made of `parts`, runs of whole blocks in order.
///
/// On the CPU the runs are copied straight into the vector of blocks the tensor keeps.
/// Candle's `QStorage::from_data` copies whatever it is given, so gathering the runs into a
/// buffer of the loader's own first held every shard twice at once while it loaded
/// (`tests/gguf_load_transients.rs` counts the bytes live at the peak of a cut).
fn qtensor_of(
    parts: &[&[u8]],
    dtype: GgmlDType,
    shape: (usize, usize),
    device: &Device,
) -> Result<QTensor> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let storage = match device {
        Device::Cpu => QStorage::Cpu(cpu_blocks(parts, len, dtype)?),
        // A device copies the blocks to its own memory; the staging buffer is aligned for
        // every block type (Candle reinterprets the bytes as blocks and checks alignment).
        _ => {
            let mut words = vec![0u64; len.div_ceil(8)];
            // SAFETY: any bytes are a valid u64 and vice versa; the length covers the same
            // memory.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 8)
            };
            copy_runs(parts, &mut dst[..len]);
            QStorage::from_data(Cow::Borrowed(&dst[..len]), device, dtype)?
        }
    };
    QTensor::new(storage, shape)
}

fn copy_runs(parts: &[&[u8]], dst: &mut [u8]) {
    let mut at = 0;
    for p in parts {
        dst[at..at + p.len()].copy_from_slice(p);
        at += p.len();
    }
}

/// The runs as the `Vec` of `dtype`'s blocks that Candle's CPU storage is.
fn cpu_blocks(parts: &[&[u8]], len: usize, dtype: GgmlDType) -> Result<Box<dyn QuantizedType>> {
    fn blocks<T: GgmlType + 'static>(
        parts: &[&[u8]],
        len: usize,
    ) -> Result<Box<dyn QuantizedType>> {
        let size = std::mem::size_of::<T>();
        // ggml's block sizes are the sums of their fields' sizes: no padding, so the blocks'
        // memory may be written as bytes.
        if size != T::DTYPE.type_size() || !len.is_multiple_of(size) {
            candle_core::bail!(
                "{:?}: {len} bytes are not whole blocks of {size} bytes (ggml's block is {})",
                T::DTYPE,
                T::DTYPE.type_size()
            );
        }
        let mut v = vec![T::zeros(); len / size];
        // SAFETY: `v` holds `len` initialised bytes of plain integers and floats without
        // padding (checked above), any bit pattern of which is a valid block.
        let dst = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), len) };
        copy_runs(parts, dst);
        Ok(Box::new(v))
    }
    use candle_core::quantized::k_quants as k;
    match dtype {
        GgmlDType::F32 => blocks::<f32>(parts, len),
        GgmlDType::F16 => blocks::<half::f16>(parts, len),
        GgmlDType::BF16 => blocks::<half::bf16>(parts, len),
        GgmlDType::Q4_0 => blocks::<k::BlockQ4_0>(parts, len),
        GgmlDType::Q4_1 => blocks::<k::BlockQ4_1>(parts, len),
        GgmlDType::Q5_0 => blocks::<k::BlockQ5_0>(parts, len),
        GgmlDType::Q5_1 => blocks::<k::BlockQ5_1>(parts, len),
        GgmlDType::Q8_0 => blocks::<k::BlockQ8_0>(parts, len),
        GgmlDType::Q8_1 => blocks::<k::BlockQ8_1>(parts, len),
        GgmlDType::Q2K => blocks::<k::BlockQ2K>(parts, len),
        GgmlDType::Q3K => blocks::<k::BlockQ3K>(parts, len),
        GgmlDType::Q4K => blocks::<k::BlockQ4K>(parts, len),
        GgmlDType::Q5K => blocks::<k::BlockQ5K>(parts, len),
        GgmlDType::Q6K => blocks::<k::BlockQ6K>(parts, len),
        GgmlDType::Q8K => blocks::<k::BlockQ8K>(parts, len),
    }
}

/// Cuts the logical rows (`dim` 0) or columns (`dim` 1) `ranges` out of the ggml tensor
/// `bytes` of `dtype` and logical shape `(rows, cols)`, whose rows are stored in `order`.
#[allow(clippy::too_many_arguments)]
pub fn shard(
    what: &Named<'_>,
    bytes: &[u8],
    dtype: GgmlDType,
    (rows, cols): (usize, usize),
    order: &RowOrder,
    dim: usize,
    ranges: &[Range<usize>],
    device: &Device,
) -> Result<WeightShard> {
    let file = what.file.display();
    let name = what.tensor;
    let (bs, ts) = (dtype.block_size(), dtype.type_size());
    let row_bytes = cols / bs * ts;
    if cols % bs != 0 || bytes.len() != rows * row_bytes {
        candle_core::bail!(
            "{file}: tensor {name} ({dtype:?}, [{rows}, {cols}]): {} bytes, expected {}",
            bytes.len(),
            rows * row_bytes
        );
    }
    let extent = match dim {
        0 => rows,
        1 => cols,
        _ => candle_core::bail!("{file}: tensor {name}: no dimension {dim} to shard"),
    };
    if ranges.is_empty() {
        candle_core::bail!("{file}: tensor {name}: asked for an empty list of ranges");
    }
    for r in ranges {
        if r.start >= r.end || r.end > extent {
            candle_core::bail!(
                "{file}: tensor {name} ({} [{rows}, {cols}]): range {}..{} along dim {dim} is \
                 out of bounds or empty (size {extent})",
                what.hf,
                r.start,
                r.end
            );
        }
    }
    let width: usize = ranges.iter().map(|r| r.len()).sum();
    if dim == 0 {
        let runs: Vec<&[u8]> = ranges
            .iter()
            .flat_map(|r| r.clone())
            .map(|r| &bytes[order.source_row(r) * row_bytes..][..row_bytes])
            .collect();
        return Ok(WeightShard::Quantized(qtensor_of(
            &runs,
            dtype,
            (width, cols),
            device,
        )?));
    }
    let aligned = ranges.iter().all(|r| r.start % bs == 0 && r.end % bs == 0);
    if aligned && (bs == 1 || kernel_accepts(dtype, width)) {
        return Ok(WeightShard::Quantized(copy_columns(
            bytes, dtype, rows, row_bytes, order, ranges, device,
        )?));
    }
    // Fallback: dequantize the covering blocks of this rank's columns only.
    let mut parts = Vec::with_capacity(ranges.len());
    for r in ranges {
        let cover = (r.start / bs * bs)..r.end.div_ceil(bs) * bs;
        let q = copy_columns(
            bytes,
            dtype,
            rows,
            row_bytes,
            order,
            std::slice::from_ref(&cover),
            device,
        )?;
        let d = q.dequantize(device)?;
        parts.push(d.narrow(1, r.start - cover.start, r.len())?);
    }
    // A tensor with storage of its own: Candle's `QTensor::quantize` reads a view's whole
    // storage, whatever its layout.
    let dense = Tensor::cat(&parts, 1)?;
    let dense = Tensor::from_vec(
        dense.flatten_all()?.to_vec1::<f32>()?,
        (rows, width),
        device,
    )?;
    let requantize = width.is_multiple_of(GgmlDType::Q8_0.block_size());
    if let Ok(mut set) = logged().lock() {
        // Once per file tensor: the experts of a 3-D tensor share its name, and one line.
        if set.insert(format!("{}:{name}", what.file.display())) {
            eprintln!(
                "candle-tp: {file}: tensor {name} ({dtype:?}, [{rows}, {cols}]): the columns \
                 {ranges:?} of this shard do not fall on whole blocks of {} for Candle's kernel; \
                 this rank's slice is {}",
                kernel_unit(dtype),
                if requantize {
                    "dequantized and requantized to Q8_0"
                } else {
                    "dequantized and kept in f32"
                }
            );
        }
    }
    if requantize {
        Ok(WeightShard::Quantized(QTensor::quantize(
            &dense,
            GgmlDType::Q8_0,
        )?))
    } else {
        Ok(WeightShard::Dense(dense))
    }
}

/// Every logical row's blocks in `ranges` (block-aligned), rows in logical order.
fn copy_columns(
    bytes: &[u8],
    dtype: GgmlDType,
    rows: usize,
    row_bytes: usize,
    order: &RowOrder,
    ranges: &[Range<usize>],
    device: &Device,
) -> Result<QTensor> {
    let (bs, ts) = (dtype.block_size(), dtype.type_size());
    let width: usize = ranges.iter().map(|r| r.len()).sum();
    let mut runs = Vec::with_capacity(rows * ranges.len());
    for r in 0..rows {
        let row = &bytes[order.source_row(r) * row_bytes..][..row_bytes];
        for c in ranges {
            runs.push(&row[c.start / bs * ts..c.end / bs * ts]);
        }
    }
    qtensor_of(&runs, dtype, (rows, width), device)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named() -> Named<'static> {
        Named {
            file: Path::new("test.gguf"),
            tensor: "blk.0.ffn_down.weight",
            hf: "model.layers.0.mlp.down_proj.weight",
        }
    }

    fn data(rows: usize, cols: usize) -> Result<Tensor> {
        Tensor::arange(0f32, (rows * cols) as f32, &Device::Cpu)?
            .affine(0.37, -3.0)?
            .sin()?
            .reshape((rows, cols))
    }

    fn cut(
        bytes: &[u8],
        dtype: GgmlDType,
        shape: (usize, usize),
        dim: usize,
        ranges: &[Range<usize>],
    ) -> Result<WeightShard> {
        shard(
            &named(),
            bytes,
            dtype,
            shape,
            &RowOrder::Identity,
            dim,
            ranges,
            &Device::Cpu,
        )
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        let d = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(d.is_finite(), "non-finite difference");
        Ok(d)
    }

    #[test]
    fn row_and_block_shards_are_exact_byte_copies() -> Result<()> {
        let (rows, cols) = (6, 128);
        let w = data(rows, cols)?;
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q4_0] {
            let q = QTensor::quantize(&w, dtype)?;
            let full = q.dequantize(&Device::Cpu)?;
            let bytes = q.data()?;
            let s = cut(&bytes, dtype, (rows, cols), 0, &[1..3, 4..6])?;
            let WeightShard::Quantized(s) = s else {
                panic!("dense")
            };
            let want = Tensor::cat(&[full.narrow(0, 1, 2)?, full.narrow(0, 4, 2)?], 0)?;
            assert_eq!(max_diff(&s.dequantize(&Device::Cpu)?, &want)?, 0.0);
            let s = cut(
                &bytes,
                dtype,
                (rows, cols),
                1,
                std::slice::from_ref(&(64..128)),
            )?;
            let WeightShard::Quantized(s) = s else {
                panic!("dense")
            };
            assert_eq!(s.dtype(), dtype);
            assert_eq!(
                max_diff(&s.dequantize(&Device::Cpu)?, &full.narrow(1, 64, 64)?)?,
                0.0
            );
        }
        Ok(())
    }

    #[test]
    fn rotary_rows_are_put_back_in_order() -> Result<()> {
        // 2 heads of 4 rows: stored row 2i + j of a head holds logical row j * 2 + i.
        let order = RowOrder::rotary(8, 2).map_err(candle_core::Error::msg)?;
        let stored: Vec<usize> = (0..8).map(|r| order.source_row(r)).collect();
        assert_eq!(stored, vec![0, 2, 1, 3, 4, 6, 5, 7]);
        assert!(RowOrder::rotary(6, 4).is_err());
        Ok(())
    }

    #[test]
    fn misaligned_columns_fall_back_to_q8_0_within_its_error() -> Result<()> {
        let (rows, cols) = (4, 512);
        let w = data(rows, cols)?;
        let q = QTensor::quantize(&w, GgmlDType::Q4K)?;
        let full = q.dequantize(&Device::Cpu)?;
        let bytes = q.data()?;
        let s = cut(
            &bytes,
            GgmlDType::Q4K,
            (rows, cols),
            1,
            std::slice::from_ref(&(192..448)),
        )?;
        let WeightShard::Quantized(s) = s else {
            panic!("dense")
        };
        assert_eq!(s.dtype(), GgmlDType::Q8_0);
        // Q8_0 rounding of values within [-1.2, 1.2]: at most half a step of 1/127 of the max.
        let d = max_diff(&s.dequantize(&Device::Cpu)?, &full.narrow(1, 192, 256)?)?;
        assert!(d < 6e-3, "Q8_0 fallback differs by {d}");
        assert!(fallbacks_logged()
            .iter()
            .any(|n| n.ends_with("blk.0.ffn_down.weight")));
        // A width that is not a multiple of 32 stays in f32, exactly.
        let s = cut(
            &bytes,
            GgmlDType::Q4K,
            (rows, cols),
            1,
            std::slice::from_ref(&(10..30)),
        )?;
        let WeightShard::Dense(s) = s else {
            panic!("quantized")
        };
        assert_eq!(max_diff(&s, &full.narrow(1, 10, 20)?)?, 0.0);
        // Q4_1 with an odd number of blocks per row stays Q4_1: the crate's kernel takes any
        // block count.
        let q = QTensor::quantize(&w, GgmlDType::Q4_1)?;
        let s = cut(
            &q.data()?,
            GgmlDType::Q4_1,
            (rows, cols),
            1,
            std::slice::from_ref(&(0..96)),
        )?;
        let WeightShard::Quantized(s) = s else {
            panic!("dense")
        };
        assert_eq!(s.dtype(), GgmlDType::Q4_1);
        // Q5_0 with an odd number of blocks per row (Candle's kernel asserts even): Q8_0.
        let q = QTensor::quantize(&w, GgmlDType::Q5_0)?;
        let s = cut(
            &q.data()?,
            GgmlDType::Q5_0,
            (rows, cols),
            1,
            std::slice::from_ref(&(0..96)),
        )?;
        let WeightShard::Quantized(s) = s else {
            panic!("dense")
        };
        assert_eq!(s.dtype(), GgmlDType::Q8_0);
        Ok(())
    }

    #[test]
    fn bad_ranges_name_the_tensor() {
        let bytes = vec![0u8; 4 * 2 * 34];
        let e = cut(
            &bytes,
            GgmlDType::Q8_0,
            (4, 64),
            1,
            std::slice::from_ref(&(0..65)),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("blk.0.ffn_down.weight") && e.contains("out of bounds"),
            "{e}"
        );
        let e = cut(
            &bytes[1..],
            GgmlDType::Q8_0,
            (4, 64),
            0,
            std::slice::from_ref(&(0..1)),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("test.gguf") && e.contains("271 bytes"), "{e}");
    }
}
