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
