//! RStore's control plane on etcd (Trivedi's thesis, chapter 6; docs/RSTORE.md).
//!
//! Memory servers (ordinary `skiff serve` processes with `--pool`) donate RAM or a file as a
//! pool of chunks and keep a registration alive under an etcd lease. Namespaces, the chunks
//! they reserved and the `raddress` segments allocated in them live in etcd as JSON values;
//! every change is one etcd transaction that checks the revisions it read, so two clients
//! racing for the same thing (a namespace name, the bootstrap address) see exactly one win.
//! This is the slow path: it runs when a client sets up, never per I/O. A mapped `raddress`
//! says, for every chunk, which server (endpoint, export) holds it at which offset, and the
//! data path goes there directly.
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

pub mod etcd;

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::etcd::{Compare, Etcd, EtcdError, Kv, Op};

const SERVERS: &str = "/skiff/servers/";
const POOLS: &str = "/skiff/pools/";
const NAMESPACES: &str = "/skiff/ns/";

/// Transactions retried when another client changed what one read, before giving up.
const TXN_RETRIES: usize = 64;

/// Most chunks (stripes times replicas) one namespace may hold: its record is one etcd value,
/// and etcd takes requests of 1.5 MiB at most.
pub const NAMESPACE_CHUNKS_MAX: usize = 16_384;

/// Most chunks one server's pool may hold. Its record lists its free chunks and the
/// generations of those zeroed (about 16 bytes a chunk at most), and transactions carry whole
/// records: this keeps one under 300 KB, well inside etcd's 1.5 MiB request limit.
pub const POOL_CHUNKS_MAX: u64 = 16_384;

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
    /// Which life of the server this is: a RAM pool draws a new one each time it starts (its
    /// old chunks' data died with the old process); a file pool keeps 0, its data outliving
    /// the process. Chunks remember the incarnation they were reserved in.
    #[serde(default)]
    pub incarnation: u64,
    /// The key the server seals its pool's chunk grants under, hex (docs/RSTORE.md): the
    /// control plane mints a namespace's grants with it. Empty for a server whose pool takes
    /// no grants (anyone who reaches it may read and write it).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub grant_key: String,
}

impl ServerInfo {
    pub fn chunks(&self) -> u64 {
        self.bytes / self.chunk_bytes.max(1)
    }

    /// The grant of `chunk` at `generation`, read and write, if the server takes grants.
    pub fn grant(&self, chunk: u64, generation: u32) -> Result<Option<wire::Capability>, CoordError> {
        if self.grant_key.is_empty() {
            return Ok(None);
        }
        let key = decode_key(&self.grant_key).ok_or_else(|| {
            CoordError::Invalid(format!("server {}: its grant key is not 64 hex digits", self.id))
        })?;
        let rights = wire::CapRights::READ.union(wire::CapRights::WRITE);
        Ok(Some(proto::grant::seal(&key, chunk, self.chunk_bytes, generation, rights)))
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
    /// so no namespace gets them until their server has zeroed them ([`Coordinator::dirty`],
    /// [`Coordinator::cleaned`]).
    #[serde(default)]
    pub dirty: Vec<u64>,
    /// The chunk size the pool's chunks were numbered in: a server registering again must use
    /// the same, or chunk numbers held by namespaces would name other bytes.
    #[serde(default)]
    pub chunk_bytes: u64,
    /// The generation of each chunk zeroed at least once (the others are at 0): the server
    /// moves a chunk's generation on before zeroing it, which makes its last owner's grants
    /// stale, and records it here with [`Coordinator::cleaned`] for the next owner's.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub generations: BTreeMap<u64, u32>,
}

/// One chunk of a server's pool.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChunkRef {
    pub server: String,
    pub index: u64,
    /// The server's incarnation when the chunk was reserved.
    #[serde(default)]
    pub incarnation: u64,
    /// The chunk's generation when it was reserved: its grants are sealed with it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: u32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// A stripe: one chunk's worth of a namespace, on `replicas` distinct servers.
pub type Stripe = Vec<ChunkRef>;

/// An `raddress` segment's binding: its length and its stripes, in address order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub len: u64,
    pub stripes: Vec<Stripe>,
    /// Servers whose copies of this allocation may have missed writes: a client lost one of
    /// them while it had the allocation mapped. Their copies are not mapped again until
    /// repaired ([`Coordinator::mark_stale`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stale: Vec<String>,
}

