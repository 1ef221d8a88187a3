//! The elements of a KV cache the attention kernels read ([`KvElement`]): f32 as it is, f16
//! widened to f32 once per task into a scratch buffer of the thread ([`WIDENED`]), which
//! stays in the core's cache while the f32 kernels read it.

/// An element of a KV cache the kernels read: f32 as it is, f16 widened to f32 per task.
pub trait KvElement: Copy + Send + Sync + 'static {
    /// The buffer as f32, when it is f32.
    fn as_f32(data: &[Self]) -> Option<&[f32]>;
    /// `src` widened to f32 into `dst` (the same length).
    fn widen(src: &[Self], dst: &mut [f32]);
}

impl KvElement for f32 {
    fn as_f32(data: &[f32]) -> Option<&[f32]> {
        Some(data)
    }

    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
}

impl KvElement for half::f16 {
    fn as_f32(_: &[half::f16]) -> Option<&[f32]> {
        None
    }

    fn widen(src: &[half::f16], dst: &mut [f32]) {
        // F16C where the CPU has it (half detects it at run time).
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst)
    }
}

std::thread_local! {
    /// A task's keys and values widened to f32 (a cache of f16).
    pub(super) static WIDENED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}
