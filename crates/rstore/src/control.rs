//! RStore's control path on etcd (Trivedi's thesis, chapter 6; docs/RSTORE.md): the
//! [`Coordinator`] and what it hands the data path.
//!
//! Memory servers (ordinary `skiff serve` processes with `--pool`) donate RAM or a file as a
//! pool of chunks and keep a registration alive under an etcd lease. Namespaces, the chunks
//! they reserved and the `raddress` segments allocated in them live in etcd as JSON values
//! (`coord::schema` says where and how); every change is one etcd transaction that checks the
//! revisions it read, so two clients racing for the same thing (a namespace name, the bootstrap
//! address) see exactly one win. This is the slow path: it runs when a client sets up, never
//! per I/O. A mapped `raddress` says, for every chunk, which server (endpoint, export) holds it
//! at which offset, and the data path ([`Segment`]) goes there directly.
//!
//! The etcd client and the records are `coord`'s; this module owns the operations on them.

use std::collections::BTreeMap;
use std::time::Duration;

use coord::etcd::{Compare, Etcd, Op, Tls};
use coord::schema::{check_name, decode, encode, encode_ns, key, NAMESPACES, POOLS, SERVERS, TXN_RETRIES};
use coord::{
    Allocation, CoordError, CopyState, Namespace, PoolState, Scope, ServerInfo, Stripe, NAMESPACE_CHUNKS_MAX,
    POOL_CHUNKS_MAX,
};
use serde::Serialize;

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
    /// Allocation `a`, at `addr` of namespace `ns` of `chunk_bytes` chunks, as the data path
    /// sees it.
    fn of(a: &Allocation, ns: &str, addr: u64, chunk_bytes: u64) -> RAddress {
        RAddress { ns: ns.to_owned(), addr, len: a.len, chunk_bytes, stripes: a.stripes.clone() }
    }

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

/// A copy a source repaired: copy `copy` of stripe `stripe` of the allocation at `addr`,
/// under the stripe's epoch `epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub addr: u64,
    pub stripe: usize,
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
        self.coord.mark_stale(&self.ns, self.addr, &id).map_err(source_error)
    }

    fn map(&mut self) -> Result<SegmentMap, SourceError> {
        let (r, live) = self.coord.resolve(&self.ns, self.addr).map_err(source_error)?;
        let map = segment_map(&r, &live).map_err(source_error)?;
        self.live = live;
        Ok(map)
    }
}

/// A client of the control plane.
pub struct Coordinator {
    etcd: Etcd,
}

impl Coordinator {
    /// The coordinator at `endpoints` (etcd client URLs, e.g. `http://127.0.0.1:2379`).
    pub fn connect(endpoints: &[String]) -> Coordinator {
        Coordinator { etcd: Etcd::new(endpoints, Duration::from_secs(5)) }
    }

    /// The coordinator at `endpoints`, reaching `https://` members with `tls` (the CA of their
    /// certificates, and a client certificate for members that ask for one). Fails when the
    /// PEM files cannot be read.
    pub fn connect_with(endpoints: &[String], tls: Option<Tls>) -> Result<Coordinator, CoordError> {
        let etcd = Etcd::with_tls(endpoints, Duration::from_secs(5), tls).map_err(CoordError::Invalid)?;
        Ok(Coordinator { etcd })
    }

