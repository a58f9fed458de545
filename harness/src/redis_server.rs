//! A `redis-server` of a test's own ([`RedisServer`]): a free loopback port, no persistence,
//! its own working directory; paused (SIGSTOP), resumed, killed and restarted on the same port;
//! killed on drop.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

/// The `redis-server` flags of every test server: loopback only, nothing persisted, in the
/// foreground, quiet.
pub const REDIS_EPHEMERAL: [&str; 10] = [
    "--bind",
    "127.0.0.1",
    "--save",
    "",
    "--appendonly",
    "no",
    "--daemonize",
    "no",
    "--loglevel",
    "warning",
];

/// The `redis-server` binary: `REDIS_SERVER` or the one on PATH.
pub fn redis_binary() -> String {
    std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_owned())
}

/// A `redis-server` of this test's own.
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    extra: Vec<String>,
    /// Its working directory: a replica's full sync writes an RDB file there, never into the
    /// checkout.
    dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts one on a free loopback port, with no persistence.
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Starts one with extra `--option value` arguments.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let mut s = RedisServer {
            port: free_port(),
            child: None,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            dir: tempfile::tempdir().expect("a working directory for redis-server"),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let child = Command::new(redis_binary())
            .args(["--port", &self.port.to_string()])
            .args(REDIS_EPHEMERAL)
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server (install it: apt-get install redis-server)");
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(client) = redis::Client::open(self.url())
                && let Ok(mut c) = client.get_connection_with_timeout(Duration::from_millis(200))
                && redis::cmd("PING").query::<String>(&mut c).is_ok()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not start on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `redis://127.0.0.1:PORT/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT`, for a relay in front of it.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child
            .as_ref()
            .map(|c| c.id())
            .expect("redis is running")
    }

    fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {sig} redis");
    }

    /// SIGSTOP: Redis hangs, connections stay open.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts again on the same port (after [`RedisServer::kill`]). Empty: no persistence.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// A synchronous connection, for inspecting or corrupting what the proxy stored.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .expect("redis url")
            .get_connection_with_timeout(Duration::from_secs(2))
            .expect("connect to redis")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            // A paused server must be resumed to die promptly on some kernels; SIGKILL works
            // on stopped processes anyway, this is belt and braces.
            let _ = Command::new("kill")
                .args(["-CONT", &c.id().to_string()])
                .status();
        }
        self.kill();
    }
}
