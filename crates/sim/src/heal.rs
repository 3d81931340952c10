//! The seeded simulation of RStore's healing (issue 32; docs/RSTORE.md, "Healing"): memory
//! servers, a namespace record as etcd would hold it, writers that map it, and the repair
//! agent, stepped on one thread in an order the seed draws, with crashes (a RAM pool comes
//! back empty, a file pool with its data, perhaps damaged), restarts, leases that lapse, etcd going away and
//! coming back, and stale maps. Every read is checked against the writes acknowledged before
//! it, and at the end every copy of every stripe against them all.
//!
//! What runs for real: the servers' chunk state ([`proto::grant::PoolGrants`]: epochs raised
//! by grants, dirty regions, repair locks), the grants' sealing ([`coord::ServerInfo`]), and
//! every decision of the control plane and the leader ([`rstore::repair`]). What is modelled:
//! the drivers around them, step for step as `rstore::segment` and `rstore::agent` take
//! them: a write goes to the healthy copies, then to the syncing ones; a lost server is
//! reported and the map read again; a stale map is read again; `Busy` is tried again; a
//! source raises its chunk, then locks, copies and unlocks region by region. Each of
//! those is one step, so the seed interleaves them with everything else.
//!
//! A file server back from a crash may find its pool damaged in place: a region of each of
//! its copies that are not `ok` reads other bytes, which only a partial repair's comparison
//! of the regions not dirty finds.
//!
//! Planted bugs ([`Lie`]) prove the checks catch what they claim: a repair that skips a
//! dirty region, one that compares nothing, and a server that takes a write made under a
//! stale map.

use coord::{ChunkRef, CopyState, Namespace, Scope, ServerInfo};
use proto::grant::{Bound, PoolGrants, REGIONS};
use rstore::repair;
use wire::{Opcode, Status};

use crate::rng::Rng;

const CHUNK: u64 = 4096;
const REGION: u64 = CHUNK / REGIONS as u64;
const SERVERS: usize = 4;
const CHUNKS_PER_SERVER: u64 = 8;
const STRIPES: usize = 4;
const WRITERS: usize = 2;
/// Steps a dead server stays registered (its lease) before it vanishes.
const LEASE: u64 = 40;
/// Steps a stale copy's server may stay away before its copy is rebuilt elsewhere.
const GRACE: u64 = 150;

/// A bug planted on purpose, to show the simulation catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lie {
    None,
    /// Sources skip the last dirty region of each repair.
    SkipDirty,
    /// Servers take writes made under a map older than the one they know.
    AcceptStale,
    /// Partial repairs trust the regions not dirty: they compare nothing.
    NoVerify,
}

#[derive(Debug, Clone, Copy)]
pub struct HealOptions {
    pub seed: u64,
    pub steps: usize,
    pub lie: Lie,
}

/// What a run did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HealReport {
    pub writes: u64,
    pub reads: u64,
    pub crashes: u64,
    pub remaps: u64,
    pub busy: u64,
    pub repairs: u64,
    pub partial: u64,
    pub relocations: u64,
    pub regions_copied: u64,
    pub etcd_outages: u64,
    /// Regions of copies not ok damaged while their file server was down, and regions a
    /// partial repair found different from its source (and copied).
    pub damaged: u64,
    pub mismatched: u64,
}

impl HealReport {
    pub fn add(&mut self, o: &HealReport) {
        self.writes += o.writes;
        self.reads += o.reads;
        self.crashes += o.crashes;
        self.remaps += o.remaps;
        self.busy += o.busy;
        self.repairs += o.repairs;
        self.partial += o.partial;
        self.relocations += o.relocations;
        self.regions_copied += o.regions_copied;
        self.etcd_outages += o.etcd_outages;
        self.damaged += o.damaged;
        self.mismatched += o.mismatched;
    }
}

