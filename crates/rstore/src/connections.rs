//! Connections kept across mappings, as RStore keeps its RDMA connections (thesis 6.3.2): a
//! segment that is dropped (unmapped) leaves its idle lanes here, and the next segment mapped
//! to the same server and export takes one and presents its own grants on it (`GRANT`,
//! docs/PROTOCOL.md, section 14.6): one round trip instead of a connection, a handshake and an
//! `OPEN`.
//!
//! A kept lane holds the grants of the mappings it served. That gives its owner nothing it
//! could not have: a grant of a chunk that changed owner since is of a generation the chunk
//! has left, and a grant of a stale map is of an epoch the chunk has passed. Lanes are kept
//! only while idle and connected, at most [`IDLE_PER_SERVER`] per server and export and
//! [`IDLE_MAX`] in all, for [`KEEP_FOR`]; past that they close. A lane whose server went away
//! or closed it (a `GOAWAY` for its silence) while it waited here fails its `GRANT`, and a new
//! connection is made in its place.
//!
//! Lanes are kept per lane configuration: a segment takes only a lane made with the same
//! settings (limits, polling, key, TLS, ...) as its own.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use initiator::{Endpoint, Error, Lane, LaneConfig, Result};

/// Idle lanes kept at most per server, export and configuration.
pub const IDLE_PER_SERVER: usize = 8;

/// Idle lanes kept at most in all.
pub const IDLE_MAX: usize = 256;

/// How long a lane is kept: well inside a target's idle timeout (60 s by default), after which
/// it closes a silent connection (with a `GOAWAY` that a kept lane reads only at its next
/// `GRANT`, and then makes a new connection anyway).
pub const KEEP_FOR: Duration = Duration::from_secs(30);

/// Idle lanes to memory servers, shared by the segments of a coordinator (and its
/// [`again`](crate::Coordinator::again) copies); cloning shares them.
#[derive(Clone, Default)]
pub struct Connections(Arc<Shared>);

#[derive(Default)]
struct Shared {
    idle: Mutex<Idle>,
    opened: AtomicU64,
    reused: AtomicU64,
}

#[derive(Default)]
struct Idle {
    /// Each with when it was kept.
    lanes: HashMap<Key, Vec<(Lane, Instant)>>,
    count: usize,
}

/// Server endpoint, export, and the configuration's fingerprint.
type Key = (String, String, String);

/// What the connections did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ConnectionStats {
    /// New connections made.
    pub opened: u64,
    /// Kept lanes taken up again (their grants accepted).
    pub reused: u64,
    /// Lanes kept now.
    pub idle: u64,
}

/// What of a configuration a kept lane must share with the one asked for: everything but the
/// grants (the key and TLS configuration by identity, as their secrets are not printed).
fn fingerprint(config: &LaneConfig) -> String {
    let settings = LaneConfig { grants: Arc::from([]), key: None, tls: None, ..config.clone() };
    let key = config.key.as_ref().map(Arc::as_ptr);
    let tls = config.tls.as_ref().map(Arc::as_ptr);
    format!("{settings:?} {key:?} {tls:?}")
}

impl Connections {
    pub fn new() -> Connections {
        Connections::default()
    }

    /// A lane to `export` at `endpoint` holding `config.grants`: a kept one that accepts
    /// them, or else a new connection. A grant refused on a kept lane fails as it would on a
    /// new connection (the lane is closed); any other failure of a kept lane (its server went
    /// away meanwhile) closes it and makes a new connection.
    pub fn open(&self, endpoint: &Endpoint, export: &str, config: &LaneConfig) -> Result<Lane> {
        let key = (endpoint.to_string(), export.to_owned(), fingerprint(config));
        while let Some(mut lane) = self.take(&key) {
            match lane.grant(&config.grants) {
                Ok(()) => {
                    self.0.reused.fetch_add(1, Relaxed);
                    return Ok(lane);
                }
                Err(e @ Error::Refused(_)) => return Err(e),
                Err(e) => tracing::debug!(%endpoint, export, error = %e, "a kept connection failed; another"),
            }
        }
        let lane = Lane::connect(endpoint, export, config)?;
        self.0.opened.fetch_add(1, Relaxed);
        Ok(lane)
    }

    /// The lane kept last for `key`, if kept within [`KEEP_FOR`]; older ones are closed.
    fn take(&self, key: &Key) -> Option<Lane> {
        let mut idle = self.0.idle.lock().unwrap_or_else(|p| p.into_inner());
        let lanes = idle.lanes.get_mut(key)?;
        let before = lanes.len();
        lanes.retain(|(_, at)| at.elapsed() < KEEP_FOR);
        let lane = lanes.pop().map(|(lane, _)| lane);
        let left = lanes.len();
        if left == 0 {
            idle.lanes.remove(key);
        }
        idle.count -= before - left;
        lane
    }

    /// Keep `lane` (made by [`open`](Self::open) with `config` to `export` at `endpoint`)
    /// for a later mapping, if it is idle and connected and there is room; else close it.
    pub fn keep(&self, endpoint: &Endpoint, export: &str, config: &LaneConfig, lane: Lane) {
        if lane.in_flight() > 0 || lane.is_broken() || lane.is_reconnecting() {
            return;
        }
        let key = (endpoint.to_string(), export.to_owned(), fingerprint(config));
        let mut idle = self.0.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.count >= IDLE_MAX {
            return;
        }
        let lanes = idle.lanes.entry(key).or_default();
        if lanes.len() < IDLE_PER_SERVER {
            lanes.push((lane, Instant::now()));
            idle.count += 1;
        }
    }

    /// Close every kept lane.
    pub fn close_idle(&self) {
        let mut idle = self.0.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.lanes.clear();
        idle.count = 0;
    }

    pub fn stats(&self) -> ConnectionStats {
        ConnectionStats {
            opened: self.0.opened.load(Relaxed),
            reused: self.0.reused.load(Relaxed),
            idle: self.0.idle.lock().unwrap_or_else(|p| p.into_inner()).count as u64,
        }
    }
}
