//! The upstream every proxy of the run and the reference nginx forward to (`--upstream`): the
//! mock, or an nginx that answers every request with one fixed small JSON body.
//!
//! The mock does some work per request (it reads the JSON, echoes it, counts the call per key)
//! and is what the checks read: the conflict storm's and fill's call counts, replay's "the
//! upstream saw it once", the 64 KiB answers (`X-Mock-Body-Size`), the storm's held first
//! requests (`X-Mock-Delay`). nginx's `return 200` is about the least an upstream can cost, so
//! a proxy's own cost is read against the cheapest upstream there is. With it, the scenarios
//! that need the mock are skipped ([`Upstream::lacks`]) and replay checks the first answer
//! only (nothing counts the upstream's calls).

use std::net::SocketAddr;
use std::path::Path;

use crate::args::UpstreamKind;
use crate::cores::Part;
use crate::procs::{self, Mock, NGINX_BODY, Nginx, NginxSite};
use crate::scenario::{Scenario, Target};

pub(crate) enum Upstream {
    Mock(Mock),
    /// An nginx of [`NginxSite::Fixed`].
    Nginx(Nginx),
}

impl Upstream {
    /// Starts it; `--upstream nginx` without nginx installed is an error, not a skip: every
    /// row would measure something else than asked.
    pub(crate) fn start(kind: UpstreamKind, dir: &Path) -> Result<Upstream, String> {
        match kind {
            UpstreamKind::Mock => {
                let mock = Mock::start(Path::new(env!("CARGO_BIN_EXE_mock-upstream")), dir)?;
                println!("mock-upstream on http://{}", mock.addr);
                Ok(Upstream::Mock(mock))
            }
            UpstreamKind::Nginx => {
                let bin = procs::find_binary("nginx", "NGINX").ok_or(
                    "--upstream nginx: nginx is not installed (apt-get install nginx-light; \
                     NGINX=/path names the binary)",
                )?;
                let nginx = Nginx::start(&bin, dir, "nginx-upstream", NginxSite::Fixed)?;
                println!(
                    "nginx-upstream (return 200, a fixed {}-byte JSON body) on http://{}",
                    NGINX_BODY.len(),
                    nginx.addr
                );
                Ok(Upstream::Nginx(nginx))
            }
        }
    }

    /// For the run's header line.
    pub(crate) fn describe(kind: UpstreamKind) -> String {
        match kind {
            UpstreamKind::Mock => "mock-upstream".to_owned(),
            UpstreamKind::Nginx => format!(
                "nginx return 200 (a fixed {}-byte JSON body; --upstream nginx)",
                NGINX_BODY.len()
            ),
        }
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        match self {
            Upstream::Mock(mock) => mock.addr,
            Upstream::Nginx(nginx) => nginx.addr,
        }
    }

    /// The mock, when it is the upstream: its ledger and control headers.
    pub(crate) fn mock(&self) -> Option<&Mock> {
        match self {
            Upstream::Mock(mock) => Some(mock),
            Upstream::Nginx(_) => None,
        }
    }

    /// The upstream in the `limit` column. nginx's workers are its master's children, counted
    /// with it.
    pub(crate) fn part(&self) -> Part {
        match self {
            Upstream::Mock(mock) => Part::process("mock", mock.pid()),
            Upstream::Nginx(nginx) => Part::process("nginx-upstream", nginx.pid()),
        }
    }

    /// Why `s` cannot run on this upstream, if it cannot.
    pub(crate) fn lacks(&self, s: &Scenario) -> Option<&'static str> {
        if self.mock().is_some() {
            return None;
        }
        if s.big {
            return Some("needs the mock upstream (64 KiB answers: X-Mock-Body-Size)");
        }
        match s.target {
            Target::Storm(_) => Some("needs the mock upstream (X-Mock-Delay, its call counts)"),
            Target::Fill => Some("needs the mock upstream (its call counts)"),
            Target::Resolve(_) => {
                Some("needs the mock upstream (X-Mock-Hang, its bookings and their lookup)")
            }
            _ => None,
        }
    }
}
