//! `examples/embed` as real processes: 2 ranks under `tprun` print the same sentences, token
//! ids and embeddings as 1 rank, and standard input gives the same as `--text`, also when it
//! is piped through `tprun` (which hands it to rank 0).

mod common;

use common::example;

use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

const TEXTS: [&str; 3] = [
    "The cat sits on the mat.",
    "Sharded inference splits the twelve attention heads across processes.",
    "Héllo, wörld!",
];

fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The JSON lines of rank 0 (prefixed `[rank 0] ` under tprun).
fn json_lines(out: &Output, prefixed: bool) -> Vec<Value> {
    let t = text(out);
    assert!(out.status.success(), "embed failed:\n{t}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            if prefixed {
                l.strip_prefix("[rank 0] ")
            } else {
                Some(l)
            }
        })
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON {l}: {e}")))
        .collect()
}

fn under_tprun(nproc: usize) -> Vec<Value> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tprun"));
    cmd.args(["--standalone", "--nproc-per-node", &nproc.to_string()])
        .arg(example("embed"))
        .arg("--normalize");
    for t in TEXTS {
        cmd.args(["--text", t]);
    }
    json_lines(&cmd.output().expect("run tprun"), true)
}

fn embedding(v: &Value) -> Vec<f64> {
    v["embedding"]
        .as_array()
        .expect("embedding array")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn two_ranks_under_tprun_match_one_rank() {
    let one = under_tprun(1);
    let two = under_tprun(2);
    assert_eq!(one.len(), TEXTS.len(), "{one:?}");
    assert_eq!(two.len(), TEXTS.len(), "{two:?}");
    for ((a, b), t) in one.iter().zip(&two).zip(TEXTS) {
        assert_eq!(a["text"], t);
        assert_eq!(b["text"], t);
        assert_eq!(a["token_ids"], b["token_ids"]);
        let ids = a["token_ids"].as_array().expect("ids");
        assert_eq!(
            ids.first().and_then(Value::as_u64),
            Some(101),
            "[CLS] first"
        );
        assert_eq!(ids.last().and_then(Value::as_u64), Some(102), "[SEP] last");
        let (ea, eb) = (embedding(a), embedding(b));
        assert_eq!(ea.len(), 384);
        let norm = ea.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!(
            (norm - 1.0).abs() < 1e-5,
            "--normalize gives unit norm: {norm}"
        );
        let d = max_diff(&ea, &eb);
        assert!(d <= 1e-5, "{t:?}: 1 rank vs 2 ranks differ by {d}");
    }
}

/// Runs `cmd` with [`TEXTS`] on its standard input, one a line, then end of file.
fn with_texts_on_stdin(mut cmd: Command) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin
        .write_all(format!("{}\n", TEXTS.join("\n")).as_bytes())
        .expect("write stdin");
    // Closing the pipe is the end of file that must reach rank 0 (through tprun too).
    drop(stdin);
    child.wait_with_output().expect("wait")
}

/// The JSON lines of `embed --normalize --text ...` as one process.
fn one_rank_with_text_args() -> Vec<Value> {
    let mut cmd = Command::new(example("embed"));
    cmd.arg("--normalize");
    for t in TEXTS {
        cmd.args(["--text", t]);
    }
    json_lines(&cmd.output().expect("run embed"), false)
}

#[test]
fn standard_input_gives_the_same_as_text() {
    let mut cmd = Command::new(example("embed"));
    cmd.arg("--normalize");
    let from_stdin = json_lines(&with_texts_on_stdin(cmd), false);
    let from_args = one_rank_with_text_args();
    assert_eq!(from_stdin.len(), TEXTS.len());
    for (a, b) in from_stdin.iter().zip(&from_args) {
        assert_eq!(a["text"], b["text"]);
        assert_eq!(a["token_ids"], b["token_ids"]);
        assert_eq!(max_diff(&embedding(a), &embedding(b)), 0.0);
    }
}

#[test]
fn standard_input_through_tprun_reaches_rank_0() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tprun"));
    cmd.args(["--standalone", "--nproc-per-node", "2"])
        .arg(example("embed"))
        .arg("--normalize");
    let piped = json_lines(&with_texts_on_stdin(cmd), true);
    let one_rank = one_rank_with_text_args();
    assert_eq!(piped.len(), TEXTS.len(), "{piped:?}");
    for (a, b) in piped.iter().zip(&one_rank) {
        assert_eq!(a["text"], b["text"]);
        assert_eq!(a["token_ids"], b["token_ids"]);
        let d = max_diff(&embedding(a), &embedding(b));
        assert!(
            d <= 1e-5,
            "{}: 2 ranks (stdin) vs 1 rank differ by {d}",
            a["text"]
        );
    }
}