impl Allocation {
    /// This allocation, at `addr` of namespace `ns` of `chunk_bytes` chunks, as the data
    /// path sees it.
    fn raddress(&self, ns: &str, addr: u64, chunk_bytes: u64) -> RAddress {
        RAddress {
            ns: ns.to_owned(),
            addr,
            len: self.len,
            chunk_bytes,
            stripes: self.stripes.clone(),
            stale: self.stale.clone(),
        }
    }
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

/// An allocated segment, resolved for the data path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RAddress {
    pub ns: String,
    pub addr: u64,
    pub len: u64,
    pub chunk_bytes: u64,
    pub stripes: Vec<Stripe>,
    /// Servers whose copies are stale ([`Allocation::stale`]).
    pub stale: Vec<String>,
}

/// Where one copy of a chunk lives, for the data path: the server's endpoint, its pool
/// export, the chunk's byte offset in it, and its grant (for a server that takes grants).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Place {
    pub endpoint: String,
    pub export: String,
    pub offset: u64,
    #[serde(skip)]
    pub grant: Option<wire::Capability>,
}

impl RAddress {
    /// Every stripe's copies, placed on the servers registered in `live` (RStore's `map`,
    /// the control-plane half). A copy whose server is not live, lives in another
    /// incarnation, or is stale, is left out; a stripe left with none is an error.
    pub fn places(&self, live: &[ServerInfo]) -> Result<Vec<Vec<Place>>, CoordError> {
        self.stripes
            .iter()
            .enumerate()
            .map(|(i, stripe)| {
                let mut copies = Vec::with_capacity(stripe.len());
                for c in stripe.iter().filter(|c| !self.stale.contains(&c.server)) {
                    let Some(s) = live.iter().find(|s| s.id == c.server && s.incarnation == c.incarnation)
                    else {
                        continue;
                    };
                    copies.push(Place {
                        endpoint: s.endpoint.clone(),
                        export: s.export.clone(),
                        offset: c.index * self.chunk_bytes,
                        grant: s.grant(c.index, c.generation)?,
                    });
                }
                if copies.is_empty() {
                    Err(CoordError::Invalid(format!(
                        "stripe {i} of {:#x} in {:?} is lost: no copy on a live server",
                        self.addr, self.ns
                    )))
                } else {
                    Ok(copies)
                }
            })
            .collect()
    }
}

/// A segment resolved for the data path: an allocation's live copies as lane locations.
pub fn segment_map(r: &RAddress, live: &[ServerInfo]) -> Result<initiator::SegmentMap, CoordError> {
    let mut stripes = Vec::with_capacity(r.stripes.len());
    for copies in r.places(live)? {
        let mut locs = Vec::with_capacity(copies.len());
        for p in copies {
            let endpoint = initiator::Endpoint::parse(&p.endpoint)
                .map_err(|e| CoordError::Invalid(format!("server endpoint {:?}: {e}", p.endpoint)))?;
            locs.push(initiator::Location { endpoint, export: p.export, offset: p.offset, grant: p.grant });
        }
        stripes.push(locs);
    }
    Ok(initiator::SegmentMap { len: r.len, chunk_bytes: r.chunk_bytes, stripes })
}

/// A client of the control plane.
pub struct Coordinator {
    etcd: Etcd,
}

fn key(prefix: &str, name: &str) -> Vec<u8> {
    format!("{prefix}{name}").into_bytes()
}

fn decode<T: serde::de::DeserializeOwned>(kv: &Kv) -> Result<T, CoordError> {
    serde_json::from_slice(&kv.value).map_err(|e| CoordError::Corrupt {
        key: String::from_utf8_lossy(&kv.key).into_owned(),
        why: e.to_string(),
    })
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("control-plane records serialize")
}

/// Largest namespace record: etcd takes requests of 1.5 MiB at most, and a transaction
/// carries pool records beside it.
const NAMESPACE_RECORD_MAX: usize = 1 << 20;

/// A namespace's record, refused when it would not fit one etcd request.
fn encode_ns(ns: &Namespace) -> Result<Vec<u8>, CoordError> {
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
fn check_name(what: &str, name: &str) -> Result<(), CoordError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(CoordError::Invalid(format!("{what} {name:?}: use 1 to 128 letters, digits and -_.:")))
    }
}

