//! When to send the open caravan: the i10 doorbell.
//!
//! [`Doorbell`] rings when the caravan holds `aggregation_reqs` requests or `aggregation_bytes`
//! payload bytes, when a request asks for `NO_DELAY`, when the caller commits or waits, or once
//! `delay_us` has passed since the first request queued (a deadline the driver honours through
//! [`crate::client::ClientSession::poll_timeout`]). The caravan itself is built in
//! [`crate::client::Outbox`].

use wire::ReqFlags;

/// When to send the open caravan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Doorbell {
    /// Ring when the caravan holds this many requests (i10: 16).
    pub aggregation_reqs: u32,
    /// Ring when the caravan's payload reaches this many bytes (i10: 64 KiB).
    pub aggregation_bytes: u32,
    /// Ring when the oldest queued request has waited this long (i10: 50 µs); zero rings at
    /// once on every submit.
    pub delay_us: u64,
}

impl Default for Doorbell {
    fn default() -> Doorbell {
        Doorbell { aggregation_reqs: 16, aggregation_bytes: 64 << 10, delay_us: 50 }
    }
}

impl Doorbell {
    /// After a submit left the open caravan with `reqs` requests and `payload_bytes` bytes of
    /// payload: must it go now?
    pub fn ring_after_submit(&self, reqs: usize, payload_bytes: u32, flags: ReqFlags) -> bool {
        flags.contains(ReqFlags::NO_DELAY)
            || self.delay_us == 0
            || reqs as u64 >= u64::from(self.aggregation_reqs)
            || payload_bytes >= self.aggregation_bytes
    }

    /// Has the delay bound passed for a caravan whose first request queued at `first_us`?
    pub fn expired(&self, first_us: u64, now_us: u64) -> bool {
        now_us.saturating_sub(first_us) >= self.delay_us
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doorbell_rings_on_size_bytes_no_delay_and_time() {
        let bell = Doorbell { aggregation_reqs: 2, aggregation_bytes: 8192, delay_us: 50 };
        assert!(!bell.ring_after_submit(1, 0, ReqFlags::empty()));
        assert!(bell.ring_after_submit(1, 0, ReqFlags::NO_DELAY));
        assert!(bell.ring_after_submit(2, 0, ReqFlags::empty()));
        assert!(bell.ring_after_submit(1, 8192, ReqFlags::empty()), "byte threshold");
        assert!(!bell.expired(100, 149));
        assert!(bell.expired(100, 150));
        let eager = Doorbell { delay_us: 0, ..bell };
        assert!(eager.ring_after_submit(1, 512, ReqFlags::empty()));
    }
}
