//! Which implementation of the inner loops runs: [`Kernel::Scalar`] (portable, the reference),
//! [`Kernel::Avx2`] (x86-64 AVX2 + FMA + F16C), [`Kernel::Avx512Vnni`] (AVX2 plus
//! AVX-512 F/BW/VL and VNNI's `vpdpbusd`) or [`Kernel::Amx`] (AVX-512 VNNI plus AMX-INT8
//! tiles), chosen at run time, and the environment switch `CANDLE_TP_KERNEL` that forces one.
//!
//! | `CANDLE_TP_KERNEL` | [`Kernel::detect`] gives |
//! |---|---|
//! | unset, empty or `auto` | the fastest kernel this CPU runs ([`Kernel::fastest`]: not yet [`Kernel::Amx`]) |
//! | `scalar` | [`Kernel::Scalar`] |
//! | `avx2` | [`Kernel::Avx2`] where the CPU has it; elsewhere the fastest available, with one warning on stderr |
//! | `avx512vnni` | [`Kernel::Avx512Vnni`] where the CPU has it; elsewhere likewise |
//! | `amx` | [`Kernel::Amx`] where the CPU and the OS offer it; elsewhere likewise, and [`Kernel::check_forced`] (which loading a quantized weight calls) is an error naming AMX |
//!
//! Every caller of the crate's kernels (the quantized matmuls, the small-m dense product)
//! takes its kernel from [`Kernel::detect`], so forcing `scalar` runs the whole model on the
//! portable code: that is how the scalar path is tested on a host that has AVX2.
//!
//! [`Kernel::Avx512Vnni`] runs VNNI code where the crate has it (the repacked products of every
//! type, whose byte dot products become `vpdpbusd` and Q6_K's scaling `vpdpwssd`: the 32-wide
//! types on 512-bit vectors, sixteen weight rows at once, [`crate::repack`]; the k-quants
//! likewise for 2-39 activation rows and in panels of sixteen unpacked weight rows above, one
//! row on the four-row kernel; the attention's decode loops and prompt tiles on 512-bit
//! vectors, [`crate::attention`]) and the AVX2 code everywhere else (the per-row f32 kernels,
//! the small-m product); its results are bit for bit the AVX2 kernel's (tested). candle 0.11.1's own
//! `QMatMul` also has AVX-512 VNNI and AVX-VNNI paths, see [`cpu_features`].
//!
//! [`Kernel::Amx`] is [`Kernel::Avx512Vnni`] except where the crate has tile code: the
//! repacked products of the 32-wide types in tiles of eight activation rows
//! ([`crate::repack`]'s `amx.rs`), with the same integers and f64 steps, so the same bits.

use std::sync::OnceLock;

/// The environment variable that forces a kernel (`scalar`, `avx2` or `auto`).
pub const KERNEL_ENV: &str = "CANDLE_TP_KERNEL";

/// Which implementation of the quantized dot products and the small-m product runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Portable Rust, the reference every SIMD kernel is tested against.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (Haswell / Zen and later), checked at run time.
    Avx2,
    /// [`Kernel::Avx2`] plus AVX-512 F, BW, VL and VNNI (Ice Lake, Zen 4 and later), checked
    /// at run time: `vpdpbusd` for the byte dot products where the crate has such a kernel,
    /// the AVX2 code elsewhere.
    Avx512Vnni,
    /// [`Kernel::Avx512Vnni`] plus AMX-INT8 tiles (Sapphire Rapids and later Xeons), checked
    /// at run time (CPUID, and Linux's `arch_prctl(ARCH_REQ_XCOMP_PERM)` granting the tile
    /// state): `tdpbsud` for the products where the crate has tile code, the AVX-512 VNNI
    /// code elsewhere.
    Amx,
}

impl Kernel {
    /// Every kernel the crate has, the reference first.
    pub const ALL: [Kernel; 4] = [
        Kernel::Scalar,
        Kernel::Avx2,
        Kernel::Avx512Vnni,
        Kernel::Amx,
    ];