impl Coordinator {
    /// The coordinator at `endpoints` (etcd client URLs, e.g. `http://127.0.0.1:2379`).
    pub fn connect(endpoints: &[String]) -> Coordinator {
        Coordinator { etcd: Etcd::new(endpoints, Duration::from_secs(5)) }
    }

    pub fn etcd(&self) -> &Etcd {
        &self.etcd
    }

    // ---- memory servers ----

    /// Register `server` under a lease of `ttl`; its pool record is created if it has none.
    /// The registration lasts while [`Registration::keep_alive`] is called within `ttl`.
    pub fn register(&self, server: &ServerInfo, ttl: Duration) -> Result<Registration, CoordError> {
        check_name("server id", &server.id)?;
        if server.chunk_bytes == 0 || server.chunks() == 0 {
            return Err(CoordError::Invalid(format!(
                "a pool of {} bytes holds no chunk of {} bytes",
                server.bytes, server.chunk_bytes
            )));
        }
        if server.chunks() > POOL_CHUNKS_MAX {
            return Err(CoordError::Invalid(format!(
                "a pool of {} bytes in chunks of {} bytes holds {} chunks, more than {POOL_CHUNKS_MAX}: use larger chunks",
                server.bytes,
                server.chunk_bytes,
                server.chunks()
            )));
        }
        let pool = key(POOLS, &server.id);
        let fresh = PoolState { chunk_bytes: server.chunk_bytes, ..PoolState::default() };
        let created = self.etcd.txn(
            &[Compare::Absent(pool.clone())],
            &[Op::Put { key: pool.clone(), value: encode(&fresh), lease: 0 }],
            &[],
        )?;
        if !created {
            // Registering again: the chunks handed out must still be these bytes.
            let kv = self.etcd.get(&pool)?.ok_or_else(|| CoordError::Contended(server.id.clone()))?;
            let state: PoolState = decode(&kv)?;
            if state.chunk_bytes != 0 && state.chunk_bytes != server.chunk_bytes {
                return Err(CoordError::Invalid(format!(
                    "server {}: its pool's chunks are {} bytes, not {}: register with the same --chunk, or delete {} by hand once no namespace holds its chunks",
                    server.id, state.chunk_bytes, server.chunk_bytes, String::from_utf8_lossy(&pool)
                )));
            }
            if state.next > server.chunks() {
                return Err(CoordError::Invalid(format!(
                    "server {}: namespaces hold chunks up to {} of its pool, which now has {}",
                    server.id,
                    state.next,
                    server.chunks()
                )));
            }
        }
        let lease = self.etcd.grant(ttl)?;
        self.etcd.put(&key(SERVERS, &server.id), &encode(server), lease)?;
        Ok(Registration { lease, ttl })
    }

    /// The servers registered now.
    pub fn servers(&self) -> Result<Vec<ServerInfo>, CoordError> {
        self.etcd.prefix(SERVERS.as_bytes())?.iter().map(decode).collect()
    }

    // ---- namespaces ----

    /// Create namespace `name` (nothing reserved yet). Fails if it exists: of two clients
    /// creating one name at once, exactly one succeeds.
    pub fn create_ns(
        &self,
        name: &str,
        scope: Scope,
        chunk_bytes: u64,
        replicas: u32,
    ) -> Result<Namespace, CoordError> {
        check_name("namespace", name)?;
        if chunk_bytes < 512 || !chunk_bytes.is_power_of_two() {
            return Err(CoordError::Invalid(format!(
                "chunk size {chunk_bytes}: use a power of two of 512 or more"
            )));
        }
        if replicas == 0 {
            return Err(CoordError::Invalid("replicas: at least 1".into()));
        }
        let ns = Namespace {
            name: name.to_owned(),
            scope,
            chunk_bytes,
            replicas,
            reserved: Vec::new(),
            allocs: BTreeMap::new(),
            next_addr: 0,
        };
        let k = key(NAMESPACES, name);
        let created = self.etcd.txn(
            &[Compare::Absent(k.clone())],
            &[Op::Put { key: k, value: encode(&ns), lease: 0 }],
            &[],
        )?;
        if created {
            Ok(ns)
        } else {
            Err(CoordError::Exists(name.to_owned()))
        }
    }

