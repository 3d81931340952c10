//! The target's connection handling for a driver other than the worker: the seeded simulator
//! (`crates/sim`) runs the worker's own [`Conn`] (front ends, frame and reply buffers, the
//! backlog pause, waits for device work and for durability) over its faulty links, one step
//! at a time, instead of a copy of that logic.
//!
//! A [`Target`] is the shared state of a one-worker target over an export table; a
//! [`TargetConn`] one connection of it over any [`ConnStream`]. The driver decides when each
//! connection reads ([`TargetConn::service`]) and sends ([`TargetConn::flush`]), as the
//! worker's poller would, and wakes a connection whose batch landed ([`TargetConn::resume`]).

use std::sync::Arc;

use engine::{Batch, ExportTable};
use wire::Limits;

use crate::conn::{Conn, ReadOutcome};
pub use crate::conn::{ConnStream, Mutation, Protocol};
use crate::stats::WorkerStats;
use crate::{Shared, TargetConfig};

/// A target with one worker: its exports, keys and bounds, and the worker's counters.
pub struct Target {
    shared: Arc<Shared>,
    stats: Arc<WorkerStats>,
}

/// What a target is, for a driver: the limits it offers, the keys it takes (none: no
/// authentication), and how many reply bytes a connection queues before it stops reading.
#[derive(Debug, Clone)]
pub struct TargetSettings {
    pub limits: Limits,
    pub open_handles_max: usize,
    pub keys: Vec<proto::auth::Key>,
    pub tx_backlog_bytes_max: usize,
    /// Receives a connection makes per [`TargetConn::service`] before it yields.
    pub reads_per_pass: usize,
}

impl Target {
    pub fn new(settings: TargetSettings, exports: ExportTable) -> Result<Target, String> {
        let mut config = TargetConfig { workers: 1, keys: settings.keys, ..TargetConfig::default() };
        config.bounds.limits = settings.limits;
        config.bounds.open_handles_max = settings.open_handles_max;
        config.bounds.tx_backlog_bytes_max = settings.tx_backlog_bytes_max;
        config.bounds.reads_per_pass = settings.reads_per_pass;
        let shared = Shared::with_flash(config, exports, None, 1, false).map_err(|e| e.to_string())?;
        let stats = shared.workers[0].clone();
        Ok(Target { shared: Arc::new(shared), stats })
    }

    /// Accept a connection of `protocol` over `stream`, as the acceptor and a worker would.
    pub fn accept<S: ConnStream>(&self, stream: S, protocol: Protocol) -> Result<TargetConn<S>, String> {
        let shared = &self.shared;
        let admitted = shared
            .admission
            .admit(None, 0, &shared.config.bounds, &shared.connections)
            .map_err(|e| format!("admission: {e}"))?;
        Ok(TargetConn { conn: Conn::new(stream, protocol, admitted.ticket, shared) })
    }

    /// Connections closed because the peer broke the protocol (after a `GOAWAY`).
    pub fn protocol_errors(&self) -> u64 {
        self.stats.front.connections_closed_protocol_error.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// What a connection's [`service`](TargetConn::service) left it as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serviced {
    /// Read what there was: come back when more arrives.
    Drained,
    /// Stopped at its budget, or paused for its backlog: come back soon.
    More,
    /// Waits for its batch's wake ([`TargetConn::resume`]).
    Waiting,
    /// The peer closed, or the connection failed: drop it.
    Closed,
}

/// One connection of a [`Target`].
pub struct TargetConn<S> {
    conn: Conn<S>,
}

impl<S: ConnStream> TargetConn<S> {
    /// Park requests that wait for device work, and replies that wait for durability, on
    /// `batch`, as a worker does on a target with asynchronous flash reads.
    pub fn set_batch(&mut self, batch: Arc<Batch>) {
        self.conn.batch = Some(batch);
    }

    /// Its batch landed: what waited goes on at the next service.
    pub fn resume(&mut self) {
        self.conn.resume();
    }

    /// Read what arrived and execute it, within the pass's budget.
    pub fn service(&mut self, target: &Target) -> Serviced {
        let outcome = self.conn.service(&target.shared, &target.stats);
        if self.conn.newly_established() {
            target.shared.admission.established(&self.conn.ticket);
        }
        match outcome {
            ReadOutcome::Drained => Serviced::Drained,
            ReadOutcome::More | ReadOutcome::Paused => Serviced::More,
            ReadOutcome::Waiting => Serviced::Waiting,
            ReadOutcome::Closed => Serviced::Closed,
        }
    }

    /// Send what is queued (and may be sent). Returns whether the connection stays: false once
    /// it failed, or once it closed and said all it had to.
    pub fn flush(&mut self, target: &Target) -> bool {
        self.conn.flush_pass(&target.stats)
    }

    /// Durability a FLUSH or FUA asked for failed: the connection closes without sending the
    /// replies that waited for it.
    pub fn durability_failed(&self) -> bool {
        self.conn.durability_failed()
    }

    /// The connection's stream.
    pub fn stream(&self) -> &S {
        &self.conn.stream
    }

    pub fn stream_mut(&mut self) -> &mut S {
        &mut self.conn.stream
    }

    /// Reply bytes queued and not yet sent.
    pub fn pending(&self) -> usize {
        self.conn.pending()
    }

    /// Plant a bug in the connection's handling or its front end.
    #[cfg(feature = "mutations")]
    pub fn plant(&mut self, mutation: Mutation) {
        self.conn.plant(mutation);
    }
}
