//! Network namespaces: move the calling thread into one, so that the sockets it opens
//! afterwards live there (the raw-Ethernet tests and fault relay run each end of a veth pair
//! in a namespace of its own). Only this thread moves; the process and its other threads stay.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Enter the network namespace bound at `path` (e.g. `/run/netns/NAME`, as `ip netns add`
/// makes it). Needs CAP_SYS_ADMIN.
pub fn enter(path: &Path) -> io::Result<()> {
    let ns = std::fs::File::open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("network namespace {}: {e}", path.display())))?;
    // SAFETY: setns(2) with a descriptor we own, for this thread only (CLONE_NEWNET).
    let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
    if r != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("enter network namespace {}: {e}", path.display())));
    }
    Ok(())
}
