//! RStore heals its replicas (docs/RSTORE.md, "Healing"): what the repair leader decides, as
//! pure functions over a group of stripes, the servers registered now and the time. The
//! driver (`crate::agent`) reads the records, calls these, and writes what changed back in one
//! etcd transaction a group, guarded by the revision it read; the simulator and the unit tests call them
//! the same way. Nothing here does I/O.
//!
//! Every change to a stripe's copies moves its group's epoch on ([`touch`]): the stripe's
//! grants are sealed with it, so a memory server that is shown the new grants refuses requests
//! made under the old map (docs/PROTOCOL.md, 14.6). A copy goes:
//!
//! - `ok` → `stale` when its server is gone (or another incarnation of it registered: a RAM
//!   pool restarted empty), or a client lost it mid-write ([`mark_stale`]). It records which
//!   healthy copies track the regions it misses from then on (`dirty_on`, each `id@boot`). A
//!   tracker counts only while its copy stays healthy and its server keeps that boot: when
//!   its copy goes stale it is struck from the others' lists.
//! - `stale` → `syncing` when its server is back ([`plan`]): a partial copy from a healthy
//!   copy whose dirty regions cover what it missed (that server still runs the same boot), or
//!   else a full one. A RAM server back in another incarnation takes the chunk back empty, so
//!   in full.
//! - `stale` → a new `syncing` copy on another server, when its server stayed away longer than
//!   the grace period: [`Plan::relocate`] names it, and the driver reserves the spare chunk.
//! - `syncing` → `ok` when the source server copied it ([`finish`]); `syncing` → `stale` when
//!   its server or its source is gone.

use coord::{ChunkRef, CopyState, Namespace, ServerInfo, Stripe};

/// Repairs of one copy that may fail before its server stops counting as back.
pub const REPAIR_FAILURES_MAX: u32 = 3;

/// `id@boot` of a server: whose dirty regions a stale copy may be repaired from.
pub fn tracker(s: &ServerInfo) -> String {
    format!("{}@{:x}", s.id, s.boot)
}

/// The live registration of the server holding `c`, in `c`'s incarnation: its data is there.
pub fn holder<'a>(live: &'a [ServerInfo], c: &ChunkRef) -> Option<&'a ServerInfo> {
    live.iter().find(|s| s.id == c.server && s.incarnation == c.incarnation)
}

/// Whether every copy of the stripe is `ok`: its grants then carry no `TRACK`.
pub fn whole(stripe: &Stripe) -> bool {
    stripe.iter().all(|c| c.state == CopyState::Ok)
}

/// Move the epoch counter on (its stripe group's), and give it to every copy of `stripe`.
pub fn touch(epoch: &mut u32, stripe: &mut Stripe) {
    *epoch = epoch.wrapping_add(1).max(1);
    for c in stripe.iter_mut() {
        c.epoch = *epoch;
    }
}

/// Mark copy `i` of `stripe` stale at `now_ms`: it may miss writes from now on. Refused
/// (`false`) when no other copy is `ok` on a live server: its data is all there is, and there
/// is nothing to mark it stale against. The healthy copies' servers track what it misses.
pub fn mark_stale(epoch: &mut u32, stripe: &mut Stripe, i: usize, live: &[ServerInfo], now_ms: u64) -> bool {
    if stripe[i].state == CopyState::Stale {
        return false;
    }
    let trackers: Vec<String> = (0..stripe.len())
        .filter(|&j| j != i && stripe[j].state == CopyState::Ok)
        .filter_map(|j| holder(live, &stripe[j]).map(tracker))
        .collect();
    if trackers.is_empty() {
        return false;
    }
    let c = &mut stripe[i];
    // A partial repair that stops keeps what made it partial: its source's regions still
    // cover what is left. A full one starts over.
    c.dirty_on = match c.state {
        CopyState::Syncing if c.full => Vec::new(),
        CopyState::Syncing => std::mem::take(&mut c.dirty_on),
        _ => trackers,
    };
    // A repair that failed keeps the time the copy first went stale: the grace period runs on.
    if c.state == CopyState::Syncing {
        c.failures += 1;
    }
    if c.state != CopyState::Syncing || c.since_ms == 0 {
        c.since_ms = now_ms;
    }
    c.state = CopyState::Stale;
    c.from.clear();
    c.full = false;
    // Its server stops tracking for the others: it misses writes now, so its dirty regions
    // no longer cover what they miss.
    let gone = format!("{}@", stripe[i].server);
    for (j, other) in stripe.iter_mut().enumerate() {
        if j != i {
            other.dirty_on.retain(|t| !t.starts_with(&gone));
        }
    }
    touch(epoch, stripe);
    true
}

