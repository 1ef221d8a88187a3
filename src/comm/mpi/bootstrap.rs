//! A job's rendezvous store found through MPI: rank 0 serves it on one address (loopback when
//! the job is on one host, else an interface every host shares) and hands that address, its
//! port and a fresh random token to the other ranks with `MPI_Bcast`, so that a job launched by
//! `mpirun` or `srun` needs no `MASTER_ADDR`/`MASTER_PORT` and no other process can join (as
//! TensorRT-LLM hands out NCCL's unique id through MPI). The NCCL backend, and the shm backend
//! under an MPI launcher, meet there when launched that way.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use crate::comm::backend::{Backend, HostBuf, HostBufMut};
use crate::comm::error::{CommError, CommResult};
use crate::comm::secret::random_token;
use crate::comm::store::{Keep, Store, TcpStore, TcpStoreServer};

use super::MpiBackend;

/// The longest message rank 0 may announce (port, token and every address as text).
const MAX_MESSAGE: usize = 1 << 20;

/// The IPv4 addresses of this host's interfaces that are up, with their netmasks, loopback
/// last.
fn interfaces() -> Vec<(Ipv4Addr, Ipv4Addr)> {
    let mut out = Vec::new();
    let mut ifs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `ifs` with a list we only read and then free with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut ifs) } != 0 {
        return vec![(Ipv4Addr::LOCALHOST, Ipv4Addr::new(255, 0, 0, 0))];
    }
    let v4 = |sa: *const libc::sockaddr| -> Option<Ipv4Addr> {
        // SAFETY: `sa` is null or a sockaddr of the list, whose family says how to read it;
        // an AF_INET address is a sockaddr_in.
        unsafe {
            if sa.is_null() || (*sa).sa_family as i32 != libc::AF_INET {
                return None;
            }
            let sin = &*(sa as *const libc::sockaddr_in);
            Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
        }
    };
    let mut p = ifs;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned.
        let ifa = unsafe { &*p };
        if ifa.ifa_flags & libc::IFF_UP as u32 != 0 {
            if let Some(addr) = v4(ifa.ifa_addr) {
                let mask = v4(ifa.ifa_netmask).unwrap_or(Ipv4Addr::BROADCAST);
                out.push((addr, mask));
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: `ifs` came from getifaddrs.
    unsafe { libc::freeifaddrs(ifs) };
    out.sort_by_key(|(a, _)| a.is_loopback());
    out.dedup_by_key(|(a, _)| *a);
    if out.is_empty() {
        out.push((Ipv4Addr::LOCALHOST, Ipv4Addr::new(255, 0, 0, 0)));
    }
    out
}

/// The IPv4 addresses of this host's interfaces that are up, loopback last.
#[cfg(test)]
fn addresses() -> Vec<Ipv4Addr> {
    interfaces().into_iter().map(|(a, _)| a).collect()
}

/// This host, as the other ranks compare it: its name and its interfaces other than loopback
/// (`NAME ADDR/MASK,...`).
fn this_host() -> String {
    let mut name = [0u8; 256];
    // SAFETY: gethostname writes at most `name.len()` bytes.
    let got = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len() - 1) };
    let name = if got == 0 {
        let end = name.iter().position(|&b| b == 0).unwrap_or(0);
        String::from_utf8_lossy(&name[..end]).into_owned()
    } else {
        String::new()
    };
    let ifs: Vec<String> = interfaces()
        .into_iter()
        .filter(|(a, _)| !a.is_loopback())
        .map(|(a, m)| format!("{a}/{m}"))
        .collect();
    format!("{name} {}", ifs.join(","))
}

/// The address rank 0's store listens on, chosen from every rank's [`this_host`]: loopback
/// when every rank is on rank 0's host; else `MASTER_ADDR` when set (the interface the user
/// chose); else the first of rank 0's interfaces whose subnet holds an address of every other
/// host (the network they share), or its first interface other than loopback.
fn choose_address(hosts: &[String]) -> String {
    let mine = &hosts[0];
    if hosts.iter().all(|h| h == mine) {
        return Ipv4Addr::LOCALHOST.to_string();
    }
    if let Some(addr) = std::env::var("MASTER_ADDR")
        .ok()
        .filter(|a| !a.trim().is_empty())
    {
        return addr.trim().to_string();
    }
    let parse = |h: &str| -> Vec<(Ipv4Addr, Ipv4Addr)> {
        h.split_once(' ')
            .map_or("", |(_, l)| l)
            .split(',')
            .filter_map(|am| {
                let (a, m) = am.split_once('/')?;
                Some((a.parse().ok()?, m.parse().ok()?))
            })
            .collect()
    };
    let ours = parse(mine);
    let others: Vec<Vec<(Ipv4Addr, Ipv4Addr)>> = hosts
        .iter()
        .filter(|h| *h != mine)
        .map(|h| parse(h))
        .collect();
    let net = |a: Ipv4Addr, m: Ipv4Addr| u32::from(a) & u32::from(m);
    ours.iter()
        .find(|&&(a, m)| {
            others
                .iter()
                .all(|theirs| theirs.iter().any(|&(b, _)| net(b, m) == net(a, m)))
        })
        .or(ours.first())
        .map_or(Ipv4Addr::LOCALHOST.to_string(), |(a, _)| a.to_string())
}

