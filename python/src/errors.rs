//! Library errors as Python exceptions: `KvreplayError` with the message the command line prints
//! after `error: `.

use pyo3::create_exception;
use pyo3::PyErr;

create_exception!(
    kvreplay,
    KvreplayError,
    pyo3::exceptions::PyException,
    "A kvreplay error: bad trace, unknown method, bad setting, missing asset; the message is the command line's."
);

/// `err` as a `KvreplayError`, its causes chained as the command line prints them.
pub fn raised(err: impl std::error::Error + 'static) -> PyErr {
    KvreplayError::new_err(kvreplay::error_text(&err))
}

/// A `KvreplayError` with `message`.
pub fn message(message: impl Into<String>) -> PyErr {
    KvreplayError::new_err(message.into())
}

/// What a Python method's failure says where kvreplay reports it: `raised` and the exception,
/// then Python's traceback of where it was raised.
pub fn python_failure(err: &PyErr) -> String {
    use pyo3::types::PyTracebackMethods;
    let traceback = pyo3::Python::attach(|py| {
        err.traceback(py)
            .and_then(|traceback| traceback.format().ok())
    });
    match traceback {
        Some(traceback) => format!("raised {err}\n{}", traceback.trim_end()),
        None => format!("raised {err}"),
    }
}
