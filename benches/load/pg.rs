//! The run's PostgreSQL server, for the `*/postgres` scenarios and the pgbench ceiling: the
//! harness's private server ([`PgServer`]: `initdb` into a temp dir, `postgres` on a free
//! loopback port, as an unprivileged user when the bench runs as root), with the schemas the
//! run hands out.
//!
//! Durability is what these scenarios measure, so the server keeps its defaults there:
//! `fsync = on`, `synchronous_commit = on` (every commit waits for its WAL flush). Its log is
//! `postgres.log` in the run's directory. It is killed on drop, and on Ctrl-C like the other
//! children (`procs::kill_all`: SIGQUIT, an immediate shutdown that takes every backend down).
//! The binaries come from `PG_BIN` (a directory; `none`: act as if PostgreSQL were not
//! installed), else the newest `/usr/lib/postgresql/*/bin`, else `PATH`.

use std::path::{Path, PathBuf};

use harness::postgres::{self as server, PgServer};

use crate::procs;

/// The database initdb always makes.
pub(crate) const DATABASE: &str = server::DATABASE;

/// The directory holding `initdb`, `postgres`, `psql` and `pgbench`, if PostgreSQL is installed.
pub(crate) fn find_bin_dir() -> Option<PathBuf> {
    server::installed_bin_dir()
}

/// The run's PostgreSQL server.
pub(crate) struct Postgres {
    server: PgServer,
    /// Schemas handed out so far.
    schemas: std::cell::Cell<u32>,
    /// Schemas below this number are dropped.
    dropped: std::cell::Cell<u32>,
}

impl Postgres {
    /// A fresh cluster, its log in `run_dir/postgres.log`, waiting until it answers.
    pub(crate) fn start(run_dir: &Path) -> Result<Postgres, String> {
        let log = run_dir.join("postgres.log");
        let settings = ["max_connections=200", "log_min_messages=warning"];
        let server = PgServer::try_start(&settings, Some(&log))?;
        procs::track(server.pid(), Some("-QUIT"));
        Ok(Postgres {
            server,
            schemas: std::cell::Cell::new(0),
            dropped: std::cell::Cell::new(0),
        })
    }

    /// `postgres://ROLE@127.0.0.1:PORT/postgres`: over TCP, as the proxy connects.
    pub(crate) fn url(&self) -> String {
        self.server.url()
    }

    /// The role the server knows (initdb names it after the user the server runs as).
    pub(crate) fn role(&self) -> String {
        self.server.role()
    }

    /// The postmaster's pid; the backends are its children (see `procs::cpu_time`). Each one
    /// runs in a session of its own (postgres calls `setsid` in every child), so they are found
    /// by parentage, not by process group.
    pub(crate) fn pid(&self) -> u32 {
        self.server.pid()
    }

    pub(crate) fn port(&self) -> u16 {
        self.server.port()
    }

    /// A binary of the installation (`pgbench`, `psql`).
    pub(crate) fn bin(&self, name: &str) -> PathBuf {
        server::bin(name)
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
        self.server
            .try_sql(sql)
            .map_err(|e| format!("psql {sql:?}: {}", e.trim()))
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // The server itself goes when `server` is dropped, right after.
        procs::untrack(self.server.pid());
    }
}
