//! RStore's key schema in etcd: the key prefixes, the records stored under them (JSON), their
//! bounds, and the helpers that name, encode, decode and check them. What the records mean and
//! how they change (every change one etcd transaction) is `rstore`'s control path; this module
//! holds no operation of its own beyond pure helpers over one record.
//!
//! Keys (all under `/skiff/`), each record small however large the pool or namespace:
//!
//! | key | value | lifetime |
//! |---|---|---|
//! | `servers/<id>` | [`ServerInfo`]: where the server listens, its pool export, scope, size, chunk size | the server's lease |
//! | `pools/<id>` | [`PoolHead`]: chunk size, chunks, free and dirty counts, extents with free or dirty chunks | until deleted by hand |
//! | `pool-extents/<id>/<e>` | [`Extent`]: 1,024 chunks' use and dirt | as the pool |
//! | `pool-generations/<id>/<e>` | [`Generations`]: the generations of those zeroed at least once | as the pool |
//! | `ns/<name>` | [`NsHead`]: scope, chunk size, replicas, the reserve's slots, the next address | until `delete_ns` |
//! | `ns-allocs/<name>/<addr>` | [`AllocRecord`]: an allocation's length and slots | until freed |
//! | `ns-stripes/<name>/<g>` | [`StripeGroup`]: 256 slots' stripes, each copy's server, chunk and state | as the namespace |
//! | `ns-mending/<name>/<g>` | empty: group `g` holds a copy that is not `ok` | until it is whole |
//!
//! A server whose lease expires (it died, or lost etcd for longer than its TTL) vanishes from
//! `servers/`; the chunks namespaces hold on it are then reported lost ([`Namespace::lost`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::etcd::Kv;
use crate::CoordError;

/// Where memory servers' registrations live ([`ServerInfo`], under their lease).
pub const SERVERS: &str = "/skiff/servers/";
/// Where each server's pool head lives ([`PoolHead`]).
pub const POOLS: &str = "/skiff/pools/";
/// Where each server's pool extents live ([`Extent`]).
pub const POOL_EXTENTS: &str = "/skiff/pool-extents/";
/// Where each extent's generations live ([`Generations`]).
pub const POOL_GENERATIONS: &str = "/skiff/pool-generations/";
/// Where namespaces' heads live ([`NsHead`]).
pub const NAMESPACES: &str = "/skiff/ns/";
/// Where namespaces' allocations live ([`AllocRecord`]).
pub const ALLOCS: &str = "/skiff/ns-allocs/";
/// Where namespaces' stripe groups live ([`StripeGroup`]).
pub const GROUPS: &str = "/skiff/ns-stripes/";
/// Where the groups holding a copy that is not `ok` are marked.
pub const MENDING: &str = "/skiff/ns-mending/";

/// Transactions retried when another client changed what one read, before giving up.
pub const TXN_RETRIES: usize = 64;

/// Operations one transaction carries at most: etcd's `--max-txn-ops` is 128 by default.
pub const TXN_OPS_MAX: usize = 120;

/// Most chunks one server's pool may hold: its server keeps a few words of grant state a
/// chunk in memory (16 TiB of 4 MiB chunks take about 100 MB). Its records in etcd stay small
/// at any size.
pub const POOL_CHUNKS_MAX: u64 = 1 << 22;

/// What a pool (and a namespace) is made of: RAM (FlashNet's DRAM namespaces), a file, or a
/// volume of a flash array (FlashNet's flash namespaces, thesis chapter 7: chunks are volume
/// ranges, allocated on flash only where written).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Ram,
    File,
    Flash,
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Scope::Ram => "ram",
            Scope::File => "file",
            Scope::Flash => "flash",
        })
    }
}

