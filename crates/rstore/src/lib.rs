//! RStore on skiff (Trivedi's thesis, chapter 6; docs/RSTORE.md): namespaces striped over the
//! memory servers' pools, with a slow control path that prepares everything up front and a
//! fast data path that only reads and writes.
//!
//! - [`control`]: the [`Coordinator`], RStore's control path on etcd: memory servers'
//!   registrations, namespaces, reserve and release, alloc, free and lookup, `map`, and the
//!   stale marks of copies a client lost; [`RAddress`] and [`Place`], an allocation resolved
//!   to its live copies.
//! - [`segment`]: the data path: a mapped `raddress` ([`Segment`]), striped over one lane per
//!   server, with replicas.
//! - [`connections`]: lanes kept across mappings: an unmapped segment's idle lanes serve the
//!   next segment mapped to the same servers ([`Connections`]).
//! - [`coordination`]: the coordination service of RStore's applications: a [`Board`] of
//!   one-byte status fields, areas and heartbeats in a namespace, through which a coordinator
//!   and its workers move through phases, and stop with a reason, never a hang.
//! - [`pool`]: the memory server's side: the pool export a `skiff serve --pool` serves, its
//!   registration kept alive under a lease, and the zeroing of the chunks given back.
//!
//! The etcd client and the records kept there (the key schema) are `coord`'s; the lanes are
//! `initiator`'s. Applications on RStore (RSort) live in `apps`.

pub mod agent;
pub mod connections;
pub mod control;
pub mod coordination;
pub mod pool;
pub mod repair;
pub mod segment;
pub mod shared;

pub use connections::{ConnectionStats, Connections};
pub use control::{segment_map, Coordinator, Place, RAddress, Registration};
pub use coordination::{Board, Heartbeat, Party, Step, Stop};
pub use segment::{Location, MapSource, Segment, SegmentMap, SegmentStats, SourceError};
pub use shared::{SegmentHandle, SharedSegment};
