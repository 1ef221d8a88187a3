//! [`unrolled!`]: a block written out once per activation row, for the kernels' register
//! tiles (`avx2.rs`, `avx512.rs`, `panel.rs`).

/// `unrolled!(M, |i| { … })`: the block for `i` = 0, …, `M − 1` (`M` at most 8), written out
/// one after another, so that each copy indexes the kernels' per-row arrays with a constant.
/// A `for i in 0..M` loop whose body is too large for LLVM to unroll indexes them at run
/// time, so they live on the stack: Q4_0's eight-row kernel then stored and reloaded each
/// row's 512-bit accumulator per block (`perf annotate`: the store and the instruction after
/// it took half its samples). A macro, not a function taking a closure: a closure's calls
/// are not always inlined into the kernel.
macro_rules! unrolled {
    ($m:expr, |$i:ident| $body:block) => {{
        const { assert!($m <= 8, "unrolled!: at most 8 copies") };
        $crate::repack::unrolled!(@copies $m, $i, $body, 0 1 2 3 4 5 6 7);
    }};
    (@copies $m:expr, $i:ident, $body:block, $($n:literal)*) => {
        $(
            if $m > $n {
                let $i: usize = $n;
                $body
            }
        )*
    };
}
pub(crate) use unrolled;
