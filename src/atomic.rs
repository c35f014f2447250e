//! Writing a file so that it appears whole or not at all: the content goes to a temporary name
//! beside the target (`<name>.partial.<pid>`, one per process, so concurrent writers never share
//! one), which is renamed over the target at the end. A killed writer leaves only its partial
//! file; a failed write removes it and leaves any earlier file in place.

use std::io;
use std::path::{Path, PathBuf};

/// The temporary name beside `path` that this process writes to.
fn partial_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".partial.{}", std::process::id()));
    path.with_file_name(name)
}

/// Creates `path`'s directory, lets `write` fill the temporary file it is given, and renames
/// that over `path`.
pub fn write_with(path: &Path, write: impl FnOnce(&Path) -> io::Result<()>) -> io::Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    let partial = partial_name(path);
    let written = write(&partial).and_then(|()| std::fs::rename(&partial, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written
}

/// Writes `bytes` to `path` atomically.
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_with(path, |partial| std::fs::write(partial, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_keeps_the_old_file_and_leaves_no_partial() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/out.txt");
        write(&path, b"first").unwrap();
        let failed = write_with(&path, |partial| {
            std::fs::write(partial, b"half")?;
            Err(io::Error::other("disk full"))
        });
        assert!(failed.is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        assert_eq!(
            std::fs::read_dir(dir.path().join("sub")).unwrap().count(),
            1
        );
        write(&path, b"second").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
    }
}
