//! Every bound the target holds to, with its default, in one place, and below them the
//! fixed sizes and intervals of its workers (in the manner of TigerBeetle's constants file:
//! one place to read them, and checks at compile time of how they relate).
//!
//! The protocol's own limits (what a connection may negotiate) are the first field; the rest
//! bound what one peer can make the target hold or do, so that one misbehaving peer never
//! disturbs another. The command line and the C-free library share these defaults.

use std::time::Duration;

use wire::Limits;

/// Most gather-list entries handed to one send (`writev` takes up to 1,024).
pub(crate) const IOV_BATCH: usize = 128;
/// A connection silent this long gives its buffers back (checked at the sweep): a request of
/// up to `nbd::DEFAULT_PAYLOAD_MAX` grows them to its size, and a connection that sent one long
/// ago should not hold that for ever.
pub(crate) const IDLE_SHRINK_AFTER: Duration = Duration::from_secs(2);
/// The reply buffer a quiet connection keeps.
pub(crate) const TX_IDLE_BYTES: usize = 256 << 10;
/// How often a worker looks for connections past their handshake or idle timeout and for
/// buffers to give back: timeouts are enforced to within this much.
pub(crate) const SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// Response caravans queued to a staged target's send thread, at most; a full queue stalls
/// the worker.
pub(crate) const SEND_QUEUE_MAX: usize = 4096;
/// Largest single receive of a staged target's receive thread.
pub(crate) const RECV_CHUNK: usize = 256 * 1024;
/// The default of [`Bounds::tx_backlog_bytes_max`].
const TX_BACKLOG_BYTES_MAX: usize = 8 << 20;

// How the fixed sizes relate, checked when the crate compiles.
const _: () = {
    // A quiet connection keeps less than a backlogged one may queue.
    assert!(TX_IDLE_BYTES < TX_BACKLOG_BYTES_MAX);
    // Buffers are given back only after at least one sweep has looked at them.
    assert!(IDLE_SHRINK_AFTER.as_secs() >= SWEEP_INTERVAL.as_secs());
    // writev refuses more entries than IOV_MAX (1,024 on Linux) with EINVAL.
    assert!(IOV_BATCH > 0 && IOV_BATCH <= 1024);
};

/// The target's bounds. `Bounds::default()` is what `skiff serve` uses unless told otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// The most the target offers in the handshake: queue depth 256, 64 requests and 2 MiB per
    /// caravan, 1 MiB per I/O (docs/PROTOCOL.md, section 9). A connection negotiates at most
    /// these.
    pub limits: Limits,
    /// Connections open at once across all workers; more are refused at accept. 1,024.
    pub connections_max: usize,
    /// Exports one native connection may hold open; an OPEN past it gets `TooManyOpen`. 16.
    pub open_handles_max: usize,
    /// Response bytes queued on one connection before its worker stops reading from it (the
    /// peer is not draining its socket). 8 MiB.
    pub tx_backlog_bytes_max: usize,
    /// Receives from one connection per loop pass, so a busy peer cannot starve the others
    /// on its worker. 8.
    pub reads_per_pass: usize,
    /// Readiness events a worker takes from one poll. 256.
    pub events_per_poll: usize,
    /// Extents in one NBD `BLOCK_STATUS` reply; the client asks again for the rest. 1,024.
    pub nbd_extents_per_reply_max: usize,
    /// Connections still in their handshake (native: before `HELLO`; NBD: before `GO` or
    /// `EXPORT_NAME`) at once. One more arriving evicts the oldest of them, so stalled
    /// handshakes can never lock out a client that completes its own. 256.
    pub handshakes_max: usize,
    /// Connections open at once from one client address; past it, a new one evicts that
    /// address's oldest connection still in its handshake, or is refused. 256.
    pub connections_per_address_max: usize,
    /// A connection that has not finished its handshake this long after it was accepted is
    /// closed (native: `GOAWAY` `TimedOut`). 10 s.
    pub handshake_timeout: Duration,
    /// A native connection that sends nothing for this long, with nothing of its own queued,
    /// gets `GOAWAY` `TimedOut` and is closed; an initiator with reconnection on reconnects
    /// when it next has work. Zero: never. 60 s.
    pub idle_timeout: Duration,
    /// The same for NBD connections after their handshake. Zero (the default): never, since
    /// NBD clients such as the kernel's do not reconnect on their own.
    pub nbd_idle_timeout: Duration,
    /// Flash volumes (snapshots and clones included) a target with a flash array can export
    /// over its life: the volumes found at start and every one created since. Each takes an
    /// export index that is never reused, so that a handle never comes to name another
    /// volume (`engine::table`); past it, creating one is refused until a restart. 4,096.
    pub volume_exports_max: usize,
}

impl Default for Bounds {
    fn default() -> Bounds {
        Bounds {
            limits: Limits::default(),
            connections_max: 1024,
            open_handles_max: 16,
            tx_backlog_bytes_max: TX_BACKLOG_BYTES_MAX,
            reads_per_pass: 8,
            events_per_poll: 256,
            nbd_extents_per_reply_max: 1024,
            handshakes_max: 256,
            connections_per_address_max: 256,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            nbd_idle_timeout: Duration::ZERO,
            volume_exports_max: 4096,
        }
    }
}
