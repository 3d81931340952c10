//! RStore's key schema in etcd: the key prefixes, the records stored under them (JSON), their
//! bounds, and the helpers that name, encode, decode and check them. What the records mean and
//! how they change (every change one etcd transaction) is `rstore`'s control path; this module
//! holds no operation of its own beyond pure helpers over one record.
//!
//! Keys (all under `/skiff/`):
//!
//! | key | value | lifetime |
//! |---|---|---|
//! | `servers/<id>` | [`ServerInfo`]: where the server listens, its pool export, scope, size, chunk size | the server's lease |
//! | `pools/<id>` | [`PoolState`]: the next never-used chunk and the chunks given back | until deleted by hand |
//! | `ns/<name>` | [`Namespace`]: scope, chunk size, replicas, reserved stripes, allocations | until `delete_ns` |
//!
//! A server whose lease expires (it died, or lost etcd for longer than its TTL) vanishes from
//! `servers/`; the chunks namespaces hold on it are then reported lost ([`Namespace::lost`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::etcd::Kv;
use crate::CoordError;

/// Where memory servers' registrations live ([`ServerInfo`], under their lease).
pub const SERVERS: &str = "/skiff/servers/";
/// Where each server's pool record lives ([`PoolState`]).
pub const POOLS: &str = "/skiff/pools/";
/// Where namespaces live ([`Namespace`]).
pub const NAMESPACES: &str = "/skiff/ns/";

/// Transactions retried when another client changed what one read, before giving up.
pub const TXN_RETRIES: usize = 64;

/// Most chunks (stripes times replicas) one namespace may hold: its record is one etcd value,
/// and etcd takes requests of 1.5 MiB at most.
pub const NAMESPACE_CHUNKS_MAX: usize = 16_384;

/// Most chunks one server's pool may hold. Its record lists its free chunks and the
/// generations of those zeroed (about 16 bytes a chunk at most), and transactions carry whole
/// records: this keeps one under 300 KB, well inside etcd's 1.5 MiB request limit.
pub const POOL_CHUNKS_MAX: u64 = 16_384;

/// What a pool (and a namespace) is made of: RAM (FlashNet's DRAM namespaces) or a file
/// (flash namespaces, thesis 7.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Ram,
    File,
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Scope::Ram => "ram",
            Scope::File => "file",
        })
    }
}

impl std::str::FromStr for Scope {
    type Err = String;
    fn from_str(s: &str) -> Result<Scope, String> {
        match s {
            "ram" => Ok(Scope::Ram),
            "file" => Ok(Scope::File),
            _ => Err(format!("{s:?} is not a scope (ram or file)")),
        }
    }
}

/// A memory server's registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// Unique among the servers of one coordinator (by default its endpoint).
    pub id: String,
    /// Where initiators reach it (the native protocol's endpoint).
    pub endpoint: String,
    /// The export that holds its pool; chunk `i` is at byte `i * chunk_bytes` of it.
    pub export: String,
    pub scope: Scope,
    pub bytes: u64,
    pub chunk_bytes: u64,
    /// Which life of the server's pool this is: a RAM pool draws a new one each time it
    /// starts (its old chunks' data died with the old process); a file pool's is the id kept
    /// in the file (`rstore::pool::incarnation`), the same while it is the same file. Chunks
    /// remember the incarnation they were reserved (or rebuilt) in.
    #[serde(default)]
    pub incarnation: u64,
    /// The key the server seals its pool's chunk grants under, hex (docs/RSTORE.md): the
    /// control plane mints a namespace's grants with it. Empty for a server whose pool takes
    /// no grants (anyone who reaches it may read and write it).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub grant_key: String,
    /// Drawn at every start of the server process, whatever its scope: the dirty regions it
    /// tracks for a copy that misses writes live in its memory, and die with the process. A
    /// stale copy names the `id@boot` of the servers tracking it (`ChunkRef::dirty_on`).
    #[serde(default)]
    pub boot: u64,
}

impl ServerInfo {
    pub fn chunks(&self) -> u64 {
        self.bytes / self.chunk_bytes.max(1)
    }

    /// The grant of `chunk` at `generation` and map epoch 0, read and write, if the server
    /// takes grants.
    pub fn grant(&self, chunk: u64, generation: u32) -> Result<Option<wire::Capability>, CoordError> {
        self.grant_at(chunk, generation, 0, false)
    }

