//! Ctrl-C and SIGTERM on the command line. While a command that replays, captures or runs live
//! runs, the first Ctrl-C (SIGINT) or SIGTERM (what `kill`, Slurm's `scancel` and its time limit
//! send) asks its work to stop where it stands: within a replay's layer (before the next KV group,
//! or within a few hundred positions of a cache's stream), after the prefill chunk or token in
//! progress of a model (a sweep keeps every run it stored, so running it again resumes; a capture
//! writes no trace of the question it was running); the command then exits with 128 + the
//! signal's number (130 for Ctrl-C, 143 for SIGTERM), as a shell reports a process the signal
//! ended. A second signal of either kind ends the process at once. Outside such work both keep
//! their default.

use kvreplay::replay::Stopped;
use std::sync::atomic::{AtomicI32, Ordering};

/// The signals that ask the work to stop.
const SIGNALS: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

/// The first of them received, 0 before.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    // Keeps the first signal's number: the exit code says which one stopped the work.
    let _ = RECEIVED.compare_exchange(0, signal, Ordering::Relaxed, Ordering::Relaxed);
    // SAFETY: `signal` is async-signal-safe; the next signal gets the default action.
    unsafe {
        for signal in SIGNALS {
            libc::signal(signal, libc::SIG_DFL);
        }
    }
}

/// Catches the first Ctrl-C or SIGTERM from now on.
pub fn catch_interrupt() {
    let handler = on_signal as extern "C" fn(libc::c_int);
    // SAFETY: the handler only stores to an atomic and resets the dispositions.
    unsafe {
        for signal in SIGNALS {
            libc::signal(signal, handler as libc::sighandler_t);
        }
    }
}

/// `Stopped` once Ctrl-C or SIGTERM came: what a `Checkpoints` returns to end the work.
pub fn check() -> Result<(), Stopped> {
    match RECEIVED.load(Ordering::Relaxed) {
        0 => Ok(()),
        _ => Err(Stopped),
    }
}

/// The signal that stopped the work, if one did.
pub fn received() -> Option<libc::c_int> {
    Some(RECEIVED.load(Ordering::Relaxed)).filter(|&signal| signal != 0)
}

/// Whether `err` is the stop a signal asked for, anywhere in its chain of causes.
pub fn is_stop(err: &anyhow::Error) -> bool {
    err.chain()
        .any(|cause| cause.downcast_ref::<Stopped>().is_some())
}
