//! The 2D (4 processes) and 3D (8 processes) MLPs as real processes: `tprun` launches
//! `examples/parallel_modes`, whose ranks meet over the shm backend, check every gradient
//! against the dense MLP and report measured and predicted memory and bytes.

mod common;

use common::example;

use std::process::Command;

fn run(nproc: usize) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_tprun"))
        .args(["--standalone", "--nproc-per-node", &nproc.to_string()])
        .arg(example("parallel_modes"))
        .args(["--batch", "4", "--seq-len", "2", "--hidden", "16"])
        .env("CANDLE_TP_TIMEOUT", "60")
        .output()
        .expect("run tprun");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    let json = text
        .lines()
        .filter_map(|l| l.strip_prefix("[rank 0] "))
        .rfind(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON line: {text}"));
    serde_json::from_str(json).expect("JSON")
}

fn check_mode(v: &serde_json::Value, mode: &str, skipped: &[&str]) {
    let modes = v["modes"].as_array().expect("modes");
    for m in modes {
        let name = m["mode"].as_str().expect("mode name");
        if skipped.contains(&name) {
            assert!(m["skipped"].is_string(), "{name} should be skipped: {m}");
            continue;
        }
        for key in ["max_abs_err_out", "max_abs_err_grads"] {
            let e = m[key].as_f64().expect(key);
            assert!(e <= 1e-5, "{name}: {key} = {e}");
        }
    }
    let m = modes
        .iter()
        .find(|m| m["mode"] == mode)
        .expect("the mode ran");
    // Activations split in q x q (x q) blocks: exactly the dense size over P.
    let act = m["measured_max_over_ranks"]["activation_bytes"]
        .as_f64()
        .expect("act");
    let dense = v["dense_activation_bytes"].as_f64().expect("dense");
    let p = v["world_size"].as_f64().expect("world");
    assert_eq!(act, dense / p, "{m}");
    // Bytes received: the derivation in the docs, plus the small bias/LayerNorm gathers.
    for (meas, pred) in [
        ("fwd_received_bytes", "fwd_bytes"),
        ("bwd_received_bytes", "bwd_bytes"),
    ] {
        let meas = m["measured_max_over_ranks"][meas].as_f64().expect("meas");
        let pred = m["predicted"][pred].as_f64().expect("pred");
        assert!(
            meas >= pred && meas <= pred * 1.25,
            "{mode}: measured {meas} vs predicted {pred}"
        );
    }
}

#[test]
fn mlp_2d_on_4_processes_and_3d_on_8_processes() {
    let v = run(4);
    assert_eq!(v["world_size"], 4);
    check_mode(&v, "2d", &["3d"]);
    let v = run(8);
    assert_eq!(v["world_size"], 8);
    check_mode(&v, "3d", &["2d"]);
}
