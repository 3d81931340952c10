//! RStore's control path on etcd (Trivedi's thesis, chapter 6; docs/RSTORE.md): the
//! [`Coordinator`] and what it hands the data path.
//!
//! Memory servers (ordinary `skiff serve` processes with `--pool`) donate RAM or a file as a
//! pool of chunks and keep a registration alive under an etcd lease. Namespaces, the chunks
//! they reserved and the `raddress` segments allocated in them live in etcd as JSON values
//! split so that each stays small at any size (`coord::schema` says where and how): a pool is
//! a head and extents of 1,024 chunks, a namespace a head, a record per allocation naming
//! slots of its stripe table, and groups of 256 stripes. Every change is one etcd transaction
//! that checks the revisions it read, so two clients racing for the same thing (a namespace
//! name, the bootstrap address) see exactly one win; what touches many groups (a large
//! reserve, a release, a delete) goes a group at a time, each step whole. This is the slow path: it runs when a client sets up, never
//! per I/O. A mapped `raddress` says, for every chunk, which server (endpoint, export) holds it
//! at which offset, and the data path ([`Segment`]) goes there directly.
//!
//! The etcd client and the records are `coord`'s; this module owns the operations on them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use coord::etcd::{Compare, Etcd, Op, Tls};
use coord::schema::{
    add_run, alloc_addr, alloc_key, check_name, check_runs, decode, encode, extent_chunks, extent_key,
    generations_key, group_index, group_key, group_of, intersect, key, mend_key, remove_run, run_len,
    take_runs, under, ALLOCS, EXTENT_CHUNKS, GROUPS, GROUP_STRIPES, MENDING, NAMESPACES, POOLS,
    POOL_GENERATIONS, SERVERS, TXN_RETRIES,
};
use coord::{
    AllocRecord, Allocation, ChunkRef, CoordError, CopyState, Extent, Generations, Namespace, NsHead,
    PoolHead, Run, Scope, ServerInfo, Stripe, StripeGroup, POOL_CHUNKS_MAX,
};
use serde::Serialize;

use crate::connections::Connections;
use crate::repair;
use crate::segment::{Location, MapSource, Segment, SegmentMap, SourceError};

/// An allocated segment, resolved for the data path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RAddress {
    pub ns: String,
    pub addr: u64,
    pub len: u64,
    pub chunk_bytes: u64,
    /// Each stripe's copies, with where each stands ([`coord::CopyState`]).
    pub stripes: Vec<Stripe>,
}

/// Where one copy of a chunk lives, for the data path: the server's endpoint, its pool
/// export, the chunk's byte offset in it, its grant (for a server that takes grants), and
/// whether it is being repaired (written after the healthy copies, never read).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Place {
    pub endpoint: String,
    pub export: String,
    pub offset: u64,
    #[serde(skip)]
    pub grant: Option<wire::Capability>,
    pub syncing: bool,
}

