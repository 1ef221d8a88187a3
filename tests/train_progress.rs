//! Progress bars (indicatif) are drawn on stderr under a terminal, and not at all when stderr is
//! a pipe: `examples/train`'s steps and `examples/convert_gguf`'s tensors. The terminal is a
//! pseudo-terminal made by util-linux `script`.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use common::example;

const ARGS: &str = "--steps 2 --batch 2 --seq 16";

/// Runs `program args` with stderr on a pseudo-terminal (stdout to /dev/null) and returns what
/// the terminal received.
fn on_a_terminal(program: &Path, args: &str) -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    let typescript = dir.path().join("typescript");
    let inner = format!("{} {args} 2>&1 >/dev/null", program.display());
    let status = Command::new("script")
        .args(["-q", "-e", "-c", &inner])
        .arg(&typescript)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status()
        .expect("util-linux `script` is needed for this test (apt-get install util-linux)");
    assert!(
        status.success(),
        "{} under script: {status}",
        program.display()
    );
    String::from_utf8_lossy(&std::fs::read(&typescript).expect("typescript")).into_owned()
}

#[test]
fn progress_bar_under_a_terminal_only() {
    let train = example("train");
    let screen = on_a_terminal(&train, ARGS);
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

#[test]
fn conversion_progress_bar_under_a_terminal_only() -> anyhow::Result<()> {
    let gguf = candle_tp::models::models_dir()?.join("smollm2-135m-instruct.Q4_1.gguf");
    anyhow::ensure!(
        gguf.is_file(),
        "{} is missing: run scripts/fetch-models.sh",
        gguf.display()
    );
    let convert = example("convert_gguf");
    let dir = tempfile::tempdir()?;
    let args = |out: &str| {
        format!(
            "--gguf {} --out {}",
            gguf.display(),
            dir.path().join(out).display()
        )
    };
    let screen = on_a_terminal(&convert, &args("tty"));
    // SmolLM2-135M has 272 tensors; the bar shows the count and the current tensor's name.
    assert!(
        screen.contains("/272") && screen.contains("tensor ") && screen.contains('█'),
        "no progress bar on the terminal:\n{screen}"
    );
    assert!(dir.path().join("tty/model.safetensors").is_file());

    let out = Command::new(&convert)
        .args(args("pipe").split(' '))
        .output()?;
    assert!(out.status.success(), "convert_gguf on a pipe: {out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.trim().is_empty(),
        "stderr on a pipe should stay empty, got: {stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with("converted ") && !stdout.contains('█'),
        "stdout on a pipe: {stdout}"
    );
    Ok(())
}
