//! Picking the device a rank runs on from a command-line argument.

use candle_core::{Device, Result};

/// The device named by a `--device` argument: `cpu`, or `cuda` (the GPU `LOCAL_RANK`, which
/// `tprun` and `torchrun` set for each process on a node; 0 when unset). `cuda:N` picks GPU `N`
/// explicitly.
///
/// A build without the `cuda` feature asked for `cuda` fails with the command that rebuilds
/// it (`--features cuda,nccl`); a build with it fails with CUDA's own error (no driver, no
/// such GPU).
///
/// ```
/// let device = candle_tp::device_from_arg("cpu").unwrap();
/// assert!(device.is_cpu());
/// assert!(candle_tp::device_from_arg("tpu").is_err());
/// ```
pub fn device_from_arg(name: &str) -> Result<Device> {
    let name = name.trim();
    match name.to_ascii_lowercase().as_str() {
        "cpu" => Ok(Device::Cpu),
        "cuda" | "gpu" => {
            let local = match std::env::var("LOCAL_RANK") {
                Ok(v) if !v.trim().is_empty() => v.trim().parse::<usize>().map_err(|_| {
                    candle_core::Error::Msg(format!(
                        "--device {name}: LOCAL_RANK='{v}' is not a GPU index"
                    ))
                })?,
                _ => 0,
            };
            cuda(name, local)
        }
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(ordinal)) => cuda(name, ordinal),
            _ => candle_core::bail!(
                "--device '{name}' is not a device: use cpu, cuda (GPU LOCAL_RANK) or cuda:N"
            ),
        },
    }
}

#[cfg(feature = "cuda")]
fn cuda(name: &str, ordinal: usize) -> Result<Device> {
    Device::new_cuda(ordinal).map_err(|e| {
        candle_core::Error::Msg(format!(
            "--device {name}: cannot open CUDA device {ordinal} (is an NVIDIA driver installed \
             and a GPU visible? check nvidia-smi and CUDA_VISIBLE_DEVICES): {e}"
        ))
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda(name: &str, _ordinal: usize) -> Result<Device> {
    candle_core::bail!(
        "--device {name}: this build of candle-tp has no CUDA support; rebuild with \
         `cargo build --release --features cuda,nccl` (see docs/GPU.md)"
    )
}
