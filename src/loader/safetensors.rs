//! A memory-mapped, sharded safetensors checkpoint that reads only the bytes each rank needs.
//!
//! [`SafetensorsSource`] memory-maps every file, has the `safetensors` crate parse and validate
//! its header (with the checks it lacks and readable errors added in `header.rs`), and
//! serves [`TensorSource::load_ranges`] by copying, straight from the map into the output
//! buffer, only the runs of bytes that make up the requested slice. Any dimension can be
//! split, in uneven pieces, and several ranges (the q, k and v rows of a fused `qkv_proj`)
//! are concatenated in one pass, so no rank ever reads or allocates the whole tensor.
//! candle-nn's `ShardedSafeTensors` only splits dimensions 0 and 1 evenly.
//!
//! Every offset and size read from a file is checked before it is used: a hostile or
//! truncated file gives an error naming the file and the tensor, never a panic, an
//! out-of-bounds read or a huge allocation.

mod header;
mod mapped;

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};

use candle_core::{bail, DType, Device, Result, Shape, Tensor, WithDType};
use serde_json::Value;

use self::header::open_file;
use self::mapped::{Entry, MappedFile};
use super::source::{RangeRequest, TensorSource};

/// The single-file checkpoint name.
const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
const INDEX_FILE: &str = "model.safetensors.index.json";

/// A safetensors checkpoint (one file or an index plus shards), memory-mapped, that reads only
/// the byte ranges of the slices asked for.
///
/// The maps are read-only and shared; the source is `Send + Sync`. As with any memory-mapped
/// file, the files must not be modified while the source is alive. Symbolic links are
/// followed (the Hugging Face cache links snapshot files to blobs elsewhere).
pub struct SafetensorsSource {
    files: Vec<MappedFile>,
    tensors: HashMap<String, Entry>,
    /// What was opened, for error messages (a file list or the index path).
    origin: String,
}

