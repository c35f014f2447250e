//! Shared helpers of the integration tests: the workspace's test kit ([`kvreplay_testkit`]: fixture
//! traces, their policies, the real assets and reference environments) and the command line's
//! own (a `kvreplay` spawned and interrupted).

#![allow(dead_code)]

pub use kvreplay_testkit::*;
use std::path::Path;

/// `kvreplay` run with `args` in `dir`, its output piped, for a test that interrupts it.
pub fn spawn_kvreplay(dir: &Path, args: &[&str]) -> std::process::Child {
    std::process::Command::new(assert_cmd::cargo::cargo_bin("kvreplay"))
        .current_dir(dir)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kvreplay starts")
}

/// Sends `child` (a `kvreplay` the test spawned) SIGINT, as Ctrl-C does, once `ready()` holds,
/// and checks that it stopped as the command line says: exit 130 and its message. Returns what
/// it wrote.
pub fn interrupt_when(
    child: std::process::Child,
    ready: impl Fn() -> bool,
) -> std::process::Output {
    signal_when(child, libc::SIGINT, ready)
}

/// Sends `child` (a `kvreplay` the test spawned) `signal` (SIGINT or SIGTERM) once `ready()`
/// holds, and checks that it stopped as the command line says: exit 128 + the signal's number
/// and its message. Returns what it wrote.
pub fn signal_when(
    mut child: std::process::Child,
    signal: libc::c_int,
    ready: impl Fn() -> bool,
) -> std::process::Output {
    while !ready() {
        assert!(child.try_wait().unwrap().is_none(), "it ended early");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: sends a signal to the child this test spawned.
    unsafe {
        libc::kill(child.id() as libc::pid_t, signal);
    }
    let output = child.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(128 + signal), "{said}");
    let what = match signal {
        libc::SIGTERM => "terminated (SIGTERM): stopped where the work stood",
        _ => "interrupted: stopped where the work stood",
    };
    assert!(said.contains(what), "{said}");
    output
}
