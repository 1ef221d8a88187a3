//! The README's first example (`examples/quickstart.rs`): the README shows the file verbatim,
//! and the program runs as one process and under `tprun` with 2 and 3 ranks (3: uneven
//! slices, 11 + 11 + 10 rows), where it checks itself against the dense MLP and prints the
//! error.

mod common;

use std::process::Command;

use common::example;

/// The example's code from its first `use` line: what the README must show verbatim.
fn example_code() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/quickstart.rs");
    let text = std::fs::read_to_string(path).expect("read examples/quickstart.rs");
    let start = text.find("use std::").expect("a use line");
    text[start..].to_string()
}

#[test]
fn readme_shows_the_example_verbatim() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("read README.md");
    let code = example_code();
    assert!(
        readme.contains(&format!("```rust\n{code}```\n")),
        "README.md must show examples/quickstart.rs from its first `use` line, verbatim, in a \
         ```rust block; the example is now:\n{code}"
    );
}

/// Runs the example (under tprun with `ranks` ranks, or alone for `None`) and returns the
/// errors it printed, one per line of rank 0.
fn run(ranks: Option<usize>) -> Vec<f64> {
    let out = match ranks {
        Some(n) => Command::new(env!("CARGO_BIN_EXE_tprun"))
            .args(["--standalone", "--nproc-per-node", &n.to_string()])
            .arg(example("quickstart"))
            .output(),
        None => Command::new(example("quickstart")).output(),
    }
    .expect("run quickstart");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let world = ranks.unwrap_or(1);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), world, "one line per rank: {stdout}");
    (0..world)
        .map(|r| {
            let prefix = match ranks {
                Some(_) => format!("[rank {r}] rank {r} of {world}: y[0] = ["),
                None => "rank 0 of 1: y[0] = [".to_string(),
            };
            let line = lines
                .iter()
                .find(|l| l.starts_with(&prefix))
                .unwrap_or_else(|| panic!("no line of rank {r}: {stdout}"));
            let err = line.rsplit("= ").next().expect("error value");
            err.trim().parse::<f64>().expect("a number")
        })
        .collect()
}

#[test]
fn runs_alone_and_under_tprun() {
    for ranks in [None, Some(2), Some(3)] {
        for err in run(ranks) {
            // The example itself fails above 1e-5; measured: 0 (1 rank), 2.4e-7 (2), 1.2e-7 (3).
            assert!(err.is_finite() && err <= 1e-6, "{ranks:?}: {err}");
        }
    }
}

/// Issue 44, defect 8: environment values that were read as something else are errors that
/// name the variable and the value, alone and under tprun: a deadline that is not a positive
/// number of seconds (it became 300 s), and the NCCL backend on a CPU job (it ran shm).
#[test]
fn bad_environment_values_are_named() {
    for (var, value, says) in [
        ("CANDLE_TP_TIMEOUT", "abc", "abc"),
        ("CANDLE_TP_TIMEOUT", "0", "above 0"),
        ("CANDLE_TP_TIMEOUT", "30s", "30s"),
        ("CANDLE_TP_BACKEND", "nccl", "CUDA"),
    ] {
        for ranks in [None, Some(2)] {
            let mut c = match ranks {
                Some(n) => {
                    let mut c = Command::new(env!("CARGO_BIN_EXE_tprun"));
                    c.args(["--standalone", "--nproc-per-node", &n.to_string()])
                        .arg(example("quickstart"));
                    c
                }
                None => Command::new(example("quickstart")),
            };
            let out = c.env(var, value).output().expect("run quickstart");
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                !out.status.success(),
                "{var}={value} {ranks:?} ran:\n{text}"
            );
            assert!(
                text.contains(var) && text.contains(says),
                "{var}={value} {ranks:?}:\n{text}"
            );
        }
    }
}