/// Every rank's `text`, gathered over `world`.
fn gather_text(world: &MpiBackend, text: &str) -> CommResult<Vec<String>> {
    let n = world.size();
    let mut lens = vec![0i64; n];
    world.all_gather_v(
        HostBuf::new(&[text.len() as i64]),
        HostBufMut::new(&mut lens),
        &vec![1; n],
    )?;
    let counts: Vec<usize> = lens.iter().map(|&l| l.max(0) as usize).collect();
    let mut all = vec![0u8; counts.iter().sum()];
    world.all_gather_v(
        HostBuf::new(text.as_bytes()),
        HostBufMut::new(&mut all),
        &counts,
    )?;
    let mut out = Vec::with_capacity(n);
    let mut at = 0;
    for c in counts {
        out.push(String::from_utf8_lossy(&all[at..at + c]).into_owned());
        at += c;
    }
    Ok(out)
}

/// Rank 0's store: a fresh 128-bit token from the kernel (no fallback: a guessable token would
/// let another local user into the job), the server on [`choose_address`], and the message
/// `PORT TOKEN ADDRESS` the other ranks receive.
fn serve_store(hosts: &[String]) -> CommResult<(TcpStoreServer, String)> {
    let token = random_token()
        .map_err(|e| CommError::io("drawing the store's token from getrandom (rank 0)", e))?;
    let addr = choose_address(hosts);
    let server = TcpStoreServer::bind(&addr, 0, &token)?;
    let text = format!("{} {} {}", server.port(), token, addr);
    Ok((server, text))
}

/// Rank 0 of `world` serves the store; every rank returns a client of it (rank 0 also the
/// server, to keep alive). Collective over `world`.
///
/// The store listens on one address only ([`choose_address`]: loopback for a job on one host),
/// at a port the kernel picks, and takes only the token rank 0 draws (128 random bits), which
/// reaches the other ranks in MPI's broadcast, never through a file or the environment.
pub(crate) fn store_over_mpi(
    world: &MpiBackend,
    timeout: Duration,
) -> CommResult<(Arc<dyn Store>, Keep)> {
    let mut keep: Keep = Vec::new();
    let hosts = gather_text(world, &this_host())?;
    let mut text = String::new();
    // Rank 0's own failure to draw a token or to listen, announced as a length of -1 so that
    // the others fail at once instead of waiting for a message that will not come.
    let mut failed = None;
    if world.rank() == 0 {
        match serve_store(&hosts) {
            Ok((server, announce)) => {
                text = announce;
                keep.push(Box::new(server));
            }
            Err(e) => failed = Some(e),
        }
    }
    // Its length first, then the message.
    let mut len = [if failed.is_some() {
        -1
    } else {
        text.len() as i64
    }];
    world.broadcast(HostBufMut::new(&mut len), 0)?;
    if let Some(e) = failed {
        return Err(e);
    }
    if len[0] == -1 {
        return Err(CommError::invalid(
            format!("rank {} of the rendezvous store over MPI", world.rank()),
            "rank 0 could not serve the job's store (its own error says why)",
        ));
    }
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
            format!("rank 0 sent a message that is not 'PORT TOKEN ADDRESS' ({len} bytes)"),
        )
    };
    let port: u16 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
    let token = parts.next().ok_or_else(bad)?.to_string();
    let addr = parts.next().ok_or_else(bad)?;
    let store = TcpStore::connect(addr, port, &token, timeout).map_err(|e| {
        CommError::invalid(
            format!(
                "rank {} reaching rank 0's rendezvous store over MPI",
                world.rank()
            ),
            format!("{addr}:{port} did not answer (set MASTER_ADDR to an address of rank 0 every rank reaches): {e}"),
        )
    })?;
    Ok((Arc::new(store), keep))
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
        // Issue 44, defect 4: a client with a wrong token is refused, and nothing listens on
        // this host's other addresses (a job on one host: loopback only; it was 0.0.0.0).
        let port = keep[0]
            .downcast_ref::<crate::comm::store::TcpStoreServer>()
            .expect("the server")
            .port();
        let short = std::time::Duration::from_millis(300);
        let wrong = crate::comm::store::TcpStore::connect("127.0.0.1", port, "wrong", short);
        let e = wrong
            .err()
            .expect("a wrong token must be refused")
            .to_string();
        assert!(e.contains("different job tokens"), "{e}");
        for a in super::addresses().iter().filter(|a| !a.is_loopback()) {
            let e = crate::comm::store::TcpStore::connect(&a.to_string(), port, "x", short)
                .err()
                .unwrap_or_else(|| panic!("the store answers on {a}"))
                .to_string();
            assert!(
                !e.contains("different job tokens"),
                "the store listens on {a}: {e}"
            );
        }
    }

    /// The store's address: loopback for ranks on one host; else `MASTER_ADDR`, or rank 0's
    /// interface whose subnet every other host shares (not its first one).
    #[test]
    fn the_store_listens_on_the_network_the_hosts_share() {
        let one = "h1 192.168.1.5/255.255.255.0,10.77.0.11/255.255.255.0".to_string();
        assert_eq!(
            super::choose_address(&[one.clone(), one.clone()]),
            "127.0.0.1"
        );
        let two = "h2 172.16.0.9/255.255.0.0,10.77.0.12/255.255.255.0".to_string();
        let hosts = [one.clone(), two.clone(), one.clone(), two];
        if std::env::var_os("MASTER_ADDR").is_none() {
            assert_eq!(super::choose_address(&hosts), "10.77.0.11");
            let apart = "h3 172.16.0.9/255.255.0.0".to_string();
            assert_eq!(super::choose_address(&[one, apart]), "192.168.1.5");
        }
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