    /// The kernel to run: the one `CANDLE_TP_KERNEL` forces if this CPU has it, else the
    /// fastest this CPU supports. The variable is read once per process.
    pub fn detect() -> Self {
        static CHOSEN: OnceLock<Kernel> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let best = Self::fastest();
            match Self::forced() {
                Ok(Some(k)) if k.is_available() => k,
                Ok(Some(k)) => {
                    eprintln!(
                        "candle-tp: {KERNEL_ENV}={} asks for a kernel this CPU cannot run \
                         ({}); running {} instead",
                        k.name(),
                        cpu_features(),
                        best.name()
                    );
                    best
                }
                Ok(None) => best,
                Err(e) => {
                    eprintln!("candle-tp: {e}; running {}", best.name());
                    best
                }
            }
        })
    }

    /// The fastest kernel this CPU supports, whatever the environment says.
    ///
    /// [`Kernel::Amx`] is not among them yet: its tile code has run only on the emulation
    /// (`repack/amx.rs`) since no AMX host was at hand when it was written, so it runs where
    /// `CANDLE_TP_KERNEL=amx` asks for it (`scripts/bench-device.sh` does, once the kernel
    /// tests pass on that host) until a measurement on one says it is the faster.
    pub fn fastest() -> Self {
        if Self::Avx512Vnni.is_available() {
            Self::Avx512Vnni
        } else if Self::Avx2.is_available() {
            Self::Avx2
        } else {
            Self::Scalar
        }
    }

    /// The kernel `CANDLE_TP_KERNEL` names: `None` when it is unset, empty or `auto`; an
    /// error naming the value when it is none of the kernels' names.
    pub fn forced() -> Result<Option<Self>, String> {
        match std::env::var(KERNEL_ENV) {
            Err(_) => Ok(None),
            Ok(v) => Self::parse(&v),
        }
    }

    /// An error where `CANDLE_TP_KERNEL` forces [`Kernel::Amx`] on a host that cannot run it
    /// (no AMX-INT8, or an OS that does not grant the tile state), naming AMX and the CPU's
    /// features; `Ok` otherwise. The other kernels, forced where absent, fall back to the
    /// fastest one with a warning ([`Kernel::detect`]); AMX is absent from most hosts, so a
    /// benchmark that asks for it must not quietly measure something else.
    pub fn check_forced() -> Result<(), String> {
        Self::check(Self::forced()?)
    }

    /// [`Kernel::check_forced`] of a forced kernel (`None`: none forced).
    fn check(forced: Option<Self>) -> Result<(), String> {
        match forced {
            Some(Self::Amx) if !Self::Amx.is_available() => Err(format!(
                "{KERNEL_ENV}=amx: this host cannot run AMX tiles (they need amx-tile and \
                 amx-int8 on the CPU and Linux granting the tile state; here: {}); unset it \
                 or choose avx512vnni, avx2 or scalar",
                cpu_features()
            )),
            _ => Ok(()),
        }
    }

    /// Parses a kernel name as `CANDLE_TP_KERNEL` takes it (case-insensitive): `scalar`,
    /// `avx2`, `avx512vnni`, `amx`, or `auto` / empty for none.
    ///
    /// ```
    /// use candle_tp_kernels::kernel::Kernel;
    /// assert_eq!(Kernel::parse("AVX2"), Ok(Some(Kernel::Avx2)));
    /// assert_eq!(Kernel::parse("auto"), Ok(None));
    /// assert!(Kernel::parse("avx512").unwrap_err().contains("avx512"));
    /// ```
    pub fn parse(v: &str) -> Result<Option<Self>, String> {
        let v = v.trim().to_ascii_lowercase();
        match v.as_str() {
            "" | "auto" => Ok(None),
            _ => Self::ALL
                .into_iter()
                .find(|k| k.name() == v)
                .map(Some)
                .ok_or_else(|| {
                    format!(
                        "{KERNEL_ENV}={v} is not a kernel (scalar, avx2, avx512vnni, amx or auto)"
                    )
                }),
        }
    }

    /// The kernel's name as `CANDLE_TP_KERNEL` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::Avx512Vnni => "avx512vnni",
            Self::Amx => "amx",
        }
    }

    /// Whether the kernel runs the AVX2 code (where it has no code of its own).
    pub fn has_avx2(self) -> bool {
        matches!(self, Self::Avx2 | Self::Avx512Vnni | Self::Amx)
    }

    /// Whether the kernel runs the AVX-512 VNNI code (where it has no code of its own).
    pub fn has_avx512(self) -> bool {
        matches!(self, Self::Avx512Vnni | Self::Amx)
    }

    /// Whether this CPU can run the kernel.
    pub fn is_available(self) -> bool {
        // Asked before every group of every product: the answers, detected once.
        static AVAILABLE: OnceLock<[bool; 4]> = OnceLock::new();
        let available = AVAILABLE.get_or_init(|| Self::ALL.map(Self::detect_available));
        available[self as usize]
    }

    /// Whether this CPU has the kernel's features (asks the CPU).
    fn detect_available(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Vnni => {
                Self::Avx2.detect_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Amx => Self::Avx512Vnni.detect_available() && amx::usable(),
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx2 | Self::Avx512Vnni | Self::Amx => false,
        }
    }

    /// The kernels a test of the SIMD code must cover, printed on stderr with the CPU's
    /// features, so that a test log says which paths ran:
    /// - `CANDLE_TP_KERNEL` names one kernel: that one alone (and a panic if this CPU cannot
    ///   run it: a forced path that is absent must fail, not pass vacuously);
    /// - otherwise every kernel this CPU runs, and a panic on an x86-64 CPU without AVX2
    ///   (whose tests would otherwise pass without the path they mean to test), which names
    ///   the switch that restricts them to the scalar kernel. [`Kernel::Avx512Vnni`] and
    ///   [`Kernel::Amx`] are tested where the CPU has them; elsewhere the printed list shows
    ///   them absent, and a line says "AMX kernel not run: no AMX" (force one with the switch
    ///   to make its absence a failure).
    ///
    /// # Panics
    /// As above, and on a `CANDLE_TP_KERNEL` value that names no kernel.
    pub fn under_test() -> Vec<Self> {
        let ks = match Self::forced() {
            Err(e) => panic!("{e}"),
            Ok(Some(k)) => {
                assert!(
                    k.is_available(),
                    "{KERNEL_ENV}={} forces a kernel this CPU cannot run ({})",
                    k.name(),
                    cpu_features()
                );
                vec![k]
            }
            Ok(None) if cfg!(target_arch = "x86_64") => {
                assert!(
                    Self::Avx2.is_available(),
                    "the AVX2 kernel cannot run on this CPU ({}): its tests would pass without \
                     it; set {KERNEL_ENV}=scalar to test the scalar kernel alone",
                    cpu_features()
                );
                Self::ALL.into_iter().filter(|k| k.is_available()).collect()
            }
            Ok(None) => vec![Self::Scalar],
        };
        let names: Vec<_> = ks.iter().map(|k| k.name()).collect();
        eprintln!(
            "kernels under test: {} (CPU: {})",
            names.join(", "),
            cpu_features()
        );
        if !ks.contains(&Self::Amx) {
            eprintln!("AMX kernel not run: no AMX ({})", amx_support());
        }
        ks
    }
}