impl std::str::FromStr for Scope {
    type Err = String;
    fn from_str(s: &str) -> Result<Scope, String> {
        match s {
            "ram" => Ok(Scope::Ram),
            "file" => Ok(Scope::File),
            "flash" => Ok(Scope::Flash),
            _ => Err(format!("{s:?} is not a scope (ram, file or flash)")),
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

/// Chunks one pool extent record covers ([`Extent`]): its bitmaps take 256 hex digits each
/// (its [`Generations`], at most 1,024 small entries, are a record of their own).
pub const EXTENT_CHUNKS: u64 = 1024;

/// A set of small integers as a bitmap, stored as hex (16 digits a 64-bit word, lowest word
/// first): a pool's extents with free chunks, an extent's chunks in use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bitmap(Vec<u64>);

impl Bitmap {
    pub fn get(&self, i: u64) -> bool {
        self.0.get((i / 64) as usize).is_some_and(|w| w >> (i % 64) & 1 == 1)
    }

    pub fn set(&mut self, i: u64, on: bool) {
        let w = (i / 64) as usize;
        if w >= self.0.len() {
            if !on {
                return;
            }
            self.0.resize(w + 1, 0);
        }
        if on {
            self.0[w] |= 1 << (i % 64);
        } else {
            self.0[w] &= !(1 << (i % 64));
        }
        while self.0.last() == Some(&0) {
            self.0.pop();
        }
    }

    /// The members, lowest first.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.iter().enumerate().flat_map(|(w, &word)| {
            (0..64u64).filter(move |b| word >> b & 1 == 1).map(move |b| w as u64 * 64 + b)
        })
    }

    pub fn count(&self) -> u64 {
        self.0.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// The lowest member, a word at a time.
    pub fn first(&self) -> Option<u64> {
        let (w, word) = self.0.iter().enumerate().find(|(_, w)| **w != 0)?;
        Some(w as u64 * 64 + u64::from(word.trailing_zeros()))
    }

    /// Members `64 × w` to `64 × w + 63`, as a word (bit `b`: member `64 × w + b`).
    pub fn word(&self, w: u64) -> u64 {
        self.0.get(w as usize).copied().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether every member is below `n`.
    pub fn within(&self, n: u64) -> bool {
        (self.0.len() as u64) <= n.div_ceil(64) && self.iter().last().is_none_or(|m| m < n)
    }
}

impl Serialize for Bitmap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let hex: String = self.0.iter().map(|w| format!("{w:016x}")).collect();
        s.serialize_str(&hex)
    }
}

impl<'de> Deserialize<'de> for Bitmap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Bitmap, D::Error> {
        let hex = String::deserialize(d)?;
        if hex.len() % 16 != 0 || !hex.is_ascii() {
            return Err(serde::de::Error::custom("a bitmap is hex in 16-digit words"));
        }
        let words = (0..hex.len() / 16)
            .map(|i| u64::from_str_radix(&hex[i * 16..i * 16 + 16], 16))
            .collect::<Result<Vec<u64>, _>>()
            .map_err(serde::de::Error::custom)?;
        let mut b = Bitmap(words);
        while b.0.last() == Some(&0) {
            b.0.pop();
        }
        Ok(b)
    }
}

/// A server's pool: what it is made of, how many chunks it holds, and which of its extents
/// ([`Extent`], `EXTENT_CHUNKS` chunks each) have a chunk free or a chunk to zero. Small at
/// any size: a bit per extent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolHead {
    /// The chunk size the pool's chunks were numbered in: a server registering again must use
    /// the same, or chunk numbers held by namespaces would name other bytes.
    pub chunk_bytes: u64,
    /// Chunks the pool holds, as last registered.
    pub chunks: u64,
    /// Chunks free to hand out (never handed out, or given back and zeroed), and chunks given
    /// back and not zeroed yet.
    pub free: u64,
    pub dirty: u64,
    /// Extents with a free chunk, and extents with a chunk to zero.
    pub with_free: Bitmap,
    pub with_dirty: Bitmap,
}

impl PoolHead {
    /// A pool of `chunks` chunks of `chunk_bytes`, none handed out.
    pub fn new(chunk_bytes: u64, chunks: u64) -> PoolHead {
        let mut head = PoolHead { chunk_bytes, ..PoolHead::default() };
        head.grow(chunks);
        head
    }

    /// The pool now holds `chunks` chunks, more than before: the new ones are free.
    pub fn grow(&mut self, chunks: u64) {
        if chunks <= self.chunks {
            return;
        }
        for e in self.chunks / EXTENT_CHUNKS..chunks.div_ceil(EXTENT_CHUNKS) {
            self.with_free.set(e, true);
        }
        self.free += chunks - self.chunks;
        self.chunks = chunks;
    }

    /// The extents of chunks `from..` (those a smaller pool would lose).
    pub fn extents_from(&self, from: u64) -> std::ops::Range<u64> {
        from / EXTENT_CHUNKS..self.chunks.div_ceil(EXTENT_CHUNKS)
    }
}