impl RAddress {
    /// Every stripe's copies, placed on the servers registered in `live` (RStore's `map`,
    /// the control-plane half): the healthy copies and those being repaired, on live servers
    /// in the copy's incarnation; stale ones are left out, and a stripe with no healthy copy
    /// left is an error. Each copy's grant carries the stripe's epoch, and the healthy copies'
    /// carry the track right while the stripe is not whole.
    pub fn places(&self, live: &[ServerInfo]) -> Result<Vec<Vec<Place>>, CoordError> {
        self.stripes
            .iter()
            .enumerate()
            .map(|(i, stripe)| {
                let track = !repair::whole(stripe);
                let mut copies = Vec::with_capacity(stripe.len());
                for c in stripe.iter().filter(|c| c.state != CopyState::Stale) {
                    let Some(s) = repair::holder(live, c) else { continue };
                    let syncing = c.state == CopyState::Syncing;
                    copies.push(Place {
                        endpoint: s.endpoint.clone(),
                        export: s.export.clone(),
                        offset: c.index * self.chunk_bytes,
                        grant: s.grant_at(c.index, c.generation, c.epoch, track && !syncing)?,
                        syncing,
                    });
                }
                if copies.iter().all(|p| p.syncing) {
                    Err(CoordError::Invalid(format!(
                        "stripe {i} of {:#x} in {:?} is lost: no healthy copy on a live server",
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
pub fn segment_map(r: &RAddress, live: &[ServerInfo]) -> Result<SegmentMap, CoordError> {
    let mut stripes = Vec::with_capacity(r.stripes.len());
    for copies in r.places(live)? {
        let mut locs = Vec::with_capacity(copies.len());
        for p in copies {
            let endpoint = initiator::Endpoint::parse(&p.endpoint)
                .map_err(|e| CoordError::Invalid(format!("server endpoint {:?}: {e}", p.endpoint)))?;
            locs.push(Location {
                endpoint,
                export: p.export,
                offset: p.offset,
                grant: p.grant,
                syncing: p.syncing,
            });
        }
        stripes.push(locs);
    }
    Ok(SegmentMap { len: r.len, chunk_bytes: r.chunk_bytes, stripes })
}

/// A copy a source repaired: copy `copy` of the stripe in slot `slot`, under the stripe's
/// epoch `epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub slot: u64,
    pub copy: usize,
    pub epoch: u32,
}

/// The key the repair leader holds, under its registration's lease.
pub const LEADER: &str = "/skiff/repair/leader";

/// Where each source publishes its repair progress ([`repair::SourceProgress`]), under its
/// registration's lease.
pub const PROGRESS: &str = "/skiff/repair/progress/";

/// Unix time in milliseconds: when a copy went stale, for the grace period before a rebuild.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The control plane behind a segment mapped by [`Coordinator::map`]: it marks the copies of
/// servers the segment loses stale, and reads the allocation's map again.
struct Source {
    coord: Coordinator,
    ns: String,
    addr: u64,
    /// The servers registered when the map was last read: a lost endpoint's server id.
    live: Vec<ServerInfo>,
}

/// A control-plane error as a segment sees it: worth asking again when etcd could not be
/// reached (or contended), final otherwise.
fn source_error(e: CoordError) -> SourceError {
    let retry = matches!(e, CoordError::Etcd(_) | CoordError::Contended(_));
    SourceError { message: e.to_string(), retry }
}

impl MapSource for Source {
    fn lost(&mut self, endpoint: &str) -> Result<(), SourceError> {
        // The segment names a server by its parsed endpoint (`host` becomes `host:7070`).
        let named = |s: &&ServerInfo| {
            s.endpoint == endpoint
                || initiator::Endpoint::parse(&s.endpoint).is_ok_and(|e| e.to_string() == endpoint)
        };
        let Some(id) = self.live.iter().find(named).map(|s| s.id.clone()) else {
            tracing::warn!(server = %endpoint, "a lost server is not among those the map came from");
            return Ok(());
        };
        self.coord.maps.forget(&self.ns, Some(self.addr));
        self.coord.mark_stale(&self.ns, self.addr, &id).map_err(source_error)
    }

    fn map(&mut self) -> Result<SegmentMap, SourceError> {
        let (r, live, revs) = self.coord.resolve_at(&self.ns, self.addr).map_err(source_error)?;
        let map = segment_map(&r, &live).map_err(source_error)?;
        self.coord.maps.put(&self.ns, self.addr, revs, &map, &live);
        self.live = live;
        Ok(map)
    }
}

/// Allocations resolved for the data path, by namespace and address, shared by a coordinator
/// and every client made from it with [`Coordinator::again`] (RStore caches its maps, thesis
/// 6.3.2): a second [`Coordinator::map`] of one allocation reads the revisions of the
/// allocation's record and of its groups (keys only, no values), and reuses the map if none
/// changed since: the same allocation (not one freed and made again at the address), and no
/// copy's state or epoch moved on. So a cached map presents the same grants a fresh one would.
/// What it may miss is a server gone since (a fresh map would mark its copies stale first);
/// the segment finds that itself, reports it, and reads the map again, which refreshes the
/// cache.
#[derive(Clone, Default)]
struct MapCache(std::sync::Arc<std::sync::Mutex<BTreeMap<(String, u64), Cached>>>);

/// A cached map: the revisions it was read at, the map, and the servers registered then.
type Cached = (Revisions, SegmentMap, Vec<ServerInfo>);

/// The revisions of an allocation's record and of each of its groups, as a map was read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Revisions {
    alloc: i64,
    /// By group; a group this client changed while resolving is left out, and the map is not
    /// reused (its revision after the write is not known).
    groups: BTreeMap<u64, i64>,
    complete: bool,
}

/// Maps cached at most: the oldest addresses go first past it.
const MAPS_CACHED: usize = 1024;

impl MapCache {
    fn get(&self, ns: &str, addr: u64) -> Option<Cached> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).get(&(ns.to_owned(), addr)).cloned()
    }

    fn put(&self, ns: &str, addr: u64, revs: Revisions, map: &SegmentMap, live: &[ServerInfo]) {
        if !revs.complete {
            self.forget(ns, Some(addr));
            return;
        }
        let mut maps = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if maps.len() >= MAPS_CACHED {
            maps.pop_first();
        }
        maps.insert((ns.to_owned(), addr), (revs, map.clone(), live.to_vec()));
    }

    /// Forget namespace `ns`'s map at `addr`, or (`None`) all of its maps.
    fn forget(&self, ns: &str, addr: Option<u64>) {
        let mut maps = self.0.lock().unwrap_or_else(|p| p.into_inner());
        maps.retain(|(n, a), _| n != ns || addr.is_some_and(|addr| *a != addr));
    }
}

/// Servers one reserve step takes chunks from at most: with each server's pool head and an
/// extent or two it stays inside one transaction's operations.
const SERVERS_PER_STEP: usize = 32;

/// Stripe groups one reserve step fills at most.
const STEP_GROUPS: u64 = 4;

/// Pool records one transaction changes at most (heads and extents), beside the namespace's.
const POOL_OPS_MAX: usize = coord::schema::TXN_OPS_MAX - 2 - 2 * STEP_GROUPS as usize;

/// Whether copy `c` is mapped (not stale) though its server is not registered in its
/// incarnation: a map resolved now marks it stale first.
fn gone(live: &[ServerInfo], c: &ChunkRef) -> bool {
    c.state != CopyState::Stale && repair::holder(live, c).is_none()
}

/// A record read (with its revision), or `empty` at revision 0 when there is none.
fn or_empty<T: coord::schema::Record>(kv: Option<coord::etcd::Kv>, empty: T) -> Result<(T, i64), CoordError> {
    match kv {
        Some(kv) => Ok((decode(&kv)?, kv.mod_revision)),
        None => Ok((empty, 0)),
    }
}

/// The record `k` of `cache`, read from etcd at `etcd_key` the first time (empty when there is
/// none), and marked to be written if `write`.
fn cached<'c, T: coord::schema::Record + Default>(
    etcd: &Etcd,
    cache: &'c mut BTreeMap<(String, u64), (T, i64, bool)>,
    k: (String, u64),
    etcd_key: &[u8],
    write: bool,
) -> Result<&'c mut T, CoordError> {
    let entry = match cache.entry(k) {
        std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::btree_map::Entry::Vacant(v) => {
            v.insert(or_empty(etcd.get(etcd_key)?, T::default()).map(|(t, rev)| (t, rev, false))?)
        }
    };
    entry.2 |= write;
    Ok(&mut entry.0)
}

/// The pool records one transaction reads and changes: each server's head and the extents it
/// touches, with the revisions read (0: no record), so the transaction goes through only if
/// nobody changed them meanwhile.
struct Pools<'a> {
    etcd: &'a Etcd,
    heads: BTreeMap<String, (Option<PoolHead>, i64, bool)>,
    extents: BTreeMap<(String, u64), (Extent, i64, bool)>,
    /// Read with their extents; written (`true`) only when chunks are zeroed.
    generations: BTreeMap<(String, u64), (Generations, i64, bool)>,
}

impl<'a> Pools<'a> {
    fn new(etcd: &'a Etcd) -> Pools<'a> {
        Pools { etcd, heads: BTreeMap::new(), extents: BTreeMap::new(), generations: BTreeMap::new() }
    }

    /// Server `id`'s head as already read elsewhere (one range read for many servers).
    fn preload(&mut self, id: &str, head: PoolHead, rev: i64) {
        self.heads.entry(id.to_owned()).or_insert((Some(head), rev, false));
    }

    /// Read the heads of `ids` and the extents `extents` not read yet, in one round trip.
    fn prefetch(&mut self, ids: &[&str], extents: &[(&str, u64)]) -> Result<(), CoordError> {
        let ids: Vec<&str> = ids.iter().copied().filter(|id| !self.heads.contains_key(*id)).collect();
        let extents: Vec<(&str, u64)> = extents
            .iter()
            .copied()
            .filter(|(id, e)| !self.extents.contains_key(&((*id).to_owned(), *e)))
            .collect();
        let mut keys: Vec<Vec<u8>> = ids.iter().map(|id| key(POOLS, id)).collect();
        keys.extend(extents.iter().map(|(id, e)| extent_key(id, *e)));
        keys.extend(extents.iter().map(|(id, e)| generations_key(id, *e)));
        let mut read = self.etcd.get_many(&keys)?.into_iter();
        for id in ids {
            let head = match read.next().flatten() {
                Some(kv) => (Some(decode(&kv)?), kv.mod_revision, false),
                None => (None, 0, false),
            };
            self.heads.insert(id.to_owned(), head);
        }
        for &(id, e) in &extents {
            let extent =
                or_empty(read.next().flatten(), Extent::default()).map(|(v, rev)| (v, rev, false))?;
            self.extents.insert((id.to_owned(), e), extent);
        }
        for (id, e) in extents {
            let generations =
                or_empty(read.next().flatten(), Generations::default()).map(|(v, rev)| (v, rev, false))?;
            self.generations.entry((id.to_owned(), e)).or_insert(generations);
        }
        Ok(())
    }

    /// The generations of extent `e` of server `id`'s pool, to be written (`write`) or only
    /// read (the extent's revision guards them: they change only with it).
    fn generations(&mut self, id: &str, e: u64, write: bool) -> Result<&mut Generations, CoordError> {
        cached(self.etcd, &mut self.generations, (id.to_owned(), e), &generations_key(id, e), write)
    }

    /// Server `id`'s pool head, `None` when it has none (deleted by hand).
    fn head(&mut self, id: &str) -> Result<Option<&mut PoolHead>, CoordError> {
        if !self.heads.contains_key(id) {
            let read = match self.etcd.get(&key(POOLS, id))? {
                Some(kv) => (Some(decode(&kv)?), kv.mod_revision, false),
                None => (None, 0, false),
            };
            self.heads.insert(id.to_owned(), read);
        }
        let (head, _, changed) = self.heads.get_mut(id).expect("read above");
        *changed = true;
        Ok(head.as_mut())
    }

    fn extent(&mut self, id: &str, e: u64) -> Result<&mut Extent, CoordError> {
        cached(self.etcd, &mut self.extents, (id.to_owned(), e), &extent_key(id, e), true)
    }

    /// A free chunk of server `s`'s pool, now in use: the lowest free one. `None` when the
    /// pool is full (or has no record).
    fn take(&mut self, s: &ServerInfo) -> Result<Option<ChunkRef>, CoordError> {
        let Some(head) = self.head(&s.id)? else { return Ok(None) };
        if head.free == 0 {
            return Ok(None);
        }
        let chunks = head.chunks;
        // The lowest extent the head shows with a free chunk, a word at a time.
        while let Some(e) = self.head(&s.id)?.expect("read above").with_free.first() {
            let extent = self.extent(&s.id, e)?;
            let found = extent.first_free(extent_chunks(e, chunks));
            let more = found.is_some_and(|c| extent.any_free(c + 1, extent_chunks(e, chunks).end));
            if let Some(c) = found {
                extent.used.set(c % EXTENT_CHUNKS, true);
                let generation = self.generations(&s.id, e, false)?.get(c);
                let head = self.head(&s.id)?.expect("read above");
                head.free -= 1;
                head.with_free.set(e, more);
                return Ok(Some(ChunkRef::new(&s.id, c, s.incarnation, generation)));
            }
            // The bit was out of date: the extent has no free chunk.
            self.head(&s.id)?.expect("read above").with_free.set(e, false);
        }
        Ok(None)
    }

    /// Chunk `c`, taken by this transaction and not used after all, is free again.
    fn untake(&mut self, c: &ChunkRef) -> Result<(), CoordError> {
        let e = c.index / EXTENT_CHUNKS;
        self.extent(&c.server, e)?.used.set(c.index % EXTENT_CHUNKS, false);
        if let Some(head) = self.head(&c.server)? {
            head.free += 1;
            head.with_free.set(e, true);
        }
        Ok(())
    }

    /// Chunk `c` is given back: dirty until its server has zeroed it.
    fn give_back(&mut self, c: &ChunkRef) -> Result<(), CoordError> {
        if self.head(&c.server)?.is_none() {
            return Ok(()); // a pool deleted by hand takes nothing back
        }
        let e = c.index / EXTENT_CHUNKS;
        let extent = self.extent(&c.server, e)?;
        let i = c.index % EXTENT_CHUNKS;
        if !extent.used.get(i) {
            tracing::warn!(server = %c.server, chunk = c.index, "a chunk given back was not in use; left as it is");
            return Ok(());
        }
        extent.used.set(i, false);
        extent.dirty.set(i, true);
        let head = self.head(&c.server)?.expect("read above");
        head.dirty += 1;
        head.with_dirty.set(e, true);
        Ok(())
    }

    /// Records changed so far.
    fn changed(&self) -> usize {
        self.heads.values().filter(|h| h.2).count()
            + self.extents.values().filter(|x| x.2).count()
            + self.generations.values().filter(|x| x.2).count()
    }

    /// The comparisons and writes of the records changed.
    fn into_txn(self, compare: &mut Vec<Compare>, ops: &mut Vec<Op>) {
        for (id, (head, rev, changed)) in self.heads {
            if let (Some(head), true) = (head, changed) {
                compare.push(Compare::ModRevision(key(POOLS, &id), rev));
                ops.push(Op::Put { key: key(POOLS, &id), value: encode(&head), lease: 0 });
            }
        }
        for ((id, e), (extent, rev, changed)) in self.extents {
            if changed {
                compare.push(Compare::ModRevision(extent_key(&id, e), rev));
                ops.push(Op::Put { key: extent_key(&id, e), value: encode(&extent), lease: 0 });
            }
        }
        for ((id, e), (generations, rev, changed)) in self.generations {
            if changed {
                compare.push(Compare::ModRevision(generations_key(&id, e), rev));
                ops.push(Op::Put { key: generations_key(&id, e), value: encode(&generations), lease: 0 });
            }
        }
    }
}

/// A group's comparison and writes: the group (deleted once empty) and its mark in the repair
/// index (there while a copy is not `ok`).
fn group_txn(
    name: &str,
    g: u64,
    group: &StripeGroup,
    rev: i64,
    compare: &mut Vec<Compare>,
    ops: &mut Vec<Op>,
) {
    compare.push(Compare::ModRevision(group_key(name, g), rev));
    if group.is_empty() {
        ops.push(Op::Delete(group_key(name, g)));
    } else {
        ops.push(Op::Put { key: group_key(name, g), value: encode(group), lease: 0 });
    }
    if group.whole() {
        ops.push(Op::Delete(mend_key(name, g)));
    } else {
        ops.push(Op::Put { key: mend_key(name, g), value: Vec::new(), lease: 0 });
    }
}

/// Each group the slots of `runs` lie in, with those slots.
fn by_group(runs: &[Run]) -> BTreeMap<u64, Vec<u64>> {
    let mut groups: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for slot in coord::schema::slots(runs) {
        groups.entry(group_of(slot)).or_default().push(slot);
    }
    groups
}

/// What a reserve step starts from: the namespace's head and its revision, the pools' heads
/// (with revisions), and the live servers of the namespace's scope.
struct Read {
    head: NsHead,
    rev: i64,
    pools: BTreeMap<String, (PoolHead, i64)>,
    servers: Vec<ServerInfo>,
}

/// A client of the control plane.
pub struct Coordinator {
    etcd: Etcd,
    maps: MapCache,
    connections: Connections,
}

impl Coordinator {
    /// The coordinator at `endpoints` (etcd client URLs, e.g. `http://127.0.0.1:2379`).
    pub fn connect(endpoints: &[String]) -> Coordinator {
        Coordinator {
            etcd: Etcd::new(endpoints, Duration::from_secs(5)),
            maps: MapCache::default(),
            connections: Connections::new(),
        }
    }