/// The CPU features that choose a path here or in candle, e.g. `avx2 fma f16c -avx512f
/// -avx512bw -avx512vl -avx512vnni -avxvnni -amx-tile -amx-int8`, a `-` marking an absent one ([`amx_support`] last).
///
/// candle 0.11.1's `QMatMul` takes a different path on AVX-512 VNNI or AVX-VNNI CPUs: it
/// repacks Q8_0 weights whose shape is a multiple of 16 rows × 256 columns and quantizes the
/// activations to Q8K (one scale per 256 values instead of one per 32), so its Q8_0 products
/// there differ from ggml's by that coarser rounding (~0.4 % of the output's magnitude
/// measured on a Zen 4 host), not by f32 summation order.
pub fn cpu_features() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let f = [
            ("avx2", is_x86_feature_detected!("avx2")),
            ("fma", is_x86_feature_detected!("fma")),
            ("f16c", is_x86_feature_detected!("f16c")),
            ("avx512f", is_x86_feature_detected!("avx512f")),
            ("avx512bw", is_x86_feature_detected!("avx512bw")),
            ("avx512vl", is_x86_feature_detected!("avx512vl")),
            ("avx512vnni", is_x86_feature_detected!("avx512vnni")),
            ("avxvnni", is_x86_feature_detected!("avxvnni")),
        ];
        f.iter()
            .map(|(n, on)| if *on { n.to_string() } else { format!("-{n}") })
            .chain([amx_support()])
            .collect::<Vec<_>>()
            .join(" ")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        format!("{}: no SIMD kernel of this crate", std::env::consts::ARCH)
    }
}