    /// Namespace `name` as it stands.
    pub fn join_ns(&self, name: &str) -> Result<Namespace, CoordError> {
        Ok(self.read_ns(name)?.0)
    }

    /// Every namespace.
    pub fn list_ns(&self) -> Result<Vec<Namespace>, CoordError> {
        self.etcd.prefix(NAMESPACES.as_bytes())?.iter().map(decode).collect()
    }

    fn read_ns(&self, name: &str) -> Result<(Namespace, i64), CoordError> {
        check_name("namespace", name)?;
        let kv =
            self.etcd.get(&key(NAMESPACES, name))?.ok_or_else(|| CoordError::NoNamespace(name.to_owned()))?;
        Ok((decode(&kv)?, kv.mod_revision))
    }

    /// Delete namespace `name`, giving every chunk it holds back to its server's pool.
    pub fn delete_ns(&self, name: &str) -> Result<(), CoordError> {
        self.retry(name, || {
            let (ns, rev) = self.read_ns(name)?;
            let stripes: Vec<Stripe> = ns
                .reserved
                .iter()
                .cloned()
                .chain(ns.allocs.values().flat_map(|a| a.stripes.iter().cloned()))
                .collect();
            let (mut compare, mut ops) = self.give_back(&stripes)?;
            compare.push(Compare::ModRevision(key(NAMESPACES, name), rev));
            ops.push(Op::Delete(key(NAMESPACES, name)));
            Ok(self.etcd.txn(&compare, &ops, &[])?.then_some(()))
        })
    }

    /// Reserve `bytes` more in namespace `name`: stripes of chunks taken from the pools of
    /// the live servers of its scope and chunk size, round robin (so consecutive stripes lie
    /// on different servers), each stripe's replicas on distinct servers.
    pub fn reserve(&self, name: &str, bytes: u64) -> Result<Namespace, CoordError> {
        self.retry(name, || {
            let (mut ns, rev) = self.read_ns(name)?;
            let want = bytes.div_ceil(ns.chunk_bytes);
            if (ns.stripes() as u64).saturating_add(want)
                > (NAMESPACE_CHUNKS_MAX as u64) / u64::from(ns.replicas)
            {
                return Err(CoordError::Invalid(format!(
                    "namespace {name:?} would hold more than {NAMESPACE_CHUNKS_MAX} chunks; use larger chunks"
                )));
            }
            let servers: Vec<ServerInfo> = self
                .servers()?
                .into_iter()
                .filter(|s| s.scope == ns.scope && s.chunk_bytes == ns.chunk_bytes)
                .collect();
            let mut pools: Vec<(ServerInfo, PoolState, Compare)> = Vec::new();
            for s in servers {
                let k = key(POOLS, &s.id);
                // A server without a pool record (deleted by hand) offers nothing until it
                // registers again: its chunk numbers may be held by namespaces.
                if let Some(kv) = self.etcd.get(&k)? {
                    pools.push((s, decode::<PoolState>(&kv)?, Compare::ModRevision(k, kv.mod_revision)));
                }
            }
            let before: Vec<PoolState> = pools.iter().map(|p| p.1.clone()).collect();
            let free = |p: &(ServerInfo, PoolState, Compare)| {
                p.1.free.len() as u64 + p.0.chunks().saturating_sub(p.1.next)
            };
            let have: u64 = pools.iter().map(free).sum();
            let zeroing: u64 = pools.iter().map(|p| p.1.dirty.len() as u64).sum();
            let no_capacity = || CoordError::NoCapacity {
                scope: ns.scope,
                chunk_bytes: ns.chunk_bytes,
                replicas: ns.replicas,
                want: want * u64::from(ns.replicas),
                have,
                zeroing,
            };
            if pools.len() < ns.replicas as usize {
                return Err(no_capacity());
            }
            // Round robin from where the namespace's last stripe ended.
            let mut cursor = ns.stripes();
            for _ in 0..want {
                let mut stripe = Vec::with_capacity(ns.replicas as usize);
                let mut tried = 0;
                while stripe.len() < ns.replicas as usize && tried < pools.len() {
                    let i = cursor % pools.len();
                    cursor += 1;
                    tried += 1;
                    let (s, state, _) = &mut pools[i];
                    let index = if let Some(c) = state.free.pop() {
                        c
                    } else if state.next < s.chunks() {
                        state.next += 1;
                        state.next - 1
                    } else {
                        continue;
                    };
                    let generation = state.generations.get(&index).copied().unwrap_or(0);
                    stripe.push(ChunkRef {
                        server: s.id.clone(),
                        index,
                        incarnation: s.incarnation,
                        generation,
                    });
                }
                if stripe.len() < ns.replicas as usize {
                    return Err(no_capacity());
                }
                ns.reserved.push(stripe);
            }
            let record = encode_ns(&ns)?;
            let mut compare = vec![Compare::ModRevision(key(NAMESPACES, name), rev)];
            let mut ops = vec![Op::Put { key: key(NAMESPACES, name), value: record, lease: 0 }];
            // Only the pools chunks came from: fewer operations, and no conflict with a
            // reserve that took from the others.
            for ((s, state, cmp), was) in pools.into_iter().zip(before) {
                if state != was {
                    compare.push(cmp);
                    ops.push(Op::Put { key: key(POOLS, &s.id), value: encode(&state), lease: 0 });
                }
            }
            Ok(self.etcd.txn(&compare, &ops, &[])?.then_some(ns))
        })
    }

