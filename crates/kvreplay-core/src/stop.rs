//! Stopping long work on request (Ctrl-C on the command line, `KeyboardInterrupt` in Python):
//! the error a progress or layer callback returns to end the work where it stands. Whoever
//! stops keeps everything already written whole and writes nothing half.

/// The work was asked to stop: what a progress or layer callback returns to end it there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("stopped on request")]
pub struct Stopped;

/// Asked between steps of long work whether to go on: `Err(Stopped)` ends the work there.
pub type Stop<'a> = &'a (dyn Fn() -> Result<(), Stopped> + Sync);

/// The stop that never asks to stop.
pub const NEVER: Stop<'static> = &go_on;

fn go_on() -> Result<(), Stopped> {
    Ok(())
}