struct Server {
    info: ServerInfo,
    key: [u8; 32],
    grants: PoolGrants,
    data: Vec<u8>,
    alive: bool,
    registered: bool,
    down_at: u64,
    /// Moves on at every start: connections and grants of an earlier life are gone.
    life: u64,
    /// Chunks never handed out, or given back.
    free: Vec<u64>,
}

impl Server {
    fn new(i: usize, scope: Scope, rng: &mut Rng) -> Server {
        let key = [i as u8 + 1; 32];
        let info = ServerInfo {
            id: format!("s{i}"),
            endpoint: format!("127.0.0.1:{}", 7000 + i),
            export: "pool".into(),
            scope,
            bytes: CHUNK * CHUNKS_PER_SERVER,
            chunk_bytes: CHUNK,
            incarnation: if scope == Scope::Ram { rng.next_u64() | 1 } else { 0 },
            grant_key: coord::encode_key(&key),
            boot: rng.next_u64(),
        };
        Server {
            info,
            key,
            grants: PoolGrants::new(key, CHUNK, CHUNKS_PER_SERVER).expect("a pool"),
            data: vec![0; (CHUNK * CHUNKS_PER_SERVER) as usize],
            alive: true,
            registered: true,
            down_at: 0,
            life: 0,
            free: (0..CHUNKS_PER_SERVER).rev().collect(),
        }
    }

    /// Back after a crash: a file pool keeps its bytes (and its incarnation), a RAM pool comes
    /// back empty in another; a new key either way, and a new boot.
    fn restart(&mut self, rng: &mut Rng) {
        self.key = [rng.next_u64() as u8 | 1; 32];
        self.info.grant_key = coord::encode_key(&self.key);
        self.info.boot = rng.next_u64();
        if self.info.scope == Scope::Ram {
            self.info.incarnation = rng.next_u64() | 1;
            self.data.fill(0);
        }
        self.grants = PoolGrants::new(self.key, CHUNK, CHUNKS_PER_SERVER).expect("a pool");
        self.alive = true;
        self.registered = true;
        self.life += 1;
    }
}

/// One copy in a writer's map, with the grant its connection holds there.
#[derive(Clone)]
struct Copy {
    server: usize,
    index: u64,
    syncing: bool,
    bound: Bound,
    life: u64,
}

#[derive(Clone)]
struct Op {
    write: Option<Vec<u8>>,
    stripe: usize,
    at: u64,
    len: u64,
    /// Copies still to do in this phase (indices into the stripe's map).
    pending: Vec<usize>,
    second: bool,
    again: bool,
}

#[derive(Default)]
struct Writer {
    map: Option<Vec<Vec<Copy>>>,
    lost: Vec<usize>,
    op: Option<Op>,
}

/// A repair a source is copying out.
struct Task {
    stripe: usize,
    copy: usize,
    epoch: u32,
    source: usize,
    source_chunk: u64,
    target: Copy,
    regions: u64,
    /// Regions left to compare with the source (a partial repair's regions not dirty).
    verify: u64,
    /// The region locked now, if any.
    locked: Option<u32>,
    full: bool,
}

struct World {
    rng: Rng,
    lie: Lie,
    now: u64,
    servers: Vec<Server>,
    ns: Namespace,
    etcd_up: bool,
    /// The bytes of the segment as the acknowledged writes left them.
    model: Vec<u8>,
    writers: Vec<Writer>,
    tasks: Vec<Task>,
    report: HealReport,
    /// The last events, for a failure's message.
    log: std::collections::VecDeque<String>,
}

fn index_of(id: &str) -> usize {
    id[1..].parse().expect("s<i>")
}

impl World {
    fn note(&mut self, what: String) {
        if self.log.len() == 4000 {
            self.log.pop_front();
        }
        self.log.push_back(format!("{}: {what}", self.now));
    }