/// `EXTENT_CHUNKS` chunks of a pool, from chunk `extent * EXTENT_CHUNKS`: which are in use
/// (held by a namespace) and which were given back and wait to be zeroed. An extent with no
/// record has every chunk free. A chunk is free when it is neither in use nor dirty. Taking and
/// giving back chunks rewrites this record only (a few hundred bytes), never the generations.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    pub used: Bitmap,
    #[serde(default, skip_serializing_if = "Bitmap::is_empty")]
    pub dirty: Bitmap,
}

/// The generation of each chunk of an extent zeroed at least once, by offset in the extent
/// (the others are at 0): written only when chunks are zeroed, together with their extent
/// (whose revision guards both), and read when chunks are taken, for their grants.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Generations(pub BTreeMap<u32, u32>);

impl Generations {
    /// Chunk `c`'s (of the pool) generation.
    pub fn get(&self, c: u64) -> u32 {
        self.0.get(&((c % EXTENT_CHUNKS) as u32)).copied().unwrap_or(0)
    }

    pub fn set(&mut self, c: u64, generation: u32) {
        let i = (c % EXTENT_CHUNKS) as u32;
        if generation == 0 {
            self.0.remove(&i);
        } else {
            self.0.insert(i, generation);
        }
    }
}

impl Extent {
    /// Chunk `c` (of the pool) is free here.
    pub fn is_free(&self, c: u64) -> bool {
        let i = c % EXTENT_CHUNKS;
        !self.used.get(i) && !self.dirty.get(i)
    }

    /// Whether any of chunks `first..end` (of the pool, within this extent) is free.
    pub fn any_free(&self, first: u64, end: u64) -> bool {
        self.first_free(first..end).is_some()
    }

    /// The lowest free chunk of `chunks` (of the pool, within this extent), a word of 64
    /// chunks at a time.
    pub fn first_free(&self, chunks: std::ops::Range<u64>) -> Option<u64> {
        if chunks.is_empty() {
            return None;
        }
        let base = chunks.start - chunks.start % EXTENT_CHUNKS;
        let (lo, hi) = (chunks.start - base, chunks.end - base);
        for w in lo / 64..hi.div_ceil(64) {
            let mut free = !(self.used.word(w) | self.dirty.word(w));
            if w == lo / 64 {
                free &= u64::MAX << (lo % 64);
            }
            if w == (hi - 1) / 64 && hi % 64 != 0 {
                free &= (1u64 << (hi % 64)) - 1;
            }
            if free != 0 {
                return Some(base + w * 64 + u64::from(free.trailing_zeros()));
            }
        }
        None
    }
}

/// The chunks of extent `e` of a pool of `chunks` chunks.
pub fn extent_chunks(e: u64, chunks: u64) -> std::ops::Range<u64> {
    e * EXTENT_CHUNKS..((e + 1) * EXTENT_CHUNKS).min(chunks)
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
    /// Its stripe group's epoch at the stripe's last change (every copy of a stripe holds the
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

/// Stripes one group record holds ([`StripeGroup`]): at three replicas about 80 KB at most.
pub const GROUP_STRIPES: u64 = 256;

/// Most runs a namespace's reserve or one allocation is made of ([`Run`]): they grow with how
/// fragmented frees left the reserve, not with its size. About 100 KB of record.
pub const RUNS_MAX: usize = 4096;

/// Slots `first..first + count` of a namespace's stripe table, as `[first, count]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Run(pub u64, pub u64);

impl Run {
    pub fn end(&self) -> u64 {
        self.0 + self.1
    }
}

/// The slots of `runs`, in order.
pub fn slots(runs: &[Run]) -> impl Iterator<Item = u64> + '_ {
    runs.iter().flat_map(|r| r.0..r.end())
}

/// Add `run` to `runs`, kept sorted and merged with its neighbours.
pub fn add_run(runs: &mut Vec<Run>, run: Run) {
    if run.1 == 0 {
        return;
    }
    let at = runs.partition_point(|r| r.0 < run.0);
    runs.insert(at, run);
    let mut merged: Vec<Run> = Vec::with_capacity(runs.len());
    for r in runs.drain(..) {
        match merged.last_mut() {
            Some(last) if last.end() == r.0 => last.1 += r.1,
            _ => merged.push(r),
        }
    }
    *runs = merged;
}

