//! The elements of a KV cache the attention kernels read ([`KvElement`]): f32 as it is, f16
//! widened to f32 in registers by the AVX2 decode loops (`vcvtph2ps`), and otherwise once per
//! task into a scratch buffer of the thread ([`WIDENED`]), which stays in the core's cache
//! while the f32 kernels read it.

/// An element of a KV cache the kernels read: f32 as it is, f16 widened to f32 (exactly) as it
/// is read.
pub trait KvElement: Copy + Send + Sync + 'static {
    /// The buffer as f32, when it is f32.
    fn as_f32(data: &[Self]) -> Option<&[f32]>;
    /// `src` widened to f32 into `dst` (the same length).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// The element as f32 (exact).
    fn get(self) -> f32;
    /// Eight elements at `p` as f32 (exact).
    ///
    /// # Safety
    /// avx2 and f16c (inline this into a function that enables them); eight elements
    /// readable at `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen elements at `p` as f32 (exact).
    ///
    /// # Safety
    /// avx512f (inline this into a function that enables it); sixteen elements readable at
    /// `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl KvElement for f32 {
    fn as_f32(data: &[f32]) -> Option<&[f32]> {
        Some(data)
    }

    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }

    #[inline(always)]
    fn get(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
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

    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const half::f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const half::f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

std::thread_local! {
    /// A task's keys and values widened to f32 (a cache of f16).
    pub(super) static WIDENED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}
