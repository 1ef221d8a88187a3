//! A bounds-checked walk over a GGUF file's header and tensor-info table.
//!
//! Candle's `gguf_file::Content::read` trusts the lengths it reads (a hostile string or array
//! length becomes an allocation of that size) and reports an unknown tensor type without the
//! tensor's name. [`scan`] walks the same structure first, checking every length against the
//! bytes that remain, and returns the tensor table with errors that name the file, the key or
//! the tensor. Only a file that passes is handed to Candle for its metadata values.
//!
//! Layout (ggml `docs/gguf.md`): magic `GGUF`, version (1, 2 or 3), tensor count and
//! metadata count (u32 in version 1, u64 after), the metadata key/value pairs, one info record
//! per tensor (name, dims fastest-first, type id, offset into the data section), then the
//! data section aligned to `general.alignment` (default 32).

use candle_core::quantized::GgmlDType;
use candle_core::Result;

/// One tensor of the table as the file declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorEntry {
    /// The tensor's name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions, slowest first (`[rows, cols]` for a matrix), as Candle orders them.
    pub dims: Vec<usize>,
    /// The ggml type.
    pub dtype: GgmlDType,
    /// Byte offset of the first block from the file's start.
    pub start: usize,
    /// Bytes the tensor occupies, from its type and shape.
    pub len: usize,
}

/// The checked tensor table of a GGUF file.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    /// Tensors in file order.
    pub tensors: Vec<GgufTensorEntry>,
    /// Where the data section starts.
    pub data_start: usize,
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    file: &'a str,
    version: u32,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => candle_core::bail!(
                "{}: truncated GGUF header: {what} needs {n} bytes at offset {} but the file has {}",
                self.file,
                self.pos,
                self.bytes.len()
            ),
        }
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A count or length: u32 in version 1, u64 after.
    fn len(&mut self, what: &str) -> Result<usize> {
        let v = if self.version == 1 {
            u64::from(self.u32(what)?)
        } else {
            self.u64(what)?
        };
        usize::try_from(v).map_err(|_| {
            candle_core::Error::msg(format!("{}: {what} = {v} does not fit", self.file))
        })
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.len(what)?;
        let b = self.take(n, what)?;
        Ok(String::from_utf8_lossy(b).into_owned())
    }

    fn skip_value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Option<u64>> {
        let scalar = |ty: u32| -> Option<usize> {
            match ty {
                0 | 1 | 7 => Some(1),
                2 | 3 => Some(2),
                4..=6 => Some(4),
                10..=12 => Some(8),
                _ => None,
            }
        };
        if let Some(n) = scalar(ty) {
            let b = self.take(n, key)?;
            let mut a = [0u8; 8];
            a[..n].copy_from_slice(b);
            return Ok(Some(u64::from_le_bytes(a)));
        }
        match ty {
            8 => {
                self.string(key)?;
                Ok(None)
            }
            9 if depth == 0 => {
                let item = self.u32(key)?;
                let count = self.len(key)?;
                if let Some(n) = scalar(item) {
                    let total = count.checked_mul(n).ok_or_else(|| {
                        candle_core::Error::msg(format!(
                            "{}: metadata {key}: array of {count} items overflows",
                            self.file
                        ))
                    })?;
                    self.take(total, key)?;
                } else {
                    for _ in 0..count {
                        self.skip_value(item, key, depth + 1)?;
                    }
                }
                Ok(None)
            }
            _ => candle_core::bail!(
                "{}: metadata {key}: unknown value type {ty} at offset {}",
                self.file,
                self.pos
            ),
        }
    }
}

/// The ggml type of id `id`, or an error naming the tensor (Candle's own reader names only
/// the number).
pub fn ggml_dtype(id: u32, file: &str, tensor: &str) -> Result<GgmlDType> {
    Ok(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        30 => GgmlDType::BF16,
        9 | 15 => candle_core::bail!(
            "{file}: tensor {tensor} has type {} (ggml type id {id}), an activation type that \
             is not supported for weights",
            if id == 9 { "Q8_1" } else { "Q8_K" }
        ),
        _ => candle_core::bail!(
            "{file}: tensor {tensor} has ggml type id {id}, which Candle does not know \
             (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K)"
        ),
    })
}

