//! CPU time and context switches, per thread and per process: the figures the papers count.
//!
//! A thread measures itself precisely with `getrusage(RUSAGE_THREAD)` ([`this_thread`]). A
//! target's stats reply must also report threads other than the caller (all its workers), and
//! for those it reads `/proc/self/task/TID/{stat,status,schedstat}` ([`of_thread`]): user and
//! system time there have clock-tick resolution (usually 10 ms), while `schedstat` gives the
//! thread's total run time in nanoseconds.

use std::io;

/// CPU and scheduling figures of one thread or process.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub user_us: u64,
    pub sys_us: u64,
    /// Total on-CPU time in nanoseconds where the kernel offers it precisely, else user + sys.
    pub cpu_ns: u64,
    /// The thread gave up the CPU (blocked): the cost the papers count as a context switch.
    pub ctx_voluntary: u64,
    /// The scheduler took the CPU away.
    pub ctx_involuntary: u64,
}

impl Usage {
    pub fn ctx_switches(&self) -> u64 {
        self.ctx_voluntary + self.ctx_involuntary
    }

    /// Field-wise `self - earlier`, saturating (counters never run backwards, but clocks of
    /// different resolution can disagree by a tick).
    pub fn since(&self, earlier: &Usage) -> Usage {
        Usage {
            user_us: self.user_us.saturating_sub(earlier.user_us),
            sys_us: self.sys_us.saturating_sub(earlier.sys_us),
            cpu_ns: self.cpu_ns.saturating_sub(earlier.cpu_ns),
            ctx_voluntary: self.ctx_voluntary.saturating_sub(earlier.ctx_voluntary),
            ctx_involuntary: self.ctx_involuntary.saturating_sub(earlier.ctx_involuntary),
        }
    }

    pub fn add(&mut self, other: &Usage) {
        self.user_us += other.user_us;
        self.sys_us += other.sys_us;
        self.cpu_ns += other.cpu_ns;
        self.ctx_voluntary += other.ctx_voluntary;
        self.ctx_involuntary += other.ctx_involuntary;
    }
}

fn rusage(who: libc::c_int) -> Usage {
    // SAFETY: getrusage only writes into the struct we pass, which is zero-initialised plain
    // data; RUSAGE_SELF and RUSAGE_THREAD are valid for every caller.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut ru);
        ru
    };
    let us = |tv: libc::timeval| tv.tv_sec as u64 * 1_000_000 + tv.tv_usec as u64;
    let user_us = us(ru.ru_utime);
    let sys_us = us(ru.ru_stime);
    Usage {
        user_us,
        sys_us,
        cpu_ns: (user_us + sys_us) * 1000,
        ctx_voluntary: ru.ru_nvcsw as u64,
        ctx_involuntary: ru.ru_nivcsw as u64,
    }
}

/// The calling thread's usage (microsecond resolution).
pub fn this_thread() -> Usage {
    rusage(libc::RUSAGE_THREAD)
}

/// The kernel's id of the calling thread, for [`of_thread`].
pub fn thread_id() -> i32 {
    // SAFETY: gettid has no preconditions and cannot fail.
    unsafe { libc::gettid() }
}

fn clock_ticks_per_s() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

/// Usage of another thread of this process, from procfs.
pub fn of_thread(tid: i32) -> io::Result<Usage> {
    let dir = format!("/proc/self/task/{tid}");
    let stat = std::fs::read_to_string(format!("{dir}/stat"))?;
    // The command name (field 2) may hold spaces and parentheses: fields after it start after
    // the last ')'. utime and stime are fields 14 and 15, i.e. the 12th and 13th after it.
    let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or_default();
    let fields: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    let per_tick_us = 1_000_000 / clock_ticks_per_s();
    let user_us = tick(11) * per_tick_us;
    let sys_us = tick(12) * per_tick_us;

    let status = std::fs::read_to_string(format!("{dir}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let cpu_ns = std::fs::read_to_string(format!("{dir}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or((user_us + sys_us) * 1000);
    Ok(Usage {
        user_us,
        sys_us,
        cpu_ns,
        ctx_voluntary: field("voluntary_ctxt_switches:"),
        ctx_involuntary: field("nonvoluntary_ctxt_switches:"),
    })
}

/// The calling thread's CPU time in nanoseconds, precisely (`CLOCK_THREAD_CPUTIME_ID`, which
/// brings the running thread's account up to date; `getrusage`'s figures for the running
/// thread move only at scheduler ticks, milliseconds apart).
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes only the timespec we pass; the clock id is valid on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    debug_assert_eq!(rc, 0, "CLOCK_THREAD_CPUTIME_ID exists on Linux");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn burn() -> u64 {
        let mut x = 1u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
        }
        x
    }

    #[test]
    fn a_busy_thread_accumulates_cpu_time() {
        // getrusage counts in scheduler ticks: one burn can fall between two of them on a
        // loaded machine. Keep burning until a tick lands (bounded), then check it was counted.
        let before = this_thread();
        let mut spent = Usage::default();
        for _ in 0..100 {
            std::hint::black_box(burn());
            spent = this_thread().since(&before);
            if spent.user_us + spent.sys_us > 0 {
                break;
            }
        }
        assert!(spent.user_us + spent.sys_us > 0, "{spent:?}");
    }

    #[test]
    fn procfs_sees_another_thread_block() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            tx.send(thread_id()).unwrap();
            // Blocking on a channel is a voluntary context switch.
            go_rx.recv().unwrap();
            std::hint::black_box(burn());
            // Stay alive until measured: procfs forgets a thread once it exits.
            let _ = done_rx.recv();
        });
        let tid = rx.recv().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        go_tx.send(()).unwrap();
        let mut seen = Usage::default();
        for _ in 0..50 {
            seen = of_thread(tid).unwrap_or(seen);
            if seen.ctx_voluntary > 0 && seen.cpu_ns > 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        done_tx.send(()).unwrap();
        t.join().unwrap();
        assert!(seen.ctx_voluntary >= 1, "{seen:?}");
        assert!(seen.cpu_ns > 0, "{seen:?}");
    }
}