/// Start repairing copy `i` of `stripe` (stale, its server live in `server`) from a healthy
/// copy: the one whose dirty regions cover what it missed if there is one (a partial copy),
/// else any (a full copy). `false` when no healthy copy is on a live server.
pub fn start_sync(
    epoch: &mut u32,
    stripe: &mut Stripe,
    i: usize,
    server: &ServerInfo,
    live: &[ServerInfo],
) -> bool {
    let healthy: Vec<&ServerInfo> = (0..stripe.len())
        .filter(|&j| j != i && stripe[j].state == CopyState::Ok)
        .filter_map(|j| holder(live, &stripe[j]))
        .collect();
    let same_life = stripe[i].incarnation == server.incarnation;
    let partial = healthy.iter().find(|s| same_life && stripe[i].dirty_on.contains(&tracker(s)));
    let Some(from) = partial.or(healthy.first()) else { return false };
    let c = &mut stripe[i];
    c.full = partial.is_none();
    c.from = from.id.clone();
    c.incarnation = server.incarnation;
    c.state = CopyState::Syncing;
    touch(epoch, stripe);
    true
}

/// Copy `i` of `stripe`, repaired by `from` under epoch `at`, is `ok`: `false` (nothing
/// changes) when the stripe moved on since, or the copy is no longer that repair's.
pub fn finish(epoch: &mut u32, stripe: &mut Stripe, i: usize, from: &str, at: u32) -> bool {
    let c = &stripe[i];
    if c.state != CopyState::Syncing || c.from != from || c.epoch != at {
        return false;
    }
    let c = &mut stripe[i];
    c.state = CopyState::Ok;
    c.from.clear();
    c.full = false;
    c.dirty_on.clear();
    c.since_ms = 0;
    c.failures = 0;
    touch(epoch, stripe);
    true
}

/// A stale copy to be rebuilt on another server: copy `copy` of the stripe the caller of
/// [`plan`] named `stripe` (the control plane names stripes by slot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relocation {
    pub stripe: u64,
    pub copy: usize,
    /// Servers the stripe already has a copy on: the spare chunk goes elsewhere.
    pub avoid: Vec<String>,
}

/// What one pass of the leader over a namespace did, and what it leaves to the driver.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Copies marked stale, repairs started, repairs undone.
    pub stale: usize,
    pub started: usize,
    /// Stale copies whose server stayed away past the grace period: rebuild elsewhere.
    pub relocate: Vec<Relocation>,
}

impl Plan {
    pub fn changed(&self) -> bool {
        self.stale + self.started > 0
    }
}