/// AMX on this host, as [`Kernel::check_forced`] names it: e.g. `amx-tile amx-int8 (tile
/// state granted)` or `-amx-tile -amx-int8`.
pub fn amx_support() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let (tile, int8) = amx::cpu_bits();
        let bit = |on: bool, n: &str| if on { n.to_string() } else { format!("-{n}") };
        let os = if tile && int8 {
            if amx::granted() {
                " (tile state granted)"
            } else {
                " (the OS refused the tile state)"
            }
        } else {
            ""
        };
        format!("{} {}{os}", bit(tile, "amx-tile"), bit(int8, "amx-int8"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        "no AMX off x86-64".to_string()
    }
}

/// Detection of AMX-INT8: std's `is_x86_feature_detected!("amx-int8")` is unstable, so CPUID
/// is read here, and Linux asked for the tile state (without which the first tile instruction
/// faults).
#[cfg(target_arch = "x86_64")]
mod amx {
    use std::sync::OnceLock;

    /// CPUID leaf 7's AMX-TILE (EDX bit 24) and AMX-INT8 (bit 25).
    pub fn cpu_bits() -> (bool, bool) {
        #[allow(unused_unsafe)]
        // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is read only where leaf 0 says
        // it exists.
        let edx = unsafe {
            if std::arch::x86_64::__cpuid(0).eax < 7 {
                return (false, false);
            }
            std::arch::x86_64::__cpuid_count(7, 0).edx
        };
        (edx & (1 << 24) != 0, edx & (1 << 25) != 0)
    }

    /// Whether this process may use the tile registers: on Linux (5.16+) it must ask once with
    /// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; the answer holds for every
    /// thread of the process.
    pub fn granted() -> bool {
        static GRANTED: OnceLock<bool> = OnceLock::new();
        *GRANTED.get_or_init(|| {
            #[cfg(target_os = "linux")]
            {
                const SYS_ARCH_PRCTL: i64 = 158;
                const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
                const XFEATURE_XTILEDATA: i64 = 18;
                let ret: i64;
                // SAFETY: the arch_prctl system call with these arguments only changes which
                // extended states the process may use; it reads and writes no memory of ours.
                unsafe {
                    std::arch::asm!(
                        "syscall",
                        inlateout("rax") SYS_ARCH_PRCTL => ret,
                        in("rdi") ARCH_REQ_XCOMP_PERM,
                        in("rsi") XFEATURE_XTILEDATA,
                        lateout("rcx") _,
                        lateout("r11") _,
                        options(nostack),
                    );
                }
                ret == 0
            }
            #[cfg(not(target_os = "linux"))]
            {
                false
            }
        })
    }

    /// Both CPUID bits, and the OS's grant.
    pub fn usable() -> bool {
        let (tile, int8) = cpu_bits();
        tile && int8 && granted()
    }
}