/// Take the first `n` slots of `runs` (fewer if it holds fewer), as runs.
pub fn take_runs(runs: &mut Vec<Run>, mut n: u64) -> Vec<Run> {
    let mut taken = Vec::new();
    while n > 0 && !runs.is_empty() {
        let r = &mut runs[0];
        let k = r.1.min(n);
        taken.push(Run(r.0, k));
        r.0 += k;
        r.1 -= k;
        n -= k;
        if r.1 == 0 {
            runs.remove(0);
        }
    }
    taken
}

/// Take the last `n` slots of `runs` (fewer if it holds fewer), as runs.
pub fn take_last_runs(runs: &mut Vec<Run>, mut n: u64) -> Vec<Run> {
    let mut taken = Vec::new();
    while n > 0 {
        let Some(r) = runs.last_mut() else { break };
        let k = r.1.min(n);
        r.1 -= k;
        taken.insert(0, Run(r.0 + r.1, k));
        n -= k;
        if r.1 == 0 {
            runs.pop();
        }
    }
    taken
}

/// Take `run` (within one of `runs`) out of `runs`.
pub fn remove_run(runs: &mut Vec<Run>, run: Run) {
    let Some(i) = runs.iter().position(|r| r.0 <= run.0 && run.end() <= r.end()) else { return };
    let r = runs.remove(i);
    let (before, after) = (Run(r.0, run.0 - r.0), Run(run.end(), r.end() - run.end()));
    for piece in [after, before] {
        if piece.1 > 0 {
            runs.insert(i, piece);
        }
    }
}

/// The slots of `runs` inside `within`, as runs.
pub fn intersect(runs: &[Run], within: Run) -> Vec<Run> {
    runs.iter()
        .filter_map(|r| {
            let (lo, hi) = (r.0.max(within.0), r.end().min(within.end()));
            (lo < hi).then(|| Run(lo, hi - lo))
        })
        .collect()
}

/// Slots in `runs`.
pub fn run_len(runs: &[Run]) -> u64 {
    runs.iter().map(|r| r.1).sum()
}

/// A namespace's head (`ns/<name>`): what it is, where the next allocation goes, and which
/// slots of its stripe table are reserved and not bound to an address. Its stripes live in
/// groups ([`StripeGroup`]) and its allocations in records of their own ([`AllocRecord`]),
/// so every record stays small however large the namespace grows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NsHead {
    pub name: String,
    pub scope: Scope,
    pub chunk_bytes: u64,
    pub replicas: u32,
    /// Where the next allocation without an address goes.
    pub next_addr: u64,
    /// Slots ever made: the next reserve's stripes take slots from here. A slot is never
    /// used twice (one given back leaves an empty stripe in its group).
    pub slots: u64,
    /// Slots reserved and not bound to an address (`reserve` adds, `alloc` takes).
    pub reserved: Vec<Run>,
    /// Allocations held.
    pub allocs: u64,
    /// Being deleted: its chunks are going back to their pools, a group at a time. Nothing
    /// else may use it; `delete_ns` again finishes the job.
    #[serde(default, skip_serializing_if = "is_false")]
    pub deleting: bool,
}

/// An allocation's record (`ns-allocs/<name>/<addr, 16 hex digits>`): its length and the
/// slots of its stripes, in address order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocRecord {
    pub len: u64,
    pub runs: Vec<Run>,
}

/// `GROUP_STRIPES` slots of a namespace's stripe table (`ns-stripes/<name>/<group, 8 hex
/// digits>`): slot `group * GROUP_STRIPES + i` is `stripes[i]`, empty when the slot was never
/// filled or was given back. `epoch` moves on with every change to one of its stripes'
/// copies (`rstore::repair`), and each stripe's copies carry the epoch of its last change.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StripeGroup {
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch: u32,
    pub stripes: Vec<Stripe>,
}

impl StripeGroup {
    /// The stripe in `slot` (of this group), if filled.
    pub fn get(&self, slot: u64) -> Option<&Stripe> {
        self.stripes.get((slot % GROUP_STRIPES) as usize).filter(|s| !s.is_empty())
    }

    pub fn get_mut(&mut self, slot: u64) -> Option<&mut Stripe> {
        self.stripes.get_mut((slot % GROUP_STRIPES) as usize).filter(|s| !s.is_empty())
    }

