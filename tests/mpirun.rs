//! Jobs launched by Open MPI's `mpirun` on one host: `init_from_env` reads
//! `OMPI_COMM_WORLD_*`, the ranks meet at a port derived from the MPI job id and talk through
//! shared memory, with no tprun and no `MASTER_*` variables.
//!
//! - the quickstart MLP at 2 and 3 ranks (each rank checks itself against the dense MLP);
//! - SmolLM2 greedy decoding (safetensors and the Q4_1 GGUF) at 2 ranks gives the token ids of
//!   one plain process;
//! - a layout that spans hosts on the CPU is refused with a message naming the variable.
//!
//! Needs `mpirun` (Debian's `openmpi-bin`, which `scripts/test.sh` installs when run as root).
//! Without it each test prints `SKIPPED: ...` and passes, except under CI (`CI` set), where a
//! missing `mpirun` fails.

mod common;

use std::process::{Command, Output};

/// `mpirun` with the flags a 2-core root container needs, or `None` (after saying why) when
/// it is not installed outside CI.
fn mpirun(np: usize) -> Option<Command> {
    let found = Command::new("mpirun")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "mpirun is missing under CI: .ci/run installs openmpi-bin through scripts/test.sh"
        );
        eprintln!("SKIPPED: mpirun not found (apt-get install openmpi-bin)");
        return None;
    }
    let mut c = Command::new("mpirun");
    c.args(["-np", &np.to_string(), "--oversubscribe", "--tag-output"])
        // Root in a container: Open MPI refuses root without these two.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // Nothing from the test harness's own launcher, if any.
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .env("RAYON_NUM_THREADS", "1");
    Some(c)
}

fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn quickstart_under_mpirun() {
    for np in [2, 3] {
        let Some(mut c) = mpirun(np) else { return };
        let out = c
            .arg(common::example("quickstart"))
            .output()
            .expect("start mpirun");
        let t = text(&out);
        assert!(
            out.status.success(),
            "mpirun -np {np} quickstart failed:\n{t}"
        );
        for r in 0..np {
            let line = t
                .lines()
                .find(|l| l.starts_with(&format!("[1,{r}]<stdout>:rank {r} of {np}:")))
                .unwrap_or_else(|| panic!("no line from rank {r} of {np}:\n{t}"));
            // The example fails itself beyond 1e-5; read the error to be sure it ran.
            let err: f32 = line
                .rsplit("= ")
                .next()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no error figure in {line}"));
            assert!(err.is_finite() && err <= 1e-5, "{line}");
        }
    }
}

/// Rank 0's JSON line of `examples/generate` under `mpirun -np 2`.
fn generate_under_mpirun(args: &[String]) -> Option<serde_json::Value> {
    let mut c = mpirun(2)?;
    let out = c
        .arg(common::example("generate"))
        .args(args)
        .output()
        .expect("start mpirun");
    let t = text(&out);
    assert!(out.status.success(), "mpirun -np 2 generate failed:\n{t}");
    let json = t
        .lines()
        .filter_map(|l| l.strip_prefix("[1,0]<stdout>:"))
        .rfind(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("rank 0 printed no JSON line:\n{t}"));
    Some(serde_json::from_str(json).expect("JSON line"))
}

#[test]
fn smollm2_under_mpirun_gives_one_process_ids() {
    let dir = candle_tp::models::models_dir().expect("models directory");
    let safetensors = dir.join("smollm2-135m-instruct");
    let gguf = dir.join("smollm2-135m-instruct.Q4_1.gguf");
    assert!(
        safetensors.join("model.safetensors").is_file() && gguf.is_file(),
        "SmolLM2 is missing from {}: run scripts/fetch-models.sh",
        dir.display()
    );
    for model in [safetensors, gguf] {
        let args = [
            "--model".to_string(),
            model.display().to_string(),
            "--max-new-tokens".into(),
            "8".into(),
            "--prompt".into(),
            "The capital of France is".into(),
        ];
        let Some(two) = generate_under_mpirun(&args) else {
            return;
        };
        let one = common::run_generate(1, &args);
        assert_eq!(two["world_size"], 2, "{two}");
        let ids = |v: &serde_json::Value| v["token_ids"].as_array().cloned().unwrap_or_default();
        assert_eq!(ids(&two).len(), 8, "{two}");
        assert_eq!(
            ids(&two),
            ids(&one),
            "{}: mpirun -np 2 and one process differ",
            model.display()
        );
    }
}

#[test]
fn a_cpu_job_across_hosts_is_refused_with_the_variable_named() {
    // What mpirun sets for rank 0 of 2 ranks on 2 hosts, set by hand: no mpirun needed.
    let out = Command::new(common::example("quickstart"))
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .envs([
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
            ("OMPI_MCA_ess_base_jobid", "77"),
            ("MASTER_ADDR", "127.0.0.1"),
        ])
        .output()
        .expect("start quickstart");
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains("OMPI_COMM_WORLD_LOCAL_SIZE")
            && t.contains("spans hosts")
            && t.contains("Open MPI"),
        "{t}"
    );
}