    /// The coordinator at `endpoints`, reaching `https://` members with `tls` (the CA of their
    /// certificates, and a client certificate for members that ask for one). Fails when the
    /// PEM files cannot be read.
    pub fn connect_with(endpoints: &[String], tls: Option<Tls>) -> Result<Coordinator, CoordError> {
        let etcd = Etcd::with_tls(endpoints, Duration::from_secs(5), tls).map_err(CoordError::Invalid)?;
        Ok(Coordinator { etcd, maps: MapCache::default(), connections: Connections::new() })
    }

    /// Another client of the same coordinator, reached the same way (for a thread of its own),
    /// sharing this one's cached maps and kept connections.
    pub fn again(&self) -> Coordinator {
        Coordinator {
            etcd: self.etcd.again(),
            maps: self.maps.clone(),
            connections: self.connections.clone(),
        }
    }

    /// The connections the segments this coordinator maps take their lanes from, and leave
    /// them to when unmapped (`crate::connections`).
    pub fn connections(&self) -> &Connections {
        &self.connections
    }

    pub fn etcd(&self) -> &Etcd {
        &self.etcd
    }

    // ---- memory servers ----

    /// Register `server` under a lease of `ttl`; its pool head is created if it has none, and
    /// grown if the pool grew. The registration lasts while [`Registration::keep_alive`] is
    /// called within `ttl`.
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
        let k = key(POOLS, &server.id);
        self.retry(&server.id, || {
            let Some(kv) = self.etcd.get(&k)? else {
                let fresh = PoolHead::new(server.chunk_bytes, server.chunks());
                let put = Op::Put { key: k.clone(), value: encode(&fresh), lease: 0 };
                return Ok(self.etcd.txn(&[Compare::Absent(k.clone())], &[put], &[])?.then_some(()));
            };
            // Registering again: the chunks handed out must still be these bytes.
            let mut head: PoolHead = decode(&kv)?;
            if head.chunk_bytes != server.chunk_bytes {
                return Err(CoordError::Invalid(format!(
                    "server {}: its pool's chunks are {} bytes, not {}: register with the same --chunk, or delete {} by hand once no namespace holds its chunks",
                    server.id, head.chunk_bytes, server.chunk_bytes, String::from_utf8_lossy(&k)
                )));
            }
            let chunks = server.chunks();
            if chunks == head.chunks {
                return Ok(Some(()));
            }
            if chunks < head.chunks {
                // Smaller: only if no chunk past the new end is held or waits to be zeroed.
                for e in head.extents_from(chunks) {
                    let Some(kv) = self.etcd.get(&extent_key(&server.id, e))? else { continue };
                    let extent: Extent = decode(&kv)?;
                    if let Some(c) = extent_chunks(e, head.chunks).find(|&c| c >= chunks && !extent.is_free(c)) {
                        return Err(CoordError::Invalid(format!(
                            "server {}: namespaces hold chunk {c} of its pool (or it waits to be zeroed), which now has {chunks}",
                            server.id
                        )));
                    }
                }
                head.free -= head.chunks - chunks;
                for e in chunks.div_ceil(EXTENT_CHUNKS)..head.chunks.div_ceil(EXTENT_CHUNKS) {
                    head.with_free.set(e, false);
                }
                head.chunks = chunks;
            } else {
                head.grow(chunks);
            }
            let put = Op::Put { key: k.clone(), value: encode(&head), lease: 0 };
            Ok(self.etcd.txn(&[Compare::ModRevision(k.clone(), kv.mod_revision)], &[put], &[])?.then_some(()))
        })?;
        let lease = self.etcd.grant(ttl)?;
        self.etcd.put(&key(SERVERS, &server.id), &encode(server), lease)?;
        Ok(Registration { lease, ttl })
    }

    /// The servers registered now.
    pub fn servers(&self) -> Result<Vec<ServerInfo>, CoordError> {
        self.etcd.prefix(SERVERS.as_bytes())?.iter().map(decode).collect()
    }

    /// Every pool head, by server id, with its revision.
    fn pool_heads(&self) -> Result<BTreeMap<String, (PoolHead, i64)>, CoordError> {
        let mut heads = BTreeMap::new();
        for kv in self.etcd.prefix(POOLS.as_bytes())? {
            let id = String::from_utf8_lossy(&kv.key[POOLS.len()..]).into_owned();
            heads.insert(id, (decode(&kv)?, kv.mod_revision));
        }
        Ok(heads)
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
    ) -> Result<NsHead, CoordError> {
        check_name("namespace", name)?;
        if chunk_bytes < 512 || !chunk_bytes.is_power_of_two() {
            return Err(CoordError::Invalid(format!(
                "chunk size {chunk_bytes}: use a power of two of 512 or more"
            )));
        }
        if replicas == 0 {
            return Err(CoordError::Invalid("replicas: at least 1".into()));
        }
        let head = NsHead {
            name: name.to_owned(),
            scope,
            chunk_bytes,
            replicas,
            next_addr: 0,
            slots: 0,
            reserved: Vec::new(),
            allocs: 0,
            deleting: false,
        };
        let k = key(NAMESPACES, name);
        let created = self.etcd.txn(
            &[Compare::Absent(k.clone())],
            &[Op::Put { key: k, value: encode(&head), lease: 0 }],
            &[],
        )?;
        if created {
            Ok(head)
        } else {
            Err(CoordError::Exists(name.to_owned()))
        }
    }