    /// The group's epoch counter and the stripe in `slot` (of this group), if filled, apart:
    /// what `rstore::repair`'s transitions take.
    pub fn slot_mut(&mut self, slot: u64) -> Option<(&mut u32, &mut Stripe)> {
        let stripe = self.stripes.get_mut((slot % GROUP_STRIPES) as usize).filter(|s| !s.is_empty())?;
        Some((&mut self.epoch, stripe))
    }

    /// Put `stripe` in `slot` (of this group).
    pub fn put(&mut self, slot: u64, stripe: Stripe) {
        let i = (slot % GROUP_STRIPES) as usize;
        if self.stripes.len() <= i {
            self.stripes.resize(i + 1, Vec::new());
        }
        self.stripes[i] = stripe;
    }

    /// Whether every stripe's copies are all `ok` (the repair index leaves it out).
    pub fn whole(&self) -> bool {
        self.stripes.iter().flatten().all(|c| c.state == CopyState::Ok)
    }

    pub fn is_empty(&self) -> bool {
        self.stripes.iter().all(Vec::is_empty)
    }
}

/// The group of `slot`.
pub fn group_of(slot: u64) -> u64 {
    slot / GROUP_STRIPES
}

/// An `raddress` segment's binding, as read: its length and its stripes, in address order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub len: u64,
    pub stripes: Vec<Stripe>,
}

/// A whole namespace, read from its head, its allocations and its groups (`rstore`'s
/// `Coordinator::join_ns`): what `skiff ns` shows and tests check. Never written as one
/// record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Namespace {
    pub name: String,
    pub scope: Scope,
    pub chunk_bytes: u64,
    pub replicas: u32,
    /// Stripes reserved and not bound to an address.
    pub reserved: Vec<Stripe>,
    /// Allocations by address.
    pub allocs: BTreeMap<u64, Allocation>,
    /// Where the next allocation without an address goes.
    pub next_addr: u64,
    /// The highest epoch of its groups.
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

/// The key of extent `e` of server `id`'s pool.
pub fn extent_key(id: &str, e: u64) -> Vec<u8> {
    format!("{POOL_EXTENTS}{id}/{e:08x}").into_bytes()
}

/// The key of the generations of extent `e` of server `id`'s pool.
pub fn generations_key(id: &str, e: u64) -> Vec<u8> {
    format!("{POOL_GENERATIONS}{id}/{e:08x}").into_bytes()
}

/// The key of the allocation at `addr` of namespace `name` (key order is address order).
pub fn alloc_key(name: &str, addr: u64) -> Vec<u8> {
    format!("{ALLOCS}{name}/{addr:016x}").into_bytes()
}

/// The address an allocation's key names.
pub fn alloc_addr(key: &[u8]) -> Option<u64> {
    let hex = key.rsplit(|&b| b == b'/').next()?;
    u64::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()
}

/// The key of group `g` of namespace `name`'s stripe table.
pub fn group_key(name: &str, g: u64) -> Vec<u8> {
    format!("{GROUPS}{name}/{g:08x}").into_bytes()
}

/// The group a group's key names.
pub fn group_index(key: &[u8]) -> Option<u64> {
    let hex = key.rsplit(|&b| b == b'/').next()?;
    u64::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()
}

/// The key that marks group `g` of namespace `name` as holding a copy that is not `ok`
/// (the repair leader and the sources look there first).
pub fn mend_key(name: &str, g: u64) -> Vec<u8> {
    format!("{MENDING}{name}/{g:08x}").into_bytes()
}

/// The prefix of every key of namespace `name` under `prefix` ([`ALLOCS`], [`GROUPS`],
/// [`MENDING`]).
pub fn under(prefix: &str, name: &str) -> Vec<u8> {
    format!("{prefix}{name}/").into_bytes()
}

/// A record's own bounds, checked whenever it is read: one that parses but breaks them (a run
/// past the slots made, a bitmap past its extent, a group of more stripes than it has room
/// for) is as corrupt as one that does not parse, and no caller walks what it claims.
pub trait Record: serde::de::DeserializeOwned {
    fn check(&self) -> Result<(), String>;
}

/// Most copies a stripe may have in a record.
pub const REPLICAS_MAX: usize = 16;

