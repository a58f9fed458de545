//! A PostgreSQL server of the run's own, for the `*/postgres` scenarios and the pgbench ceiling.
//!
//! `initdb` into the run's temp dir, then `postgres` on a free loopback port with its unix socket
//! beside the data. Durability is what these scenarios measure, so the server keeps its
//! defaults there: `fsync = on`, `synchronous_commit = on` (every commit waits for its WAL
//! flush). initdb refuses to run as root: as root, the cluster belongs to the `postgres` user
//! (else `nobody`; `PG_USER` names another) and the server runs as that user.
//!
//! The server is stopped with SIGQUIT (immediate shutdown: the postmaster takes every backend
//! down with it; nothing is kept anyway), then SIGKILL, on drop and on Ctrl-C like the other
//! children; a backend still there afterwards is killed too. The binaries come from `PG_BIN`
//! (a directory; `none`: act as if PostgreSQL were not installed), else the newest
//! `/usr/lib/postgresql/*/bin`, else `PATH`.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::procs::{ChildProcess, free_port};

/// The superuser initdb is told to create, and the database it always makes.
pub(crate) const ROLE: &str = "postgres";
pub(crate) const DATABASE: &str = "postgres";
/// How long the server may take to accept a first query.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The directory holding `initdb`, `postgres`, `psql` and `pgbench`, if PostgreSQL is installed.
pub(crate) fn find_bin_dir() -> Option<PathBuf> {
    if let Some(value) = std::env::var_os("PG_BIN") {
        let none = value.is_empty() || value == "none";
        return (!none).then(|| PathBuf::from(value));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Some(bin);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .find(|dir| dir.join("postgres").is_file() && dir.join("initdb").is_file())
}

/// The uid and gid the server runs as: `None` when this process is not root (then it runs as
/// this user).
fn server_user() -> Result<Option<(u32, u32)>, String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("read /proc/self/status: {e}"))?;
    let root = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        == Some("0");
    if !root {
        return Ok(None);
    }
    let wanted: Vec<String> = match std::env::var("PG_USER") {
        Ok(user) => vec![user],
        Err(_) => vec!["postgres".to_owned(), "nobody".to_owned()],
    };
    let passwd =
        std::fs::read_to_string("/etc/passwd").map_err(|e| format!("read /etc/passwd: {e}"))?;
    for name in &wanted {
        for line in passwd.lines() {
            let fields: Vec<&str> = line.split(':').collect();
            if fields.len() > 3
                && fields[0] == name
                && let (Ok(uid), Ok(gid)) = (fields[2].parse(), fields[3].parse())
            {
                return Ok(Some((uid, gid)));
            }
        }
    }
    Err(format!(
        "running as root, and no unprivileged user for PostgreSQL (tried {wanted:?}; set PG_USER)"
    ))
}

/// The run's PostgreSQL server.
pub(crate) struct Postgres {
    process: ChildProcess,
    bin: PathBuf,
    /// Holds `data/` and the unix socket.
    dir: PathBuf,
    port: u16,
    /// Schemas handed out so far.
    schemas: std::cell::Cell<u32>,
    /// Schemas below this number are dropped.
    dropped: std::cell::Cell<u32>,
}

impl Postgres {
    /// `initdb` into `run_dir/postgres/data`, then the server, waiting until it answers.
    pub(crate) fn start(bin: &Path, run_dir: &Path) -> Result<Postgres, String> {
        let user = server_user()?;
        let dir = run_dir.join("postgres");
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        if let Some((uid, gid)) = user {
            // The server's user must reach its directory inside the run's private one.
            std::fs::set_permissions(run_dir, std::fs::Permissions::from_mode(0o711))
                .map_err(|e| format!("chmod {}: {e}", run_dir.display()))?;
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))
                .map_err(|e| format!("chown {}: {e}", dir.display()))?;
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("chmod {}: {e}", dir.display()))?;
        let data = dir.join("data");
        let mut initdb = Command::new(bin.join("initdb"));
        as_user(&mut initdb, user);
        let out = initdb
            .arg("-D")
            .arg(&data)
            .args(["-A", "trust", "-E", "UTF8", "--locale=C", "-U", ROLE])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("run initdb: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let port = free_port()?;
        let mut command = Command::new(bin.join("postgres"));
        as_user(&mut command, user);
        command
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", dir.display()))
            .args(["-c", "max_connections=200"])
            .args([
                "-c",
                "logging_collector=off",
                "-c",
                "log_min_messages=warning",
            ])
            // Its own process group, away from the terminal's Ctrl-C: the bench stops it.
            .process_group(0)
            .stdout(Stdio::null());
        let mut process = ChildProcess::spawn(
            "postgres".to_owned(),
            &mut command,
            run_dir.join("postgres.log"),
            Some("-QUIT"),
        )?;
        let server = Postgres {
            bin: bin.to_owned(),
            dir,
            port,
            schemas: std::cell::Cell::new(0),
            dropped: std::cell::Cell::new(0),
            process: {
                process.wait_listening(SocketAddr::from(([127, 0, 0, 1], port)))?;
                process
            },
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match server.sql("SELECT 1") {
                Ok(_) => break,
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("postgres did not answer in time: {e}"));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
        Ok(server)
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`: over TCP, as the proxy connects.
    pub(crate) fn url(&self) -> String {
        format!("postgres://{ROLE}@127.0.0.1:{}/{DATABASE}", self.port)
    }

    /// The postmaster's pid; the backends are its children (see `procs::cpu_time`). Each one
    /// runs in a session of its own (postgres calls `setsid` in every child), so they are found
    /// by parentage, not by process group.
    pub(crate) fn pid(&self) -> u32 {
        self.process.pid()
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// A binary of the installation (`pgbench`, `psql`).
    pub(crate) fn bin(&self, name: &str) -> PathBuf {
        self.bin.join(name)
    }

    /// A schema name no scenario of this run has had yet (the proxy creates it).
    pub(crate) fn fresh_schema(&self) -> String {
        let n = self.schemas.get();
        self.schemas.set(n + 1);
        format!("load_{n}")
    }

    /// Drops every schema handed out since the last call, so the disk does not fill over a
    /// run (the 64 KiB scenarios write gigabytes).
    pub(crate) fn drop_schemas(&self) -> Result<(), String> {
        for n in self.dropped.get()..self.schemas.get() {
            self.sql(&format!("DROP SCHEMA IF EXISTS load_{n} CASCADE"))?;
            self.dropped.set(n + 1);
        }
        Ok(())
    }

    /// `sql` through psql over the unix socket: its unaligned, tuples-only output.
    pub(crate) fn sql(&self, sql: &str) -> Result<String, String> {
        let out = Command::new(self.bin("psql"))
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
            .arg("-h")
            .arg(&self.dir)
            .args(["-p", &self.port.to_string(), "-U", ROLE, "-d", DATABASE])
            .args(["-c", sql])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("run psql: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(format!(
                "psql {sql:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// The postmaster's children now.
    fn children(&self) -> Vec<u32> {
        let parent = self.pid();
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if ppid == Some(parent) {
                found.push(pid);
            }
        }
        found
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // Listed while they are still the postmaster's; once it is gone they would be init's.
        let children = self.children();
        self.process.stop();
        for pid in children {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }
}

fn as_user(command: &mut Command, user: Option<(u32, u32)>) {
    if let Some((uid, gid)) = user {
        command.uid(uid).gid(gid);
    }
}
