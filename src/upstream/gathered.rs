//! A response body gathered frame by frame, up to a bound, with as few copies as it allows.

use bytes::{Bytes, BytesMut};

/// A body read frame by frame: a body of one frame (the usual small response) is kept as it
/// came, without a copy; a longer one is joined.
#[derive(Default)]
pub(super) struct Gathered {
    first: Option<Bytes>,
    joined: BytesMut,
    /// The whole body's expected size, reserved when frames start being joined.
    reserve: usize,
}

impl Gathered {
    /// Room for `capacity` bytes, taken only if a second frame comes.
    pub(super) fn with_capacity(capacity: usize) -> Gathered {
        Gathered {
            first: None,
            joined: BytesMut::new(),
            reserve: capacity,
        }
    }

    /// Adds a frame; the length so far.
    pub(super) fn push(&mut self, data: Bytes) -> u64 {
        match self.first.take() {
            None if self.joined.is_empty() => self.first = Some(data),
            first => {
                if let Some(first) = first {
                    self.joined
                        .reserve(self.reserve.max(first.len() + data.len()));
                    self.joined.extend_from_slice(&first);
                }
                self.joined.extend_from_slice(&data);
            }
        }
        self.first.as_ref().map_or(self.joined.len(), Bytes::len) as u64
    }

    pub(super) fn into_bytes(self) -> Bytes {
        self.first.unwrap_or_else(|| self.joined.freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_gathered_frame_by_frame_keeps_every_byte_in_order() {
        let mut one = Gathered::default();
        assert_eq!(one.push(Bytes::from_static(b"abc")), 3);
        assert_eq!(one.into_bytes(), "abc");
        let mut three = Gathered::default();
        three.push(Bytes::from_static(b"ab"));
        three.push(Bytes::new());
        assert_eq!(three.push(Bytes::from_static(b"cde")), 5);
        assert_eq!(three.into_bytes(), "abcde");
        let mut empty_first = Gathered::default();
        empty_first.push(Bytes::new());
        assert_eq!(empty_first.push(Bytes::from_static(b"x")), 1);
        assert_eq!(empty_first.into_bytes(), "x");
        assert_eq!(Gathered::default().into_bytes(), "");
        let mut sized = Gathered::with_capacity(6);
        sized.push(Bytes::from_static(b"abc"));
        assert_eq!(sized.push(Bytes::from_static(b"def")), 6);
        assert_eq!(sized.into_bytes(), "abcdef");
    }
}