/// Most slots an allocation or a reserve may name (2^40: far past any pool).
const SLOTS_MAX: u64 = 1 << 40;

fn check_run_list(runs: &[Run], below: u64, what: &str) -> Result<(), String> {
    if runs.len() > RUNS_MAX * 2 {
        return Err(format!("{what}: {} runs", runs.len()));
    }
    let mut end = 0;
    for r in runs {
        let Some(e) = r.0.checked_add(r.1).filter(|&e| e <= below && r.1 > 0 && r.0 >= end) else {
            return Err(format!(
                "{what}: run [{}, {}] is empty, overlaps, or ends past slot {below}",
                r.0, r.1
            ));
        };
        end = e;
    }
    Ok(())
}

impl Record for ServerInfo {
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

impl Record for PoolHead {
    fn check(&self) -> Result<(), String> {
        let extents = self.chunks.div_ceil(EXTENT_CHUNKS);
        if self.chunks > POOL_CHUNKS_MAX || self.free.checked_add(self.dirty).is_none_or(|n| n > self.chunks)
        {
            return Err(format!("{} chunks, {} free and {} dirty", self.chunks, self.free, self.dirty));
        }
        if !self.with_free.within(extents) || !self.with_dirty.within(extents) {
            return Err(format!("an extent bitmap past the pool's {extents} extents"));
        }
        Ok(())
    }
}

impl Record for Extent {
    fn check(&self) -> Result<(), String> {
        let ok = self.used.within(EXTENT_CHUNKS) && self.dirty.within(EXTENT_CHUNKS);
        ok.then_some(()).ok_or_else(|| format!("a chunk past the extent's {EXTENT_CHUNKS}"))
    }
}

impl Record for Generations {
    fn check(&self) -> Result<(), String> {
        let ok = self.0.keys().all(|&c| u64::from(c) < EXTENT_CHUNKS);
        ok.then_some(()).ok_or_else(|| format!("a chunk past the extent's {EXTENT_CHUNKS}"))
    }
}

impl Record for NsHead {
    fn check(&self) -> Result<(), String> {
        if self.chunk_bytes < 512 || !self.chunk_bytes.is_power_of_two() || self.replicas == 0 {
            return Err(format!("chunks of {} bytes, {} replicas", self.chunk_bytes, self.replicas));
        }
        check_run_list(&self.reserved, self.slots.min(SLOTS_MAX), "the reserve")
    }
}

impl Record for AllocRecord {
    fn check(&self) -> Result<(), String> {
        if self.len == 0 {
            return Err("an allocation of 0 bytes".into());
        }
        // Runs in the order of the addresses they back, which need not be slot order.
        let mut sorted = self.runs.clone();
        sorted.sort();
        check_run_list(&sorted, SLOTS_MAX, "the allocation")
    }
}

impl Record for StripeGroup {
    fn check(&self) -> Result<(), String> {
        if self.stripes.len() as u64 > GROUP_STRIPES || self.stripes.iter().any(|s| s.len() > REPLICAS_MAX) {
            return Err(format!(
                "{} stripes (at most {GROUP_STRIPES}), or one of more than {REPLICAS_MAX} copies",
                self.stripes.len()
            ));
        }
        Ok(())
    }
}

/// A record read from etcd; one that does not parse, or breaks its bounds, is
/// [`CoordError::Corrupt`].
pub fn decode<T: Record>(kv: &Kv) -> Result<T, CoordError> {
    let corrupt =
        |why: String| CoordError::Corrupt { key: String::from_utf8_lossy(&kv.key).into_owned(), why };
    let record: T = serde_json::from_slice(&kv.value).map_err(|e| corrupt(e.to_string()))?;
    record.check().map_err(corrupt)?;
    Ok(record)
}

/// What fuzzing reaches (fuzz/fuzz_targets/records.rs): `bytes` decoded as each record, and
/// what parses walked as the control path walks it. Never panics, never loops long.
pub fn fuzz_records(bytes: &[u8]) {
    let kv = Kv {
        key: b"/skiff/fuzz".to_vec(),
        value: bytes.to_vec(),
        create_revision: 1,
        mod_revision: 1,
        lease: 0,
    };
    if let Ok(h) = decode::<PoolHead>(&kv) {
        let _ = (h.with_free.iter().count(), h.with_dirty.count(), h.extents_from(h.chunks / 2));
    }
    if let Ok(e) = decode::<Extent>(&kv) {
        let _ = (e.any_free(0, EXTENT_CHUNKS), e.used.count());
    }
    if let Ok(g) = decode::<Generations>(&kv) {
        let _ = g.get(EXTENT_CHUNKS - 1);
    }
    if let Ok(h) = decode::<NsHead>(&kv) {
        let mut reserved = h.reserved.clone();
        let _ = (run_len(&h.reserved), take_runs(&mut reserved, 3), take_last_runs(&mut reserved, 3));
    }
    if let Ok(a) = decode::<AllocRecord>(&kv) {
        let _ = (run_len(&a.runs), slots(&a.runs).take(1 << 16).count());
    }
    if let Ok(g) = decode::<StripeGroup>(&kv) {
        let _ = (g.whole(), g.is_empty(), g.get(GROUP_STRIPES - 1));
    }
    let _ = decode::<ServerInfo>(&kv);
}

/// A record as etcd stores it (JSON).
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("control-plane records serialize")
}

