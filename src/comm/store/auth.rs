//! The store's handshake: client and server each prove that they hold the job token, and the
//! token itself never crosses the wire (issue 44, defect 4).
//!
//! The first protocol sent the token in the client's hello. Whoever listened on the store's
//! port then learnt it: where that port is predictable (derived from an MPI launcher's job
//! id), a local user who bound it before rank 0 received every rank's token and could answer
//! as the store, pointing the ranks at a shared-memory segment of their own. Now:
//!
//! 1. client → server: the magic and a fresh 32-byte nonce `cn`;
//! 2. server → client: its own fresh nonce `sn` and `HMAC-SHA256(token, "server" ‖ cn ‖ sn)`;
//! 3. the client checks that proof, and only then sends `HMAC-SHA256(token, "client" ‖ cn ‖
//!    sn)`; the server checks it and accepts or refuses.
//!
//! A server that does not hold the token cannot make step 2's proof, so the client stops
//! before it says anything that depends on the token; a client that does not hold it cannot
//! make step 3's. Fresh nonces on both sides keep a recorded exchange from being replayed. An
//! empty token proves nothing (anyone can compute its MACs): the launchers give every job a
//! random one ([`crate::comm::rendezvous`]).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of each side's nonce.
pub(super) const NONCE_BYTES: usize = 32;
/// Bytes of a proof (an HMAC-SHA256 tag).
pub(super) const PROOF_BYTES: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// Which side a proof speaks for; the two proofs of one exchange differ, so a server cannot
/// send the client's proof back as its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    Server,
    Client,
}

impl Side {
    fn label(self) -> &'static [u8] {
        match self {
            Side::Server => b"candle-tp-store server",
            Side::Client => b"candle-tp-store client",
        }
    }
}

fn mac(token: &[u8], side: Side, cn: &[u8], sn: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length (a long one is hashed first): `new_from_slice` cannot fail.
    let mut m = HmacSha256::new_from_slice(token).expect("HMAC accepts any key length");
    m.update(side.label());
    m.update(cn);
    m.update(sn);
    m
}

/// `side`'s proof of holding `token` in the exchange of nonces `cn` (client's) and `sn`
/// (server's).
pub(super) fn proof(token: &[u8], side: Side, cn: &[u8], sn: &[u8]) -> [u8; PROOF_BYTES] {
    mac(token, side, cn, sn).finalize().into_bytes().into()
}

/// Whether `tag` is `side`'s proof for `token` in this exchange, compared in constant time.
pub(super) fn verify(token: &[u8], side: Side, cn: &[u8], sn: &[u8], tag: &[u8]) -> bool {
    mac(token, side, cn, sn).verify_slice(tag).is_ok()
}

/// A fresh nonce from the kernel's random source; an error if it cannot give one (no
/// predictable fallback: a nonce that repeats lets a recorded proof be replayed).
pub(super) fn nonce() -> std::io::Result<[u8; NONCE_BYTES]> {
    crate::comm::secret::random_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 4231, test case 2: the HMAC-SHA256 underneath is the standard one.
    #[test]
    fn hmac_sha256_is_rfc_4231s() {
        let mut m = HmacSha256::new_from_slice(b"Jefe").unwrap();
        m.update(b"what do ya want for nothing?");
        assert_eq!(
            crate::comm::secret::hex(&m.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn proofs_depend_on_the_token_the_side_and_both_nonces() {
        let (cn, sn) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(cn, sn, "two nonces from the kernel");
        let p = proof(b"tok", Side::Server, &cn, &sn);
        assert!(verify(b"tok", Side::Server, &cn, &sn, &p));
        assert!(!verify(b"tok2", Side::Server, &cn, &sn, &p));
        assert!(!verify(b"tok", Side::Client, &cn, &sn, &p));
        assert!(!verify(b"tok", Side::Server, &sn, &cn, &p));
        assert!(!verify(b"tok", Side::Server, &cn, &sn, &p[..31]));
    }
}
