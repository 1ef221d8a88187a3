//! Keeping the memory a forward frees for the next forward.
//!
//! Candle allocates a fresh buffer for the output of every op, and frees it when the tensor
//! drops: a prefill of 128 tokens through a 1 B Llama allocates and frees some 4-16 MiB
//! buffers a few hundred times. glibc's malloc returns such buffers to the kernel (buffers
//! above its mmap threshold are unmapped; the top of a thread's arena is trimmed), so the next
//! forward takes a page fault and a page of kernel zeroing for every 4 KiB it writes. On the
//! 1 B model's Q5_K_M prefill that was 5 % of the samples (`clear_page_erms`, the faults and
//! the `memset` of fresh pages). llama.cpp allocates its compute buffers once; candle-tp's
//! binaries call [`retain_freed_memory`] instead, which keeps freed memory in the process for
//! reuse. Measured on a Zen 4 core (1 B Q5_K_M, pp 128, world 1, one thread, 3 interleaved
//! runs): 110-114 tok/s before, 115-117 after; at world 2 within the noise (each rank's
//! buffers are half as large, and glibc's own threshold already keeps many of them).

/// The mmap threshold set: glibc's largest (`DEFAULT_MMAP_THRESHOLD_MAX` on 64-bit targets).
/// Larger buffers (a model's biggest weights, loaded once) are still mapped on their own.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: usize = 32 << 20;

/// How much free memory may stay at the top of an arena before malloc gives it back.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: usize = 512 << 20;

/// Asks glibc's malloc to keep freed memory for reuse: buffers up to 32 MiB (glibc's largest mmap
/// threshold) come from the heap instead of their own mappings, and up to 512 MiB of free
/// memory stays in each arena. A process-wide setting, for the start of a program that runs
/// forwards (candle-tp's `generate`, `bench_generate`, `train` and `candle-tp-serve` call
/// it); the price is a resident size up to the peak of one forward's temporaries above what
/// is live.
/// Returns whether both settings took: `false` off glibc (other allocators keep their own
/// caches), where it does nothing.
///
/// ```
/// let kept = candle_tp::retain_freed_memory();
/// assert_eq!(kept, cfg!(all(target_os = "linux", target_env = "gnu")));
/// ```
pub fn retain_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes malloc's tunables; both values are in range.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Gives the memory malloc holds free back to the kernel (glibc's `malloc_trim(0)`, which
/// releases the free pages of every arena). The model loader calls it once a model is built:
/// loading leaves freed copies behind (a quantized weight's blocks, replaced by the kernels'
/// repacked layout), and under [`retain_freed_memory`] the last of them stayed resident when
/// nothing loaded after them reused the memory (11 MiB of SmolLM2's Q4_1 file; at ep 2 the
/// LM head's half, 26 MiB of the Mixtral GGUF). The forwards' temporaries come back on the
/// first forward and stay, as [`retain_freed_memory`] means them to.
/// Returns whether any memory was released (`false` off glibc, where it does nothing).
///
/// ```
/// candle_tp::trim_freed_memory();
/// ```
pub fn trim_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only returns free pages to the kernel.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    /// Minor page faults of the calling thread so far.
    fn faults() -> i64 {
        // SAFETY: getrusage fills the struct it is given.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        assert_eq!(
            unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) },
            0
        );
        usage.ru_minflt
    }

    /// What a forward does to memory: buffers of several sizes written, then freed, in turns,
    /// on a thread of its own (its own arena, as the forwards run on rayon workers). After a
    /// first round, the next rounds reuse the memory: no page faults here, where glibc's
    /// defaults fault again in every round (409 per round on this project's machine, with
    /// transparent huge pages on `madvise`; checked by leaving the call out).
    #[test]
    fn freed_buffers_are_reused_without_page_faults() {
        assert!(super::retain_freed_memory());
        let per_round = std::thread::spawn(|| {
            let round = || {
                for mib in [4usize, 16, 2, 8] {
                    let mut v = vec![0u8; mib << 20];
                    for page in v.chunks_mut(4096) {
                        page[0] = 1;
                    }
                    std::hint::black_box(&v);
                }
            };
            round();
            let before = faults();
            for _ in 0..5 {
                round();
            }
            (faults() - before) / 5
        })
        .join()
        .unwrap();
        // 30 MiB written per round: 7680 pages.
        assert!(
            per_round < 100,
            "{per_round} page faults per round of 30 MiB written and freed"
        );
    }
}