    /// Every stripe's copies, `server/chunk state epoch`.
    fn states(&self) -> String {
        let stripes: Vec<String> = self.ns.allocs[&0]
            .stripes
            .iter()
            .map(|st| {
                let copies: Vec<String> = st
                    .iter()
                    .map(|c| {
                        let from = if c.from.is_empty() { String::new() } else { format!("<{}", c.from) };
                        format!("{}/{} {}{} e{}", c.server, c.index, c.state, from, c.epoch)
                    })
                    .collect();
                copies.join(", ")
            })
            .collect();
        stripes.join(" | ")
    }

    fn live(&self) -> Vec<ServerInfo> {
        self.servers.iter().filter(|s| s.registered).map(|s| s.info.clone()).collect()
    }

    fn present(&self) -> Vec<ServerInfo> {
        self.servers.iter().filter(|s| s.registered && s.alive).map(|s| s.info.clone()).collect()
    }

    /// The stripe's bytes in the model.
    fn expected(&self, stripe: usize) -> &[u8] {
        &self.model[stripe * CHUNK as usize..(stripe + 1) * CHUNK as usize]
    }

    /// The map a client reads now (`Coordinator::resolve`): first the copies (healthy or
    /// syncing) whose server is gone are marked stale, then each stripe's ok and syncing copies on live
    /// servers, with grants presented to the servers alive.
    fn resolve(&mut self) -> Option<Vec<Vec<Copy>>> {
        let live = self.live();
        let now = self.now;
        let alloc = self.ns.allocs.get_mut(&0).expect("the allocation");
        for stripe in &mut alloc.stripes {
            for i in 0..stripe.len() {
                if stripe[i].state != CopyState::Stale && repair::holder(&live, &stripe[i]).is_none() {
                    repair::mark_stale(&mut self.ns.epoch, stripe, i, &live, now);
                }
            }
        }
        let mut map = Vec::new();
        for stripe in &self.ns.allocs[&0].stripes {
            let track = !repair::whole(stripe);
            let mut copies = Vec::new();
            for c in stripe.iter().filter(|c| c.state != CopyState::Stale) {
                let Some(info) = repair::holder(&live, c) else { continue };
                let s = index_of(&info.id);
                let syncing = c.state == CopyState::Syncing;
                let cap = info.grant_at(c.index, c.generation, c.epoch, track && !syncing).ok()??;
                let server = &self.servers[s];
                // A server that cannot be reached is in the map all the same: as for a
                // segment whose lane fails to connect, the first request to it reports it lost.
                let (bound, life) = if server.alive {
                    (server.grants.admit(&cap).ok()?, server.life)
                } else {
                    let b = Bound {
                        chunk: c.index,
                        generation: c.generation,
                        epoch: c.epoch,
                        rights: cap.rights,
                    };
                    (b, u64::MAX)
                };
                copies.push(Copy { server: s, index: c.index, syncing, bound, life });
            }
            copies.sort_by_key(|c| c.syncing);
            if copies.iter().all(|c| c.syncing) {
                return None;
            }
            map.push(copies);
        }
        Some(map)
    }

    /// Server `s`'s answer to a request on `copy` (`None`: its connection is gone).
    fn check(&mut self, copy: &Copy, opcode: Opcode, at: u64, len: u32) -> Option<Result<(), Status>> {
        let s = &self.servers[copy.server];
        if !s.alive || s.life != copy.life {
            return None;
        }
        let offset = copy.index * CHUNK + at;
        let mut verdict = s.grants.check(opcode, Some(&copy.bound), offset, len);
        if self.lie == Lie::AcceptStale && verdict == Err(Status::StaleCapability) {
            let generation = s.grants.generation(copy.index);
            if generation == Some(copy.bound.generation) {
                verdict = Ok(());
            }
        }
        Some(verdict)
    }

