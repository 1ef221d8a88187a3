//! Secrets from the kernel's random source, with no predictable fallback: what a job token
//! (`job_token.rs`), the stores' tokens under MPI (`mpi/bootstrap.rs`, the hierarchical
//! backend) and the store handshake's nonces (`store/auth.rs`) are drawn from. (The
//! segment names of `region::random_hex` need only be unique, and fall back to the clock.)

/// `N` bytes from `getrandom`, retried through interruptions and short reads; an error if the
/// kernel cannot give them.
pub(crate) fn random_bytes<const N: usize>() -> std::io::Result<[u8; N]> {
    let mut n = [0u8; N];
    let mut filled = 0;
    while filled < N {
        // SAFETY: getrandom writes at most `N - filled` bytes into the rest of `n`.
        let got = unsafe { libc::getrandom(n[filled..].as_mut_ptr().cast(), N - filled, 0) };
        if got < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        filled += got as usize;
    }
    Ok(n)
}

/// A fresh 128-bit token as 32 lowercase hexadecimal characters: what a rendezvous store is
/// served with (`mpi/bootstrap.rs`, the hierarchical backend's host stores, `job_token.rs`).
pub(crate) fn random_token() -> std::io::Result<String> {
    Ok(hex(&random_bytes::<16>()?))
}

/// `bytes` as lowercase hexadecimal.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_differ_and_print_as_hex() {
        let (a, b) = (random_bytes::<16>().unwrap(), random_bytes::<16>().unwrap());
        assert_ne!(a, b, "two 128-bit draws from the kernel");
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(hex(&a).len(), 32);
    }
}
