//! What a safetensors checkpoint is once opened: its memory-mapped files ([`MappedFile`]) and
//! where each tensor lives in them ([`Entry`]). The header walk (`header.rs`) builds them, the
//! source (`safetensors.rs`) reads the tensors' bytes through them.

use std::ops::Range;
use std::path::PathBuf;

use candle_core::DType;
use memmap2::Mmap;

/// One memory-mapped safetensors file.
pub(super) struct MappedFile {
    pub(super) path: PathBuf,
    pub(super) mmap: Mmap,
}

/// Where one tensor lives and how it is stored.
pub(super) struct Entry {
    /// Index into `SafetensorsSource::files`.
    pub(super) file: usize,
    /// The stored dtype, or the safetensors name of a dtype this source cannot load.
    pub(super) dtype: std::result::Result<DType, String>,
    pub(super) shape: Vec<usize>,
    /// Absolute byte range in the file (header included), already validated.
    pub(super) bytes: Range<usize>,
}