    /// Namespace `name` as it stands, read whole: its head, its allocations and every stripe
    /// (for `skiff ns`, status and tests; the data path reads only what it maps).
    pub fn join_ns(&self, name: &str) -> Result<Namespace, CoordError> {
        let (head, _) = self.read_head(name)?;
        let mut groups: BTreeMap<u64, StripeGroup> = BTreeMap::new();
        for kv in self.etcd.prefix(&under(GROUPS, name))? {
            let g = group_index(&kv.key).ok_or_else(|| CoordError::Corrupt {
                key: String::from_utf8_lossy(&kv.key).into_owned(),
                why: "not a group's key".into(),
            })?;
            groups.insert(g, decode(&kv)?);
        }
        let stripe = |slot: u64| -> Stripe {
            groups.get(&group_of(slot)).and_then(|g| g.get(slot)).cloned().unwrap_or_default()
        };
        let mut allocs = BTreeMap::new();
        for (addr, a) in self.alloc_records(name)? {
            allocs.insert(
                addr,
                Allocation { len: a.len, stripes: coord::schema::slots(&a.runs).map(stripe).collect() },
            );
        }
        Ok(Namespace {
            name: head.name.clone(),
            scope: head.scope,
            chunk_bytes: head.chunk_bytes,
            replicas: head.replicas,
            reserved: coord::schema::slots(&head.reserved).map(stripe).collect(),
            allocs,
            next_addr: head.next_addr,
            epoch: groups.values().map(|g| g.epoch).max().unwrap_or(0),
        })
    }

    /// Namespace `name`'s head.
    pub fn head(&self, name: &str) -> Result<NsHead, CoordError> {
        Ok(self.read_head(name)?.0)
    }

    /// Every namespace's head (those being deleted left out).
    pub fn list_ns(&self) -> Result<Vec<NsHead>, CoordError> {
        let heads: Vec<NsHead> =
            self.etcd.prefix(NAMESPACES.as_bytes())?.iter().map(decode).collect::<Result<_, _>>()?;
        Ok(heads.into_iter().filter(|h| !h.deleting).collect())
    }

    /// Namespace `name`'s head and its revision; one being deleted is refused.
    fn read_head(&self, name: &str) -> Result<(NsHead, i64), CoordError> {
        let (head, rev) = self.read_head_any(name)?;
        if head.deleting {
            return Err(CoordError::Invalid(format!(
                "namespace {name:?} is being deleted: `delete` it again to finish"
            )));
        }
        Ok((head, rev))
    }

    fn read_head_any(&self, name: &str) -> Result<(NsHead, i64), CoordError> {
        check_name("namespace", name)?;
        let kv =
            self.etcd.get(&key(NAMESPACES, name))?.ok_or_else(|| CoordError::NoNamespace(name.to_owned()))?;
        Ok((decode(&kv)?, kv.mod_revision))
    }

    /// Every allocation of namespace `name`, by address.
    fn alloc_records(&self, name: &str) -> Result<Vec<(u64, AllocRecord)>, CoordError> {
        self.etcd
            .prefix(&under(ALLOCS, name))?
            .iter()
            .map(|kv| {
                let addr = alloc_addr(&kv.key).ok_or_else(|| CoordError::Corrupt {
                    key: String::from_utf8_lossy(&kv.key).into_owned(),
                    why: "not an allocation's key".into(),
                })?;
                Ok((addr, decode(kv)?))
            })
            .collect()
    }

    /// The allocation at `addr` of namespace `name`, with its revision; one whose slots do not
    /// cover its length in `chunk_bytes` chunks is corrupt.
    fn read_alloc(&self, name: &str, addr: u64, chunk_bytes: u64) -> Result<(AllocRecord, i64), CoordError> {
        let k = alloc_key(name, addr);
        let kv = self.etcd.get(&k)?.ok_or(CoordError::NoAllocation { ns: name.to_owned(), addr })?;
        let a: AllocRecord = decode(&kv)?;
        if run_len(&a.runs) != a.len.div_ceil(chunk_bytes) {
            return Err(CoordError::Corrupt {
                key: String::from_utf8_lossy(&k).into_owned(),
                why: format!("{} slots for {} bytes in chunks of {chunk_bytes}", run_len(&a.runs), a.len),
            });
        }
        Ok((a, kv.mod_revision))
    }

    /// Group `g` of namespace `name`, with its revision (an empty group and 0 when it has no
    /// record).
    fn read_group(&self, name: &str, g: u64) -> Result<(StripeGroup, i64), CoordError> {
        or_empty(self.etcd.get(&group_key(name, g))?, StripeGroup::default())
    }

    /// Groups `gs` of namespace `name`, with their revisions, read a hundred to a round trip.
    fn read_groups(&self, name: &str, gs: &[u64]) -> Result<BTreeMap<u64, (StripeGroup, i64)>, CoordError> {
        let keys: Vec<Vec<u8>> = gs.iter().map(|&g| group_key(name, g)).collect();
        let mut out = BTreeMap::new();
        for (&g, kv) in gs.iter().zip(self.etcd.get_many(&keys)?) {
            let read = or_empty(kv, StripeGroup::default())?;
            out.insert(g, read);
        }
        Ok(out)
    }

    /// Delete namespace `name`, giving every chunk it holds back to its server's pool. A large
    /// namespace goes in several transactions: it is marked as being deleted first (nothing
    /// else uses it from then on), and a delete cut short is finished by the next.
    pub fn delete_ns(&self, name: &str) -> Result<(), CoordError> {
        self.maps.forget(name, None);
        self.retry(name, || {
            let (mut head, rev) = self.read_head_any(name)?;
            if head.deleting {
                return Ok(Some(()));
            }
            head.deleting = true;
            let put = Op::Put { key: key(NAMESPACES, name), value: encode(&head), lease: 0 };
            Ok(self.etcd.txn(&[Compare::ModRevision(key(NAMESPACES, name), rev)], &[put], &[])?.then_some(()))
        })?;
        // Every allocation back to the reserve, then the reserve back to the pools.
        for (addr, _) in self.alloc_records(name)? {
            self.unbind(name, addr, true)?;
        }
        while self.release_step(name, Run(0, u64::MAX), u64::MAX, true)? > 0 {}
        self.retry(name, || {
            let (_, rev) = self.read_head_any(name)?;
            let mut ops: Vec<Op> =
                [GROUPS, MENDING, ALLOCS].iter().map(|p| Op::DeletePrefix(under(p, name))).collect();
            ops.push(Op::Delete(key(NAMESPACES, name)));
            Ok(self.etcd.txn(&[Compare::ModRevision(key(NAMESPACES, name), rev)], &ops, &[])?.then_some(()))
        })
    }

    /// Reserve `bytes` more in namespace `name`: stripes of chunks taken from the pools of
    /// the live servers of its scope and chunk size, round robin (so consecutive stripes lie
    /// on different servers), each stripe's replicas on distinct servers. A large reserve
    /// goes in steps of one transaction each (a group of stripes at most); a step that finds
    /// no room gives back what the earlier ones reserved, and reports it.
    pub fn reserve(&self, name: &str, bytes: u64) -> Result<NsHead, CoordError> {
        let (head, rev) = self.read_head(name)?;
        let want = bytes.div_ceil(head.chunk_bytes);
        // Room enough, as far as the pools' heads say now.
        let servers = self.scope_servers(&head)?;
        let heads = self.pool_heads()?;
        // The first step starts from what was read here (its transaction checks the
        // revisions read, so nothing is lost if they moved meanwhile).
        let mut read = Some(Read { head: head.clone(), rev, pools: heads.clone(), servers: servers.clone() });
        let have: u64 = servers.iter().filter_map(|s| heads.get(&s.id)).map(|h| h.0.free).sum();
        let zeroing: u64 = servers.iter().filter_map(|s| heads.get(&s.id)).map(|h| h.0.dirty).sum();
        let wanted = want.saturating_mul(u64::from(head.replicas));
        let holders = servers.iter().filter(|s| heads.get(&s.id).is_some_and(|h| h.0.free > 0)).count();
        let no_capacity = || CoordError::NoCapacity {
            scope: head.scope,
            chunk_bytes: head.chunk_bytes,
            replicas: head.replicas,
            want: wanted,
            have,
            zeroing,
        };
        if want > 0 && (have < wanted || holders < head.replicas as usize) {
            return Err(no_capacity());
        }
        let mut added: Vec<Run> = Vec::new();
        let mut done = 0;
        while done < want {
            match self.retry(name, || self.reserve_step(name, want - done, read.take())) {
                Ok(run) => {
                    done += run.1;
                    add_run(&mut added, run);
                }
                Err(e) => {
                    for r in added.iter().rev() {
                        while let Ok(n) = self.release_step(name, *r, u64::MAX, false) {
                            if n == 0 {
                                break;
                            }
                        }
                    }
                    return Err(match e {
                        CoordError::NoCapacity { .. } => no_capacity(),
                        e => e,
                    });
                }
            }
        }
        self.head(name)
    }

