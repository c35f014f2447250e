//! Writing a file so that it appears whole or not at all: the content goes to a temporary name
//! beside the target (`<name>.partial.<pid>`, one per process, so concurrent writers never share
//! one), which is renamed over the target at the end. A killed writer leaves only its partial
//! file; a failed write removes it and leaves any earlier file in place. And a lock for work that
//! concurrent processes must do once ([`with_lock`]).

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

/// Runs `work` holding an exclusive `flock` on `lock` (created if missing): one process at a time
/// across the machines sharing the file, and a holder that dies releases it (the kernel drops a
/// dead process's locks), so a killed capture never blocks the next one.
pub fn with_lock<T>(lock: &Path, work: impl FnOnce() -> T) -> io::Result<T> {
    use std::os::fd::AsRawFd;
    if let Some(parent) = lock.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(lock)?;
    // SAFETY: `file` is an open descriptor for the whole call; flock has no memory effects.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let result = work();
    drop(file); // closing the descriptor releases the lock
    Ok(result)
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

    #[test]
    fn the_lock_lets_one_holder_in_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let lock = dir.path().join("x.lock");
        let inside = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    with_lock(&lock, || {
                        let now = inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        assert_eq!(now, 0, "two holders at once");
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    })
                    .unwrap();
                });
            }
        });
    }
}
