//! Forwarding tprun's standard input to one rank, as `mpirun` does: the chosen rank
//! (`--stdin-rank`, global rank 0 by default) reads what tprun reads, every other rank reads
//! /dev/null.
//!
//! The bytes go through a pipe and a thread rather than by handing the worker tprun's own
//! descriptor: each worker runs in its own process group, and a process outside the
//! terminal's foreground group that reads the terminal is stopped by `SIGTTIN`. tprun stays
//! in the foreground group, reads, and writes each chunk on at once (so a line typed at a
//! terminal reaches the rank when Enter is pressed). When tprun's input ends the pipe is
//! closed, so the rank sees end of file; when the rank closes its end (or exits) the thread
//! stops at its next write.

use std::io::{self, Read, Write};
use std::process::ChildStdin;
use std::thread;

/// Starts the thread that copies tprun's standard input into `stdin` of global rank `rank`
/// until end of file (then closes it) or until the rank stops reading.
pub fn forward_stdin(rank: usize, stdin: ChildStdin) -> io::Result<thread::JoinHandle<()>> {
    thread::Builder::new()
        .name(format!("tprun-rank{rank}-stdin"))
        .spawn(move || copy_until_closed(io::stdin().lock(), stdin))
}

/// Copies `from` into `to` chunk by chunk, writing each chunk as soon as it is read; stops at
/// end of file, a read error, or a write error (the reader went away: `EPIPE`, since Rust
/// ignores `SIGPIPE`). Dropping `to` closes the pipe, which is the end of file the rank sees.
fn copy_until_closed<R: Read, W: Write>(mut from: R, mut to: W) {
    let mut buf = [0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        if to.write_all(&buf[..n]).and_then(|_| to.flush()).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that accepts `limit` bytes, then fails as a closed pipe does.
    struct Closing {
        got: Vec<u8>,
        limit: usize,
    }

    impl Write for Closing {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            if self.got.len() >= self.limit {
                return Err(io::Error::from(io::ErrorKind::BrokenPipe));
            }
            let n = b.len().min(self.limit - self.got.len());
            self.got.extend_from_slice(&b[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn copies_everything_up_to_end_of_file() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let mut out = Vec::new();
        copy_until_closed(&data[..], &mut out);
        assert_eq!(out, data);
    }

    #[test]
    fn stops_when_the_reader_goes_away() {
        let data = vec![7u8; 300_000];
        let mut out = Closing {
            got: Vec::new(),
            limit: 1000,
        };
        copy_until_closed(&data[..], &mut out);
        assert_eq!(out.got.len(), 1000);
    }
}