    /// The live servers a namespace's chunks may come from: its scope and chunk size.
    fn scope_servers(&self, head: &NsHead) -> Result<Vec<ServerInfo>, CoordError> {
        Ok(self
            .servers()?
            .into_iter()
            .filter(|s| s.scope == head.scope && s.chunk_bytes == head.chunk_bytes)
            .collect())
    }

    /// One step of [`reserve`](Self::reserve): up to `want` stripes in the next slots, within
    /// one group, from a window of the servers with room; from `read` if given, else from
    /// what it reads. `None` when another client changed what it read.
    fn reserve_step(&self, name: &str, want: u64, read: Option<Read>) -> Result<Option<Run>, CoordError> {
        let Read { mut head, rev, pools: heads, servers } = match read {
            Some(read) => read,
            None => {
                let (head, rev) = self.read_head(name)?;
                let servers = self.scope_servers(&head)?;
                Read { head, rev, pools: self.pool_heads()?, servers }
            }
        };
        let replicas = head.replicas as usize;
        let servers: Vec<ServerInfo> =
            servers.into_iter().filter(|s| heads.get(&s.id).is_some_and(|h| h.0.free > 0)).collect();
        let no_room = || CoordError::NoCapacity {
            scope: head.scope,
            chunk_bytes: head.chunk_bytes,
            replicas: head.replicas,
            want: want * replicas as u64,
            have: 0,
            zeroing: 0,
        };
        if servers.len() < replicas {
            return Err(no_room());
        }
        // A window of the servers, from where the namespace's last stripe ended (namespaces
        // start at servers of their own, so that clients reserving at once seldom meet).
        let width = servers.len().min(SERVERS_PER_STEP.max(replicas));
        let origin = name
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        let start = (origin.wrapping_add(head.slots.wrapping_mul(head.replicas as u64))
            % servers.len() as u64) as usize;
        let window: Vec<&ServerInfo> = (0..width).map(|i| &servers[(start + i) % servers.len()]).collect();
        let mut pools = Pools::new(&self.etcd);
        let mut first_extents = Vec::with_capacity(width);
        for s in &window {
            let (h, r) = &heads[&s.id];
            pools.preload(&s.id, h.clone(), *r);
            first_extents.extend(h.with_free.iter().next().map(|e| (s.id.as_str(), e)));
        }
        pools.prefetch(&[], &first_extents)?;
        let first = head.slots;
        // Up to STEP_GROUPS groups a step: fewer, larger transactions for a large reserve.
        let room = (group_of(first) + STEP_GROUPS) * GROUP_STRIPES - first;
        let gs: Vec<u64> = (group_of(first)..group_of(first) + STEP_GROUPS).collect();
        let mut groups = self.read_groups(name, &gs)?;
        let mut made = 0;
        let mut cursor = 0;
        while made < want.min(room) && pools.changed() + 2 * replicas <= POOL_OPS_MAX {
            let mut stripe = Vec::with_capacity(replicas);
            let mut tried = 0;
            while stripe.len() < replicas && tried < width {
                let s = window[cursor % width];
                cursor += 1;
                tried += 1;
                if let Some(c) = pools.take(s)? {
                    stripe.push(c);
                }
            }
            if stripe.len() < replicas {
                // The window ran dry: what it made goes now, and the next step looks wider.
                if made == 0 {
                    return Err(no_room());
                }
                for c in &stripe {
                    pools.untake(c)?;
                }
                break;
            }
            let slot = first + made;
            groups.get_mut(&group_of(slot)).expect("read above").0.put(slot, stripe);
            made += 1;
        }
        let run = Run(first, made);
        add_run(&mut head.reserved, run);
        check_runs(name, &head.reserved)?;
        head.slots += made;
        let mut compare = vec![Compare::ModRevision(key(NAMESPACES, name), rev)];
        let mut ops = vec![Op::Put { key: key(NAMESPACES, name), value: encode(&head), lease: 0 }];
        for (g, (group, grev)) in groups.iter().filter(|(g, _)| **g <= group_of(first + made.max(1) - 1)) {
            group_txn(name, *g, group, *grev, &mut compare, &mut ops);
        }
        pools.into_txn(&mut compare, &mut ops);
        Ok(self.etcd.txn(&compare, &ops, &[])?.then_some(run))
    }

    /// Give up to `bytes` of namespace `name`'s unallocated reserve back to the pools, from
    /// its last slots, in one transaction up to four groups at a time (fewer when their
    /// chunks span many servers).
    pub fn release(&self, name: &str, bytes: u64) -> Result<NsHead, CoordError> {
        let (head, _) = self.read_head(name)?;
        let mut left = bytes / head.chunk_bytes;
        while left > 0 {
            let n = self.release_step(name, Run(0, u64::MAX), left, false)?;
            if n == 0 {
                break;
            }
            left -= n;
        }
        self.head(name)
    }

    /// Give back to the pools up to `max` reserved slots of namespace `name` that lie in
    /// `within`, the last ones first, over up to `STEP_GROUPS` groups, in one transaction. How
    /// many it gave back (0: none left).
    fn release_step(&self, name: &str, within: Run, max: u64, deleting: bool) -> Result<u64, CoordError> {
        self.retry(name, || {
            let (mut head, rev) = if deleting { self.read_head_any(name)? } else { self.read_head(name)? };
            let reserved = intersect(&head.reserved, within);
            let Some(last) = reserved.last() else { return Ok(Some(0)) };
            // The last slots first, over up to STEP_GROUPS groups.
            let low = group_of(last.end() - 1).saturating_sub(STEP_GROUPS - 1) * GROUP_STRIPES;
            let candidates = intersect(&reserved, Run(low, u64::MAX - low));
            let mut slots: Vec<u64> = coord::schema::slots(&candidates).collect();
            slots.reverse();
            let gs: Vec<u64> = by_group(&candidates).into_keys().collect();
            let mut groups = self.read_groups(name, &gs)?;
            let mut pools = Pools::new(&self.etcd);
            let copies: BTreeSet<(&str, u64)> = slots
                .iter()
                .filter_map(|&slot| groups.get(&group_of(slot)).and_then(|g| g.0.get(slot)))
                .flatten()
                .map(|c| (c.server.as_str(), c.index / EXTENT_CHUNKS))
                .take(POOL_OPS_MAX / 2)
                .collect();
            let ids: BTreeSet<&str> = copies.iter().map(|c| c.0).collect();
            pools.prefetch(&ids.into_iter().collect::<Vec<_>>(), &copies.into_iter().collect::<Vec<_>>())?;
            let mut n = 0;
            for &slot in &slots {
                if n == max || pools.changed() + 2 * head.replicas as usize > POOL_OPS_MAX {
                    break;
                }
                let group = &mut groups.get_mut(&group_of(slot)).expect("read above").0;
                if let Some(stripe) = group.get_mut(slot) {
                    for c in std::mem::take(stripe) {
                        pools.give_back(&c)?;
                    }
                }
                n += 1;
            }
            let mut given = candidates;
            for r in coord::schema::take_last_runs(&mut given, n) {
                remove_run(&mut head.reserved, r);
            }
            let mut compare = vec![Compare::ModRevision(key(NAMESPACES, name), rev)];
            let mut ops = vec![Op::Put { key: key(NAMESPACES, name), value: encode(&head), lease: 0 }];
            let touched: BTreeSet<u64> = slots.iter().take(n as usize).map(|&s| group_of(s)).collect();
            for g in touched {
                let (group, grev) = &groups[&g];
                group_txn(name, g, group, *grev, &mut compare, &mut ops);
            }
            pools.into_txn(&mut compare, &mut ops);
            Ok(self.etcd.txn(&compare, &ops, &[])?.then_some(n))
        })
    }