/// Runs of a namespace's reserve or an allocation, refused past [`RUNS_MAX`].
pub fn check_runs(name: &str, runs: &[Run]) -> Result<(), CoordError> {
    if runs.len() > RUNS_MAX {
        return Err(CoordError::Invalid(format!(
            "namespace {name:?}: its reserve would be split into {} runs, more than {RUNS_MAX}; free and allocate in larger pieces",
            runs.len()
        )));
    }
    Ok(())
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

    /// A seeded xorshift64 generator: the tests' inputs are the seed's.
    fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

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

    /// Bitmaps keep their members through a record, trailing empty words dropped, and a
    /// bitmap that is not hex in whole words is refused.
    #[test]
    fn bitmaps_round_trip_as_hex_words() {
        let mut b = Bitmap::default();
        for i in [0, 63, 64, 1023, 5000] {
            b.set(i, true);
        }
        b.set(5000, false);
        b.set(9999, false);
        let text = serde_json::to_string(&b).unwrap();
        assert_eq!(text.len(), 2 + 16 * 16, "{text}");
        let back: Bitmap = serde_json::from_str(&text).unwrap();
        assert_eq!(back.iter().collect::<Vec<_>>(), vec![0, 63, 64, 1023]);
        assert_eq!((back.count(), back.get(64), back.get(65)), (4, true, false));
        for bad in ["\"abc\"", "\"zzzzzzzzzzzzzzzz\"", "7"] {
            assert!(serde_json::from_str::<Bitmap>(bad).is_err(), "{bad}");
        }
    }

    /// The word-at-a-time searches agree with a search chunk by chunk, over extents filled at
    /// random and every range within them (the last extent of a pool may be short).
    #[test]
    fn free_chunks_are_found_a_word_at_a_time_as_one_by_one() {
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
        for round in 0..200 {
            let e = round % 3;
            let mut extent = Extent::default();
            let density = next() % 100;
            for i in 0..EXTENT_CHUNKS {
                extent.used.set(i, next() % 100 < density);
                extent.dirty.set(i, next() % 100 < density / 4);
            }
            let base = e * EXTENT_CHUNKS;
            for _ in 0..50 {
                let a = base + next() % EXTENT_CHUNKS;
                let b = a + next() % (base + EXTENT_CHUNKS - a + 1);
                let naive = (a..b).find(|&c| extent.is_free(c));
                assert_eq!(extent.first_free(a..b), naive, "round {round}: {a}..{b}");
            }
            assert_eq!(extent.used.first(), extent.used.iter().next(), "round {round}");
        }
    }

    /// Runs stay sorted and merged as slots come back, and are taken from the front (alloc)
    /// or the back (release) exactly.
    #[test]
    fn runs_merge_and_split_exactly() {
        let mut runs = Vec::new();
        add_run(&mut runs, Run(10, 5));
        add_run(&mut runs, Run(0, 5));
        add_run(&mut runs, Run(5, 5));
        add_run(&mut runs, Run(20, 0));
        assert_eq!(runs, vec![Run(0, 15)]);
        assert_eq!(take_runs(&mut runs, 4), vec![Run(0, 4)]);
        add_run(&mut runs, Run(30, 2));
        assert_eq!(take_last_runs(&mut runs, 3), vec![Run(14, 1), Run(30, 2)]);
        assert_eq!(runs, vec![Run(4, 10)]);
        assert_eq!(take_runs(&mut runs, 99), vec![Run(4, 10)]);
        assert!(runs.is_empty());
        assert_eq!(slots(&[Run(3, 2), Run(9, 1)]).collect::<Vec<_>>(), vec![3, 4, 9]);
        let mut runs = vec![Run(0, 10), Run(20, 5)];
        remove_run(&mut runs, Run(3, 2));
        remove_run(&mut runs, Run(20, 5));
        remove_run(&mut runs, Run(50, 1));
        assert_eq!(runs, vec![Run(0, 3), Run(5, 5)]);
        assert_eq!(intersect(&runs, Run(4, 3)), vec![Run(5, 2)]);
    }

    /// Records that parse but break their bounds are refused as corrupt, saying why, and
    /// seeded mutations of valid records never panic the decoders or the walks after them
    /// (fuzz/fuzz_targets/records.rs runs the same, guided).
    #[test]
    fn records_out_of_bounds_are_corrupt_and_mutations_never_panic() {
        let kv = |v: &str| Kv {
            key: b"/skiff/x".to_vec(),
            value: v.into(),
            create_revision: 1,
            mod_revision: 1,
            lease: 0,
        };
        let head = r#"{"name":"n","scope":"ram","chunk_bytes":1048576,"replicas":2,"next_addr":0,"slots":10,"reserved":[[0,4],[6,4]],"allocs":0}"#;
        assert!(decode::<NsHead>(&kv(head)).is_ok());
        for (bad, says) in [
            (head.replace("[6,4]", "[6,5]"), "ends past slot 10"),
            (head.replace("[6,4]", "[2,4]"), "overlaps"),
            (head.replace("\"replicas\":2", "\"replicas\":0"), "0 replicas"),
        ] {
            let err = decode::<NsHead>(&kv(&bad)).expect_err(&bad).to_string();
            assert!(err.contains(says) && err.contains("/skiff/x"), "{err}");
        }
        let huge = r#"{"len":1,"runs":[[0,18446744073709551615]]}"#;
        assert!(decode::<AllocRecord>(&kv(huge)).is_err(), "a run of 2^64 slots is never walked");
        let extent = format!(r#"{{"used":"{}0000000000000001"}}"#, "0".repeat(16 * 16));
        assert!(decode::<Extent>(&kv(&extent)).is_err(), "a bitmap past the extent");
        let pool = r#"{"chunk_bytes":1,"chunks":10,"free":8,"dirty":3,"with_free":"","with_dirty":""}"#;
        assert!(decode::<PoolHead>(&kv(pool)).is_err(), "more free and dirty than chunks");

        let mut seeds =
            vec![head.to_owned(), String::from_utf8(encode(&PoolHead::new(1 << 20, 5000))).unwrap()];
        let mut g = StripeGroup::default();
        g.put(3, vec![ChunkRef::new("a", 7, 1, 2)]);
        seeds.push(String::from_utf8(encode(&g)).unwrap());
        seeds.push(r#"{"len":5,"runs":[[9,1],[0,2]]}"#.into());
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut bytes = seeds[i % seeds.len()].clone().into_bytes();
            for _ in 0..1 + x % 4 {
                let at = (x >> 8) as usize % bytes.len();
                match x % 3 {
                    0 => bytes[at] = b"0123456789[],:\"{}e-"[(x >> 20) as usize % 19],
                    1 => bytes.truncate(at.max(1)),
                    _ => bytes.insert(at, b'9'),
                }
                x = x.rotate_left(11) ^ i as u64;
            }
            fuzz_records(&bytes);
        }
    }

    /// A pool head is small at any size (a bit per extent), and growing it frees the new
    /// chunks and marks their extents.
    #[test]
    fn a_pool_head_is_small_at_any_size() {
        let mut head = PoolHead::new(4 << 20, 3000);
        assert_eq!((head.free, head.with_free.iter().collect::<Vec<_>>()), (3000, vec![0, 1, 2]));
        head.grow(5000);
        assert_eq!((head.free, head.with_free.count()), (5000, 5));
        let big = PoolHead::new(1 << 20, POOL_CHUNKS_MAX);
        assert!(encode(&big).len() < 2048, "{} bytes", encode(&big).len());
        assert_eq!(extent_chunks(4, 5000), 4096..5000);
    }
}
