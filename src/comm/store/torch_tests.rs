//! [`TorchTcpStore`] against a small in-test server of c10d's TCPStore protocol (written from
//! `TCPStoreBackend.cpp`'s query handlers). The real check, against torchrun's own store, is
//! `scripts/test-torchrun.sh`.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::{Store, TorchTcpStore};

#[derive(Default)]
struct Kv {
    map: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    changed: Condvar,
}

fn u8_(s: &mut TcpStream) -> std::io::Result<u8> {
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    Ok(b[0])
}

fn u64_(s: &mut TcpStream) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn bytes_(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let n = u64_(s)? as usize;
    let mut v = vec![0u8; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn send_value(s: &mut TcpStream, v: &[u8]) -> std::io::Result<()> {
    s.write_all(&(v.len() as u64).to_le_bytes())?;
    s.write_all(v)
}

/// Serves one client as c10d's backend does; `magic` is the validation number it accepts.
fn serve(kv: &Kv, mut s: TcpStream, magic: u32) -> std::io::Result<()> {
    let mut validated = false;
    loop {
        let q = u8_(&mut s)?;
        if !validated && q != 0 {
            return Ok(()); // the server drops a client that does not validate first
        }
        match q {
            0 => {
                let mut b = [0u8; 4];
                s.read_exact(&mut b)?;
                if u32::from_le_bytes(b) != magic {
                    return Ok(());
                }
                validated = true;
            }
            1 => {
                let (k, v) = (bytes_(&mut s)?, bytes_(&mut s)?);
                kv.map.lock().unwrap().insert(k, v);
                kv.changed.notify_all();
            }
            3 => {
                let k = bytes_(&mut s)?;
                let v = kv.map.lock().unwrap().get(&k).cloned().unwrap_or_default();
                send_value(&mut s, &v)?;
            }
            4 => {
                let k = bytes_(&mut s)?;
                let delta = u64_(&mut s)? as i64;
                let mut map = kv.map.lock().unwrap();
                let old: i64 = map
                    .get(&k)
                    .map(|v| String::from_utf8_lossy(v).parse().unwrap())
                    .unwrap_or(0);
                map.insert(k, (old + delta).to_string().into_bytes());
                kv.changed.notify_all();
                s.write_all(&(old + delta).to_le_bytes())?;
            }
            5 => {
                let n = u64_(&mut s)?;
                let keys: Vec<_> = (0..n).map(|_| bytes_(&mut s)).collect::<Result<_, _>>()?;
                let map = kv.map.lock().unwrap();
                let ready = keys.iter().all(|k| map.contains_key(k));
                s.write_all(&[if ready { 0 } else { 1 }])?;
            }
            6 => {
                let n = u64_(&mut s)?;
                let keys: Vec<_> = (0..n).map(|_| bytes_(&mut s)).collect::<Result<_, _>>()?;
                // Wait until every key exists or the client cancels (a CANCEL_WAIT byte).
                s.set_nonblocking(true)?;
                let mut map = kv.map.lock().unwrap();
                loop {
                    if keys.iter().all(|k| map.contains_key(k)) {
                        s.set_nonblocking(false)?;
                        s.write_all(&[0])?;
                        break;
                    }
                    let mut b = [0u8; 1];
                    match s.read(&mut b) {
                        Ok(1) if b[0] == 12 => {
                            s.set_nonblocking(false)?;
                            s.write_all(&[1])?;
                            break;
                        }
                        Ok(_) => return Ok(()),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e),
                    }
                    map = kv
                        .changed
                        .wait_timeout(map, Duration::from_millis(5))
                        .unwrap()
                        .0;
                }
            }
            8 => {
                let k = bytes_(&mut s)?;
                let n = i64::from(kv.map.lock().unwrap().remove(&k).is_some());
                s.write_all(&n.to_le_bytes())?;
            }
            13 => {
                let mut b = [0u8; 4];
                s.read_exact(&mut b)?;
                s.write_all(&b)?;
            }
            _ => return Ok(()),
        }
    }
}

/// Starts the in-test server on a free port; it accepts clients until the test ends.
fn server(magic: u32) -> (u16, Arc<Kv>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let kv = Arc::new(Kv::default());
    let shared = kv.clone();
    thread::spawn(move || {
        for s in listener.incoming().flatten() {
            let kv = shared.clone();
            thread::spawn(move || serve(&kv, s, magic));
        }
    });
    (port, kv)
}

const MAGIC: u32 = 0x3C85_F7CE;
const T: Duration = Duration::from_secs(5);

#[test]
fn set_get_add_delete_under_the_prefix() {
    let (port, kv) = server(MAGIC);
    let a = TorchTcpStore::connect("127.0.0.1", port, "candle-tp/run/0/", T).unwrap();
    let b = TorchTcpStore::connect("127.0.0.1", port, "candle-tp/run/0/", T).unwrap();
    a.set("job", b"abc").unwrap();
    assert_eq!(b.get("job", T).unwrap(), b"abc");
    assert!(kv
        .map
        .lock()
        .unwrap()
        .contains_key(b"candle-tp/run/0/job".as_slice()));
    assert_eq!(a.try_get("none").unwrap(), None);
    assert_eq!(
        b.try_get("job").unwrap().as_deref(),
        Some(b"abc".as_slice())
    );
    assert_eq!(a.add("n", 2).unwrap(), 2);
    assert_eq!(b.add("n", -5).unwrap(), -3);
    assert_eq!(a.get("n", T).unwrap(), b"-3");
    assert!(a.delete("n").unwrap());
    assert!(!a.delete("n").unwrap());
    // Another restart's prefix sees none of these keys.
    let c = TorchTcpStore::connect("127.0.0.1", port, "candle-tp/run/1/", T).unwrap();
    assert_eq!(c.try_get("job").unwrap(), None);
}

#[test]
fn get_waits_for_a_later_set() {
    let (port, _kv) = server(MAGIC);
    let a = TorchTcpStore::connect("127.0.0.1", port, "p/", T).unwrap();
    let setter = thread::spawn(move || {
        let b = TorchTcpStore::connect("127.0.0.1", port, "p/", T).unwrap();
        thread::sleep(Duration::from_millis(200));
        b.set("late", b"v").unwrap();
    });
    let start = Instant::now();
    assert_eq!(a.get("late", T).unwrap(), b"v");
    assert!(start.elapsed() >= Duration::from_millis(150));
    setter.join().unwrap();
}

#[test]
fn get_times_out_cancels_and_the_connection_stays_usable() {
    let (port, _kv) = server(MAGIC);
    let a = TorchTcpStore::connect("127.0.0.1", port, "p/", T).unwrap();
    let start = Instant::now();
    let err = a
        .get("never", Duration::from_millis(300))
        .unwrap_err()
        .to_string();
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    assert!(err.contains("never") && err.contains("timed out"), "{err}");
    // The wait was canceled cleanly: the next query gets its own reply.
    a.set("k", b"1").unwrap();
    assert_eq!(a.get("k", T).unwrap(), b"1");
}

#[test]
fn a_server_refusing_the_handshake_is_a_clear_error() {
    let (port, _kv) = server(0x1234_5678);
    let err = match TorchTcpStore::connect("127.0.0.1", port, "p/", T) {
        Ok(_) => panic!("a server that drops us must not look connected"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("handshake") && err.contains(&port.to_string()),
        "{err}"
    );
}

#[test]
fn nothing_listening_fails_within_the_timeout() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let start = Instant::now();
    let err = match TorchTcpStore::connect("127.0.0.1", port, "p/", Duration::from_millis(300)) {
        Ok(_) => panic!("nothing listens"),
        Err(e) => e.to_string(),
    };
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(err.contains("torchrun"), "{err}");
}