    /// The grant of `chunk` at `generation` and map `epoch`, read and write, and with `track`
    /// the right that makes the server mark the regions writes touch (another copy of the
    /// stripe misses them: docs/PROTOCOL.md, 14.6). `None` if the server takes no grants.
    pub fn grant_at(
        &self,
        chunk: u64,
        generation: u32,
        epoch: u32,
        track: bool,
    ) -> Result<Option<wire::Capability>, CoordError> {
        if self.grant_key.is_empty() {
            return Ok(None);
        }
        let key = decode_key(&self.grant_key).ok_or_else(|| {
            CoordError::Invalid(format!("server {}: its grant key is not 64 hex digits", self.id))
        })?;
        let mut rights = wire::CapRights::READ.union(wire::CapRights::WRITE);
        if track {
            rights = rights.union(wire::CapRights::TRACK);
        }
        Ok(Some(proto::grant::seal_at(&key, chunk, self.chunk_bytes, generation, epoch, rights)))
    }
}

/// A grant key as [`ServerInfo::grant_key`] holds it.
pub fn encode_key(key: &[u8; proto::capability::KEY_LEN]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

fn decode_key(hex: &str) -> Option<proto::capability::CapKey> {
    let key = proto::auth::decode_hex(hex)?.try_into().ok()?;
    Some(proto::capability::CapKey::new(key))
}

/// The allocation state of one server's pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolState {
    /// Chunks from here on were never handed out.
    pub next: u64,
    /// Chunks given back and zeroed: free to hand out again.
    pub free: Vec<u64>,
    /// Chunks given back and not yet zeroed: they still hold what their last namespace wrote,
    /// so no namespace gets them until their server has zeroed them (`rstore::Coordinator::dirty`,
    /// `rstore::Coordinator::cleaned`).
    #[serde(default)]
    pub dirty: Vec<u64>,
    /// The chunk size the pool's chunks were numbered in: a server registering again must use
    /// the same, or chunk numbers held by namespaces would name other bytes.
    #[serde(default)]
    pub chunk_bytes: u64,
    /// The generation of each chunk zeroed at least once (the others are at 0): the server
    /// moves a chunk's generation on before zeroing it, which makes its last owner's grants
    /// stale, and records it here with `rstore::Coordinator::cleaned` for the next owner's.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub generations: BTreeMap<u64, u32>,
}

impl PoolState {
    /// Take a chunk of server `s`'s pool for a namespace: one given back and zeroed, else one
    /// never handed out; `None` when the pool is full. The copy is `ok`, at the generation the
    /// chunk's grants are sealed with.
    pub fn take(&mut self, s: &ServerInfo) -> Option<ChunkRef> {
        let index = if let Some(c) = self.free.pop() {
            c
        } else if self.next < s.chunks() {
            self.next += 1;
            self.next - 1
        } else {
            return None;
        };
        let generation = self.generations.get(&index).copied().unwrap_or(0);
        Some(ChunkRef::new(&s.id, index, s.incarnation, generation))
    }
}

/// Where a copy of a stripe stands (docs/RSTORE.md, "Healing").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CopyState {
    /// Holds every acknowledged write: read and written.
    #[default]
    Ok,
    /// May miss writes (its server went away, or a client lost it): neither read nor written
    /// until a repair brings it back.
    Stale,
    /// Being repaired from another copy (`from`): written after the stripe's healthy copies,
    /// never read.
    Syncing,
}

impl std::fmt::Display for CopyState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CopyState::Ok => "ok",
            CopyState::Stale => "stale",
            CopyState::Syncing => "syncing",
        })
    }
}

