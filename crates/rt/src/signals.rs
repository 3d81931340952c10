//! Termination signals for daemons: block SIGINT and SIGTERM in every thread, then wait for
//! one synchronously in the thread that owns shutdown. No handler runs in signal context, so
//! shutdown is ordinary code.

use std::io;

fn termination_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and modify the set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    }
}

/// Block SIGINT and SIGTERM in the calling thread; threads spawned afterwards inherit the mask.
/// Call before starting any thread.
pub fn block_termination() -> io::Result<()> {
    let set = termination_set();
    // SAFETY: the set is initialised; a null old-set pointer is allowed.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// Wait until SIGINT or SIGTERM arrives; returns the signal number.
pub fn wait_termination() -> io::Result<i32> {
    let set = termination_set();
    let mut sig: libc::c_int = 0;
    // SAFETY: both pointers refer to live locals.
    let rc = unsafe { libc::sigwait(&set, &mut sig) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(sig)
}
