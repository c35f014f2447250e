//! Ctrl-C on the command line. While a command that replays, captures or runs live runs, the first
//! Ctrl-C asks its work to stop where it stands: within a replay's layer (before the next KV
//! group, or within a few hundred positions of a cache's stream), after the prefill chunk or
//! token in progress of a model (a sweep keeps every run it stored, so running it again resumes;
//! a capture writes no trace of the question it was running); the command then exits with 130,
//! as a shell reports an interrupt. A second Ctrl-C ends the process at once. Outside such work
//! Ctrl-C keeps its default.

use kvreplay::replay::Stopped;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set by the first Ctrl-C.
static ASKED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    ASKED.store(true, Ordering::Relaxed);
    // SAFETY: `signal` is async-signal-safe; the next Ctrl-C gets the default action.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_DFL);
    }
}

/// Catches the first Ctrl-C from now on.
pub fn catch_interrupt() {
    let handler = on_interrupt as extern "C" fn(libc::c_int);
    // SAFETY: the handler only stores to an atomic and resets the disposition.
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
    }
}

/// `Stopped` once Ctrl-C was pressed: what a `Checkpoints` returns to end the work.
pub fn check() -> Result<(), Stopped> {
    match ASKED.load(Ordering::Relaxed) {
        true => Err(Stopped),
        false => Ok(()),
    }
}

/// Whether `err` is the stop Ctrl-C asked for, anywhere in its chain of causes.
pub fn is_stop(err: &anyhow::Error) -> bool {
    err.chain()
        .any(|cause| cause.downcast_ref::<Stopped>().is_some())
}