/// `$scalar` for [`Kernel::Scalar`]; for [`Kernel::Avx2`], after asserting that this CPU runs
/// it, `$avx2` in an `unsafe` block on x86-64 (it may call `#[target_feature(enable =
/// "avx2,fma,f16c")]` functions: the assertion checked those features; any other requirement
/// of theirs is the caller's to meet); for [`Kernel::Avx512Vnni`] likewise `$avx512`, which
/// may also use AVX-512 F/BW/VL and VNNI, or `$avx2` where no `avx512` arm is given; for
/// [`Kernel::Amx`] the same `$avx512` (whose code may branch on the kernel for its tiles).
macro_rules! by_kernel {
    ($kernel:expr, scalar => $scalar:expr, avx2 => $avx2:expr $(,)?) => {
        $crate::kernel::by_kernel!($kernel, scalar => $scalar, avx2 => $avx2, avx512 => $avx2)
    };
    ($kernel:expr, scalar => $scalar:expr, avx2 => $avx2:expr, avx512 => $avx512:expr $(,)?) => {
        match $kernel {
            $crate::kernel::Kernel::Scalar => $scalar,
            kernel @ $crate::kernel::Kernel::Avx2 => {
                assert!(
                    kernel.is_available(),
                    "the AVX2 kernel needs avx2, fma and f16c"
                );
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the CPU features were checked just above.
                unsafe {
                    $avx2
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("is_available is false off x86-64")
            }
            kernel @ ($crate::kernel::Kernel::Avx512Vnni | $crate::kernel::Kernel::Amx) => {
                assert!(
                    kernel.is_available(),
                    "the {} kernel needs avx2, fma, f16c, avx512f, avx512bw, avx512vl and \
                     avx512vnni (and AMX-INT8 for amx)",
                    kernel.name()
                );
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the CPU features were checked just above.
                unsafe {
                    $avx512
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("is_available is false off x86-64")
            }
        }
    };
}
pub(crate) use by_kernel;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_values_are_named() {
        for k in Kernel::ALL {
            assert_eq!(Kernel::parse(k.name()), Ok(Some(k)));
        }
        assert_eq!(Kernel::parse(" Scalar "), Ok(Some(Kernel::Scalar)));
        assert_eq!(Kernel::parse(""), Ok(None));
        let e = Kernel::parse("avx512").unwrap_err();
        assert!(e.contains(KERNEL_ENV) && e.contains("avx512"), "{e}");
        assert!(e.contains("amx"), "{e}");
    }

    #[test]
    fn amx_forced_where_absent_is_an_error_naming_amx() {
        assert_eq!(Kernel::check(None), Ok(()));
        assert_eq!(Kernel::check(Some(Kernel::Avx2)), Ok(()));
        match Kernel::check(Some(Kernel::Amx)) {
            Ok(()) => {
                assert!(Kernel::Amx.is_available());
                eprintln!("AMX present ({}): nothing to refuse", amx_support());
            }
            Err(e) => {
                assert!(!Kernel::Amx.is_available());
                assert!(
                    e.contains("amx") && e.contains("AMX") && e.contains(KERNEL_ENV),
                    "{e}"
                );
                assert!(e.contains(&amx_support()), "{e}");
            }
        }
    }

    #[test]
    fn availability_is_looked_up_at_each_kernels_index() {
        for (i, k) in Kernel::ALL.into_iter().enumerate() {
            assert_eq!(k as usize, i, "{k:?}");
            assert_eq!(k.is_available(), k.detect_available(), "{k:?}");
        }
    }

    #[test]
    fn detect_honours_the_switch() {
        // The test process's own environment decides: whatever it forces is what runs.
        match Kernel::forced() {
            Ok(Some(k)) if k.is_available() => assert_eq!(Kernel::detect(), k),
            _ => assert_eq!(Kernel::detect(), Kernel::fastest()),
        }
        assert!(Kernel::detect().is_available());
        assert!(Kernel::under_test().contains(&Kernel::detect()));
    }
}