/// One pass of the repair leader over `stripes` (each named by the caller, and all under the
/// epoch counter `epoch`: a namespace's stripe group) at `now_ms`, `live` being the servers
/// registered now and `present` those of them the leader reached: marks the copies whose
/// servers are gone stale, starts repairing those whose servers are back (registered and
/// reached: a server killed keeps its registration until its lease lapses), undoes repairs
/// whose copy or source went away, and names the copies away longer than `rebuild_after_ms`
/// for the driver to rebuild elsewhere. The caller passes only allocated stripes: the
/// reserve holds no data.
pub fn plan<'a>(
    epoch: &mut u32,
    stripes: impl IntoIterator<Item = (u64, &'a mut Stripe)>,
    live: &[ServerInfo],
    present: &[ServerInfo],
    now_ms: u64,
    rebuild_after_ms: u64,
) -> Plan {
    let mut plan = Plan::default();
    {
        for (si, stripe) in stripes {
            for i in 0..stripe.len() {
                let here = holder(live, &stripe[i]).is_some();
                match stripe[i].state {
                    CopyState::Ok if !here => {
                        plan.stale += usize::from(mark_stale(epoch, stripe, i, live, now_ms))
                    }
                    CopyState::Syncing => {
                        let source_ok = stripe.iter().any(|c| {
                            c.server == stripe[i].from
                                && c.state == CopyState::Ok
                                && holder(live, c).is_some()
                        });
                        if !here || !source_ok {
                            plan.stale += usize::from(mark_stale(epoch, stripe, i, live, now_ms));
                        }
                    }
                    CopyState::Stale => {
                        // A server whose repairs keep failing (it takes connections but not
                        // the copy) is not counted as back: past the grace period the copy
                        // moves.
                        let back = present
                            .iter()
                            .find(|s| s.id == stripe[i].server)
                            .filter(|_| stripe[i].failures < REPAIR_FAILURES_MAX);
                        if let Some(server) = back {
                            plan.started += usize::from(start_sync(epoch, stripe, i, server, live));
                        } else if now_ms.saturating_sub(stripe[i].since_ms) >= rebuild_after_ms {
                            plan.relocate.push(Relocation {
                                stripe: si,
                                copy: i,
                                avoid: stripe.iter().map(|c| c.server.clone()).collect(),
                            });
                        }
                    }
                    CopyState::Ok => {}
                }
            }
        }
    }
    plan
}

/// Put `spare` (a chunk reserved on a server the stripe has no copy on) in place of the stale
/// copy `r` names, to be repaired in full from a healthy copy. Returns the chunk it replaces
/// (to give back to its pool, dirty), or `None` when the stripe changed since `r` was planned.
pub fn relocate(
    epoch: &mut u32,
    stripe: &mut Stripe,
    r: &Relocation,
    spare: ChunkRef,
    live: &[ServerInfo],
) -> Option<ChunkRef> {
    let old = stripe.get(r.copy)?;
    if old.state != CopyState::Stale || stripe.iter().any(|c| c.server == spare.server) {
        return None;
    }
    let server = live.iter().find(|s| s.id == spare.server)?;
    let was = std::mem::replace(&mut stripe[r.copy], ChunkRef { state: CopyState::Stale, ..spare });
    if !start_sync(epoch, stripe, r.copy, server, live) {
        stripe[r.copy] = was;
        return None;
    }
    Some(was)
}

/// A namespace's health, for `skiff ns status`.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Health {
    /// Allocated stripes with every copy `ok`, with a copy not `ok`, and with a copy syncing.
    pub healthy: usize,
    pub degraded: usize,
    pub rebuilding: usize,
    /// Stripes with no `ok` copy on a live server: their data cannot be read now.
    pub unavailable: usize,
}

impl Health {
    pub fn of(ns: &Namespace, live: &[ServerInfo]) -> Health {
        let mut h = Health::default();
        for stripe in ns.allocs.values().flat_map(|a| a.stripes.iter()) {
            if !stripe.iter().any(|c| c.state == CopyState::Ok && holder(live, c).is_some()) {
                h.unavailable += 1;
            }
            if stripe.iter().any(|c| c.state == CopyState::Syncing) {
                h.rebuilding += 1;
            } else if whole(stripe) && stripe.iter().all(|c| holder(live, c).is_some()) {
                h.healthy += 1;
            } else {
                h.degraded += 1;
            }
        }
        h
    }

    pub fn label(&self) -> &'static str {
        if self.unavailable > 0 {
            "unavailable"
        } else if self.rebuilding > 0 {
            "rebuilding"
        } else if self.degraded > 0 {
            "degraded"
        } else {
            "healthy"
        }
    }
}

