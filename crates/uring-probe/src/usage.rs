//! CPU time and context switches of the calling thread (`getrusage(RUSAGE_THREAD)`).

/// What one thread spent between two readings.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub user_us: u64,
    pub sys_us: u64,
    pub ctx_voluntary: u64,
    pub ctx_involuntary: u64,
}

impl Usage {
    pub fn cpu_us(&self) -> u64 {
        self.user_us + self.sys_us
    }

    pub fn ctx_switches(&self) -> u64 {
        self.ctx_voluntary + self.ctx_involuntary
    }

    /// Field-wise `self - earlier`.
    pub fn since(&self, earlier: &Usage) -> Usage {
        Usage {
            user_us: self.user_us.saturating_sub(earlier.user_us),
            sys_us: self.sys_us.saturating_sub(earlier.sys_us),
            ctx_voluntary: self.ctx_voluntary.saturating_sub(earlier.ctx_voluntary),
            ctx_involuntary: self.ctx_involuntary.saturating_sub(earlier.ctx_involuntary),
        }
    }
}

/// The calling thread's totals so far.
pub fn this_thread() -> Usage {
    // SAFETY: getrusage only writes the zero-initialised plain-data struct we pass.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut ru);
        ru
    };
    let us = |tv: libc::timeval| tv.tv_sec as u64 * 1_000_000 + tv.tv_usec as u64;
    Usage {
        user_us: us(ru.ru_utime),
        sys_us: us(ru.ru_stime),
        ctx_voluntary: ru.ru_nvcsw as u64,
        ctx_involuntary: ru.ru_nivcsw as u64,
    }
}
