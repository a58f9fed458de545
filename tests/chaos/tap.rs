//! The tap on the upstream relay: every request the upstream received, parsed and timestamped.

use super::*;

/// One request forwarded to the mock upstream, whole (head and body): an execution.
#[derive(Debug, Clone)]
pub(crate) struct Exec {
    pub(crate) at: Duration,
    pub(crate) auth: String,
    pub(crate) key: String,
    pub(crate) via: String,
    pub(crate) attempt: String,
}

/// Parses the HTTP/1.1 requests the upstream relay forwards (hyper's client: `content-length`
/// bodies), per connection.
#[derive(Default)]
pub(crate) struct ExecTap {
    pub(crate) clock: Mutex<Option<Clock>>,
    pub(crate) conns: Mutex<HashMap<u64, RequestParser>>,
    pub(crate) events: Mutex<Vec<Exec>>,
    pub(crate) errors: Mutex<Vec<String>>,
}

impl ExecTap {
    pub(crate) fn start(&self, clock: Clock) {
        *self.clock.lock().unwrap_or_else(PoisonError::into_inner) = Some(clock);
    }

    pub(crate) fn events(&self) -> Vec<Exec> {
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn errors(&self) -> Vec<String> {
        self.errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Tap for ExecTap {
    fn forwarded(&self, conn: u64, dir: Direction, bytes: &[u8]) {
        if dir != Direction::Up {
            return;
        }
        let now = self
            .clock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(Clock::now)
            .unwrap_or_default();
        let mut done = Vec::new();
        let result = self
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(conn)
            .or_default()
            .feed(bytes, now, &mut done);
        if let Err(e) = result {
            self.errors
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(format!("connection {conn}: {e}"));
        }
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(done);
    }

    fn closed(&self, conn: u64) {
        self.conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&conn);
    }
}

#[derive(Default)]
pub(crate) struct RequestParser {
    pub(crate) buf: Vec<u8>,
    /// The request whose body is being read, and how much of it is left.
    pub(crate) pending: Option<Exec>,
    pub(crate) body_left: usize,
    pub(crate) broken: bool,
}

impl RequestParser {
    pub(crate) fn feed(
        &mut self,
        bytes: &[u8],
        now: Duration,
        out: &mut Vec<Exec>,
    ) -> Result<(), String> {
        if self.broken {
            return Ok(());
        }
        self.buf.extend_from_slice(bytes);
        loop {
            if let Some(mut exec) = self.pending.take() {
                if self.buf.len() < self.body_left {
                    self.body_left -= self.buf.len();
                    self.buf.clear();
                    self.pending = Some(exec);
                    return Ok(());
                }
                self.buf.drain(..self.body_left);
                self.body_left = 0;
                exec.at = now;
                if !exec.key.is_empty() {
                    out.push(exec);
                }
                continue;
            }
            let Some(end) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                return Ok(());
            };
            let head = String::from_utf8_lossy(&self.buf[..end]).into_owned();
            self.buf.drain(..end + 4);
            let mut exec = Exec {
                at: now,
                auth: String::new(),
                key: String::new(),
                via: String::new(),
                attempt: String::new(),
            };
            let mut length = 0usize;
            for line in head.lines().skip(1) {
                let Some((name, value)) = line.split_once(':') else {
                    continue;
                };
                let value = value.trim().to_owned();
                match name.trim().to_ascii_lowercase().as_str() {
                    "content-length" => {
                        length = value.parse().map_err(|_| format!("bad length {value:?}"))?;
                    }
                    "transfer-encoding" => {
                        self.broken = true;
                        return Err(format!("a {value} request body: the tap can't follow it"));
                    }
                    "authorization" => exec.auth = value,
                    "idempotency-key" => exec.key = value,
                    "x-chaos-via" => exec.via = value,
                    "x-chaos-attempt" => exec.attempt = value,
                    _ => {}
                }
            }
            self.pending = Some(exec);
            self.body_left = length;
        }
    }
}