    /// Give up to `bytes` of namespace `name`'s unallocated reserve back to the pools.
    pub fn release(&self, name: &str, bytes: u64) -> Result<Namespace, CoordError> {
        self.retry(name, || {
            let (mut ns, rev) = self.read_ns(name)?;
            let n = (bytes / ns.chunk_bytes).min(ns.reserved.len() as u64) as usize;
            let back: Vec<Stripe> = ns.reserved.split_off(ns.reserved.len() - n);
            let (mut compare, mut ops) = self.give_back(&back)?;
            compare.push(Compare::ModRevision(key(NAMESPACES, name), rev));
            ops.push(Op::Put { key: key(NAMESPACES, name), value: encode(&ns), lease: 0 });
            Ok(self.etcd.txn(&compare, &ops, &[])?.then_some(ns))
        })
    }

    /// Bind `len` bytes of namespace `name`'s reserve to an address: `at`, or after the last
    /// allocation. Atomic: of clients racing to allocate one address (RStore's bootstrap
    /// address, 0), exactly one succeeds and the others get [`CoordError::AddressTaken`].
    pub fn alloc(&self, name: &str, len: u64, at: Option<u64>) -> Result<RAddress, CoordError> {
        if len == 0 {
            return Err(CoordError::Invalid("an allocation of 0 bytes".into()));
        }
        self.change_ns(name, |ns| {
            let chunk = ns.chunk_bytes;
            let want = len.div_ceil(chunk);
            let addr = match at {
                Some(a) if a % chunk != 0 => {
                    return Err(CoordError::Invalid(format!(
                        "address {a:#x} is not a multiple of the chunk size {chunk}"
                    )))
                }
                Some(a) => a,
                None => ns.next_addr,
            };
            let end = want
                .checked_mul(chunk)
                .and_then(|bytes| addr.checked_add(bytes))
                .ok_or_else(|| CoordError::Invalid("address overflows".into()))?;
            if let Some((&other, _)) = ns
                .allocs
                .range(..end)
                .next_back()
                .filter(|(&a, al)| a + al.stripes.len() as u64 * chunk > addr)
            {
                return Err(CoordError::AddressTaken { ns: name.to_owned(), addr, other });
            }
            if (ns.reserved.len() as u64) < want {
                return Err(CoordError::NotReserved {
                    ns: name.to_owned(),
                    want,
                    have: ns.reserved.len() as u64,
                });
            }
            let stripes: Vec<Stripe> = ns.reserved.drain(..want as usize).collect();
            let a = Allocation { len, stripes, stale: Vec::new() };
            let r = a.raddress(name, addr, chunk);
            ns.allocs.insert(addr, a);
            ns.next_addr = ns.next_addr.max(end);
            Ok((r, true))
        })
    }

    /// RStore's `init` and `map` together: the allocation at `addr` of namespace `name`,
    /// resolved to its live copies and mapped with a lane to each of their servers.
    pub fn map(
        &self,
        name: &str,
        addr: u64,
        config: &initiator::LaneConfig,
    ) -> Result<initiator::Segment, Box<dyn std::error::Error + Send + Sync>> {
        let live = self.servers()?;
        let map = segment_map(&self.lookup(name, addr)?, &live)?;
        let mut segment = initiator::Segment::map(map, config)?;
        self.mark_stale_on_failure(&mut segment, name, addr, live);
        Ok(segment)
    }

