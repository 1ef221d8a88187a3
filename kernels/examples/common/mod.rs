//! What the kernel benchmarks share: their command line (`[ROUNDS]`, 5 by default), the
//! kernels this CPU runs that they compare (scalar excluded: it is the reference, not a
//! contender), named with the CPU's features on the first line, and one thread to run on.

use candle_tp_kernels::kernel::Kernel;

/// A benchmark's rounds, its kernels and a one-thread pool; prints the kernels line.
pub fn setup() -> (usize, Vec<Kernel>, rayon::ThreadPool) {
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|r| r.parse().expect("ROUNDS is a number"))
        .unwrap_or(5);
    let kernels: Vec<Kernel> = Kernel::ALL
        .into_iter()
        .filter(|k| *k != Kernel::Scalar && k.is_available())
        .collect();
    println!(
        "kernels: {kernels:?} (CPU: {})",
        candle_tp_kernels::kernel::cpu_features()
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    (rounds, kernels, pool)
}