    /// Another client of the same coordinator, reached the same way (for a thread of its own).
    pub fn again(&self) -> Coordinator {
        Coordinator { etcd: self.etcd.again() }
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
            epoch: 0,
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
                    if let Some(chunk) = state.take(s) {
                        stripe.push(chunk);
                    }
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
            let a = Allocation { len, stripes };
            let r = RAddress::of(&a, name, addr, chunk);
            ns.allocs.insert(addr, a);
            ns.next_addr = ns.next_addr.max(end);
            Ok((r, true))
        })
    }

    /// RStore's `init` and `map` together: the allocation at `addr` of namespace `name`,
    /// resolved to its live copies and mapped with a lane to each of their servers. The
    /// segment heals through this coordinator's etcd: it reports the servers it loses (their
    /// copies are marked stale) and reads its map again when a server knows a newer one.
    pub fn map(
        &self,
        name: &str,
        addr: u64,
        config: &initiator::LaneConfig,
    ) -> Result<Segment, Box<dyn std::error::Error + Send + Sync>> {
        let mut source = Source { coord: self.again(), ns: name.to_owned(), addr, live: Vec::new() };
        let map = source.map().map_err(|e| e.message)?;
        Ok(Segment::map_with(map, config, Box::new(source))?)
    }

    /// The allocation at `addr` of namespace `name` with the servers registered now, after
    /// marking stale the copies (healthy or syncing) whose server is gone (or restarted
    /// empty): a client that maps the allocation without them writes to the other copies,
    /// which must track what those miss before it does, and a repair must not count on it.
    pub fn resolve(&self, name: &str, addr: u64) -> Result<(RAddress, Vec<ServerInfo>), CoordError> {
        let live = self.servers()?;
        let now = unix_ms();
        let r = self.change_ns(name, |ns| {
            let a = ns.allocs.get_mut(&addr).ok_or(CoordError::NoAllocation { ns: name.to_owned(), addr })?;
            let mut changed = false;
            for stripe in &mut a.stripes {
                for i in 0..stripe.len() {
                    if stripe[i].state != CopyState::Stale && repair::holder(&live, &stripe[i]).is_none() {
                        changed |= repair::mark_stale(&mut ns.epoch, stripe, i, &live, now);
                    }
                }
            }
            let a = &ns.allocs[&addr];
            Ok((RAddress::of(a, name, addr, ns.chunk_bytes), changed))
        })?;
        Ok((r, live))
    }

    /// Mark server `id`'s copies of the allocation at `addr` stale: they may miss writes from
    /// now on, are not mapped again until repaired, and the other copies track what they miss.
    /// A stripe whose other copies are not healthy keeps its copy (with one replica the lost
    /// server's copy is the only data there is).
    pub fn mark_stale(&self, name: &str, addr: u64, id: &str) -> Result<(), CoordError> {
        let live = self.servers()?;
        let now = unix_ms();
        self.change_ns(name, |ns| {
            let Some(a) = ns.allocs.get_mut(&addr) else { return Ok(((), false)) };
            let mut changed = false;
            for stripe in &mut a.stripes {
                if let Some(i) = stripe.iter().position(|c| c.server == id) {
                    changed |= repair::mark_stale(&mut ns.epoch, stripe, i, &live, now);
                }
            }
            Ok(((), changed))
        })
    }

    // ---- healing (crate::repair, crate::agent) ----

    /// One pass of the repair leader over namespace `name` at `now_ms` ([`repair::plan`]),
    /// written back in one transaction if it changed anything.
    pub fn plan(
        &self,
        name: &str,
        present: &[ServerInfo],
        now_ms: u64,
        rebuild_after_ms: u64,
    ) -> Result<repair::Plan, CoordError> {
        let live = self.servers()?;
        self.change_ns(name, |ns| {
            let plan = repair::plan(ns, &live, present, now_ms, rebuild_after_ms);
            let changed = plan.changed();
            Ok((plan, changed))
        })
    }

    /// Rebuild the stale copy `r` names on another live server of the namespace's scope with
    /// a free chunk, one the stripe has no copy on: the spare chunk is taken from its pool,
    /// the copy put in its place to be repaired in full, and the old chunk given back to its
    /// server's pool (zeroed when it returns), in one transaction. `false` when no server has
    /// room, or the stripe changed since `r` was planned.
    pub fn relocate(&self, name: &str, r: &repair::Relocation) -> Result<bool, CoordError> {
        self.retry(name, || {
            let (mut ns, rev) = self.read_ns(name)?;
            let live = self.servers()?;
            let mut spare = None;
            for s in live.iter().filter(|s| {
                s.scope == ns.scope && s.chunk_bytes == ns.chunk_bytes && !r.avoid.contains(&s.id)
            }) {
                let k = key(POOLS, &s.id);
                let Some(kv) = self.etcd.get(&k)? else { continue };
                let mut state: PoolState = decode(&kv)?;
                let Some(chunk) = state.take(s) else { continue };
                spare = Some((chunk, state, Compare::ModRevision(k, kv.mod_revision)));
                break;
            }
            let Some((chunk, pool, pool_cmp)) = spare else { return Ok(Some(false)) };
            let server = chunk.server.clone();
            let Some(old) = repair::relocate(&mut ns, r, chunk, &live) else { return Ok(Some(false)) };
            let (mut compare, mut ops) = self.give_back(&[vec![old]])?;
            compare.push(pool_cmp);
            ops.push(Op::Put { key: key(POOLS, &server), value: encode(&pool), lease: 0 });
            compare.push(Compare::ModRevision(key(NAMESPACES, name), rev));
            ops.push(Op::Put { key: key(NAMESPACES, name), value: encode_ns(&ns)?, lease: 0 });
            Ok(self.etcd.txn(&compare, &ops, &[])?.then_some(true))
        })
    }

    /// Copy `copy` of stripe `stripe` of the allocation at `addr`, repaired by server `from`
    /// under epoch `at`, is healthy ([`repair::finish`]). `false` when the stripe moved on
    /// since (the repair goes again under the new epoch) or the copy is no longer that repair's.
    pub fn finish_sync(
        &self,
        name: &str,
        addr: u64,
        stripe: usize,
        copy: usize,
        from: &str,
        at: u32,
    ) -> Result<bool, CoordError> {
        Ok(self.finish_syncs(name, &[Finished { addr, stripe, copy, epoch: at }], from)? == 1)
    }

    /// [`finish_sync`](Self::finish_sync) for many copies of namespace `name` at once, in one
    /// transaction: how many were marked healthy.
    pub fn finish_syncs(&self, name: &str, done: &[Finished], from: &str) -> Result<usize, CoordError> {
        self.change_ns(name, |ns| {
            let mut n = 0;
            for d in done {
                let Some(st) = ns.allocs.get_mut(&d.addr).and_then(|a| a.stripes.get_mut(d.stripe)) else {
                    continue;
                };
                n += usize::from(
                    d.copy < st.len() && repair::finish(&mut ns.epoch, st, d.copy, from, d.epoch),
                );
            }
            Ok((n, n > 0))
        })
    }

    /// The repair of `copy` of stripe `stripe` of the allocation at `addr`, by server `from`
    /// under epoch `at`, cannot go on (its server cannot be reached): the copy is stale again,
    /// and the leader starts it over once its server is back.
    pub fn abandon_sync(
        &self,
        name: &str,
        addr: u64,
        stripe: usize,
        copy: usize,
        from: &str,
        at: u32,
    ) -> Result<bool, CoordError> {
        let live = self.servers()?;
        let now = unix_ms();
        self.change_ns(name, |ns| {
            let Some(st) = ns.allocs.get_mut(&addr).and_then(|a| a.stripes.get_mut(stripe)) else {
                return Ok((false, false));
            };
            let ours = st
                .get(copy)
                .is_some_and(|c| c.state == CopyState::Syncing && c.from == from && c.epoch == at);
            let done = ours && repair::mark_stale(&mut ns.epoch, st, copy, &live, now);
            Ok((done, done))
        })
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
        let ns = self.join_ns(name)?;
        let a = ns.allocs.get(&addr).ok_or(CoordError::NoAllocation { ns: name.to_owned(), addr })?;
        Ok(RAddress::of(a, name, addr, ns.chunk_bytes))
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