/// One copy that is not healthy, for `skiff ns status`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CopyStatus {
    pub addr: u64,
    pub stripe: usize,
    pub server: String,
    pub index: u64,
    pub state: CopyState,
    /// Whether its server is registered now, in the copy's incarnation.
    pub live: bool,
    /// Stale: since when (Unix ms), and whose dirty regions cover it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since_ms: Option<u64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dirty_on: Vec<String>,
    /// Syncing: its source, and whether the whole chunk is copied.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    pub full: bool,
}

/// What a source published of the repairs it copied out (`/skiff/repair/progress/<id>`).
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SourceProgress {
    pub server: String,
    /// Repairs finished, and bytes copied, since the server started.
    pub chunks: u64,
    pub bytes: u64,
    /// Bytes a second over the last chunk copied.
    pub rate: u64,
    /// When it last copied (Unix ms).
    pub at_ms: u64,
    /// Bytes of regions not dirty compared with the copies repaired, and the regions found
    /// different (and copied) since the server started.
    #[serde(default)]
    pub verified: u64,
    #[serde(default)]
    pub mismatched: u64,
}

impl coord::schema::Record for SourceProgress {
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

/// A namespace's state of repair, for `skiff ns status`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Status {
    pub name: String,
    pub epoch: u32,
    pub health: &'static str,
    pub stripes: Health,
    /// The repair leader now, if any.
    pub leader: Option<String>,
    /// Copies not healthy.
    pub copies: Vec<CopyStatus>,
    /// Bytes the syncing copies have left to copy at most (a full repair's whole chunk, a
    /// partial one's dirty regions counted whole).
    pub syncing_bytes_max: u64,
    /// What every source published of the repairs it copied out (those of the syncing
    /// copies first, and any that never published).
    pub sources: Vec<SourceProgress>,
}