impl std::fmt::Debug for SafetensorsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsSource")
            .field("origin", &self.origin)
            .field("files", &self.files.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl SafetensorsSource {
    /// Opens `model.safetensors`, or `model.safetensors.index.json` plus its shards, in `dir`.
    ///
    /// The single file wins when both exist. With an index, shard names must be plain paths
    /// inside `dir` (no absolute path, no `..`), every shard must exist and hold every
    /// tensor the index assigns to it.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            bail!(
                "model directory {} does not exist or is not a directory (expected {SINGLE_FILE} or {INDEX_FILE} in it)",
                dir.display()
            );
        }
        let single = dir.join(SINGLE_FILE);
        if single.is_file() {
            return Self::from_files(&[single]);
        }
        let index = dir.join(INDEX_FILE);
        if index.is_file() {
            return Self::from_index(dir, &index);
        }
        bail!(
            "no safetensors checkpoint in {}: looked for {SINGLE_FILE} and {INDEX_FILE}, found neither",
            dir.display()
        )
    }

    /// Opens the given safetensors files (each memory-mapped). A tensor name may appear in
    /// only one of them.
    pub fn from_files(paths: &[impl AsRef<Path>]) -> Result<Self> {
        if paths.is_empty() {
            bail!("SafetensorsSource::from_files: no files given");
        }
        let mut files: Vec<MappedFile> = Vec::with_capacity(paths.len());
        let mut tensors: HashMap<String, Entry> = HashMap::new();
        for (i, p) in paths.iter().enumerate() {
            let (file, entries) = open_file(p.as_ref())?;
            for (name, mut entry) in entries {
                if let Some(prev) = tensors.get(&name) {
                    let (a, b) = (files[prev.file].path.display(), file.path.display());
                    bail!("tensor '{name}' is stored in both {a} and {b}");
                }
                entry.file = i;
                tensors.insert(name, entry);
            }
            files.push(file);
        }
        let origin = files
            .iter()
            .map(|f| f.path.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        Ok(Self {
            files,
            tensors,
            origin,
        })
    }

    /// Opens a sharded checkpoint from its index: `{"weight_map": {tensor: shard_file}}`.
    fn from_index(dir: &Path, index: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(index).map_err(|e| {
            candle_core::Error::Msg(format!("cannot read {}: {e}", index.display()))
        })?;
        let json: Value = serde_json::from_str(&text).map_err(|e| {
            candle_core::Error::Msg(format!("{} is not valid JSON: {e}", index.display()))
        })?;
        let Some(map) = json.get("weight_map").and_then(Value::as_object) else {
            bail!(
                "{} has no \"weight_map\" object mapping tensor names to shard files",
                index.display()
            );
        };
        // Shard names in first-seen order, and each tensor's shard.
        let mut shard_names: Vec<&str> = Vec::new();
        let mut wanted: Vec<(&str, usize)> = Vec::with_capacity(map.len());
        for (tensor, shard) in map {
            let Some(shard) = shard.as_str() else {
                bail!(
                    "{}: the shard of tensor '{tensor}' is {shard}, not a file name",
                    index.display()
                );
            };
            let pos = match shard_names.iter().position(|s| *s == shard) {
                Some(p) => p,
                None => {
                    shard_names.push(shard);
                    shard_names.len() - 1
                }
            };
            wanted.push((tensor, pos));
        }
        let mut files = Vec::with_capacity(shard_names.len());
        let mut per_shard = Vec::with_capacity(shard_names.len());
        for shard in &shard_names {
            let path = shard_path(dir, index, shard)?;
            if !path.is_file() {
                bail!(
                    "shard {shard} named in {} is missing (expected {})",
                    index.display(),
                    path.display()
                );
            }
            let (file, entries) = open_file(&path)?;
            files.push(file);
            per_shard.push(entries);
        }
        let mut tensors = HashMap::with_capacity(wanted.len());
        for (tensor, shard) in wanted {
            let Some(mut entry) = per_shard[shard].remove(tensor) else {
                bail!(
                    "tensor '{tensor}' is assigned to shard {} by {}, but that shard does not contain it",
                    files[shard].path.display(),
                    index.display()
                );
            };
            entry.file = shard;
            tensors.insert(tensor.to_string(), entry);
        }
        Ok(Self {
            files,
            tensors,
            origin: index.display().to_string(),
        })
    }

    /// Names of all tensors, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        names
    }

    /// Stored dtype of a tensor; `None` when there is no such tensor, an error when it is
    /// stored in a dtype this source cannot load.
    pub fn dtype(&self, name: &str) -> Result<Option<DType>> {
        match self.tensors.get(name) {
            None => Ok(None),
            Some(e) => self.stored_dtype(name, e).map(Some),
        }
    }

    fn stored_dtype(&self, name: &str, entry: &Entry) -> Result<DType> {
        match &entry.dtype {
            Ok(d) => Ok(*d),
            Err(st) => bail!(
                "tensor '{name}' in {} is stored as {st}, which is not supported (supported: F32, F16, BF16, F64, I64, U32, U8)",
                self.files[entry.file].path.display()
            ),
        }
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        if let Some(e) = self.tensors.get(name) {
            return Ok(e);
        }
        let similar = similar_names(name, self.tensors.keys(), 3);
        let hint = if similar.is_empty() {
            String::new()
        } else {
            format!("; similar names: {}", similar.join(", "))
        };
        bail!(
            "tensor '{name}' not found in {} ({} tensors){hint}",
            self.origin,
            self.tensors.len()
        )
    }

    /// Copies the slice `ranges` along `dim` of `name` into a new CPU tensor of the stored
    /// dtype.
    fn read_slice(&self, name: &str, dim: usize, ranges: &[Range<usize>]) -> Result<Tensor> {
        let entry = self.entry(name)?;
        let dtype = self.stored_dtype(name, entry)?;
        let shape = &entry.shape;
        let file = &self.files[entry.file];
        if dim >= shape.len() {
            bail!(
                "tensor '{name}' in {} has shape {shape:?}: no dimension {dim} to slice",
                file.path.display()
            );
        }
        if ranges.is_empty() {
            bail!(
                "tensor '{name}' in {}: asked for an empty list of ranges along dim {dim}",
                file.path.display()
            );
        }
        let size = shape[dim];
        for r in ranges {
            if r.start > r.end || r.end > size {
                bail!(
                    "tensor '{name}' in {} of shape {shape:?}: range {}..{} along dim {dim} is out of bounds (size {size})",
                    file.path.display(),
                    r.start,
                    r.end
                );
            }
        }
        let elem = dtype.size_in_bytes();
        // All products below are bounded by the validated byte size of the tensor.
        let outer: usize = shape[..dim].iter().product();
        let inner_bytes: usize = shape[dim + 1..].iter().product::<usize>() * elem;
        let row_bytes = size * inner_bytes;
        let taken: usize = ranges.iter().map(|r| r.end - r.start).sum();
        let mut out_shape = shape.clone();
        out_shape[dim] = taken;
        let runs = (0..outer).flat_map(|o| {
            ranges.iter().map(move |r| {
                let start = o * row_bytes + r.start * inner_bytes;
                start..start + (r.end - r.start) * inner_bytes
            })
        });
        self.gather(name, entry, runs, outer * taken * inner_bytes, out_shape)
    }

    /// Copies the byte `runs` (relative to the tensor's data) of `name` into a new CPU tensor
    /// of the stored dtype and the given shape.
    fn gather(
        &self,
        name: &str,
        entry: &Entry,
        runs: impl Iterator<Item = Range<usize>>,
        total_bytes: usize,
        shape: Vec<usize>,
    ) -> Result<Tensor> {
        let data = &self.files[entry.file].mmap[entry.bytes.clone()];
        match self.stored_dtype(name, entry)? {
            DType::U8 => gather::<u8>(data, runs, total_bytes, shape),
            DType::U32 => gather::<u32>(data, runs, total_bytes, shape),
            DType::I64 => gather::<i64>(data, runs, total_bytes, shape),
            DType::F16 => gather::<half::f16>(data, runs, total_bytes, shape),
            DType::BF16 => gather::<half::bf16>(data, runs, total_bytes, shape),
            DType::F32 => gather::<f32>(data, runs, total_bytes, shape),
            DType::F64 => gather::<f64>(data, runs, total_bytes, shape),
            other => bail!("tensor '{name}': dtype {other:?} cannot be loaded"),
        }
    }
}