/// One copy of a stripe: a chunk of a server's pool, and where the copy stands.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChunkRef {
    pub server: String,
    pub index: u64,
    /// The server's incarnation when the chunk was reserved (or rebuilt there).
    #[serde(default)]
    pub incarnation: u64,
    /// The chunk's generation when it was reserved: its grants are sealed with it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: u32,
    /// The namespace's epoch at the stripe's last change (every copy of a stripe holds the
    /// same): its grants are sealed with it, and a server shown them refuses older maps.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch: u32,
    #[serde(default, skip_serializing_if = "is_ok")]
    pub state: CopyState,
    /// Stale: when it went stale (Unix ms), for the grace period before a rebuild elsewhere.
    #[serde(default, skip_serializing_if = "is_zero64")]
    pub since_ms: u64,
    /// Stale (or syncing from one of them): the servers (`id@boot`) whose dirty regions cover
    /// every write it missed, as long as they run that boot.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dirty_on: Vec<String>,
    /// Syncing: the server of the healthy copy it is repaired from.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub from: String,
    /// Syncing: the whole chunk is copied (no tracker covered it), not its dirty regions.
    #[serde(default, skip_serializing_if = "is_false")]
    pub full: bool,
    /// Repairs of this copy that failed since it was last healthy: past a few, its server is
    /// not counted as back, and the copy moves elsewhere after the grace period.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failures: u32,
}

impl ChunkRef {
    /// A copy of `index` on `server`, `ok`, at epoch 0.
    pub fn new(server: &str, index: u64, incarnation: u64, generation: u32) -> ChunkRef {
        ChunkRef {
            server: server.to_owned(),
            index,
            incarnation,
            generation,
            epoch: 0,
            state: CopyState::Ok,
            since_ms: 0,
            dirty_on: Vec::new(),
            from: String::new(),
            full: false,
            failures: 0,
        }
    }
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

fn is_zero64(v: &u64) -> bool {
    *v == 0
}

fn is_false(v: &bool) -> bool {
    !*v
}

fn is_ok(s: &CopyState) -> bool {
    *s == CopyState::Ok
}

/// A stripe: one chunk's worth of a namespace, on `replicas` distinct servers.
pub type Stripe = Vec<ChunkRef>;

/// An `raddress` segment's binding: its length and its stripes, in address order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub len: u64,
    pub stripes: Vec<Stripe>,
}

/// A namespace: a flat 64-bit address space over chunks of the servers of one scope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Namespace {
    pub name: String,
    pub scope: Scope,
    pub chunk_bytes: u64,
    pub replicas: u32,
    /// Stripes reserved and not bound to an address (`reserve` adds, `alloc` takes).
    pub reserved: Vec<Stripe>,
    /// Allocations by address.
    pub allocs: BTreeMap<u64, Allocation>,
    /// Where the next allocation without an address goes.
    pub next_addr: u64,
    /// Moves on with every change to a stripe's copies (`rstore::repair`): each stripe's copies
    /// carry the epoch of its last change.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch: u32,
}

impl Namespace {
    /// Stripes held, reserved or allocated.
    pub fn stripes(&self) -> usize {
        self.reserved.len() + self.allocs.values().map(|a| a.stripes.len()).sum::<usize>()
    }

    pub fn reserved_bytes(&self) -> u64 {
        self.stripes() as u64 * self.chunk_bytes
    }

    pub fn allocated_bytes(&self) -> u64 {
        self.allocs.values().map(|a| a.stripes.len() as u64 * self.chunk_bytes).sum()
    }

    /// The chunks whose data is gone: their server is not registered now (its lease
    /// expired), or registered in another incarnation (a RAM pool that restarted). A stripe
    /// with a replica left still has its data there.
    pub fn lost<'a>(&'a self, live: &'a [ServerInfo]) -> impl Iterator<Item = &'a ChunkRef> + 'a {
        let stripes = self.reserved.iter().chain(self.allocs.values().flat_map(|a| a.stripes.iter()));
        stripes
            .flatten()
            .filter(move |c| !live.iter().any(|s| s.id == c.server && s.incarnation == c.incarnation))
    }
}

/// The etcd key of `name` under `prefix` ([`SERVERS`], [`POOLS`], [`NAMESPACES`]).
pub fn key(prefix: &str, name: &str) -> Vec<u8> {
    format!("{prefix}{name}").into_bytes()
}

/// A record read from etcd; one that does not parse is [`CoordError::Corrupt`].
pub fn decode<T: serde::de::DeserializeOwned>(kv: &Kv) -> Result<T, CoordError> {
    serde_json::from_slice(&kv.value).map_err(|e| CoordError::Corrupt {
        key: String::from_utf8_lossy(&kv.key).into_owned(),
        why: e.to_string(),
    })
}

/// A record as etcd stores it (JSON).
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("control-plane records serialize")
}

