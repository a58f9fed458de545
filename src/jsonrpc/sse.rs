//! A `text/event-stream` read by the grammar of the HTML standard's server-sent events, as the
//! bytes arrive: lines end in CR, LF or CRLF (a CR at the end of one chunk and an LF at the start
//! of the next are one line end), `data:` lines of one event are joined with LF, lines that
//! start with `:` are comments, an empty line ends the event. Only `data` matters here: the
//! response to a call is the data of one event.

use bytes::Bytes;

/// An event stream being read.
#[derive(Debug)]
pub struct EventStream {
    /// The current line, not yet ended.
    line: Vec<u8>,
    /// The current event's data so far (`None`: no `data:` line yet).
    data: Option<Vec<u8>>,
    /// The last byte fed was a CR: an LF right after it ends nothing more.
    after_cr: bool,
    /// The most bytes a line or an event's data may hold.
    limit: usize,
    /// The stream's first bytes may be a byte order mark, which is skipped.
    started: bool,
}

/// The stream holds a line or an event larger than the limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an event of the stream is larger than {limit} bytes")]
pub struct SseError {
    pub limit: usize,
}

impl EventStream {
    /// A stream whose lines and events hold at most `limit` bytes.
    pub fn new(limit: usize) -> EventStream {
        EventStream {
            line: Vec::new(),
            data: None,
            after_cr: false,
            limit,
            started: false,
        }
    }

    /// Reads `chunk`, handing every event it ends (its data) to `event`.
    pub fn feed(&mut self, chunk: &[u8], mut event: impl FnMut(Bytes)) -> Result<(), SseError> {
        let mut chunk = chunk;
        if !self.started && !chunk.is_empty() {
            self.started = true;
            chunk = chunk.strip_prefix("\u{feff}".as_bytes()).unwrap_or(chunk);
        }
        for &b in chunk {
            match b {
                b'\n' if self.after_cr => self.after_cr = false,
                b'\r' | b'\n' => {
                    self.after_cr = b == b'\r';
                    self.end_line(&mut event)?;
                }
                _ => {
                    self.after_cr = false;
                    if self.line.len() >= self.limit {
                        return Err(SseError { limit: self.limit });
                    }
                    self.line.push(b);
                }
            }
        }
        Ok(())
    }

    fn end_line(&mut self, event: &mut impl FnMut(Bytes)) -> Result<(), SseError> {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            if let Some(data) = self.data.take() {
                event(Bytes::from(data));
            }
            return Ok(());
        }
        if line.first() == Some(&b':') {
            return Ok(());
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let value = &line[i + 1..];
                (&line[..i], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (&line[..], &[][..]),
        };
        if field == b"data" {
            let data = match &mut self.data {
                Some(data) => {
                    data.push(b'\n');
                    data
                }
                None => self.data.insert(Vec::new()),
            };
            if data.len() + value.len() > self.limit {
                return Err(SseError { limit: self.limit });
            }
            data.extend_from_slice(value);
        }
        Ok(())
    }
}