impl Status {
    /// `ns` as it stands with the servers `live`, the leader and the sources' progress.
    pub fn of(
        ns: &Namespace,
        live: &[ServerInfo],
        leader: Option<String>,
        progress: &[SourceProgress],
    ) -> Status {
        let health = Health::of(ns, live);
        let mut copies = Vec::new();
        let mut syncing_bytes_max = 0;
        let mut sources: Vec<SourceProgress> = Vec::new();
        for (&addr, a) in &ns.allocs {
            for (si, stripe) in a.stripes.iter().enumerate() {
                for c in stripe {
                    let live_now = holder(live, c).is_some();
                    if c.state == CopyState::Ok && live_now {
                        continue;
                    }
                    if c.state == CopyState::Syncing {
                        syncing_bytes_max += ns.chunk_bytes;
                        if !sources.iter().any(|s| s.server == c.from) {
                            let p = progress.iter().find(|p| p.server == c.from).cloned();
                            sources.push(
                                p.unwrap_or(SourceProgress { server: c.from.clone(), ..Default::default() }),
                            );
                        }
                    }
                    copies.push(CopyStatus {
                        addr,
                        stripe: si,
                        server: c.server.clone(),
                        index: c.index,
                        state: c.state,
                        live: live_now,
                        since_ms: (c.state == CopyState::Stale).then_some(c.since_ms),
                        dirty_on: c.dirty_on.clone(),
                        from: (c.state == CopyState::Syncing).then(|| c.from.clone()),
                        full: c.full,
                    });
                }
            }
        }
        for p in progress {
            if !sources.iter().any(|s| s.server == p.server) {
                sources.push(p.clone());
            }
        }
        Status {
            name: ns.name.clone(),
            epoch: ns.epoch,
            health: health.label(),
            stripes: health,
            leader,
            copies,
            syncing_bytes_max,
            sources,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use coord::{Allocation, Scope};

    fn server(id: &str, incarnation: u64, boot: u64) -> ServerInfo {
        ServerInfo {
            id: id.into(),
            endpoint: format!("{id}:1"),
            export: "pool".into(),
            scope: Scope::File,
            bytes: 64 << 20,
            chunk_bytes: 4 << 20,
            incarnation,
            grant_key: String::new(),
            boot,
        }
    }

    /// One allocation of one stripe with a copy on each of `servers`.
    fn ns(servers: &[&str]) -> Namespace {
        let stripe = servers.iter().enumerate().map(|(i, s)| ChunkRef::new(s, i as u64, 0, 0)).collect();
        let mut allocs = std::collections::BTreeMap::new();
        allocs.insert(0, Allocation { len: 4 << 20, stripes: vec![stripe] });
        Namespace {
            name: "t".into(),
            scope: Scope::File,
            chunk_bytes: 4 << 20,
            replicas: servers.len() as u32,
            reserved: Vec::new(),
            allocs,
            next_addr: 4 << 20,
            epoch: 0,
        }
    }

    /// [`plan`] over every allocated stripe of `ns`, named by its index in allocation 0.
    fn plan_ns(
        ns: &mut Namespace,
        live: &[ServerInfo],
        present: &[ServerInfo],
        now: u64,
        after: u64,
    ) -> Plan {
        let stripes = ns.allocs.get_mut(&0).unwrap().stripes.iter_mut().enumerate();
        plan(&mut ns.epoch, stripes.map(|(i, s)| (i as u64, s)), live, present, now, after)
    }

    fn stripe(ns: &Namespace) -> &Stripe {
        &ns.allocs[&0].stripes[0]
    }

    /// A copy goes stale against the healthy copies that track it, every change moves the
    /// epoch on for the whole stripe, and the only healthy copy is never marked.
    #[test]
    fn a_copy_goes_stale_against_its_trackers_and_the_last_healthy_one_never_does() {
        let live = [server("a", 0, 1), server("b", 0, 2), server("c", 0, 3)];
        let mut n = ns(&["a", "b", "c"]);
        let st = &mut n.allocs.get_mut(&0).unwrap().stripes[0];
        assert!(mark_stale(&mut n.epoch, st, 0, &live, 7));
        assert_eq!(st[0].dirty_on, ["b@2", "c@3"]);
        assert_eq!((st[0].state, st[0].since_ms), (CopyState::Stale, 7));
        assert!(st.iter().all(|c| c.epoch == 1), "the whole stripe takes the epoch");
        assert!(!mark_stale(&mut n.epoch, st, 0, &live, 8), "already stale");
        assert!(mark_stale(&mut n.epoch, st, 1, &live, 9));
        assert_eq!(st[0].dirty_on, ["c@3"], "b's regions no longer cover what a misses");
        assert!(!mark_stale(&mut n.epoch, st, 2, &live, 9), "c holds the only healthy copy");
        assert_eq!(n.epoch, 2);
    }

    /// A stale copy whose server is reached again is repaired partially from a tracker of the
    /// same boot, in full when none is (its tracker restarted, or it came back in another
    /// incarnation), and only once its server is present, not merely registered.
    #[test]
    fn a_copy_back_is_repaired_partially_from_a_tracker_of_its_boot_else_in_full() {
        let live = [server("a", 0, 1), server("b", 0, 2)];
        let mut n = ns(&["a", "b"]);
        let st = &mut n.allocs.get_mut(&0).unwrap().stripes[0];
        assert!(mark_stale(&mut n.epoch, st, 0, &live, 0));
        let registered_only = plan_ns(&mut n, &live, &live[1..], 10, 1_000);
        assert_eq!((registered_only.started, registered_only.relocate.len()), (0, 0), "a is not reached");
        let p = plan_ns(&mut n, &live, &live, 10, 1_000);
        assert_eq!(p.started, 1);
        assert_eq!(
            (stripe(&n)[0].state, stripe(&n)[0].full, stripe(&n)[0].from.as_str()),
            (CopyState::Syncing, false, "b")
        );
        let at = stripe(&n)[0].epoch;
        assert!(finish(&mut n.epoch, &mut n.allocs.get_mut(&0).unwrap().stripes[0], 0, "b", at));
        assert!(whole(stripe(&n)));
        // b restarted since a went stale: its marks are gone, so a full copy.
        let mut n = ns(&["a", "b"]);
        let st = &mut n.allocs.get_mut(&0).unwrap().stripes[0];
        assert!(mark_stale(&mut n.epoch, st, 0, &live, 0));
        let rebooted = [server("a", 0, 1), server("b", 0, 99)];
        plan_ns(&mut n, &rebooted, &rebooted, 10, 1_000);
        assert_eq!((stripe(&n)[0].state, stripe(&n)[0].full), (CopyState::Syncing, true));
        // a back in another incarnation (a RAM pool restarted empty): full, and it takes the
        // new incarnation.
        let mut n = ns(&["a", "b"]);
        let st = &mut n.allocs.get_mut(&0).unwrap().stripes[0];
        assert!(mark_stale(&mut n.epoch, st, 0, &live, 0));
        let reborn = [server("a", 5, 1), server("b", 0, 2)];
        plan_ns(&mut n, &reborn, &reborn, 10, 1_000);
        assert_eq!((stripe(&n)[0].full, stripe(&n)[0].incarnation), (true, 5));
    }

    /// A repair whose stripe moved on is not finished by it; a syncing copy whose source went
    /// away goes stale again, keeping the trackers that made it partial; a copy away past the
    /// grace period is named for a rebuild elsewhere, avoiding the stripe's servers.
    #[test]
    fn repairs_end_only_on_their_epoch_and_stale_copies_move_after_the_grace_period() {
        let live = [server("a", 0, 1), server("b", 0, 2), server("c", 0, 3)];
        let mut n = ns(&["a", "b", "c"]);
        let st = &mut n.allocs.get_mut(&0).unwrap().stripes[0];
        assert!(mark_stale(&mut n.epoch, st, 0, &live, 0));
        plan_ns(&mut n, &live, &live, 10, 1_000);
        let at = stripe(&n)[0].epoch;
        let from = stripe(&n)[0].from.clone();
        let st = &mut n.allocs.get_mut(&0).unwrap().stripes[0];
        touch(&mut n.epoch, st);
        assert!(!finish(&mut n.epoch, st, 0, &from, at), "the stripe moved on since the repair began");
        // Its source goes away: stale again, still partial from what is left.
        let without: Vec<ServerInfo> = live.iter().filter(|s| s.id != from).cloned().collect();
        plan_ns(&mut n, &without, &without, 20, 1_000);
        assert_eq!(stripe(&n)[0].state, CopyState::Stale);
        // a stays away: past the grace period it is named for a rebuild elsewhere.
        let away: Vec<ServerInfo> = without.iter().filter(|s| s.id != "a").cloned().collect();
        let p = plan_ns(&mut n, &away, &away, 20 + 999, 1_000);
        assert!(p.relocate.is_empty(), "not yet");
        let p = plan_ns(&mut n, &away, &away, 20 + 1_000 + 1, 1_000);
        // a, and the source, which went stale when it went away.
        assert_eq!(
            p.relocate.iter().map(|r| r.copy).collect::<Vec<_>>(),
            [0, if from == "b" { 1 } else { 2 }],
            "{p:?}"
        );
        assert!(p.relocate[0].avoid.iter().any(|s| s == "a"));
        let spare = ChunkRef::new("d", 9, 0, 3);
        let mut live_d = away.clone();
        live_d.push(server("d", 0, 4));
        let old = relocate(
            &mut n.epoch,
            &mut n.allocs.get_mut(&0).unwrap().stripes[p.relocate[0].stripe as usize],
            &p.relocate[0],
            spare,
            &live_d,
        )
        .expect("relocated");
        assert_eq!(old.server, "a");
        assert_eq!(
            (stripe(&n)[0].server.as_str(), stripe(&n)[0].state, stripe(&n)[0].full),
            ("d", CopyState::Syncing, true)
        );
    }
}
