//! Helpers shared by the command-line tests.
#![allow(dead_code)]

use std::process::{Command, Output};

/// Runs the built `kvtier` binary with `args` (RUST_LOG unset, so logs stay at their default).
pub fn kvtier(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("the kvtier binary runs")
}
