//! What the kernel keeps per thread (task) that changes how it treats the thread: the CPUs it
//! may run on ([`pin_to_cpu`]), the I/O-flusher state for its memory allocations, and its
//! scheduling policy.
//!
//! A thread that serves block I/O for the kernel (a FUSE daemon under a loop device, a
//! user-space target on the same machine) must not wait, while allocating, for the very
//! writeback it is there to complete. `PR_SET_IO_FLUSHER` (Linux 5.6) marks the thread so that
//! its allocations never start I/O to reclaim memory (`PF_MEMALLOC_NOIO`) and it is throttled
//! only on its own device's dirty pages (`PF_LOCAL_THROTTLE`). Threads it creates afterwards
//! inherit the state.
//!
//! A thread woken once per request (a FUSE daemon's) preempts, by default, whatever runs on
//! its CPU when it is woken: the submitter, who had more requests to queue. `SCHED_BATCH`
//! (no privilege needed) turns wake-up preemption off for the thread: it runs when the task
//! that woke it sleeps or at the next tick, and finds the requests queued meanwhile.

use std::io;

/// `PR_SET_IO_FLUSHER` from `<linux/prctl.h>` (the libc crate names it only for Android).
const PR_SET_IO_FLUSHER: libc::c_int = 57;
/// `PR_GET_IO_FLUSHER`.
const PR_GET_IO_FLUSHER: libc::c_int = 58;

/// Put the calling thread in the I/O-flusher state. Needs `CAP_SYS_RESOURCE` and Linux 5.6;
/// fails with `EPERM` or `EINVAL` otherwise.
pub fn set_io_flusher() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only; the extra arguments must be zero.
    let rc = unsafe {
        libc::prctl(
            PR_SET_IO_FLUSHER,
            1 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether the calling thread is in the I/O-flusher state.
pub fn is_io_flusher() -> io::Result<bool> {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe {
        libc::prctl(
            PR_GET_IO_FLUSHER,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc == 1)
    }
}

/// Put the calling thread under `SCHED_BATCH`: same share of the CPU as `SCHED_OTHER`, but
/// it never preempts the running task when woken.
pub fn set_batch_scheduling() -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param that outlives the call; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether the calling thread is under `SCHED_BATCH`.
pub fn is_batch_scheduled() -> io::Result<bool> {
    // SAFETY: plain syscall; pid 0 is the calling thread.
    let policy = unsafe { libc::sched_getscheduler(0) };
    if policy < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(policy == libc::SCHED_BATCH)
    }
}

/// Run the calling thread on CPU `cpu` only (`sched_setaffinity`), as `taskset` does for a
/// whole process: for measurements that place two threads of one process on chosen CPUs.
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("CPU {cpu} is past CPU_SETSIZE")));
    }
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes one bit inside it (the index
    // was checked against CPU_SETSIZE above).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: pid 0 is the calling thread; the set is a valid cpu_set_t of the size given.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("pin this thread to CPU {cpu}: {e}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_flusher_state_is_per_thread_and_inherited() {
        // In a fresh thread, so that the test harness's threads keep their state.
        std::thread::spawn(|| {
            match set_io_flusher() {
                Ok(()) => {}
                // Without CAP_SYS_RESOURCE (not root) or before Linux 5.6 there is nothing to check.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::EINVAL)) => return,
                Err(e) => panic!("prctl: {e}"),
            }
            assert!(is_io_flusher().unwrap());
            let child = std::thread::spawn(|| is_io_flusher().unwrap()).join().unwrap();
            assert!(child, "threads created afterwards inherit the state");
        })
        .join()
        .unwrap();
        assert!(!is_io_flusher().unwrap_or(false), "other threads are untouched");
    }

    #[test]
    fn batch_scheduling_is_per_thread() {
        let before = is_batch_scheduled().unwrap();
        std::thread::spawn(|| {
            set_batch_scheduling().unwrap();
            assert!(is_batch_scheduled().unwrap());
        })
        .join()
        .unwrap();
        assert_eq!(is_batch_scheduled().unwrap(), before, "other threads are untouched");
    }
}
