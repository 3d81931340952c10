//! When to reconnect, when to fail what waits, and when to give up: the initiator's policy
//! after a lost connection, on a clock passed in.
//!
//! The knobs are named as SPDK's NVMe-oF initiator and nvme-cli name them:
//! - `reconnect_delay`: the longest wait between two attempts. The first attempt is made at
//!   once; the waits after failed ones double from [`FIRST_RETRY_US`] up to this bound.
//! - `ctrl_loss_timeout`: how long after the loss attempts go on; then the driver gives up and
//!   every request completes with an error ([`ClientSession::handle_closed`]).
//! - `fast_io_fail_timeout`: how long after the loss the requests waiting may wait; then they
//!   complete with an error and new ones are refused ([`ClientSession::fail_parked`]) while
//!   attempts go on until `ctrl_loss_timeout`. Off means they wait until the connection is
//!   back or lost for good.
//!
//! [`ClientSession::handle_closed`]: super::ClientSession::handle_closed
//! [`ClientSession::fail_parked`]: super::ClientSession::fail_parked

/// The wait after the first failed attempt, in microseconds.
pub const FIRST_RETRY_US: u64 = 20_000;

/// Reconnection settings. `reconnect_delay_us == 0` turns reconnection off: a lost connection
/// fails every request at once, as before reconnection existed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconnectConfig {
    pub reconnect_delay_us: u64,
    pub ctrl_loss_timeout_us: u64,
    /// `None`: requests wait as long as attempts go on.
    pub fast_io_fail_timeout_us: Option<u64>,
}

impl ReconnectConfig {
    /// No reconnection.
    pub const OFF: ReconnectConfig =
        ReconnectConfig { reconnect_delay_us: 0, ctrl_loss_timeout_us: 0, fast_io_fail_timeout_us: None };

    pub fn is_on(&self) -> bool {
        self.reconnect_delay_us > 0
    }
}

impl Default for ReconnectConfig {
    /// Attempts at most a second apart for 60 s; requests wait that long.
    fn default() -> ReconnectConfig {
        ReconnectConfig {
            reconnect_delay_us: 1_000_000,
            ctrl_loss_timeout_us: 60_000_000,
            fast_io_fail_timeout_us: None,
        }
    }
}

/// What the driver should do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Connected, or nothing to do before `until` (microseconds).
    Wait { until: u64 },
    /// Try to connect now, then report with [`Reconnect::handle_connected`] or
    /// [`Reconnect::handle_attempt_failed`].
    Attempt,
    /// Fail the requests that wait ([`ClientSession::fail_parked`](super::ClientSession::fail_parked)),
    /// and ask again.
    FailIo,
    /// Lost for good: close the session ([`ClientSession::handle_closed`](super::ClientSession::handle_closed)).
    GiveUp,
}

/// One connection's reconnection state.
#[derive(Debug, Clone)]
pub struct Reconnect {
    config: ReconnectConfig,
    /// When the connection was lost (`None`: connected).
    lost_at_us: Option<u64>,
    next_attempt_us: u64,
    retry_us: u64,
    io_failed: bool,
    /// An attempt is under way (its outcome not yet reported).
    attempting: bool,
    /// Connections lost, and attempts made, since the start.
    pub losses: u64,
    pub attempts: u64,
}

impl Reconnect {
    pub fn new(config: ReconnectConfig) -> Reconnect {
        Reconnect {
            config,
            lost_at_us: None,
            next_attempt_us: 0,
            retry_us: FIRST_RETRY_US,
            io_failed: false,
            attempting: false,
            losses: 0,
            attempts: 0,
        }
    }

    pub fn config(&self) -> &ReconnectConfig {
        &self.config
    }

    /// Whether the connection is lost and not yet back.
    pub fn is_lost(&self) -> bool {
        self.lost_at_us.is_some()
    }

    /// The connection was lost at `now_us`. Returns false when reconnection is off (the
    /// driver gives up at once).
    pub fn handle_lost(&mut self, now_us: u64) -> bool {
        if !self.config.is_on() {
            return false;
        }
        if self.lost_at_us.is_none() {
            self.lost_at_us = Some(now_us);
            self.next_attempt_us = now_us;
            self.retry_us = FIRST_RETRY_US.min(self.config.reconnect_delay_us);
            self.io_failed = false;
            self.losses += 1;
        }
        true
    }

    /// An attempt at `now_us` failed: the next waits longer, up to `reconnect_delay`.
    pub fn handle_attempt_failed(&mut self, now_us: u64) {
        self.attempting = false;
        self.next_attempt_us = now_us + self.retry_us;
        self.retry_us = (self.retry_us * 2).min(self.config.reconnect_delay_us);
    }

    /// The connection is back.
    pub fn handle_connected(&mut self) {
        self.attempting = false;
        self.lost_at_us = None;
        self.io_failed = false;
    }