    /// Have `segment` (the allocation at `addr` of namespace `name`, mapped over the servers
    /// `live`) mark the copies of each server it loses stale: such a server may miss writes
    /// from then on, and nobody should map its copies again. A blocking etcd call, on the
    /// failure path only.
    fn mark_stale_on_failure(
        &self,
        segment: &mut initiator::Segment,
        name: &str,
        addr: u64,
        live: Vec<ServerInfo>,
    ) {
        let (endpoints, ns) = (self.etcd.endpoints().to_vec(), name.to_owned());
        segment.on_server_failed(move |endpoint: &str| {
            let Some(id) = live.iter().find(|s| s.endpoint == endpoint).map(|s| s.id.clone()) else { return };
            if let Err(e) = Coordinator::connect(&endpoints).mark_stale(&ns, addr, &id) {
                tracing::warn!(server = %id, error = %e, "cannot mark a lost server's copies stale");
            }
        });
    }

    /// Mark server `id`'s copies of the allocation at `addr` stale: they may have missed
    /// writes, and are not mapped again. Not done when a stripe of the allocation would have
    /// no other copy left (with one replica the lost server's copy is the only data there is).
    pub fn mark_stale(&self, name: &str, addr: u64, id: &str) -> Result<(), CoordError> {
        self.change_ns(name, |ns| {
            let Some(a) = ns.allocs.get_mut(&addr) else { return Ok(((), false)) };
            let held = |st: &&Stripe| st.iter().any(|c| c.server == id);
            let others_left = a
                .stripes
                .iter()
                .filter(held)
                .all(|st| st.iter().any(|c| c.server != id && !a.stale.contains(&c.server)));
            if a.stale.iter().any(|s| s == id) || !others_left {
                return Ok(((), false));
            }
            a.stale.push(id.to_owned());
            Ok(((), true))
        })
    }

    /// The allocation at `addr` of namespace `name` (RStore's `init`).
    pub fn lookup(&self, name: &str, addr: u64) -> Result<RAddress, CoordError> {
        let ns = self.join_ns(name)?;
        let a = ns.allocs.get(&addr).ok_or(CoordError::NoAllocation { ns: name.to_owned(), addr })?;
        Ok(a.raddress(name, addr, ns.chunk_bytes))
    }

    /// Unbind the allocation at `addr`: its chunks return to the namespace's reserve.
    pub fn free(&self, name: &str, addr: u64) -> Result<(), CoordError> {
        self.change_ns(name, |ns| {
            let a = ns.allocs.remove(&addr).ok_or(CoordError::NoAllocation { ns: name.to_owned(), addr })?;
            ns.reserved.extend(a.stripes);
            Ok(((), true))
        })
    }

    /// Change namespace `name`'s record and nothing else: `change` edits the record read and
    /// returns its result, with whether the record is to be written. The write is one
    /// transaction on the revision read, redone from a fresh read when another client changed
    /// the namespace first.
    fn change_ns<T>(
        &self,
        name: &str,
        mut change: impl FnMut(&mut Namespace) -> Result<(T, bool), CoordError>,
    ) -> Result<T, CoordError> {
        self.retry(name, || {
            let (mut ns, rev) = self.read_ns(name)?;
            let (result, write) = change(&mut ns)?;
            if !write {
                return Ok(Some(result));
            }
            // Through the record bound, as `reserve`: an alloc or a stale mark adds a little.
            let ok = self.etcd.txn(
                &[Compare::ModRevision(key(NAMESPACES, name), rev)],
                &[Op::Put { key: key(NAMESPACES, name), value: encode_ns(&ns)?, lease: 0 }],
                &[],
            )?;
            Ok(ok.then_some(result))
        })
    }

    /// The comparisons and writes that give `stripes`' chunks back to their pools.
    fn give_back(&self, stripes: &[Stripe]) -> Result<(Vec<Compare>, Vec<Op>), CoordError> {
        let mut by_server: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
        for c in stripes.iter().flatten() {
            by_server.entry(&c.server).or_default().push(c.index);
        }
        let (mut compare, mut ops) = (Vec::new(), Vec::new());
        for (server, chunks) in by_server {
            let k = key(POOLS, server);
            // A pool deleted by hand takes nothing back.
            let Some(kv) = self.etcd.get(&k)? else { continue };
            let mut state: PoolState = decode(&kv)?;
            state.dirty.extend(chunks);
            compare.push(Compare::ModRevision(k.clone(), kv.mod_revision));
            ops.push(Op::Put { key: k, value: encode(&state), lease: 0 });
        }
        Ok((compare, ops))
    }

