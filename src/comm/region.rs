//! Shared memory regions that hold a group's control block and data slots.
//!
//! Two kinds share one code path: POSIX shared memory between processes (`shm_open` with
//! `O_EXCL`, mode 0600, a random job id in the name, unlinked as soon as every rank has mapped
//! it, and by any rank of the job stopped by SIGTERM before then ([`sweep_on_sigterm`]), so a
//! crash leaks nothing) and anonymous shared mappings between threads of one process,
//! handed out through an in-process registry under the same kind of name.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex, OnceLock};

use super::error::{CommError, CommResult};

/// A mapped region; unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all concurrent access to it goes through atomics
// or through the phase protocol of the engine, which orders writes before peers' reads.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn map(fd: libc::c_int, len: usize, what: &str) -> CommResult<Self> {
        let flags = if fd < 0 {
            libc::MAP_SHARED | libc::MAP_ANONYMOUS
        } else {
            libc::MAP_SHARED
        };
        // SAFETY: plain mmap call; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(CommError::last_os_error(format!(
                "mapping {len} bytes of shared memory for {what}"
            )));
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len come from a successful mmap.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Where a group's region lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RegionKind {
    /// POSIX shared memory (`/dev/shm`), for ranks that are processes.
    Shm,
    /// An anonymous mapping shared by the threads of this process.
    InProcess,
}

fn registry() -> &'static Mutex<HashMap<String, Arc<Mapping>>> {
    static REG: OnceLock<Mutex<HashMap<String, Arc<Mapping>>>> = OnceLock::new();
    REG.get_or_init(|| Mutex::new(HashMap::new()))
}

fn c_name(name: &str) -> CommResult<CString> {
    CString::new(format!("/{name}")).map_err(|_| {
        CommError::invalid(
            "shared memory",
            format!("segment name {name:?} contains NUL"),
        )
    })
}

/// Creates a zero-filled region named `name` (exclusively: an existing one is an error).
pub(crate) fn create(kind: RegionKind, name: &str, len: usize) -> CommResult<Arc<Mapping>> {
    match kind {
        RegionKind::InProcess => {
            let map = Arc::new(Mapping::map(-1, len, name)?);
            let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
            if reg.contains_key(name) {
                return Err(CommError::invalid(
                    "shared memory",
                    format!("in-process segment {name} already exists"),
                ));
            }
            reg.insert(name.to_string(), map.clone());
            Ok(map)
        }
        RegionKind::Shm => {
            let cname = c_name(name)?;
            // SAFETY: FFI with a valid C string.
            let fd = unsafe {
                libc::shm_open(
                    cname.as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
                    0o600,
                )
            };
            if fd < 0 {
                return Err(CommError::last_os_error(format!(
                    "creating shared memory segment /dev/shm/{name}"
                )));
            }
            let guard = FdGuard(fd);
            // SAFETY: fd is valid.
            if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
                let e = CommError::last_os_error(format!(
                    "sizing shared memory segment /dev/shm/{name} to {len} bytes (is /dev/shm full?)"
                ));
                unlink(kind, name);
                return Err(e);
            }
            // Reserve the pages now, as NCCL does: ftruncate only sets the size of a sparse
            // file, and a full tmpfs then kills the rank with SIGBUS on first touch.
            // SAFETY: fd is valid; posix_fallocate returns an error number, not -1.
            let rc = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
            if rc != 0 {
                let e = if rc == libc::ENOSPC {
                    CommError::io(
                        format!(
                            "reserving {len} bytes of /dev/shm for segment {name}: /dev/shm is too small or full (see `df -h /dev/shm`); \
                             in Docker, start the container with a larger --shm-size (e.g. \
                             --shm-size=1g), or lower CANDLE_TP_SLOT_BYTES (two slots per rank per group)"
                        ),
                        std::io::Error::from_raw_os_error(rc),
                    )
                } else {
                    CommError::io(
                        format!("reserving {len} bytes of /dev/shm for segment {name}"),
                        std::io::Error::from_raw_os_error(rc),
                    )
                };
                unlink(kind, name);
                return Err(e);
            }
            let map = Mapping::map(guard.0, len, name);
            if map.is_err() {
                unlink(kind, name);
            }
            Ok(Arc::new(map?))
        }
    }
}