    /// Whether an attempt is under way: the driver reports its outcome before another starts.
    pub fn is_attempting(&self) -> bool {
        self.attempting
    }

    /// What to do at `now_us`. `Attempt` starts an attempt (none starts while one is under
    /// way); the driver may carry it out in the background and report when it ends.
    pub fn poll_action(&mut self, now_us: u64) -> Action {
        let Some(lost) = self.lost_at_us else {
            return Action::Wait { until: u64::MAX };
        };
        if now_us >= lost.saturating_add(self.config.ctrl_loss_timeout_us) {
            return Action::GiveUp;
        }
        if let Some(fail) = self.config.fast_io_fail_timeout_us {
            if !self.io_failed && now_us >= lost.saturating_add(fail) {
                self.io_failed = true;
                return Action::FailIo;
            }
        }
        if !self.attempting && now_us >= self.next_attempt_us {
            self.attempts += 1;
            self.attempting = true;
            return Action::Attempt;
        }
        Action::Wait { until: self.poll_timeout().unwrap_or(u64::MAX) }
    }

    /// When to ask [`poll_action`](Self::poll_action) again (`None`: connected).
    pub fn poll_timeout(&self) -> Option<u64> {
        let lost = self.lost_at_us?;
        let mut due = lost.saturating_add(self.config.ctrl_loss_timeout_us);
        if !self.attempting {
            due = due.min(self.next_attempt_us);
        }
        if let Some(fail) = self.config.fast_io_fail_timeout_us.filter(|_| !self.io_failed) {
            due = due.min(lost.saturating_add(fail));
        }
        Some(due)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1000;

    #[test]
    fn off_gives_up_at_once() {
        let mut r = Reconnect::new(ReconnectConfig::OFF);
        assert!(!r.handle_lost(0));
    }

    #[test]
    fn attempts_back_off_to_the_delay_and_give_up_at_the_loss_timeout() {
        let config = ReconnectConfig {
            reconnect_delay_us: 200 * MS,
            ctrl_loss_timeout_us: 1000 * MS,
            fast_io_fail_timeout_us: None,
        };
        let mut r = Reconnect::new(config);
        assert!(r.handle_lost(5 * MS));
        let mut now = 5 * MS;
        let mut attempts_at = Vec::new();
        loop {
            match r.poll_action(now) {
                Action::Attempt => {
                    attempts_at.push(now);
                    r.handle_attempt_failed(now);
                }
                Action::Wait { until } => {
                    assert!(until > now);
                    now = until;
                }
                Action::GiveUp => break,
                Action::FailIo => panic!("fast_io_fail is off"),
            }
        }
        assert_eq!(now, 1005 * MS, "gave up at the loss timeout");
        let gaps: Vec<u64> = attempts_at.windows(2).map(|w| (w[1] - w[0]) / MS).collect();
        assert_eq!(gaps, [20, 40, 80, 160, 200, 200, 200], "attempts at {attempts_at:?}");
        assert_eq!(r.attempts, attempts_at.len() as u64);
    }

    #[test]
    fn no_second_attempt_starts_while_one_is_under_way() {
        let mut r = Reconnect::new(ReconnectConfig::default());
        r.handle_lost(0);
        assert_eq!(r.poll_action(0), Action::Attempt);
        assert!(r.is_attempting());
        // Long past its retry time, but the first attempt has not reported: only the loss
        // deadline is pending.
        assert_eq!(r.poll_action(5_000_000), Action::Wait { until: 60_000_000 });
        r.handle_attempt_failed(5_000_000);
        assert_eq!(r.poll_action(5_000_000 + FIRST_RETRY_US), Action::Attempt);
    }

    #[test]
    fn fast_io_fail_comes_once_then_attempts_go_on_and_a_success_resets() {
        let config = ReconnectConfig {
            reconnect_delay_us: 100 * MS,
            ctrl_loss_timeout_us: 10_000 * MS,
            fast_io_fail_timeout_us: Some(300 * MS),
        };
        let mut r = Reconnect::new(config);
        r.handle_lost(0);
        let mut now = 0;
        let mut failed_at = None;
        while now < 1000 * MS {
            match r.poll_action(now) {
                Action::Attempt => r.handle_attempt_failed(now),
                Action::FailIo => {
                    assert!(failed_at.is_none(), "FailIo twice");
                    failed_at = Some(now);
                }
                Action::Wait { until } => now = until,
                Action::GiveUp => panic!("too early"),
            }
        }
        assert_eq!(failed_at, Some(300 * MS));
        assert_eq!(r.poll_action(now), Action::Attempt);
        r.handle_connected();
        assert!(!r.is_lost());
        assert_eq!(r.poll_action(now), Action::Wait { until: u64::MAX });
        // A second loss starts over: the first attempt at once, fast-fail armed again.
        r.handle_lost(now);
        assert_eq!(r.poll_action(now), Action::Attempt);
        assert_eq!(r.losses, 2);
    }
}