    /// The pool record of server `id`, if it has one.
    pub fn pool(&self, id: &str) -> Result<Option<PoolState>, CoordError> {
        check_name("server id", id)?;
        self.etcd.get(&key(POOLS, id))?.as_ref().map(decode).transpose()
    }

    /// The chunks of server `id`'s pool waiting to be zeroed before they are handed out again.
    pub fn dirty(&self, id: &str) -> Result<Vec<u64>, CoordError> {
        Ok(self.pool(id)?.map(|p| p.dirty).unwrap_or_default())
    }

    /// Server `id` has zeroed `chunks`, each moved on to the generation given: they are free
    /// to hand out, and their next owners' grants carry those generations.
    pub fn cleaned(&self, id: &str, chunks: &[(u64, u32)]) -> Result<(), CoordError> {
        self.retry(id, || {
            let k = key(POOLS, id);
            let Some(kv) = self.etcd.get(&k)? else { return Ok(Some(())) };
            let mut state: PoolState = decode(&kv)?;
            let zeroed = |c: &u64| chunks.iter().any(|(z, _)| z == c);
            let clean: Vec<u64> = state.dirty.iter().copied().filter(zeroed).collect();
            state.dirty.retain(|c| !zeroed(c));
            for &(chunk, generation) in chunks {
                if clean.contains(&chunk) {
                    state.generations.insert(chunk, generation);
                }
            }
            state.free.extend(clean);
            let ok = self.etcd.txn(
                &[Compare::ModRevision(k.clone(), kv.mod_revision)],
                &[Op::Put { key: k, value: encode(&state), lease: 0 }],
                &[],
            )?;
            Ok(ok.then_some(()))
        })
    }

    /// Run `attempt` until its transaction goes through (`Some`), another client's change
    /// having made it fail (`None`) at most [`TXN_RETRIES`] times.
    fn retry<T>(
        &self,
        what: &str,
        mut attempt: impl FnMut() -> Result<Option<T>, CoordError>,
    ) -> Result<T, CoordError> {
        for _ in 0..TXN_RETRIES {
            if let Some(done) = attempt()? {
                return Ok(done);
            }
        }
        Err(CoordError::Contended(what.to_owned()))
    }
}

/// A server's registration: renew it within its TTL, or it lapses and the server's chunks are
/// lost to the namespaces that hold them.
#[derive(Debug)]
pub struct Registration {
    lease: i64,
    ttl: Duration,
}

impl Registration {
    pub fn lease(&self) -> i64 {
        self.lease
    }

    /// How often to renew: a third of the TTL.
    pub fn interval(&self) -> Duration {
        self.ttl / 3
    }

    /// Renew; `false` when the lease had already expired (the server must register again).
    pub fn keep_alive(&self, coord: &Coordinator) -> Result<bool, CoordError> {
        Ok(coord.etcd.keep_alive(self.lease)?)
    }

    /// End the registration now (a clean shutdown).
    pub fn revoke(self, coord: &Coordinator) -> Result<(), CoordError> {
        Ok(coord.etcd.revoke(self.lease)?)
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
        };
        let grant = s.grant(2, 5).unwrap().expect("a server with a key");
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
        let stripe =
            |i: u64| vec![ChunkRef { server: "s".repeat(200), index: i, incarnation: 1, generation: 0 }];
        let mut ns = Namespace {
            name: "big".into(),
            scope: Scope::Ram,
            chunk_bytes: 1 << 20,
            replicas: 1,
            reserved: Vec::new(),
            allocs: BTreeMap::new(),
            next_addr: 0,
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
        let stale = "t".repeat(64 * 1024);
        ns.allocs.insert(0, Allocation { len: 1 << 20, stripes: vec![stripe(0)], stale: vec![stale] });
        let err = encode_ns(&ns).expect_err("over the bound");
        assert!(err.to_string().contains("\"big\"") && err.to_string().contains("larger chunks"), "{err}");
    }
}