    /// Bind `len` bytes of namespace `name`'s reserve to an address: `at`, or after the last
    /// allocation. Atomic: of clients racing to allocate one address (RStore's bootstrap
    /// address, 0), exactly one succeeds and the others get [`CoordError::AddressTaken`]. One
    /// small transaction whatever the size: the allocation names slots, its stripes stay put.
    pub fn alloc(&self, name: &str, len: u64, at: Option<u64>) -> Result<RAddress, CoordError> {
        if len == 0 {
            return Err(CoordError::Invalid("an allocation of 0 bytes".into()));
        }
        let (addr, runs, chunk) = self.retry(name, || {
            let (mut head, rev) = self.read_head(name)?;
            let chunk = head.chunk_bytes;
            let want = len.div_ceil(chunk);
            let addr = match at {
                Some(a) if a % chunk != 0 => {
                    return Err(CoordError::Invalid(format!(
                        "address {a:#x} is not a multiple of the chunk size {chunk}"
                    )))
                }
                Some(a) => a,
                None => head.next_addr,
            };
            let end = want
                .checked_mul(chunk)
                .and_then(|bytes| addr.checked_add(bytes))
                .ok_or_else(|| CoordError::Invalid("address overflows".into()))?;
            // The allocation below `end` closest to it is the only one that may overlap.
            let below = self.etcd.range(&under(ALLOCS, name), &alloc_key(name, end), 1, true)?;
            if let Some(kv) = below.first() {
                let other = alloc_addr(&kv.key).unwrap_or(0);
                let a: AllocRecord = decode(kv)?;
                if other + run_len(&a.runs) * chunk > addr {
                    return Err(CoordError::AddressTaken { ns: name.to_owned(), addr, other });
                }
            }
            let have = run_len(&head.reserved);
            if have < want {
                return Err(CoordError::NotReserved { ns: name.to_owned(), want, have });
            }
            let runs = take_runs(&mut head.reserved, want);
            check_runs(name, &runs)?;
            head.next_addr = head.next_addr.max(end);
            head.allocs += 1;
            let record = AllocRecord { len, runs: runs.clone() };
            let ak = alloc_key(name, addr);
            let ok = self.etcd.txn(
                &[Compare::ModRevision(key(NAMESPACES, name), rev), Compare::Absent(ak.clone())],
                &[
                    Op::Put { key: key(NAMESPACES, name), value: encode(&head), lease: 0 },
                    Op::Put { key: ak, value: encode(&record), lease: 0 },
                ],
                &[],
            )?;
            Ok(ok.then_some((addr, runs, chunk)))
        })?;
        let stripes = self.stripes(name, &runs)?;
        Ok(RAddress { ns: name.to_owned(), addr, len, chunk_bytes: chunk, stripes })
    }

    /// The stripes of `runs`' slots, in order.
    fn stripes(&self, name: &str, runs: &[Run]) -> Result<Vec<Stripe>, CoordError> {
        let gs: Vec<u64> = by_group(runs).into_keys().collect();
        let groups = self.read_groups(name, &gs)?;
        let stripe =
            |slot: u64| groups.get(&group_of(slot)).and_then(|g| g.0.get(slot)).cloned().unwrap_or_default();
        Ok(coord::schema::slots(runs).map(stripe).collect())
    }

    /// RStore's `init` and `map` together: the allocation at `addr` of namespace `name`,
    /// resolved to its live copies and mapped with a lane to each of their servers. The
    /// segment heals through this coordinator's etcd: it reports the servers it loses (their
    /// copies are marked stale) and reads its map again when a server knows a newer one. A
    /// map this coordinator (or one made from it with [`again`](Self::again)) resolved before
    /// is reused from its cache (`MapCache`) while the allocation's record is unchanged: one
    /// small read. Its lanes are taken from the coordinator's [`connections`](Self::connections)
    /// where an unmapped segment left one to the server, and left there when it is dropped.
    pub fn map(
        &self,
        name: &str,
        addr: u64,
        config: &initiator::LaneConfig,
    ) -> Result<Segment, Box<dyn std::error::Error + Send + Sync>> {
        let mut source = Source { coord: self.again(), ns: name.to_owned(), addr, live: Vec::new() };
        let cached = match self.maps.get(name, addr) {
            Some((revs, map, live)) => {
                self.unchanged(name, addr, &revs).map_err(|e| e.to_string())?.then(|| {
                    source.live = live;
                    map
                })
            }
            None => None,
        };
        let map = match cached {
            Some(map) => map,
            None => source.map().map_err(|e| e.message)?,
        };
        Ok(Segment::map_with(map, config, Box::new(source), Some(self.connections.clone()))?)
    }

    /// Whether the allocation at `addr` of namespace `name` and its groups are still at the
    /// revisions `revs`: two reads, the groups' keys only.
    fn unchanged(&self, name: &str, addr: u64, revs: &Revisions) -> Result<bool, CoordError> {
        let alloc = self.etcd.get(&alloc_key(name, addr))?;
        if alloc.is_none_or(|kv| kv.mod_revision != revs.alloc) {
            return Ok(false);
        }
        let (Some(&lo), Some(&hi)) = (revs.groups.keys().next(), revs.groups.keys().next_back()) else {
            return Ok(true);
        };
        let now = self.etcd.revisions(&group_key(name, lo), &group_key(name, hi + 1))?;
        let now: BTreeMap<u64, i64> =
            now.into_iter().filter_map(|(k, rev)| Some((group_index(&k)?, rev))).collect();
        Ok(revs.groups.iter().all(|(g, rev)| now.get(g).copied().unwrap_or(0) == *rev))
    }

    /// Whether a map of the allocation at `addr` of namespace `name` is cached.
    pub fn map_cached(&self, name: &str, addr: u64) -> bool {
        self.maps.get(name, addr).is_some()
    }

    /// The allocation at `addr` of namespace `name` with the servers registered now, after
    /// marking stale the copies (healthy or syncing) whose server is gone (or restarted
    /// empty): a client that maps the allocation without them writes to the other copies,
    /// which must track what those miss before it does, and a repair must not count on it.
    /// Reads (and writes) only the allocation's own groups.
    pub fn resolve(&self, name: &str, addr: u64) -> Result<(RAddress, Vec<ServerInfo>), CoordError> {
        let (r, live, _) = self.resolve_at(name, addr)?;
        Ok((r, live))
    }

    /// [`resolve`](Self::resolve), and the revisions of the records it read.
    fn resolve_at(
        &self,
        name: &str,
        addr: u64,
    ) -> Result<(RAddress, Vec<ServerInfo>, Revisions), CoordError> {
        let live = self.servers()?;
        let now = unix_ms();
        let (head, _) = self.read_head(name)?;
        let (a, arev) = self.read_alloc(name, addr, head.chunk_bytes)?;
        let mut stripes = Vec::with_capacity(run_len(&a.runs) as usize);
        let slots_by_group = by_group(&a.runs);
        let gs: Vec<u64> = slots_by_group.keys().copied().collect();
        let mut read = self.read_groups(name, &gs)?;
        let mut revs = Revisions { alloc: arev, groups: BTreeMap::new(), complete: true };
        for (g, slots) in slots_by_group {
            let lost = |group: &StripeGroup| {
                slots.iter().filter_map(|&s| group.get(s)).flatten().any(|c| gone(&live, c))
            };
            let first = read.remove(&g).unwrap_or_default();
            // Most maps change nothing: the group read with the others serves.
            if !lost(&first.0) {
                revs.groups.insert(g, first.1);
                stripes.extend(slots.iter().map(|&s| first.0.get(s).cloned().unwrap_or_default()));
                continue;
            }
            revs.complete = false;
            let group = self.change_group_from(name, g, Some(first), |group| {
                let mut changed = false;
                for &slot in &slots {
                    let Some((epoch, stripe)) = group.slot_mut(slot) else {
                        continue;
                    };
                    for i in 0..stripe.len() {
                        if gone(&live, &stripe[i]) {
                            changed |= repair::mark_stale(epoch, stripe, i, &live, now);
                        }
                    }
                }
                Ok((group.clone(), changed))
            })?;
            stripes.extend(slots.iter().map(|&s| group.get(s).cloned().unwrap_or_default()));
        }
        let r = RAddress { ns: name.to_owned(), addr, len: a.len, chunk_bytes: head.chunk_bytes, stripes };
        Ok((r, live, revs))
    }