/// Opens the region another rank created, checking it is at least `len` bytes.
pub(crate) fn open(kind: RegionKind, name: &str, len: usize) -> CommResult<Arc<Mapping>> {
    match kind {
        RegionKind::InProcess => {
            let reg = registry().lock().unwrap_or_else(|e| e.into_inner());
            reg.get(name).cloned().ok_or_else(|| {
                CommError::invalid(
                    "shared memory",
                    format!("in-process segment {name} does not exist"),
                )
            })
        }
        RegionKind::Shm => {
            let cname = c_name(name)?;
            // SAFETY: FFI with a valid C string.
            let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
            if fd < 0 {
                return Err(CommError::last_os_error(format!(
                    "opening shared memory segment /dev/shm/{name}"
                )));
            }
            let guard = FdGuard(fd);
            // SAFETY: zeroed stat is a valid out-parameter.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fd is valid, st is a valid pointer.
            if unsafe { libc::fstat(fd, &mut st) } != 0 {
                return Err(CommError::last_os_error(format!(
                    "inspecting /dev/shm/{name}"
                )));
            }
            if (st.st_size as u64) < len as u64 {
                return Err(CommError::invalid(
                    "shared memory",
                    format!(
                        "segment /dev/shm/{name} has {} bytes, expected {len}",
                        st.st_size
                    ),
                ));
            }
            Ok(Arc::new(Mapping::map(guard.0, len, name)?))
        }
    }
}

/// Removes the name; mappings stay valid until dropped. Idempotent.
pub(crate) fn unlink(kind: RegionKind, name: &str) {
    match kind {
        RegionKind::InProcess => {
            registry()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(name);
        }
        RegionKind::Shm => {
            if let Ok(cname) = c_name(name) {
                // SAFETY: FFI with a valid C string; failure (already gone) is fine.
                unsafe {
                    libc::shm_unlink(cname.as_ptr());
                }
            }
        }
    }
}

/// The jobs whose segments this process removes from `/dev/shm` if it gets SIGTERM, as
/// `candle-tp-<job>-` C strings, for [`on_sigterm`]: slots that a signal handler reads with
/// atomics only. A prefix is never freed once placed, so the handler never reads freed memory;
/// a process that runs more than eight jobs sweeps only the first eight's.
static JOBS: [std::sync::atomic::AtomicPtr<libc::c_char>; 8] =
    [const { std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()) }; 8];

/// From now on, a SIGTERM of this process removes every `/dev/shm/candle-tp-<job>-*` segment
/// before the process ends. Every launcher stops the ranks that survive a failed one with
/// SIGTERM (tprun, mpirun's daemons, srun), so a rank killed in the middle of a rendezvous,
/// even the one that made the segment before any other rank of its host had come to map it,
/// leaves nothing in any host's `/dev/shm` as long as one rank of the job on that host
/// survives it; segments are unlinked once mapped, so this touches no running group. The
/// handler is installed once, only where SIGTERM has its default action (a program with its
/// own handler keeps it and its meaning). Idempotent for one job.
pub(crate) fn sweep_on_sigterm(job: &str) {
    use std::sync::atomic::Ordering::SeqCst;
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(install_sigterm);
    let Ok(prefix) = CString::new(format!("candle-tp-{job}-")) else {
        return;
    };
    for slot in &JOBS {
        let p = slot.load(SeqCst);
        // SAFETY: a non-null slot holds a leaked, NUL-terminated prefix.
        if !p.is_null() && unsafe { std::ffi::CStr::from_ptr(p) } == prefix.as_c_str() {
            return;
        }
    }
    let ptr = prefix.into_raw();
    for slot in &JOBS {
        if slot
            .compare_exchange(std::ptr::null_mut(), ptr, SeqCst, SeqCst)
            .is_ok()
        {
            return;
        }
    }
    // SAFETY: `ptr` came from `into_raw` above and was placed nowhere.
    drop(unsafe { CString::from_raw(ptr) });
}

