//! A `cuda` build on a machine without a GPU (CI): with the link stubs of
//! `scripts/check-gpu-build.sh` on `LD_LIBRARY_PATH` the binaries start, the CPU paths work,
//! and asking for CUDA fails with a clear error that names the driver problem.
//!
//! Without the stubs (and without an NVIDIA driver) a `cuda` build cannot even start: candle
//! forces cudarc's load-time linking, so the loader exits with 127 before `main`. Run it with
//! `scripts/check-gpu-build.sh`, which sets the environment. On a machine with a GPU these
//! tests are skipped (there CUDA works; `scripts/gpu-smoke.sh` tests it).
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::process::Command;

use candle_core::{Device, Tensor};
use candle_tp::comm::ReduceOp;

/// True when the CUDA driver in use is the stub (every call returns
/// `CUDA_ERROR_STUB_LIBRARY`), i.e. this is the CI build check and not a GPU machine.
fn stub_driver() -> bool {
    match Device::new_cuda(0) {
        Ok(_) => false,
        Err(e) => format!("{e}").contains("CUDA_ERROR_STUB_LIBRARY"),
    }
}

fn skip() -> bool {
    if stub_driver() {
        return false;
    }
    eprintln!("skipped: the CUDA driver here is not the CI stub (a GPU machine?)");
    true
}

#[test]
fn device_from_arg_cuda_names_the_driver_problem() {
    if skip() {
        return;
    }
    let err = candle_tp::device_from_arg("cuda").expect_err("CUDA must not open with the stubs");
    let msg = err.to_string();
    for want in [
        "cannot open CUDA device 0",
        "driver",
        "CUDA_ERROR_STUB_LIBRARY",
    ] {
        assert!(msg.contains(want), "'{want}' missing from: {msg}");
    }
    let err = candle_tp::device_from_arg("cuda:3").expect_err("no GPU 3");
    assert!(err.to_string().contains("CUDA device 3"), "{err}");
    assert!(candle_tp::device_from_arg("cuda:x").is_err());
}

#[test]
fn cpu_paths_work_in_a_cuda_build() {
    if skip() {
        return;
    }
    let device = candle_tp::device_from_arg("cpu").expect("cpu");
    let out = candle_tp::run_threads(2, |pg| {
        let t = Tensor::new(&[pg.rank() as f32 + 1.0, 10.0], &device)?;
        pg.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f32>()
    })
    .expect("threads all-reduce");
    assert_eq!(out, vec![vec![3.0, 20.0], vec![3.0, 20.0]]);
}

#[cfg(feature = "nccl")]
#[test]
fn init_nccl_refuses_a_cpu_device() {
    let rv = candle_tp::comm::Rendezvous {
        rank: 0,
        world_size: 1,
        master_addr: "127.0.0.1".into(),
        master_port: 0,
        token: String::new(),
    };
    let err = candle_tp::comm::init_nccl(&rv, &Device::Cpu, Default::default())
        .expect_err("NCCL on a CPU device");
    assert!(err.to_string().contains("needs a CUDA device"), "{err}");
}

fn example(name: &str) -> PathBuf {
    // target/<profile>/deps/cuda_stub-<hash> -> target/<profile>/examples/<name>
    let exe = std::env::current_exe().expect("current_exe");
    let profile = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>");
    profile.join("examples").join(name)
}

#[test]
fn mlp_example_with_device_cuda_fails_clearly() {
    if skip() {
        return;
    }
    let exe = example("mlp");
    assert!(
        exe.exists(),
        "{} is missing: build the examples first (cargo build --all-targets --features cuda)",
        exe.display()
    );
    // On the CPU it runs (the binary starts with the stubs)...
    let ok = Command::new(&exe)
        .args(["--d-model", "16", "--seq-len", "2"])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .expect("run mlp");
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "mlp on cpu failed: {ok:?}");
    assert!(stdout.contains("\"world_size\":1"), "{stdout}");
    // ...and with --device cuda it stops with the driver error, not a panic or a crash.
    let out = Command::new(&exe)
        .args(["--d-model", "16", "--seq-len", "2", "--device", "cuda"])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("LOCAL_RANK", "0")
        .output()
        .expect("run mlp --device cuda");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    for want in [
        "cannot open CUDA device 0",
        "NVIDIA driver",
        "CUDA_ERROR_STUB_LIBRARY",
    ] {
        assert!(stderr.contains(want), "'{want}' missing from: {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}
