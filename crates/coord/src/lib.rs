//! RStore's etcd client and key schema (Trivedi's thesis, chapter 6; docs/RSTORE.md).
//!
//! - [`etcd`]: a small blocking client of etcd v3's JSON gateway, with failover across a
//!   cluster's members.
//! - [`schema`]: the keys RStore keeps in etcd and the records stored under them (servers,
//!   pools, namespaces), with their bounds; re-exported here.
//!
//! The operations on those records (register, reserve, alloc, map...) are RStore's control
//! path, in the `rstore` crate; the data path is there too. This crate holds no data-path code
//! and knows nothing of lanes or segments.

pub mod etcd;
pub mod schema;

pub use schema::{
    encode_key, AllocRecord, Allocation, ChunkRef, CopyState, Extent, Generations, Namespace, NsHead,
    PoolHead, Run, Scope, ServerInfo, Stripe, StripeGroup, POOL_CHUNKS_MAX,
};

use crate::etcd::EtcdError;
use crate::schema::TXN_RETRIES;

/// Why a control-plane call failed.
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    #[error("namespace {0:?} exists already")]
    Exists(String),
    #[error("no namespace {0:?}")]
    NoNamespace(String),
    #[error("{0}")]
    Invalid(String),
    #[error("not enough {scope} capacity: {want} chunks of {chunk_bytes} bytes on {replicas} distinct servers wanted, {have} free{}",
        if *zeroing > 0 { format!(" ({zeroing} more given back and being zeroed by their servers: try again shortly)") } else { String::new() })]
    NoCapacity { scope: Scope, chunk_bytes: u64, replicas: u32, want: u64, have: u64, zeroing: u64 },
    #[error("namespace {ns:?} has {have} reserved chunks free, {want} needed (reserve more first)")]
    NotReserved { ns: String, want: u64, have: u64 },
    #[error("address {addr:#x} of namespace {ns:?} overlaps the allocation at {other:#x}")]
    AddressTaken { ns: String, addr: u64, other: u64 },
    #[error("no allocation at address {addr:#x} of namespace {ns:?}")]
    NoAllocation { ns: String, addr: u64 },
    #[error("etcd holds a record that does not parse at {key}: {why}")]
    Corrupt { key: String, why: String },
    #[error("gave up after {TXN_RETRIES} conflicting transactions on {0}")]
    Contended(String),
}