    /// Mark server `id`'s copies of the allocation at `addr` stale: they may miss writes from
    /// now on, are not mapped again until repaired, and the other copies track what they miss.
    /// A stripe whose other copies are not healthy keeps its copy (with one replica the lost
    /// server's copy is the only data there is).
    pub fn mark_stale(&self, name: &str, addr: u64, id: &str) -> Result<(), CoordError> {
        let live = self.servers()?;
        let now = unix_ms();
        let (head, _) = self.read_head(name)?;
        let (a, _) = self.read_alloc(name, addr, head.chunk_bytes)?;
        for (g, slots) in by_group(&a.runs) {
            self.change_group(name, g, |group| {
                let mut changed = false;
                for &slot in &slots {
                    let Some((epoch, stripe)) = group.slot_mut(slot) else {
                        continue;
                    };
                    if let Some(i) = stripe.iter().position(|c| c.server == id) {
                        changed |= repair::mark_stale(epoch, stripe, i, &live, now);
                    }
                }
                Ok(((), changed))
            })?;
        }
        Ok(())
    }

    // ---- healing (crate::repair, crate::agent) ----

    /// The groups of namespace `name` to look at: every group, or (`mending_only`) those the
    /// repair index marks as holding a copy that is not `ok`.
    pub fn groups(&self, name: &str, mending_only: bool) -> Result<Vec<u64>, CoordError> {
        let prefix = under(if mending_only { MENDING } else { GROUPS }, name);
        let keys = self.etcd.revisions(&prefix, &coord::etcd::prefix_end(&prefix))?;
        Ok(keys.iter().filter_map(|(key, _)| group_index(key)).collect())
    }

    /// One pass of the repair leader over namespace `name` at `now_ms` ([`repair::plan`]):
    /// over every group, or (`mending_only`: no server came or went since the last full pass)
    /// over those the repair index marks. Each group changed is written back in one
    /// transaction; the relocations planned name stripes by slot.
    pub fn plan(
        &self,
        name: &str,
        present: &[ServerInfo],
        now_ms: u64,
        rebuild_after_ms: u64,
        mending_only: bool,
    ) -> Result<repair::Plan, CoordError> {
        let live = self.servers()?;
        // Only allocated stripes are repaired: the reserve holds no data.
        let mut allocated: BTreeMap<u64, Vec<Run>> = BTreeMap::new();
        for (_, a) in self.alloc_records(name)? {
            for r in a.runs {
                let mut slot = r.0;
                while slot < r.end() {
                    let g = group_of(slot);
                    let end = r.end().min((g + 1) * GROUP_STRIPES);
                    allocated.entry(g).or_default().push(Run(slot, end - slot));
                    slot = end;
                }
            }
        }
        let mut total = repair::Plan::default();
        let gs: Vec<u64> =
            self.groups(name, mending_only)?.into_iter().filter(|g| allocated.contains_key(g)).collect();
        let mut read = self.read_groups(name, &gs)?;
        for g in gs {
            let runs = &allocated[&g];
            let plan = self.change_group_from(name, g, read.remove(&g), |group| {
                let epoch = &mut group.epoch;
                let stripes = group.stripes.iter_mut().enumerate().filter_map(|(i, s)| {
                    let slot = g * GROUP_STRIPES + i as u64;
                    runs.iter().any(|r| r.0 <= slot && slot < r.end()).then_some((slot, s))
                });
                let plan = repair::plan(
                    epoch,
                    stripes.filter(|(_, s)| !s.is_empty()),
                    &live,
                    present,
                    now_ms,
                    rebuild_after_ms,
                );
                let changed = plan.changed();
                Ok((plan, changed))
            })?;
            total.stale += plan.stale;
            total.started += plan.started;
            total.relocate.extend(plan.relocate);
        }
        Ok(total)
    }

    /// Rebuild the stale copy `r` names on another live server of the namespace's scope with
    /// a free chunk, one the stripe has no copy on: the spare chunk is taken from its pool,
    /// the copy put in its place to be repaired in full, and the old chunk given back to its
    /// server's pool (zeroed when it returns), in one transaction. `false` when no server has
    /// room, or the stripe changed since `r` was planned.
    pub fn relocate(&self, name: &str, r: &repair::Relocation) -> Result<bool, CoordError> {
        self.retry(name, || {
            let (head, _) = self.read_head(name)?;
            let g = group_of(r.stripe);
            let (mut group, grev) = self.read_group(name, g)?;
            let live = self.servers()?;
            let heads = self.pool_heads()?;
            let mut pools = Pools::new(&self.etcd);
            let mut spare = None;
            for s in live.iter().filter(|s| {
                s.scope == head.scope
                    && s.chunk_bytes == head.chunk_bytes
                    && !r.avoid.contains(&s.id)
                    && heads.get(&s.id).is_some_and(|h| h.0.free > 0)
            }) {
                let (h, rev) = &heads[&s.id];
                pools.preload(&s.id, h.clone(), *rev);
                if let Some(chunk) = pools.take(s)? {
                    spare = Some(chunk);
                    break;
                }
            }
            let Some(chunk) = spare else { return Ok(Some(false)) };
            let Some((epoch, stripe)) = group.slot_mut(r.stripe) else {
                return Ok(Some(false));
            };
            let Some(old) = repair::relocate(epoch, stripe, r, chunk, &live) else { return Ok(Some(false)) };
            pools.give_back(&old)?;
            let (mut compare, mut ops) = (Vec::new(), Vec::new());
            group_txn(name, g, &group, grev, &mut compare, &mut ops);
            pools.into_txn(&mut compare, &mut ops);
            Ok(self.etcd.txn(&compare, &ops, &[])?.then_some(true))
        })
    }

    /// Copy `copy` of the stripe in `slot`, repaired by server `from` under epoch `at`, is
    /// healthy ([`repair::finish`]). `false` when the stripe moved on since (the repair goes
    /// again under the new epoch) or the copy is no longer that repair's.
    pub fn finish_sync(
        &self,
        name: &str,
        slot: u64,
        copy: usize,
        from: &str,
        at: u32,
    ) -> Result<bool, CoordError> {
        Ok(self.finish_syncs(name, &[Finished { slot, copy, epoch: at }], from)? == 1)
    }

    /// [`finish_sync`](Self::finish_sync) for many copies of namespace `name` at once, one
    /// transaction a group: how many were marked healthy.
    pub fn finish_syncs(&self, name: &str, done: &[Finished], from: &str) -> Result<usize, CoordError> {
        let mut by: BTreeMap<u64, Vec<&Finished>> = BTreeMap::new();
        for d in done {
            by.entry(group_of(d.slot)).or_default().push(d);
        }
        let mut total = 0;
        for (g, done) in by {
            total += self.change_group(name, g, |group| {
                let mut n = 0;
                for d in &done {
                    let Some((epoch, st)) = group.slot_mut(d.slot) else { continue };
                    n += usize::from(d.copy < st.len() && repair::finish(epoch, st, d.copy, from, d.epoch));
                }
                Ok((n, n > 0))
            })?;
        }
        Ok(total)
    }

    /// The repair of `copy` of the stripe in `slot`, by server `from` under epoch `at`, cannot
    /// go on (its server cannot be reached): the copy is stale again, and the leader starts it
    /// over once its server is back.
    pub fn abandon_sync(
        &self,
        name: &str,
        slot: u64,
        copy: usize,
        from: &str,
        at: u32,
    ) -> Result<bool, CoordError> {
        let live = self.servers()?;
        let now = unix_ms();
        self.change_group(name, group_of(slot), |group| {
            let Some((epoch, st)) = group.slot_mut(slot) else {
                return Ok((false, false));
            };
            let ours = st
                .get(copy)
                .is_some_and(|c| c.state == CopyState::Syncing && c.from == from && c.epoch == at);
            let done = ours && repair::mark_stale(epoch, st, copy, &live, now);
            Ok((done, done))
        })
    }

    /// Group `g` of namespace `name` as it stands (an empty group when it has none).
    pub fn group(&self, name: &str, g: u64) -> Result<StripeGroup, CoordError> {
        Ok(self.read_group(name, g)?.0)
    }

    /// Try to become (or stay) the repair leader as server `id`: the leader key is created
    /// under `lease` (the server's registration lease) if nobody holds it, so it lapses with
    /// the server. Whether `id` leads now.
    pub fn campaign(&self, id: &str, lease: i64) -> Result<bool, CoordError> {
        let k = LEADER.as_bytes().to_vec();
        self.etcd.txn(
            &[Compare::Absent(k.clone())],
            &[Op::Put { key: k.clone(), value: id.into(), lease }],
            &[],
        )?;
        Ok(self.etcd.get(&k)?.is_some_and(|kv| kv.value == id.as_bytes()))
    }

