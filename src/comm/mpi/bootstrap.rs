//! A job's rendezvous store found through MPI: rank 0 serves it on every interface and hands
//! its addresses, port and a fresh token to the other ranks with one `MPI_Bcast`, so that a job
//! launched by `mpirun` or `srun` needs no `MASTER_ADDR`/`MASTER_PORT` (as TensorRT-LLM hands out
//! NCCL's unique id through MPI). The NCCL backend meets there when launched that way.

#![cfg_attr(not(feature = "nccl"), allow(dead_code))] // the nccl backend's, tested here

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use crate::comm::backend::{Backend, HostBufMut};
use crate::comm::error::{CommError, CommResult};
use crate::comm::region::random_hex;
use crate::comm::store::{Keep, Store, TcpStore, TcpStoreServer};

use super::MpiBackend;

/// The longest message rank 0 may announce (port, token and every address as text).
const MAX_MESSAGE: usize = 1 << 20;

/// The IPv4 addresses of this host's interfaces that are up, loopback last.
fn addresses() -> Vec<Ipv4Addr> {
    let mut out = Vec::new();
    let mut ifs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `ifs` with a list we only read and then free with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut ifs) } != 0 {
        return vec![Ipv4Addr::LOCALHOST];
    }
    let mut p = ifs;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned.
        let ifa = unsafe { &*p };
        let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
        if up && !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points to a sockaddr whose family says how to read it.
            let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
            if family == libc::AF_INET {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                out.push(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: `ifs` came from getifaddrs.
    unsafe { libc::freeifaddrs(ifs) };
    out.sort_by_key(|a| a.is_loopback());
    out.dedup();
    if out.is_empty() {
        out.push(Ipv4Addr::LOCALHOST);
    }
    out
}

/// Rank 0 of `world` serves the store; every rank returns a client of it (rank 0 also the
/// server, to keep alive). Collective over `world`.
pub(crate) fn store_over_mpi(
    world: &MpiBackend,
    timeout: Duration,
) -> CommResult<(Arc<dyn Store>, Keep)> {
    let mut keep: Keep = Vec::new();
    let mut text = String::new();
    if world.rank() == 0 {
        let token = random_hex();
        let server = TcpStoreServer::bind("0.0.0.0", 0, &token)?;
        let addrs: Vec<String> = addresses().iter().map(|a| a.to_string()).collect();
        text = format!("{} {} {}", server.port(), token, addrs.join(","));
        keep.push(Box::new(server));
    }
    // Its length first, then the message: a host with many interfaces has a long list (a
    // fixed message of 1024 bytes cut it).
    let mut len = [text.len() as i64];
    world.broadcast(HostBufMut::new(&mut len), 0)?;
    let len = usize::try_from(len[0])
        .ok()
        .filter(|&n| n <= MAX_MESSAGE)
        .ok_or_else(|| {
            CommError::invalid(
                "the rendezvous store over MPI",
                format!("rank 0 announced a message of {} bytes", len[0]),
            )
        })?;
    let mut msg = text.into_bytes();
    msg.resize(len, 0);
    world.broadcast(HostBufMut::new(&mut msg), 0)?;
    let text = String::from_utf8_lossy(&msg);
    let mut parts = text.split(' ');
    let bad = || {
        CommError::invalid(
            "the rendezvous store over MPI",
            format!("rank 0 sent {text:?}, not 'PORT TOKEN ADDRESSES'"),
        )
    };
    let port: u16 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
    let token = parts.next().ok_or_else(bad)?.to_string();
    let addrs: Vec<&str> = parts.next().ok_or_else(bad)?.split(',').collect();
    // Rank 0 listens on all its addresses: the first that answers is one this rank can reach.
    let mut tried = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let wait = if i + 1 == addrs.len() {
            timeout
        } else {
            Duration::from_secs(2).min(timeout)
        };
        match TcpStore::connect(addr, port, &token, wait) {
            Ok(store) => return Ok((Arc::new(store), keep)),
            Err(e) => tried.push(format!("{addr}: {e}")),
        }
    }
    Err(CommError::invalid(
        format!(
            "rank {} reaching rank 0's rendezvous store over MPI",
            world.rank()
        ),
        format!("no address of rank 0 answered: {}", tried.join("; ")),
    ))
}

#[cfg(test)]
mod tests {
    use crate::comm::context::GroupOptions;

    /// A job of one (MPI's singleton start, no mpirun): rank 0 serves the store, announces
    /// itself over MPI and connects through one of its own addresses.
    #[test]
    fn one_rank_finds_its_own_store_over_mpi() {
        let world = crate::comm::mpi::mpi_world(GroupOptions::default()).expect("MPI");
        let (store, keep) =
            super::store_over_mpi(&world, std::time::Duration::from_secs(10)).expect("store");
        assert_eq!(keep.len(), 1, "rank 0 keeps its server");
        store.set("k", b"v").unwrap();
        assert_eq!(
            store.get("k", std::time::Duration::from_secs(1)).unwrap(),
            b"v"
        );
    }

    /// `addresses()` against the kernel's routing table: every address that
    /// `/proc/net/fib_trie` lists as a local host route (`/32 host LOCAL`) on an interface
    /// that is up, read without netlink or getifaddrs; loopback last.
    ///
    /// Read from `/proc` rather than from iproute2's `ip`: another test of this binary starts
    /// Open MPI as a singleton, and a process spawned while it starts failed twice in CI (its
    /// SIGCHLD handler reaped `ip` first: ECHILD; then the spawn itself: EFAULT).
    #[test]
    fn the_addresses_are_the_kernels() {
        let a = super::addresses();
        let first_loop = a.iter().position(|x| x.is_loopback()).unwrap_or(a.len());
        assert!(a[first_loop..].iter().all(|x| x.is_loopback()), "{a:?}");
        let out = std::fs::read_to_string("/proc/net/fib_trie").expect("/proc/net/fib_trie");
        let mut want: Vec<std::net::Ipv4Addr> = Vec::new();
        let mut last: Option<std::net::Ipv4Addr> = None;
        for l in out.lines().map(str::trim) {
            if let Some(addr) = l.strip_prefix("|-- ") {
                last = addr.trim().parse().ok();
            } else if l.contains("/32 host LOCAL") {
                want.extend(last);
            }
        }
        assert!(
            !want.is_empty(),
            "fib_trie lists no local IPv4 address: {out}"
        );
        want.sort();
        want.dedup();
        let mut got = a.clone();
        got.sort();
        assert_eq!(got, want, "getifaddrs against fib_trie:\n{out}");
    }
}
