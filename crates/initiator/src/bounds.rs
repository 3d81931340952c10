//! The initiator's fixed sizes, intervals and defaults, in one place (as the target keeps its
//! own in `server::bounds`), with checks at compile time of how they relate. What a caller may
//! change per lane is `LaneConfig`, whose defaults come from here.

use std::time::Duration;

/// How long a blocking call waits for the target before giving up (`LaneConfig::timeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest a reconnection attempt waits for the target to accept and answer.
pub(crate) const CONNECT_TIMEOUT_MAX: Duration = Duration::from_secs(5);

/// How often a shared lane's receiver looks for the outcome of a background attempt.
pub(crate) const ATTEMPT_POLL: Duration = Duration::from_millis(5);

/// Most requests a lane proposes for one caravan when its configuration leaves the choice to
/// the target.
pub const LANE_CARAVAN_REQS_MAX: u32 = 256;

/// The default of `LaneConfig::direct_min_bytes`: off. Measured on loopback TCP, placing
/// directly removes the copy from the lane but makes the target's sends dearer by as much or
/// more, at every read size tried (docs/PERFORMANCE.md, "Direct placement").
pub const DIRECT_MIN_BYTES: u32 = proto::client::DIRECT_OFF;

/// Most slices handed to one vectored send.
pub(crate) const SEND_IOV_MAX: usize = 64;

const _: () = {
    // A reconnection attempt gives up before the call waiting on it does.
    assert!(CONNECT_TIMEOUT_MAX.as_millis() < DEFAULT_TIMEOUT.as_millis());
    // The outcome of an attempt is looked for many times within its time.
    assert!(ATTEMPT_POLL.as_millis() * 10 <= CONNECT_TIMEOUT_MAX.as_millis());
    // A caravan's requests each take a slot of the session's table.
    assert!(LANE_CARAVAN_REQS_MAX as usize <= proto::slots::SLOTS_MAX);
    // writev refuses more entries than IOV_MAX (1,024 on Linux) with EINVAL.
    assert!(SEND_IOV_MAX > 0 && SEND_IOV_MAX <= 1024);
};
