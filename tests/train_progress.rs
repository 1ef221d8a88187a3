//! `examples/train`'s progress bar (indicatif) is drawn on stderr under a terminal, and not at
//! all when stderr is a pipe. The terminal is a pseudo-terminal made by util-linux `script`.

mod common;

use std::process::{Command, Stdio};

use common::example;

const ARGS: &str = "--steps 2 --batch 2 --seq 16";

#[test]
fn progress_bar_under_a_terminal_only() {
    let train = example("train");
    let dir = tempfile::tempdir().expect("temp dir");
    let typescript = dir.path().join("typescript");
    // stdout (the JSON lines) goes to /dev/null, stderr stays on the pseudo-terminal.
    let inner = format!("{} {ARGS} 2>&1 >/dev/null", train.display());
    let status = Command::new("script")
        .args(["-q", "-e", "-c", &inner])
        .arg(&typescript)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status()
        .expect("util-linux `script` is needed for this test (apt-get install util-linux)");
    assert!(status.success(), "train under script: {status}");
    let screen =
        String::from_utf8_lossy(&std::fs::read(&typescript).expect("typescript")).into_owned();
    assert!(
        screen.contains("step 2/2") && screen.contains("loss ") && screen.contains('█'),
        "no progress bar on the terminal:\n{screen}"
    );

    let out = Command::new(&train)
        .args(ARGS.split(' '))
        .output()
        .expect("run train");
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("step 1/2") && !stderr.contains('█'),
        "a progress bar on a pipe: {stderr}"
    );
    let steps = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("{\"loss\"") || l.contains("\"step\""))
        .count();
    assert_eq!(steps, 2, "one JSON line per step");
}
