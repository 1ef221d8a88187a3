//! Picking the device a rank runs on, and the dtype of its weights, from command-line
//! arguments.

use candle_core::{DType, Device, Result};

/// The floating-point dtype named by a `--dtype` argument: `f32`, `f16` or `bf16`.
///
/// ```
/// assert_eq!(candle_tp::dtype_from_arg("bf16").unwrap(), candle_core::DType::BF16);
/// assert!(candle_tp::dtype_from_arg("u8").is_err());
/// ```
pub fn dtype_from_arg(name: &str) -> Result<DType> {
    match name {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        other => candle_core::bail!("unsupported --dtype '{other}' (f32, f16 or bf16)"),
    }
}

/// The device named by a `--device` argument: `cpu`, or `cuda` (the GPU of this process's
/// local rank: `LOCAL_RANK` from `tprun` and `torchrun`, `OMPI_COMM_WORLD_LOCAL_RANK` from
/// `mpirun`, `MPI_LOCALRANKID` from Hydra, `SLURM_LOCALID` from `srun`; 0 when alone). `cuda:N` picks GPU `N`
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
            let launch = crate::comm::launch_from_env()
                .map_err(|e| candle_core::Error::Msg(format!("--device {name}: {e}")))?;
            cuda(name, launch.local_rank)
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
