//! Every bound the target holds to, with its default, in one place.
//!
//! The protocol's own limits (what a connection may negotiate) are the first field; the rest
//! bound what one peer can make the target hold or do, so that one misbehaving peer never
//! disturbs another. The command line and the C-free library share these defaults.

use wire::Limits;

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
}

impl Default for Bounds {
    fn default() -> Bounds {
        Bounds {
            limits: Limits::default(),
            connections_max: 1024,
            open_handles_max: 16,
            tx_backlog_bytes_max: 8 << 20,
            reads_per_pass: 8,
            events_per_poll: 256,
            nbd_extents_per_reply_max: 1024,
        }
    }
}
