//! The benchmarks' progress bar (indicatif), shared by `examples/bench_*.rs` through
//! `#[path = "common/progress.rs"] mod progress;`.
//!
//! Drawn on stderr, and only when stderr is a terminal: under `tprun` (whose ranks write to
//! pipes), in `scripts/bench-*.sh` logs and in CI nothing is drawn and the JSON lines on stdout
//! stay as they were. Results printed while the bar is up go through [`Bar::println`], so they
//! do not tear the bar on a terminal.

// Each benchmark uses the methods it needs.
#![allow(dead_code)]

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A progress bar over `len` benchmark configurations; hidden unless stderr is a terminal and
/// `show` (rank 0) is true.
pub struct Bar(ProgressBar);

impl Bar {
    /// A bar of `len` steps, each counted as one `unit` ("config", "size", ...).
    pub fn new(len: usize, unit: &str, show: bool) -> Self {
        let bar = if show && std::io::stderr().is_terminal() {
            ProgressBar::with_draw_target(Some(len as u64), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        let template =
            format!("{{bar:30}} {unit} {{pos}}/{{len}}  {{msg}}  {{elapsed}} (eta {{eta}})");
        if let Ok(style) = ProgressStyle::with_template(&template) {
            bar.set_style(style);
        }
        Self(bar)
    }

    /// Whether the bar is drawn (stderr is a terminal); a benchmark that logs its steps on
    /// stderr logs them only when it is not.
    pub fn visible(&self) -> bool {
        !self.0.is_hidden()
    }

    /// Shows what is being measured now.
    pub fn set_message(&self, msg: impl Into<String>) {
        self.0.set_message(msg.into());
    }

    /// One step done.
    pub fn inc(&self) {
        self.0.inc(1);
    }

    /// Prints a result line on stdout without tearing the bar.
    pub fn println(&self, line: impl std::fmt::Display) {
        self.0.suspend(|| println!("{line}"));
    }

    /// Removes the bar from the terminal.
    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}