/// Installs [`on_sigterm`] for SIGTERM if its action is the default one.
fn install_sigterm() {
    // SAFETY: sigaction with zeroed, then filled, structures; the results are checked.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGTERM, std::ptr::null(), &mut old) != 0
            || old.sa_sigaction != libc::SIG_DFL
        {
            return;
        }
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigterm as extern "C" fn(libc::c_int) as libc::sighandler_t;
        act.sa_flags = libc::SA_RESETHAND;
        libc::sigemptyset(&mut act.sa_mask);
        libc::sigaction(libc::SIGTERM, &act, std::ptr::null_mut());
    }
}

/// SIGTERM: removes the registered jobs' segments ([`sweep_on_sigterm`]), then ends the
/// process as SIGTERM's default action would (`SA_RESETHAND` restored it; the signal, raised
/// again, is delivered once the handler returns). Called by another handler that chains to it,
/// it only removes them.
extern "C" fn on_sigterm(_: libc::c_int) {
    use std::sync::atomic::Ordering::SeqCst;
    for slot in &JOBS {
        let p = slot.load(SeqCst);
        if !p.is_null() {
            // SAFETY: a NUL-terminated prefix that is never freed (see JOBS).
            unsafe { unlink_prefixed(std::ffi::CStr::from_ptr(p).to_bytes()) };
        }
    }
    // SAFETY: sigaction and raise are async-signal-safe.
    unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGTERM, std::ptr::null(), &mut cur) == 0
            && cur.sa_sigaction == libc::SIG_DFL
        {
            libc::raise(libc::SIGTERM);
        }
    }
}

/// Unlinks every file of `/dev/shm` whose name starts with `prefix`, with system calls only
/// (`open`, `getdents64`, `unlinkat`: no allocation, safe in a signal handler). Scans again
/// while a scan removed something, as removing entries may shift those not yet read.
///
/// # Safety
/// Only plain system calls on a buffer of this frame; callable from a signal handler.
unsafe fn unlink_prefixed(prefix: &[u8]) {
    // SAFETY (whole body): the path is NUL-terminated; getdents64 writes at most `buf.len()`
    // bytes of records, each read within the `n` bytes it returned, by its own length.
    unsafe {
        for _ in 0..4 {
            let fd = libc::open(
                c"/dev/shm".as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            );
            if fd < 0 {
                return;
            }
            let mut removed = false;
            let mut buf = [0u8; 4096];
            loop {
                let n = libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), buf.len());
                if n <= 0 {
                    break;
                }
                let mut off = 0usize;
                while off + 19 < n as usize {
                    // linux_dirent64: d_ino u64, d_off i64, d_reclen u16, d_type u8, d_name.
                    let reclen = u16::from_ne_bytes([buf[off + 16], buf[off + 17]]) as usize;
                    if reclen == 0 {
                        break;
                    }
                    let name = &buf[off + 19..(off + reclen).min(n as usize)];
                    if name.len() > prefix.len() && name.starts_with(prefix) {
                        libc::unlinkat(fd, name.as_ptr().cast(), 0);
                        removed = true;
                    }
                    off += reclen;
                }
            }
            libc::close(fd);
            if !removed {
                return;
            }
        }
    }
}

struct FdGuard(libc::c_int);

impl Drop for FdGuard {
    fn drop(&mut self) {
        // SAFETY: the fd is owned by this guard.
        unsafe {
            libc::close(self.0);
        }
    }
}

/// 16 random hex characters from the OS, for names that must not collide across jobs.
pub(crate) fn random_hex() -> String {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most 8 bytes into the buffer.
    let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if got != bytes.len() as isize {
        // Fall back to time and pid: still unique enough, and O_EXCL catches a collision.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        bytes = (t ^ ((std::process::id() as u64) << 32)).to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    /// Issue 44, defect 4: a segment is mode 0600 (its owner only), whatever the umask.
    #[test]
    fn segments_are_mode_0600() {
        let name = format!("candle-tp-test-mode-{}", super::random_hex());
        // SAFETY: umask only sets this process's file creation mask.
        let old = unsafe { libc::umask(0) };
        let map = super::create(super::RegionKind::Shm, &name, 4096);
        // SAFETY: as above, restoring it.
        unsafe { libc::umask(old) };
        let _map = map.expect("create");
        let mode = std::fs::metadata(format!("/dev/shm/{name}")).map(|m| m.permissions().mode());
        super::unlink(super::RegionKind::Shm, &name);
        assert_eq!(mode.expect("stat") & 0o777, 0o600);
    }
}
