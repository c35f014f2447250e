//! Ctrl-C during long work. The work runs on a thread of its own while the calling thread, with
//! the GIL released, checks Python's signals every few milliseconds (Python runs its signal
//! handlers only on the main thread). On KeyboardInterrupt it raises a flag; the work's
//! `layer_done` callback, called after each layer of each pass, sees it and unwinds out of the
//! library with a private payload (no panic message). What the library had finished is kept
//! (a sweep's stored runs); the call raises the KeyboardInterrupt.

use pyo3::prelude::*;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The payload that unwinds interrupted work.
struct Interrupted;

/// Runs `work` with the GIL released, handing it a `layer_done` callback that stops it when the
/// user presses Ctrl-C.
pub fn interruptible<T: Send>(
    py: Python<'_>,
    work: impl FnOnce(&(dyn Fn() + Sync)) -> T + Send,
) -> PyResult<T> {
    let stop = AtomicBool::new(false);
    let layer_done = || {
        if stop.load(Ordering::Relaxed) {
            resume_unwind(Box::new(Interrupted));
        }
    };
    let (outcome, signal) = py.detach(|| {
        std::thread::scope(|scope| {
            let worker = scope.spawn(|| catch_unwind(AssertUnwindSafe(|| work(&layer_done))));
            let mut signal = None;
            while !worker.is_finished() {
                std::thread::sleep(Duration::from_millis(20));
                if signal.is_none() {
                    if let Err(err) = Python::attach(|py| py.check_signals()) {
                        signal = Some(err);
                        stop.store(true, Ordering::Relaxed);
                    }
                }
            }
            (
                worker.join().expect("the worker catches its own unwinding"),
                signal,
            )
        })
    });
    match (outcome, signal) {
        (Ok(value), _) => Ok(value),
        (Err(payload), Some(signal)) if payload.is::<Interrupted>() => Err(signal),
        (Err(payload), _) => resume_unwind(payload),
    }
}