impl TensorSource for SafetensorsSource {
    fn shape(&self, name: &str) -> Result<Option<Shape>> {
        Ok(self.tensors.get(name).map(|e| Shape::from_dims(&e.shape)))
    }

    fn num_tensors(&self) -> Option<usize> {
        Some(self.tensors.len())
    }

    fn load(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let entry = self.entry(name)?;
        let len = entry.bytes.len();
        let t = self.gather(
            name,
            entry,
            std::iter::once(0..len),
            len,
            entry.shape.clone(),
        )?;
        convert_and_move(t, dtype, device)
    }

    fn load_ranges(&self, req: &RangeRequest<'_>) -> Result<Tensor> {
        let t = self.read_slice(req.name, req.dim, req.ranges)?;
        convert_and_move(t, req.dtype, req.device)
    }
}

/// Converts on the side where the data is smaller: before the move when narrowing (or
/// keeping) the dtype, after it when widening.
fn convert_and_move(t: Tensor, dtype: DType, device: &Device) -> Result<Tensor> {
    if t.dtype() == dtype {
        return t.to_device(device);
    }
    if device.is_cpu() || dtype.size_in_bytes() <= t.dtype().size_in_bytes() {
        t.to_dtype(dtype)?.to_device(device)
    } else {
        t.to_device(device)?.to_dtype(dtype)
    }
}

/// Element types whose every bit pattern is a valid value, so bytes can be copied into them.
///
/// # Safety
/// Implementors must be plain data with no padding and no invalid bit patterns.
unsafe trait Plain: WithDType {
    /// Turns a little-endian stored value into the native one.
    fn le_to_native(self) -> Self;
}

macro_rules! plain_int {
    ($($t:ty),*) => {$(
        // SAFETY: primitive integers have no padding and no invalid bit patterns.
        unsafe impl Plain for $t {
            fn le_to_native(self) -> Self { <$t>::from_le(self) }
        }
    )*};
}
plain_int!(u8, u32, i64);

