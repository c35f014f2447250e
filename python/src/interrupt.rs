//! Ctrl-C during long work. The work runs on a thread of its own while the calling thread, with
//! the GIL released, checks Python's signals every few milliseconds (Python runs its signal
//! handlers only on the main thread). On KeyboardInterrupt it raises a flag; the work's `stop`
//! callback, asked after each layer of each pass and within it (and after each prefill chunk and
//! token of a capture), then returns [`Stopped`], and the work ends there with it. What the
//! library had finished is kept (a sweep's stored runs); the call raises the KeyboardInterrupt.

use kvreplay::replay::Stopped;
use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Runs `work` with the GIL released, handing it a `stop` callback that stops it when the
/// user presses Ctrl-C.
pub fn interruptible<T: Send>(
    py: Python<'_>,
    work: impl FnOnce(&(dyn Fn() -> Result<(), Stopped> + Sync)) -> T + Send,
) -> PyResult<T> {
    let stop = AtomicBool::new(false);
    let asked = || match stop.load(Ordering::Relaxed) {
        true => Err(Stopped),
        false => Ok(()),
    };
    let (outcome, signal) = py.detach(|| {
        std::thread::scope(|scope| {
            let worker = scope.spawn(|| work(&asked));
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
            let outcome = match worker.join() {
                Ok(outcome) => outcome,
                Err(panic) => std::panic::resume_unwind(panic),
            };
            (outcome, signal)
        })
    });
    match signal {
        Some(signal) => Err(signal),
        None => Ok(outcome),
    }
}
