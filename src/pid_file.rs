//! `pid_file`: where the running proxy writes its process id, and how `idemproxy reload` finds
//! it there and sends it SIGHUP.
//!
//! The proxy writes the file once it listens and handles SIGHUP (a file that exists names a
//! process ready for a reload), and removes it on a clean exit — only if it still holds its
//! own id, so a second instance started on the same file keeps its own. A process killed
//! (SIGKILL, a crash) leaves the file behind: the client tells a stale file from a live
//! process before it signals anything, since SIGHUP ends a process that does not handle it.
//!
//! The signal is sent with `rustix` (`kill(2)` without `unsafe`, already in the dependency
//! tree), not by running `kill(1)`, which a minimal container image does not have.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// The file's content: the decimal process id and a newline, as daemons and init systems
/// write and read it.
fn content(pid: u32) -> String {
    format!("{pid}\n")
}

/// The pid file of this process, removed when dropped.
#[derive(Debug)]
pub(crate) struct PidFile {
    path: PathBuf,
    pid: u32,
}

impl PidFile {
    /// Writes this process's id to `path`, whole or not at all (a temporary file renamed over
    /// it), replacing what was there: a file left by a process that was killed.
    pub(crate) fn write(path: &Path) -> io::Result<PidFile> {
        let pid = std::process::id();
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".{pid}.tmp"));
        let tmp = PathBuf::from(tmp);
        let written = fs::File::create(&tmp)
            .and_then(|mut f| f.write_all(content(pid).as_bytes()))
            .and_then(|()| fs::rename(&tmp, path));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        tracing::info!(path = %path.display(), pid, "pid file written");
        Ok(PidFile {
            path: path.to_owned(),
            pid,
        })
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        // Another instance may have written its own id over ours since: that one stays.
        match fs::read_to_string(&self.path) {
            Ok(text) if text.trim() == self.pid.to_string() => {
                if let Err(e) = fs::remove_file(&self.path) {
                    tracing::warn!(path = %self.path.display(), error = %e, "cannot remove the pid file");
                }
            }
            Ok(_) => tracing::warn!(
                path = %self.path.display(),
                "the pid file names another process now: left in place"
            ),
            Err(_) => {}
        }
    }
}

/// Why `idemproxy reload` signalled nothing.
#[derive(Debug, thiserror::Error)]
pub enum SignalError {
    /// The configuration names no pid file.
    #[error(
        "the configuration sets no pid_file, so the running proxy cannot be found: set pid_file \
         (the proxy writes its process id there), or send the process SIGHUP yourself (kill -HUP PID)"
    )]
    NoPidFile,
    /// The pid file does not exist.
    #[error(
        "no proxy is running with this configuration: {} does not exist (the proxy writes it \
         once it listens and removes it when it exits)",
        .0.display()
    )]
    NotRunning(PathBuf),
    /// The pid file cannot be read.
    #[error("cannot read the pid file {}: {error}", path.display())]
    Unreadable { path: PathBuf, error: io::Error },
    /// The pid file does not hold a process id.
    #[error("the pid file {} does not hold a process id: {text:?}", path.display())]
    Garbled { path: PathBuf, text: String },
    /// The pid file names a process that is gone, or that is not idemproxy.
    #[error(
        "stale pid file {}: {why}; the proxy did not exit cleanly — start it, or remove the file",
        path.display()
    )]
    Stale { path: PathBuf, why: String },
    /// The process exists but cannot be signalled, or the signal failed.
    #[error("cannot signal process {pid}: {error}")]
    Signal { pid: u32, error: io::Error },
}

/// Sends SIGHUP to the proxy whose id `pid_file` holds, after checking that it is a live
/// idemproxy process; returns its id.
pub fn signal_reload(pid_file: Option<&Path>) -> Result<u32, SignalError> {
    let path = pid_file.ok_or(SignalError::NoPidFile)?;
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(SignalError::NotRunning(path.to_owned()));
        }
        Err(error) => {
            return Err(SignalError::Unreadable {
                path: path.to_owned(),
                error,
            });
        }
    };
    // Positive only: kill(2) reads 0 and negative ids as process groups, -1 as every process.
    let pid = text
        .trim()
        .parse::<u32>()
        .ok()
        .filter(|pid| *pid > 0 && i32::try_from(*pid).is_ok())
        .ok_or_else(|| SignalError::Garbled {
            path: path.to_owned(),
            text: text.chars().take(40).collect(),
        })?;
    let stale = |why: String| SignalError::Stale {
        path: path.to_owned(),
        why,
    };
    hangup(pid, &stale)?;
    Ok(pid)
}

#[cfg(unix)]
fn hangup(pid: u32, stale: &impl Fn(String) -> SignalError) -> Result<(), SignalError> {
    use rustix::process::{Pid, Signal, kill_process, test_kill_process};
    let raw = i32::try_from(pid).ok().and_then(Pid::from_raw);
    let Some(target) = raw else {
        return Err(stale(format!("{pid} is not a process id")));
    };
    let failed = |e: rustix::io::Errno| {
        if e == rustix::io::Errno::SRCH {
            stale(format!("no process {pid} is running"))
        } else {
            SignalError::Signal {
                pid,
                error: e.into(),
            }
        }
    };
    test_kill_process(target).map_err(failed)?;
    // After a crash the id may have been given to another program, which SIGHUP could end:
    // where the kernel says what runs under it (Linux), it must be idemproxy.
    if let Ok(name) = fs::read_to_string(format!("/proc/{pid}/comm")) {
        let name = name.trim();
        if !name.contains("idemproxy") {
            return Err(stale(format!("process {pid} is {name:?}, not idemproxy")));
        }
    }
    kill_process(target, Signal::HUP).map_err(failed)
}

#[cfg(not(unix))]
fn hangup(pid: u32, _stale: &impl Fn(String) -> SignalError) -> Result<(), SignalError> {
    Err(SignalError::Signal {
        pid,
        error: io::Error::new(io::ErrorKind::Unsupported, "signals are a Unix feature"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pid_file_holds_this_process_and_is_removed_when_dropped() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("idemproxy.pid");
        let file = PidFile::write(&path).expect("write");
        let text = fs::read_to_string(&path).expect("read");
        assert_eq!(text, format!("{}\n", std::process::id()));
        drop(file);
        assert!(!path.exists(), "removed on drop");
    }

    #[test]
    fn a_pid_file_another_process_wrote_over_is_left_alone() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("idemproxy.pid");
        let file = PidFile::write(&path).expect("write");
        fs::write(&path, "4242\n").expect("overwrite");
        drop(file);
        assert_eq!(fs::read_to_string(&path).expect("kept"), "4242\n");
    }

    #[test]
    fn the_client_refuses_what_names_no_live_idemproxy() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("idemproxy.pid");
        assert!(matches!(signal_reload(None), Err(SignalError::NoPidFile)));
        assert!(matches!(
            signal_reload(Some(&path)),
            Err(SignalError::NotRunning(_))
        ));
        for garbled in ["", "abc", "-1", "0", "4294967295"] {
            fs::write(&path, garbled).expect("write");
            let e = signal_reload(Some(&path)).expect_err(garbled);
            assert!(matches!(e, SignalError::Garbled { .. }), "{garbled:?}: {e}");
        }
        // (A live process that is not idemproxy, and a dead one: tests/server/reload/process.rs, with real
        // processes; this test binary's own name contains "idemproxy".)
    }
}
