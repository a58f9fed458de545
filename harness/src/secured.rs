//! A `redis-server` that wants TLS (a test CA's certificate, made here with rcgen) and/or a
//! password, for `rediss://`, `store.ca_file` and `store.password_file`.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::cluster::wait_for;
use super::free_port;
use super::pki::Pki;

/// A `redis-server` with TLS only (`--port 0`), a password, or both. Killed on drop.
pub struct SecuredRedis {
    /// Its port (the TLS port with TLS).
    pub port: u16,
    /// The CA that signed its certificate, with TLS.
    pub pki: Option<Pki>,
    /// Its password, if it wants one.
    pub password: Option<String>,
    child: Option<Child>,
}

impl SecuredRedis {
    /// Starts one on a free port: with TLS when `tls`, wanting `password` when given.
    pub fn start(tls: bool, password: Option<&str>) -> SecuredRedis {
        let port = free_port();
        let pki = tls.then(Pki::new);
        let mut cmd = Command::new(super::redis_binary());
        match &pki {
            Some(pki) => {
                cmd.args(["--port", "0", "--tls-port", &port.to_string()]);
                cmd.arg("--tls-cert-file").arg(&pki.cert);
                cmd.arg("--tls-key-file").arg(&pki.key);
                cmd.arg("--tls-ca-cert-file").arg(&pki.ca);
                cmd.args(["--tls-auth-clients", "no"]);
            }
            None => {
                cmd.args(["--port", &port.to_string()]);
            }
        }
        if let Some(p) = password {
            cmd.args(["--requirepass", p]);
        }
        let child = cmd
            .args(super::REDIS_EPHEMERAL)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server (install it: apt-get install redis-server)");
        let server = SecuredRedis {
            port,
            pki,
            password: password.map(str::to_owned),
            child: Some(child),
        };
        wait_for(
            Duration::from_secs(10),
            "the secured redis to start",
            || server.try_conn().is_ok(),
        );
        server
    }

    /// `redis://` or `rediss://127.0.0.1:PORT/0`, without the password.
    pub fn url(&self) -> String {
        let scheme = if self.pki.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/0", self.port)
    }

    fn try_conn(&self) -> redis::RedisResult<redis::Connection> {
        let scheme = if self.pki.is_some() {
            "rediss"
        } else {
            "redis"
        };
        let auth = self
            .password
            .as_ref()
            .map(|p| format!(":{p}@"))
            .unwrap_or_default();
        let url = format!("{scheme}://{auth}127.0.0.1:{}/0", self.port);
        let client = match &self.pki {
            Some(pki) => redis::Client::build_with_tls(
                url.as_str(),
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(std::fs::read(&pki.ca).expect("read ca.pem")),
                },
            )?,
            None => redis::Client::open(url.as_str())?,
        };
        let mut c = client.get_connection_with_timeout(Duration::from_secs(2))?;
        redis::cmd("PING").query::<String>(&mut c)?;
        Ok(c)
    }

    /// An authenticated connection, for inspecting what the proxy stored.
    pub fn conn(&self) -> redis::Connection {
        self.try_conn().expect("connect to the secured redis")
    }
}

impl Drop for SecuredRedis {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
