//! Wire format of the TCP store: length-prefixed frames, request and reply encoding, and the
//! handshake constants shared by [`super::TcpStoreServer`] and [`super::TcpStore`].

use std::io::{self, ErrorKind, Read, Write};

/// Bound on any frame (request or reply), in bytes; a longer length prefix closes the
/// connection without allocating it.
pub const MAX_FRAME_BYTES: usize = 16 << 20;
/// Protocol identifier sent in the hello frame (2: the mutual proofs of `super::auth`; 1 sent
/// the token itself).
pub(super) const MAGIC: &[u8] = b"candle-tp-store/2";
/// Bound on each handshake frame (magic and nonce; nonce and proof; proof).
pub(super) const MAX_HELLO_BYTES: usize = 1024;
/// Bound on the job token, checked by the client before it says hello.
pub(super) const MAX_TOKEN_BYTES: usize = 4096;

pub(super) const OP_SET: u8 = 1;
pub(super) const OP_GET: u8 = 2;
pub(super) const OP_TRY_GET: u8 = 3;
pub(super) const OP_ADD: u8 = 4;
pub(super) const OP_DELETE: u8 = 5;
pub(super) const R_OK: u8 = 0;
pub(super) const R_VALUE: u8 = 1;
pub(super) const R_NOT_FOUND: u8 = 2;
pub(super) const R_INT: u8 = 3;
pub(super) const R_BOOL: u8 = 4;
pub(super) const R_ERR: u8 = 5;
pub(super) const HELLO_ACCEPT: u8 = 1;
pub(super) const HELLO_BAD_TOKEN: u8 = 2;

pub(super) fn write_frame(w: &mut impl Write, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len())
        .map_err(|_| io::Error::new(ErrorKind::InvalidInput, "frame longer than u32"))?;
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()
}

/// Reads one frame; a length over `max` is an `InvalidData` error and nothing is allocated.
pub(super) fn read_frame(r: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {max} bytes"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// Builds a payload: fixed-size little-endian integers and `u32`-length-prefixed byte strings.
pub(super) struct Enc(pub(super) Vec<u8>);

impl Enc {
    pub(super) fn op(op: u8) -> Self {
        Enc(vec![op])
    }
    pub(super) fn bytes(mut self, b: &[u8]) -> Self {
        // Lengths over u32 are caught by the frame size check before sending.
        self.0
            .extend_from_slice(&(b.len().min(u32::MAX as usize) as u32).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
    pub(super) fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
}

/// Reads a payload built by [`Enc`]; every read is bounds-checked.
pub(super) struct Dec<'a>(pub(super) &'a [u8]);

pub(super) fn malformed(what: &str) -> io::Error {
    io::Error::new(ErrorKind::InvalidData, format!("malformed frame: {what}"))
}

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(malformed("truncated"));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    pub(super) fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub(super) fn u64(&mut self) -> io::Result<u64> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    pub(super) fn bytes(&mut self) -> io::Result<&'a [u8]> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        self.take(u32::from_le_bytes(b) as usize)
    }
    pub(super) fn key(&mut self) -> io::Result<&'a str> {
        std::str::from_utf8(self.bytes()?).map_err(|_| malformed("key is not UTF-8"))
    }
    pub(super) fn end(&self) -> io::Result<()> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(malformed("trailing bytes"))
        }
    }
}