/// Walks the header of the GGUF `bytes` (the whole file), checking every length, type and
/// tensor extent. `file` names the file in errors.
pub fn scan(bytes: &[u8], file: &str) -> Result<GgufHeader> {
    let mut r = Reader {
        bytes,
        pos: 0,
        file,
        version: 3,
    };
    let magic = r.take(4, "the magic number")?;
    if magic != b"GGUF" {
        candle_core::bail!("{file}: not a GGUF file (magic {magic:?}, expected b\"GGUF\")");
    }
    r.version = r.u32("the version")?;
    if !(1..=3).contains(&r.version) {
        candle_core::bail!(
            "{file}: GGUF version {} is not supported (1 to 3)",
            r.version
        );
    }
    let n_tensors = r.len("the tensor count")?;
    let n_kv = r.len("the metadata count")?;
    // Every entry takes at least 8 bytes: refuse counts the file cannot hold before looping.
    if n_tensors.saturating_add(n_kv).saturating_mul(8) > bytes.len() {
        candle_core::bail!(
            "{file}: the header declares {n_tensors} tensors and {n_kv} metadata entries, \
             more than a file of {} bytes can hold",
            bytes.len()
        );
    }
    let mut alignment = 32usize;
    for _ in 0..n_kv {
        let key = r.string("a metadata key")?;
        let ty = r.u32(&key)?;
        let v = r.skip_value(ty, &key, 0)?;
        if key == "general.alignment" {
            alignment = match v {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a as usize,
                _ => candle_core::bail!(
                    "{file}: general.alignment must be a power of two (got {v:?})"
                ),
            };
        }
    }
    let mut raw = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = r.string(&format!("the name of tensor #{i}"))?;
        let n_dims = r.u32(&name)? as usize;
        if n_dims == 0 || n_dims > 4 {
            candle_core::bail!("{file}: tensor {name} declares {n_dims} dimensions (1 to 4)");
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            dims.push(r.len(&name)?);
        }
        dims.reverse();
        let ty = r.u32(&name)?;
        let offset = r.u64(&name)?;
        raw.push((name, dims, ty, offset));
    }
    let data_start = r.pos.div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, dims, ty, offset) in raw {
        let dtype = ggml_dtype(ty, file, &name)?;
        let elems = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .filter(|&e| e > 0);
        let bs = dtype.block_size();
        let cols = *dims.last().unwrap_or(&0);
        let Some(elems) = elems else {
            candle_core::bail!("{file}: tensor {name} has an empty or overflowing shape {dims:?}");
        };
        if cols % bs != 0 {
            candle_core::bail!(
                "{file}: tensor {name} ({dtype:?}, shape {dims:?}): rows of {cols} elements are \
                 not whole blocks of {bs}"
            );
        }
        let Some(len) = (elems / bs).checked_mul(dtype.type_size()) else {
            candle_core::bail!(
                "{file}: tensor {name} ({dtype:?}, shape {dims:?}): its byte size overflows \
                 (an overflowing shape)"
            );
        };
        let start = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(data_start));
        let end = start.and_then(|s| s.checked_add(len));
        match (start, end) {
            (Some(s), Some(e)) if e <= bytes.len() && s % alignment == 0 => {
                tensors.push(GgufTensorEntry {
                    name,
                    dims,
                    dtype,
                    start: s,
                    len,
                })
            }
            (Some(s), Some(_)) if s % alignment != 0 => candle_core::bail!(
                "{file}: tensor {name} starts at offset {offset} of the data section, not a \
                 multiple of the alignment {alignment}"
            ),
            _ => candle_core::bail!(
                "{file}: tensor {name} ({dtype:?}, shape {dims:?}) needs {len} bytes at data \
                 offset {offset}, past the end of the file ({} bytes, data section from {data_start}): \
                 truncated file or wrong size",
                bytes.len()
            ),
        }
    }
    let mut sorted: Vec<&GgufTensorEntry> = tensors.iter().collect();
    sorted.sort_by_key(|t| t.start);
    for w in sorted.windows(2) {
        if w[0].start + w[0].len > w[1].start {
            candle_core::bail!(
                "{file}: tensor {} ({:?}, shape {:?}, {} bytes) overlaps tensor {}: its byte size \
                 disagrees with the offsets in the file",
                w[0].name,
                w[0].dtype,
                w[0].dims,
                w[0].len,
                w[1].name
            );
        }
    }
    Ok(GgufHeader {
        tensors,
        data_start,
    })
}