/// Largest namespace record: etcd takes requests of 1.5 MiB at most, and a transaction
/// carries pool records beside it.
pub const NAMESPACE_RECORD_MAX: usize = 1 << 20;

/// A namespace's record, refused when it would not fit one etcd request.
pub fn encode_ns(ns: &Namespace) -> Result<Vec<u8>, CoordError> {
    let record = encode(ns);
    if record.len() > NAMESPACE_RECORD_MAX {
        return Err(CoordError::Invalid(format!(
            "namespace {:?} would take a {}-byte record, over {NAMESPACE_RECORD_MAX}: use larger chunks",
            ns.name,
            record.len()
        )));
    }
    Ok(record)
}

/// A name for a key: letters, digits and `-_.:` only, 1 to 128 bytes.
pub fn check_name(what: &str, name: &str) -> Result<(), CoordError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(CoordError::Invalid(format!("{what} {name:?}: use 1 to 128 letters, digits and -_.:")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registration's grant key seals grants the pool admits; one that is not 64 hex digits
    /// is refused clearly, and a server without one takes none.
    #[test]
    fn grant_keys_seal_what_the_pool_admits_and_bad_ones_are_refused() {
        let key = [7u8; proto::capability::KEY_LEN];
        let mut s = ServerInfo {
            id: "a".into(),
            endpoint: "127.0.0.1:1".into(),
            export: "pool".into(),
            scope: Scope::Ram,
            bytes: 4 << 20,
            chunk_bytes: 1 << 20,
            incarnation: 1,
            grant_key: encode_key(&key),
            boot: 9,
        };
        let grant = s.grant(2, 5).unwrap().expect("a server with a key");
        let tracked = s.grant_at(2, 5, 7, true).unwrap().expect("a server with a key");
        assert_eq!((tracked.epoch, tracked.rights.contains(wire::CapRights::TRACK)), (7, true));
        let pool = proto::grant::PoolGrants::new(key, 1 << 20, 4).unwrap();
        pool.set_generation(2, 5);
        assert_eq!(pool.admit(&grant).map(|b| (b.chunk, b.generation)), Ok((2, 5)));
        for bad in ["zz".repeat(32), "ab".repeat(31), format!("{}é", "a".repeat(62))] {
            s.grant_key = bad;
            let err = s.grant(0, 0).expect_err("not a key");
            assert!(err.to_string().contains("not 64 hex digits"), "{err}");
        }
        s.grant_key.clear();
        assert_eq!(s.grant(0, 0).unwrap(), None);
    }

    /// Every write of a namespace record goes through the bound: one under it passes, and the
    /// same record with an allocation and a (long) stale mark more is refused with a message
    /// that names the namespace and says what to do.
    #[test]
    fn a_namespace_record_over_its_bound_is_refused_clearly() {
        let stripe = |i: u64| vec![ChunkRef::new(&"s".repeat(200), i, 1, 0)];
        let mut ns = Namespace {
            name: "big".into(),
            scope: Scope::Ram,
            chunk_bytes: 1 << 20,
            replicas: 1,
            reserved: Vec::new(),
            allocs: BTreeMap::new(),
            next_addr: 0,
            epoch: 0,
        };
        // A stripe's share of the record, then as many as leave a little room.
        ns.reserved.push(stripe(0));
        let one = encode(&ns).len();
        ns.reserved.push(stripe(1));
        let each = encode(&ns).len() - one;
        while ns.reserved.len() < (NAMESPACE_RECORD_MAX - 32 * 1024) / each {
            let i = ns.reserved.len() as u64;
            ns.reserved.push(stripe(i));
        }
        assert!(encode(&ns).len() > NAMESPACE_RECORD_MAX / 2, "{} bytes", encode(&ns).len());
        assert!(encode_ns(&ns).is_ok());
        let mut stale = stripe(0);
        stale[0].state = CopyState::Stale;
        stale[0].dirty_on = vec!["t".repeat(64 * 1024)];
        ns.allocs.insert(0, Allocation { len: 1 << 20, stripes: vec![stale] });
        let err = encode_ns(&ns).expect_err("over the bound");
        assert!(err.to_string().contains("\"big\"") && err.to_string().contains("larger chunks"), "{err}");
    }
}