    fn writer_step(&mut self, w: usize) -> Result<(), String> {
        if self.writers[w].map.is_none() {
            if !self.etcd_up {
                return Ok(());
            }
            let live = self.live();
            let now = self.now;
            for server in std::mem::take(&mut self.writers[w].lost) {
                let id = self.servers[server].info.id.clone();
                let alloc = self.ns.allocs.get_mut(&0).expect("the allocation");
                for stripe in &mut alloc.stripes {
                    if let Some(i) = stripe.iter().position(|c| c.server == id) {
                        repair::mark_stale(&mut self.ns.epoch, stripe, i, &live, now);
                    }
                }
            }
            let map = self.resolve();
            self.report.remaps += 1;
            let states = self.states();
            self.note(format!("writer {w} maps: {states}"));
            let Some(map) = map else { return Ok(()) };
            let writer = &mut self.writers[w];
            if let Some(op) = writer.op.as_mut() {
                op.pending = (0..map[op.stripe].len()).filter(|&i| !map[op.stripe][i].syncing).collect();
                if op.write.is_none() {
                    op.pending.truncate(1);
                }
                op.second = false;
                op.again = false;
            }
            writer.map = Some(map);
            return Ok(());
        }
        if self.writers[w].op.is_none() {
            let stripe = self.rng.below(STRIPES as u64) as usize;
            let share = CHUNK / WRITERS as u64;
            let len = self.rng.range(1, share.min(300));
            let at = w as u64 * share + self.rng.below(share - len + 1);
            let write = self
                .rng
                .chance(700_000)
                .then(|| (0..len).map(|_| self.rng.next_u64() as u8).collect::<Vec<u8>>());
            let map = self.writers[w].map.as_ref().expect("mapped");
            let mut pending: Vec<usize> =
                (0..map[stripe].len()).filter(|&i| !map[stripe][i].syncing).collect();
            if write.is_none() {
                pending.truncate(1);
            }
            self.writers[w].op = Some(Op { write, stripe, at, len, pending, second: false, again: false });
            return Ok(());
        }
        let op = self.writers[w].op.clone().expect("an op");
        let map = self.writers[w].map.clone().expect("mapped");
        let len = op.len;
        let Some(&next) = op.pending.first() else {
            // This phase is done.
            let writer = &mut self.writers[w];
            if op.again {
                writer.map = None;
                return Ok(());
            }
            let syncing: Vec<usize> =
                (0..map[op.stripe].len()).filter(|&i| map[op.stripe][i].syncing).collect();
            if op.write.is_some() && !op.second && !syncing.is_empty() {
                let o = writer.op.as_mut().expect("an op");
                o.second = true;
                o.pending = syncing;
                return Ok(());
            }
            if let Some(data) = &op.write {
                let at = op.stripe * CHUNK as usize + op.at as usize;
                self.model[at..at + data.len()].copy_from_slice(data);
                self.report.writes += 1;
                let copies: Vec<String> =
                    map[op.stripe].iter().map(|c| format!("s{}/{}", c.server, c.index)).collect();
                self.note(format!(
                    "writer {w} wrote stripe {} {}+{} to {copies:?}",
                    op.stripe, op.at, op.len
                ));
            }
            self.writers[w].op = None;
            return Ok(());
        };
        let copy = map[op.stripe][next].clone();
        let opcode = if op.write.is_some() { Opcode::Write } else { Opcode::Read };
        let verdict = self.check(&copy, opcode, op.at, len as u32);
        let o = self.writers[w].op.as_mut().expect("an op");
        match verdict {
            None => {
                self.note(format!("writer {w}: s{} lost", copy.server));
                self.writers[w].lost.push(copy.server);
                let o = self.writers[w].op.as_mut().expect("an op");
                o.again = true;
                o.pending.remove(0);
            }
            Some(Err(Status::Busy)) => self.report.busy += 1,
            Some(Err(Status::StaleCapability)) => {
                o.again = true;
                o.pending.remove(0);
                let now = self.servers[copy.server].grants.version(copy.index);
                let held = (copy.bound.generation, copy.bound.epoch);
                self.note(format!(
                    "writer {w}: s{}/{} is at {now:?}, the map at {held:?}",
                    copy.server, copy.index
                ));
            }
            Some(Err(other)) => return Err(format!("a request refused with {other}")),
            Some(Ok(())) => {
                o.pending.remove(0);
                let base = (copy.index * CHUNK + op.at) as usize;
                match &op.write {
                    Some(data) => {
                        self.servers[copy.server].data[base..base + data.len()].copy_from_slice(data)
                    }
                    None => {
                        self.report.reads += 1;
                        let got = &self.servers[copy.server].data[base..base + len as usize];
                        let want = &self.expected(op.stripe)[op.at as usize..(op.at + len) as usize];
                        if got != want {
                            return Err(format!(
                                "step {}: a read of stripe {} at {} from s{} returned bytes no acknowledged write left",
                                self.now, op.stripe, op.at, copy.server
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The leader's pass (when etcd is up): plan, and rebuild elsewhere what stayed away.
    fn leader_step(&mut self) {
        if !self.etcd_up {
            return;
        }
        let (live, present) = (self.live(), self.present());
        let ns = &mut self.ns;
        let stripes = ns.allocs.get_mut(&0).expect("the allocation").stripes.iter_mut().enumerate();
        let plan = repair::plan(
            &mut ns.epoch,
            stripes.map(|(i, s)| (i as u64, s)),
            &live,
            &present,
            self.now,
            GRACE,
        );
        if plan.changed() {
            let states = self.states();
            self.note(format!("leader plans: {states}"));
        }
        for r in &plan.relocate {
            let spare = self
                .servers
                .iter()
                .position(|s| s.alive && s.registered && !r.avoid.contains(&s.info.id) && !s.free.is_empty());
            let Some(to) = spare else { continue };
            let s = &self.servers[to];
            let index = *s.free.last().expect("a free chunk");
            let chunk =
                ChunkRef::new(&s.info.id, index, s.info.incarnation, s.grants.generation(index).unwrap_or(0));
            let ns = &mut self.ns;
            let stripe = &mut ns.allocs.get_mut(&0).expect("the allocation").stripes[r.stripe as usize];
            if let Some(old) = repair::relocate(&mut ns.epoch, stripe, r, chunk, &live) {
                self.servers[to].free.pop();
                // Given back: its server zeroes it when it returns, before handing it out.
                let back = &mut self.servers[index_of(&old.server)];
                let base = (old.index * CHUNK) as usize;
                back.data[base..base + CHUNK as usize].fill(0);
                back.grants.retire(old.index);
                back.free.insert(0, old.index);
                self.report.relocations += 1;
                let states = self.states();
                self.note(format!("relocated {}/{}: {states}", old.server, old.index));
            }
        }
    }

    /// Sources take up the repairs they are named in.
    fn start_tasks(&mut self) {
        if !self.etcd_up {
            return;
        }
        let live = self.live();
        for (si, stripe) in self.ns.allocs[&0].stripes.iter().enumerate() {
            for (ci, c) in stripe.iter().enumerate() {
                if c.state != CopyState::Syncing || self.tasks.iter().any(|t| t.stripe == si && t.copy == ci)
                {
                    continue;
                }
                let Some(src) = stripe.iter().find(|s| s.server == c.from && s.state == CopyState::Ok) else {
                    continue;
                };
                let source = index_of(&src.server);
                let Some(info) = repair::holder(&live, c) else { continue };
                let target = index_of(&info.id);
                if !self.servers[source].alive || !self.servers[target].alive {
                    continue;
                }
                let Ok(Some(cap)) = info.grant_at(c.index, c.generation, c.epoch, false) else { continue };
                // The source raises its chunk (no older map's write lands after), then takes
                // what its dirty regions say; presenting the grant raises the target's.
                if self.servers[source].grants.raise(src.index, src.generation, c.epoch) != Some(Ok(())) {
                    continue;
                }
                let Ok(bound) = self.servers[target].grants.admit(&cap) else { continue };
                // Partial only from the boot whose dirty regions cover the copy: a source that
                // restarted since lost them, and copies it all.
                let full = c.full || !c.dirty_on.contains(&repair::tracker(&self.servers[source].info));
                let regions = if full { u64::MAX } else { self.servers[source].grants.dirty(src.index) };
                let life = self.servers[target].life;
                let note =
                    format!("s{source} copies {:#x} to s{target}/{} (full {})", regions, c.index, c.full);
                self.log.push_back(format!("{}: {note}", self.now));
                self.tasks.push(Task {
                    stripe: si,
                    copy: ci,
                    epoch: c.epoch,
                    source,
                    source_chunk: src.index,
                    target: Copy { server: target, index: c.index, syncing: true, bound, life },
                    regions,
                    verify: if full || self.lie == Lie::NoVerify { 0 } else { !regions },
                    locked: None,
                    full,
                });
            }
        }
    }

    /// One step of task `t`: lock the next region; or copy the locked one and unlock
    /// it; or compare the next region not dirty (unlocked, as `rstore::agent` does) and copy
    /// it too if it differs; or, with nothing left, mark the copy healthy.
    fn task_step(&mut self, t: usize) {
        let task = &self.tasks[t];
        let (source, chunk) = (task.source, task.source_chunk);
        let alive = self.servers[source].alive && self.servers[task.target.server].alive;
        let target_ok = self.servers[task.target.server].life == task.target.life;
        if !alive || !target_ok {
            // The source died (its locks with it), or the target: the leader sorts it out.
            if let Some(r) = task.locked {
                self.servers[source].grants.lock(chunk, 1 << r, false);
            }
            self.tasks.swap_remove(t);
            return;
        }
        match task.locked {
            None if task.regions == 0 && task.verify != 0 => {
                let r = task.verify.trailing_zeros();
                let bit = 1u64 << r;
                let target = task.target.clone();
                let at = u64::from(r) * REGION;
                if self.check(&target, Opcode::Read, at, REGION as u32) != Some(Ok(())) {
                    // The target moved on (a newer map) or went: this repair is over.
                    self.tasks.swap_remove(t);
                    return;
                }
                let region = |server: &Server, index: u64| {
                    let from = (index * CHUNK + at) as usize;
                    server.data[from..from + REGION as usize].to_vec()
                };
                let same = region(&self.servers[source], chunk)
                    == region(&self.servers[target.server], target.index);
                let task = &mut self.tasks[t];
                task.verify &= !bit;
                if !same {
                    task.regions |= bit;
                    self.report.mismatched += 1;
                }
            }
            None if task.regions == 0 => {
                if !self.etcd_up {
                    return;
                }
                let task = self.tasks.swap_remove(t);
                let from = self.servers[source].info.id.clone();
                let stripe = &mut self.ns.allocs.get_mut(&0).expect("the allocation").stripes[task.stripe];
                if repair::finish(&mut self.ns.epoch, stripe, task.copy, &from, task.epoch) {
                    self.report.repairs += 1;
                    self.report.partial += u64::from(!task.full);
                    let states = self.states();
                    self.note(format!("repaired from {from}: {states}"));
                }
            }
            None => {
                let r = task.regions.trailing_zeros();
                if self.lie == Lie::SkipDirty && task.regions.count_ones() == 1 && !task.full {
                    self.tasks[t].regions = 0;
                    return;
                }
                let bit = 1u64 << r;
                self.servers[source].grants.lock(chunk, bit, true);
                let task = &mut self.tasks[t];
                task.locked = Some(r);
                task.regions &= !bit;
            }
            Some(r) => {
                let bit = 1u64 << r;
                let from = (chunk * CHUNK + u64::from(r) * REGION) as usize;
                let bytes = self.servers[source].data[from..from + REGION as usize].to_vec();
                let target = task.target.clone();
                match self.check(&target, Opcode::Write, u64::from(r) * REGION, REGION as u32) {
                    Some(Ok(())) => {
                        let to = (target.index * CHUNK + u64::from(r) * REGION) as usize;
                        self.servers[target.server].data[to..to + REGION as usize].copy_from_slice(&bytes);
                        self.servers[source].grants.lock(chunk, bit, false);
                        self.tasks[t].locked = None;
                        self.report.regions_copied += 1;
                    }
                    _ => {
                        // The target moved on (a newer map) or went: this repair is over.
                        self.servers[source].grants.lock(chunk, bit, false);
                        self.tasks.swap_remove(t);
                    }
                }
            }
        }
    }

    /// Crash a server if every stripe keeps a healthy copy on another server alive.
    fn crash(&mut self) {
        let s = self.rng.below(SERVERS as u64) as usize;
        if !self.servers[s].alive {
            return;
        }
        // Never more than replicas - 1 at once: another healthy copy of every stripe must hold
        // its data on a server alive (a RAM server back in another incarnation holds none).
        let id = self.servers[s].info.id.clone();
        let holds = |c: &ChunkRef| {
            let server = &self.servers[index_of(&c.server)];
            server.alive && server.info.incarnation == c.incarnation
        };
        let safe = self.ns.allocs[&0]
            .stripes
            .iter()
            .all(|st| st.iter().any(|c| c.server != id && c.state == CopyState::Ok && holds(c)));
        if !safe {
            return;
        }
        let server = &mut self.servers[s];
        server.alive = false;
        server.down_at = self.now;
        self.tasks.retain(|t| t.source != s);
        self.report.crashes += 1;
        self.note(format!("s{s} crashes"));
    }

    fn step(&mut self, faults: bool) -> Result<(), String> {
        self.now += 1;
        for s in &mut self.servers {
            if !s.alive && s.registered && self.now - s.down_at > LEASE {
                s.registered = false;
            }
        }
        let roll = self.rng.below(1000);
        match roll {
            0..=9 if faults => self.crash(),
            10..=29 => {
                let s = self.rng.below(SERVERS as u64) as usize;
                if !self.servers[s].alive && self.now - self.servers[s].down_at > 5 {
                    let mut rng = self.rng.fork(self.now);
                    self.servers[s].restart(&mut rng);
                    self.note(format!("s{s} restarts"));
                    self.damage(s);
                }
            }
            30..=34 if faults => {
                self.etcd_up = !self.etcd_up;
                self.report.etcd_outages += u64::from(!self.etcd_up);
            }
            35..=79 => self.leader_step(),
            80..=139 => self.start_tasks(),
            140..=499 if !self.tasks.is_empty() => {
                let t = self.rng.below(self.tasks.len() as u64) as usize;
                self.task_step(t);
            }
            _ => {
                let w = self.rng.below(WRITERS as u64) as usize;
                if faults || self.writers[w].op.is_some() {
                    self.writer_step(w)?;
                }
            }
        }
        Ok(())
    }

    /// A file server back from a crash with its pool damaged in place: one region of each of
    /// its copies that are not `ok` (those a repair will look at) reads other bytes. Copies
    /// still `ok` are trusted as they are (docs/RSTORE.md: no checksums on the data path).
    fn damage(&mut self, s: usize) {
        if self.servers[s].info.scope != Scope::File {
            return;
        }
        let id = self.servers[s].info.id.clone();
        let chunks: Vec<u64> = self.ns.allocs[&0]
            .stripes
            .iter()
            .flatten()
            .filter(|c| c.server == id && c.state != CopyState::Ok)
            .map(|c| c.index)
            .collect();
        for index in chunks {
            let r = self.rng.below(REGIONS as u64);
            let at = (index * CHUNK + r * REGION) as usize;
            for b in &mut self.servers[s].data[at..at + REGION as usize] {
                *b ^= 0x5A;
            }
            self.report.damaged += 1;
            self.note(format!("s{s}/{index} damaged in region {r}"));
        }
    }

    /// Every copy of every stripe holds what the acknowledged writes left.
    fn check_copies(&self) -> Result<(), String> {
        for (si, stripe) in self.ns.allocs[&0].stripes.iter().enumerate() {
            for c in stripe {
                if c.state != CopyState::Ok {
                    return Err(format!("stripe {si}: copy on {} is {} at the end", c.server, c.state));
                }
                let s = &self.servers[index_of(&c.server)];
                let base = (c.index * CHUNK) as usize;
                let got = &s.data[base..base + CHUNK as usize];
                if let Some(at) = got.iter().zip(self.expected(si)).position(|(a, b)| a != b) {
                    return Err(format!("stripe {si}: the copy on {} differs at byte {at}", c.server));
                }
            }
        }
        Ok(())
    }
}

/// Run one seed: `steps` steps with faults, then none until every copy is healthy again
/// (restarting what is down), then every copy is checked.
pub fn run_heal(opts: HealOptions) -> Result<HealReport, String> {
    let mut rng = Rng::new(opts.seed);
    let replicas = if opts.seed.is_multiple_of(3) { 3 } else { 2 };
    let scope = if opts.seed.is_multiple_of(2) { Scope::File } else { Scope::Ram };
    let mut servers: Vec<Server> = (0..SERVERS).map(|i| Server::new(i, scope, &mut rng)).collect();
    let mut stripes = Vec::new();
    for st in 0..STRIPES {
        let mut stripe = Vec::new();
        for r in 0..replicas {
            let s = &mut servers[(st + r) % SERVERS];
            let index = s.free.pop().expect("room");
            stripe.push(ChunkRef::new(&s.info.id, index, s.info.incarnation, 0));
        }
        stripes.push(stripe);
    }
    let mut ns = Namespace {
        name: "sim".into(),
        scope,
        chunk_bytes: CHUNK,
        replicas: replicas as u32,
        reserved: Vec::new(),
        allocs: Default::default(),
        next_addr: STRIPES as u64 * CHUNK,
        epoch: 0,
    };
    ns.allocs.insert(0, coord::Allocation { len: STRIPES as u64 * CHUNK, stripes });
    let mut world = World {
        rng,
        lie: opts.lie,
        now: 0,
        servers,
        ns,
        etcd_up: true,
        model: vec![0; STRIPES * CHUNK as usize],
        writers: (0..WRITERS).map(|_| Writer::default()).collect(),
        tasks: Vec::new(),
        report: HealReport::default(),
        log: Default::default(),
    };
    let fail = |w: &World, e: String| {
        let log: Vec<&str> = w.log.iter().map(String::as_str).collect();
        format!(
            "seed {}: {e} (step {}, {:?})\n  last events:\n    {}",
            opts.seed,
            w.now,
            w.report,
            log.join("\n    ")
        )
    };
    for _ in 0..opts.steps {
        world.step(true).map_err(|e| fail(&world, e))?;
    }
    // Calm: etcd back, every server back, no new I/O; run until whole and quiet.
    world.etcd_up = true;
    for _ in 0..20_000 {
        for s in 0..SERVERS {
            if !world.servers[s].alive {
                let mut rng = world.rng.fork(world.now);
                world.servers[s].restart(&mut rng);
                world.damage(s);
            }
        }
        // Whole as `skiff ns status` sees it: every copy ok, on its server in its incarnation.
        let whole = repair::Health::of(&world.ns, &world.live()).label() == "healthy";
        let quiet = world.writers.iter().all(|w| w.op.is_none()) && world.tasks.is_empty();
        if whole && quiet {
            world.check_copies().map_err(|e| fail(&world, e))?;
            return Ok(world.report);
        }
        world.step(false).map_err(|e| fail(&world, e))?;
    }
    Err(fail(&world, "never healed".into()))
}