macro_rules! plain_float {
    ($($t:ty),*) => {$(
        // SAFETY: these floats are plain bit containers of their integer width.
        unsafe impl Plain for $t {
            fn le_to_native(self) -> Self { <$t>::from_bits(self.to_bits().to_le()) }
        }
    )*};
}
plain_float!(f32, f64, half::f16, half::bf16);

/// Copies the byte `runs` of `data`, in order, into one new vector of `total_bytes` bytes and
/// wraps it as a CPU tensor of `shape`.
fn gather<T: Plain>(
    data: &[u8],
    runs: impl Iterator<Item = Range<usize>>,
    total_bytes: usize,
    shape: Vec<usize>,
) -> Result<Tensor> {
    let size = std::mem::size_of::<T>();
    if !total_bytes.is_multiple_of(size) {
        bail!("internal error: {total_bytes} bytes is not a whole number of {size}-byte elements");
    }
    let n = total_bytes / size;
    let mut out: Vec<T> = Vec::with_capacity(n);
    let spare: &mut [MaybeUninit<T>] = &mut out.spare_capacity_mut()[..n];
    // SAFETY: `spare` is `n * size` writable bytes owned by `out`; viewing them as bytes is
    // sound (MaybeUninit<u8> may hold anything).
    let dst: &mut [MaybeUninit<u8>] =
        unsafe { std::slice::from_raw_parts_mut(spare.as_mut_ptr().cast(), total_bytes) };
    let mut written = 0;
    let mut runs = runs.peekable();
    while let Some(mut run) = runs.next() {
        // Runs adjacent in the file are adjacent in the output too: copy them as one.
        while let Some(next) = runs.next_if(|next| next.start == run.end) {
            run.end = next.end;
        }
        let len = run.end - run.start;
        let (Some(src), Some(dst)) = (data.get(run.clone()), dst.get_mut(written..written + len))
        else {
            bail!(
                "internal error: byte run {run:?} does not fit the tensor data ({} bytes) or the output ({total_bytes} bytes)",
                data.len()
            );
        };
        // SAFETY: `src` and `dst` have the same length and do not overlap (one is the map,
        // the other a fresh allocation).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), len);
        }
        written += len;
    }
    if written != total_bytes {
        bail!("internal error: copied {written} bytes of {total_bytes}");
    }
    // SAFETY: all `n` elements were written above, and `T: Plain` accepts any bit pattern.
    unsafe { out.set_len(n) };
    if cfg!(target_endian = "big") {
        for v in out.iter_mut() {
            *v = v.le_to_native();
        }
    }
    Tensor::from_vec(out, shape, &Device::Cpu)
}

/// Resolves a shard name from an index, refusing anything that could leave `dir`.
fn shard_path(dir: &Path, index: &Path, shard: &str) -> Result<PathBuf> {
    let rel = Path::new(shard);
    let plain = !shard.is_empty()
        && rel
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if !plain || rel.is_absolute() {
        bail!(
            "{} names shard {shard:?}, which is not a plain relative path inside {} (absolute paths and '..' are refused)",
            index.display(),
            dir.display()
        );
    }
    Ok(dir.join(rel))
}

/// Up to `k` names closest to `name` by edit distance (only reasonably close ones).
fn similar_names<'a>(name: &str, names: impl Iterator<Item = &'a String>, k: usize) -> Vec<String> {
    let limit = (name.len() / 3).max(3);
    // The distance is at least the length difference: skip far names cheaply, and bound the
    // work on a hostile checkpoint with very many names.
    let mut scored: Vec<(usize, &String)> = names
        .filter(|n| n.len().abs_diff(name.len()) <= limit)
        .take(20_000)
        .map(|n| (edit_distance(name, n), n))
        .filter(|(d, _)| *d <= limit)
        .collect();
    scored.sort();
    scored
        .into_iter()
        .take(k)
        .map(|(_, n)| format!("'{n}'"))
        .collect()
}

/// Levenshtein distance over bytes.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.iter().enumerate() {
        cur[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}