    /// Publish what source `p.server` copied out, under `lease`.
    pub fn publish_progress(&self, p: &repair::SourceProgress, lease: i64) -> Result<(), CoordError> {
        Ok(self.etcd.put(&key(PROGRESS, &p.server), &encode(p), lease)?)
    }

    /// Namespace `name`'s state of repair ([`repair::Status`]).
    pub fn status(&self, name: &str) -> Result<repair::Status, CoordError> {
        let ns = self.join_ns(name)?;
        let live = self.servers()?;
        let progress: Vec<repair::SourceProgress> =
            self.etcd.prefix(PROGRESS.as_bytes())?.iter().map(decode).collect::<Result<_, _>>()?;
        Ok(repair::Status::of(&ns, &live, self.leader()?, &progress))
    }

    /// The repair leader now, if any.
    pub fn leader(&self) -> Result<Option<String>, CoordError> {
        Ok(self.etcd.get(LEADER.as_bytes())?.map(|kv| String::from_utf8_lossy(&kv.value).into_owned()))
    }

    /// The allocation at `addr` of namespace `name` (RStore's `init`).
    pub fn lookup(&self, name: &str, addr: u64) -> Result<RAddress, CoordError> {
        let (head, _) = self.read_head(name)?;
        let (a, _) = self.read_alloc(name, addr, head.chunk_bytes)?;
        let stripes = self.stripes(name, &a.runs)?;
        Ok(RAddress { ns: name.to_owned(), addr, len: a.len, chunk_bytes: head.chunk_bytes, stripes })
    }

    /// Unbind the allocation at `addr`: its chunks return to the namespace's reserve.
    pub fn free(&self, name: &str, addr: u64) -> Result<(), CoordError> {
        self.maps.forget(name, Some(addr));
        self.unbind(name, addr, false)
    }

    fn unbind(&self, name: &str, addr: u64, deleting: bool) -> Result<(), CoordError> {
        self.retry(name, || {
            let (mut head, rev) = if deleting { self.read_head_any(name)? } else { self.read_head(name)? };
            let (a, arev) = self.read_alloc(name, addr, head.chunk_bytes)?;
            for r in a.runs {
                add_run(&mut head.reserved, r);
            }
            if !deleting {
                check_runs(name, &head.reserved)?;
            }
            head.allocs = head.allocs.saturating_sub(1);
            let ak = alloc_key(name, addr);
            let ok = self.etcd.txn(
                &[Compare::ModRevision(key(NAMESPACES, name), rev), Compare::ModRevision(ak.clone(), arev)],
                &[Op::Put { key: key(NAMESPACES, name), value: encode(&head), lease: 0 }, Op::Delete(ak)],
                &[],
            )?;
            Ok(ok.then_some(()))
        })
    }

    /// Change group `g` of namespace `name` and nothing else: `change` edits the group read
    /// and returns its result, with whether the group is to be written. The write is one
    /// transaction on the revision read, redone from a fresh read when another client changed
    /// the group first.
    fn change_group<T>(
        &self,
        name: &str,
        g: u64,
        change: impl FnMut(&mut StripeGroup) -> Result<(T, bool), CoordError>,
    ) -> Result<T, CoordError> {
        self.change_group_from(name, g, None, change)
    }

    /// [`change_group`](Self::change_group), starting from the group as `read` (with its
    /// revision) when given: a pass that read many groups in one round trip.
    fn change_group_from<T>(
        &self,
        name: &str,
        g: u64,
        mut read: Option<(StripeGroup, i64)>,
        mut change: impl FnMut(&mut StripeGroup) -> Result<(T, bool), CoordError>,
    ) -> Result<T, CoordError> {
        self.retry(name, || {
            let (mut group, rev) = match read.take() {
                Some(read) => read,
                None => self.read_group(name, g)?,
            };
            let (result, write) = change(&mut group)?;
            if !write {
                return Ok(Some(result));
            }
            let (mut compare, mut ops) = (Vec::new(), Vec::new());
            group_txn(name, g, &group, rev, &mut compare, &mut ops);
            Ok(self.etcd.txn(&compare, &ops, &[])?.then_some(result))
        })
    }

    /// The pool head of server `id`, if it has one.
    pub fn pool(&self, id: &str) -> Result<Option<PoolHead>, CoordError> {
        check_name("server id", id)?;
        self.etcd.get(&key(POOLS, id))?.as_ref().map(decode).transpose()
    }

    /// Every chunk of server `id`'s pool zeroed at least once, with its generation (a server
    /// takes them up when it starts).
    pub fn generations(&self, id: &str) -> Result<Vec<(u64, u32)>, CoordError> {
        check_name("server id", id)?;
        let mut out = Vec::new();
        for kv in self.etcd.prefix(format!("{POOL_GENERATIONS}{id}/").as_bytes())? {
            let e = group_index(&kv.key).unwrap_or(0);
            let generations: Generations = decode(&kv)?;
            out.extend(generations.0.iter().map(|(&i, &g)| (e * EXTENT_CHUNKS + u64::from(i), g)));
        }
        Ok(out)
    }

    /// The chunks of server `id`'s pool waiting to be zeroed before they are handed out again.
    pub fn dirty(&self, id: &str) -> Result<Vec<u64>, CoordError> {
        let Some(head) = self.pool(id)? else { return Ok(Vec::new()) };
        let mut out = Vec::new();
        for e in head.with_dirty.iter() {
            let Some(kv) = self.etcd.get(&extent_key(id, e))? else { continue };
            let extent: Extent = decode(&kv)?;
            out.extend(extent.dirty.iter().map(|i| e * EXTENT_CHUNKS + i));
        }
        Ok(out)
    }

    /// Server `id` has zeroed `chunks`, each moved on to the generation given: they are free
    /// to hand out, and their next owners' grants carry those generations. One transaction
    /// for a few extents' worth (the zeroer hands back a batch at a time).
    pub fn cleaned(&self, id: &str, chunks: &[(u64, u32)]) -> Result<(), CoordError> {
        // Batches of as many chunks as lie in (POOL_OPS_MAX - 1) / 2 extents: each writes its
        // extent and its generations, beside the head.
        let mut batches: Vec<&[(u64, u32)]> = Vec::new();
        let (mut from, mut extents) = (0, BTreeSet::new());
        for (i, &(c, _)) in chunks.iter().enumerate() {
            if extents.insert(c / EXTENT_CHUNKS) && extents.len() > (POOL_OPS_MAX - 1) / 2 {
                batches.push(&chunks[from..i]);
                (from, extents) = (i, BTreeSet::from([c / EXTENT_CHUNKS]));
            }
        }
        batches.push(&chunks[from..]);
        for batch in batches.into_iter().filter(|b| !b.is_empty()) {
            self.retry(id, || {
                let mut pools = Pools::new(&self.etcd);
                if pools.head(id)?.is_none() {
                    return Ok(Some(()));
                }
                for &(c, generation) in batch {
                    let e = c / EXTENT_CHUNKS;
                    let extent = pools.extent(id, e)?;
                    let i = c % EXTENT_CHUNKS;
                    if !extent.dirty.get(i) {
                        continue;
                    }
                    extent.dirty.set(i, false);
                    let still_dirty = !extent.dirty.is_empty();
                    pools.generations(id, e, true)?.set(c, generation);
                    let head = pools.head(id)?.expect("read above");
                    head.dirty -= 1;
                    head.free += 1;
                    head.with_free.set(e, true);
                    head.with_dirty.set(e, still_dirty);
                }
                let (mut compare, mut ops) = (Vec::new(), Vec::new());
                pools.into_txn(&mut compare, &mut ops);
                Ok(self.etcd.txn(&compare, &ops, &[])?.then_some(()))
            })?;
        }
        Ok(())
    }

    /// Run `attempt` until its transaction goes through (`Some`), another client's change
    /// having made it fail (`None`) at most [`TXN_RETRIES`] times.
    fn retry<T>(
        &self,
        what: &str,
        mut attempt: impl FnMut() -> Result<Option<T>, CoordError>,
    ) -> Result<T, CoordError> {
        for tries in 0..TXN_RETRIES {
            if let Some(done) = attempt()? {
                return Ok(done);
            }
            // Another client changed what this one read: back off a little, longer each time
            // and at random, so that two clients on one record (a reserve and a server zeroing
            // its chunks) do not meet again at once.
            let ceiling = Duration::from_micros(100 << tries.min(8)).min(Duration::from_millis(20));
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            std::thread::sleep(ceiling.mul_f64(f64::from(nanos % 1000) / 1000.0));
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
