//! RStore's control plane at scale (issue 32, "Scale"): hundreds of memory servers and dozens
//! of clients against one real etcd, with a seeded schedule that kills servers (their lease
//! ends, their port closes), restarts them (a file pool in the same incarnation, a RAM pool in
//! a new one), and cuts others off from etcd (their lease lapses while they still listen). A
//! repair leader plans over every namespace and rebuilds what stays away, and the servers copy
//! their repairs out (here at once: there is no data, only the records).
//!
//! The servers are registrations with a listening socket and no data path: what is under test
//! is the records and the transactions. At the end every record is read back and checked
//! whole: no chunk held twice or by nobody that its pool counts as used, every pool's counts
//! and bitmaps agree with its extents, every namespace's slots are reserved or allocated
//! exactly once, each stripe's copies lie on distinct servers, every group with a copy not `ok`
//! is in the repair index, every client's allocations are what it was told, and no record is
//! large. A JSON line reports what the run did and what each call cost.
//!
//! `SKIFF_SCALE_SERVERS` (200), `SKIFF_SCALE_CLIENTS` (16), `SKIFF_SCALE_ROUNDS` (8) and
//! `SKIFF_SCALE_SEED` size and seed a run; bench/rstore_control.py runs larger ones.

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use coord::schema::GROUP_STRIPES;
use coord::{CoordError, CopyState, Scope, ServerInfo};
use rstore::{agent, Coordinator, Registration};
use skiff_tests::etcd::Cluster;

const MIB: u64 = 1 << 20;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A small seeded generator (xorshift64*): the schedule is the seed's.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One memory server as the control plane sees it: a registration, and a socket that takes
/// connections (the leader counts a server as back only when it reaches it).
struct Phantom {
    info: ServerInfo,
    listener: Option<TcpListener>,
    registration: Option<Registration>,
    /// Cut off from etcd: it listens, but stops renewing its lease.
    cut_off: bool,
}

impl Phantom {
    fn listen(&mut self) {
        let l = TcpListener::bind("127.0.0.1:0").expect("a port");
        l.set_nonblocking(true).expect("a non-blocking listener");
        self.info.endpoint = l.local_addr().expect("bound").to_string();
        self.listener = Some(l);
    }
}

/// What one call cost, by call.
#[derive(Default)]
struct Costs(BTreeMap<&'static str, Vec<f64>>);

impl Costs {
    fn time<T>(&mut self, what: &'static str, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.0.entry(what).or_default().push(t.elapsed().as_secs_f64() * 1e6);
        out
    }

    fn merge(&mut self, other: Costs) {
        for (k, mut v) in other.0 {
            self.0.entry(k).or_default().append(&mut v);
        }
    }

    fn json(&mut self) -> serde_json::Value {
        let mut out = serde_json::Map::new();
        for (k, v) in &mut self.0 {
            v.sort_by(f64::total_cmp);
            let at = |q: f64| v[((v.len() - 1) as f64 * q) as usize];
            out.insert(
                (*k).to_owned(),
                serde_json::json!({ "calls": v.len(), "p50_us": at(0.5).round(), "p99_us": at(0.99).round() }),
            );
        }
        serde_json::Value::Object(out)
    }
}

/// What a client was told it holds: its namespace's allocations, by address, with their
/// lengths. `None` once it cannot know (a call's fate was unknown).
type Model = Option<BTreeMap<u64, u64>>;

/// One client's rounds over a namespace of its own: reserve, allocate, map (resolve), free,
/// release, and now and then delete and create it again. Errors that a full or contended
/// control plane gives are counted; any other fails the run.
fn client(
    c: &Coordinator,
    name: &str,
    seed: u64,
    rounds: u64,
    errors: &Mutex<BTreeMap<String, u64>>,
) -> (Model, Costs) {
    let mut rng = Rng(seed | 1);
    let mut costs = Costs::default();
    let mut model: BTreeMap<u64, u64> = BTreeMap::new();
    let mut known = true;
    let count = |e: &CoordError| {
        let kind = match e {
            CoordError::NoCapacity { .. } => "no capacity",
            CoordError::NotReserved { .. } => "not reserved",
            CoordError::Contended(_) => "contended",
            CoordError::Etcd(_) => "etcd",
            other => panic!("{name}: {other}"),
        };
        *errors.lock().unwrap().entry(kind.to_owned()).or_default() += 1;
        matches!(e, CoordError::Etcd(_))
    };
    costs.time("create_ns", || c.create_ns(name, Scope::Ram, MIB, 2)).expect("create");
    for _ in 0..rounds {
        let stripes = 1 + rng.below(300);
        if let Err(e) = costs.time("reserve", || c.reserve(name, stripes * MIB)) {
            known &= !count(&e);
        }
        for _ in 0..1 + rng.below(4) {
            let len = (1 + rng.below(40)) * MIB - rng.below(MIB);
            match costs.time("alloc", || c.alloc(name, len, None)) {
                Ok(r) => {
                    assert_eq!(r.stripes.len() as u64, len.div_ceil(MIB), "{name}: {r:?}");
                    model.insert(r.addr, len);
                }
                Err(e) => known &= !count(&e),
            }
        }
        // Map every allocation as a client would: its copies on the servers there now.
        for (&addr, &len) in &model {
            match costs.time("resolve", || c.resolve(name, addr)) {
                Ok((r, _)) => {
                    assert_eq!(
                        (r.len, r.stripes.len() as u64),
                        (len, len.div_ceil(MIB)),
                        "{name} at {addr:#x}"
                    );
                    assert!(r.stripes.iter().all(|s| s.len() == 2), "{name}: a stripe lost a copy: {r:?}");
                }
                Err(e) => known &= !count(&e),
            }
        }
        if let Some(&addr) = model.keys().nth(rng.below(model.len() as u64 + 1) as usize) {
            match costs.time("free", || c.free(name, addr)) {
                Ok(()) => {
                    model.remove(&addr);
                }
                Err(e) => known &= !count(&e),
            }
        }
        if rng.below(3) == 0 {
            if let Err(e) = costs.time("release", || c.release(name, rng.below(200) * MIB)) {
                known &= !count(&e);
            }
        }
        if rng.below(6) == 0 {
            if let Err(e) = costs.time("delete_ns", || c.delete_ns(name)) {
                known &= !count(&e);
            }
            // A delete cut short is finished by the next.
            while let Err(e) = c.create_ns(name, Scope::Ram, MIB, 2) {
                match e {
                    CoordError::Exists(_) | CoordError::Invalid(_) => {
                        c.delete_ns(name).expect("finish a delete")
                    }
                    e => panic!("{name}: {e}"),
                }
            }
            // The namespace is a new one now, whether the delete above failed or not.
            model.clear();
        }
    }
    (known.then_some(model), costs)
}

/// The sources' side of repairs, for servers with no data: each syncing copy whose source
/// is up is marked repaired.
fn serve_repairs(c: &Coordinator, up: &BTreeSet<String>) -> usize {
    let mut done = 0;
    let Ok(heads) = c.list_ns() else { return 0 };
    for ns in heads {
        let Ok(groups) = c.groups(&ns.name, true) else { continue };
        for g in groups {
            let Ok(group) = c.group(&ns.name, g) else { continue };
            let mut by: BTreeMap<String, Vec<rstore::control::Finished>> = BTreeMap::new();
            for (i, stripe) in group.stripes.iter().enumerate() {
                for (ci, copy) in stripe.iter().enumerate() {
                    if copy.state == CopyState::Syncing && up.contains(&copy.from) {
                        let slot = g * GROUP_STRIPES + i as u64;
                        by.entry(copy.from.clone()).or_default().push(rstore::control::Finished {
                            slot,
                            copy: ci,
                            epoch: copy.epoch,
                        });
                    }
                }
            }
            for (from, finished) in by {
                done += c.finish_syncs(&ns.name, &finished, &from).unwrap_or(0);
            }
        }
    }
    done
}

#[test]
fn hundreds_of_servers_and_dozens_of_clients_keep_every_record_whole() {
    let servers = env("SKIFF_SCALE_SERVERS", 200) as usize;
    let clients = env("SKIFF_SCALE_CLIENTS", 16) as usize;
    let rounds = env("SKIFF_SCALE_ROUNDS", 8);
    let seed = env("SKIFF_SCALE_SEED", 32);
    let etcd = Cluster::start(1);
    let endpoints = etcd.endpoints();
    let c = Coordinator::connect(&endpoints);
    let ttl = Duration::from_secs(5);

    // Servers of 1,024 to 3,071 chunks of 1 MiB: pools of several extents.
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let started = Instant::now();
    let phantoms: Vec<Arc<Mutex<Phantom>>> = (0..servers)
        .map(|i| {
            let chunks = 1024 + rng.below(2048);
            let mut p = Phantom {
                info: ServerInfo {
                    id: format!("m{i:04}"),
                    endpoint: String::new(),
                    export: "pool".into(),
                    scope: Scope::Ram,
                    bytes: chunks * MIB,
                    chunk_bytes: MIB,
                    incarnation: 1,
                    grant_key: String::new(),
                    boot: 1,
                },
                listener: None,
                registration: None,
                cut_off: false,
            };
            p.listen();
            p.registration = Some(c.register(&p.info, ttl).expect("register"));
            Arc::new(Mutex::new(p))
        })
        .collect();
    let register_us = started.elapsed().as_secs_f64() * 1e6 / servers as f64;
    let stop = Arc::new(AtomicBool::new(false));
    let mut background = Vec::new();

    // Renewals, as every server's registration thread does.
    {
        let (phantoms, stop, c) = (phantoms.clone(), stop.clone(), c.again());
        background.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for p in &phantoms {
                    let mut p = p.lock().unwrap();
                    // The leader's probes, taken and dropped.
                    while let Some(Ok(_)) = p.listener.as_ref().map(TcpListener::accept) {}
                    if p.cut_off {
                        continue;
                    }
                    let renewed = p.registration.as_ref().map(|r| r.keep_alive(&c));
                    if let Some(Ok(false)) = renewed {
                        // Lapsed while cut off (or slow): register again, as a server does.
                        p.registration = c.register(&p.info, ttl).ok();
                    }
                }
                std::thread::sleep(Duration::from_millis(1000));
            }
        }));
    }
    // The schedule: at most a tenth of the servers away at once.
    let events = Arc::new(Mutex::new(BTreeMap::<&str, u64>::new()));
    {
        let (phantoms, stop, c, events) = (phantoms.clone(), stop.clone(), c.again(), events.clone());
        background.push(std::thread::spawn(move || {
            let mut rng = Rng(seed | 1);
            let mut away: Vec<usize> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(50 + rng.below(150)));
                let i = rng.below(phantoms.len() as u64) as usize;
                let mut p = phantoms[i].lock().unwrap();
                let event = if let Some(at) = away.iter().position(|&a| a == i) {
                    away.remove(at);
                    if p.listener.is_none() {
                        // Back: a RAM pool in a new incarnation (empty), a file pool as it was.
                        if i % 2 == 1 {
                            p.info.incarnation += 1;
                        }
                        p.info.boot += 1;
                        p.listen();
                    }
                    p.cut_off = false;
                    p.registration = c.register(&p.info, ttl).ok();
                    "restart"
                } else if away.len() < phantoms.len() / 10 {
                    away.push(i);
                    if rng.below(3) == 0 {
                        // Cut off from etcd: it stops renewing, and its lease lapses.
                        p.cut_off = true;
                        "cut off"
                    } else {
                        // Killed: its lease ends (as a lapse would, sooner) and its port closes.
                        if let Some(r) = p.registration.take() {
                            let _ = r.revoke(&c);
                        }
                        p.listener = None;
                        "kill"
                    }
                } else {
                    continue;
                };
                *events.lock().unwrap().entry(event).or_default() += 1;
            }
        }));
    }
    // The repair leader, and the sources' copies.
    let repaired = Arc::new(Mutex::new((0usize, 0usize, 0usize, 0usize)));
    {
        let (phantoms, stop, c, repaired) = (phantoms.clone(), stop.clone(), c.again(), repaired.clone());
        background.push(std::thread::spawn(move || {
            let config = agent::Config {
                rebuild_after: Duration::from_secs(3),
                rebuild_rate: 0,
                every: Duration::from_millis(200),
                ..agent::Config::default()
            };
            let mut leader = agent::Leader::default();
            while !stop.load(Ordering::Relaxed) {
                if let Ok(plan) = agent::lead_with(&c, &config, &mut leader) {
                    let mut r = repaired.lock().unwrap();
                    r.0 += plan.stale;
                    r.1 += plan.started;
                }
                let up: BTreeSet<String> = phantoms
                    .iter()
                    .filter_map(|p| {
                        let p = p.lock().unwrap();
                        (p.listener.is_some() && !p.cut_off).then(|| p.info.id.clone())
                    })
                    .collect();
                repaired.lock().unwrap().2 += serve_repairs(&c, &up);
                // The servers up zero what was given back, a whole pool's worth at once after a
                // delete (a transaction of many extents and their generations).
                for id in &up {
                    let Ok(dirty) = c.dirty(id) else { continue };
                    let generations: BTreeMap<u64, u32> =
                        c.generations(id).unwrap_or_default().into_iter().collect();
                    let zeroed: Vec<(u64, u32)> = dirty
                        .iter()
                        .map(|&chunk| (chunk, generations.get(&chunk).copied().unwrap_or(0) + 1))
                        .collect();
                    match c.cleaned(id, &zeroed) {
                        Ok(()) => repaired.lock().unwrap().3 += zeroed.len(),
                        // Contention is worth another try; anything else (a refused
                        // transaction) is a bug.
                        Err(CoordError::Contended(_)) => {}
                        Err(e) => panic!("marking {id}'s zeroed chunks free: {e}"),
                    }
                }
                std::thread::sleep(config.every);
            }
        }));
    }

    // The clients.
    let errors = Arc::new(Mutex::new(BTreeMap::new()));
    let began = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|j| {
            let (endpoints, errors) = (endpoints.clone(), errors.clone());
            std::thread::spawn(move || {
                let c = Coordinator::connect(&endpoints);
                let name = format!("client{j:03}");
                let (model, costs) = client(&c, &name, seed ^ (j as u64) << 20, rounds, &errors);
                (name, model, costs)
            })
        })
        .collect();
    let mut results = Vec::new();
    let mut costs = Costs::default();
    for t in threads {
        let (name, model, c) = t.join().expect("a client panicked");
        costs.merge(c);
        results.push((name, model));
    }
    let clients_secs = began.elapsed().as_secs_f64();
    // The schedule goes on until it has killed, cut off and restarted servers a good few times
    // and repairs have finished (a liveness bound, not a measure).
    let waiting = Instant::now();
    loop {
        let events: u64 = events.lock().unwrap().values().sum();
        let (stale, started, finished, _) = *repaired.lock().unwrap();
        if events >= 40 && stale > 0 && started > 0 && finished > 0 {
            break;
        }
        assert!(
            waiting.elapsed() < Duration::from_secs(180),
            "no repair finished: {events} events, {stale} stale, {started} started, {finished} finished"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, Ordering::Relaxed);
    for t in background {
        t.join().expect("a background thread panicked");
    }

    // Every record, read back and checked whole.
    let records = skiff_tests::records::check(&c, 2, false);
    let (all_len, bytes, largest, stripes_held, allocs) =
        (records.records, records.bytes, records.largest, records.stripes_held, records.allocs);
    // What each client was told is what the records hold.
    let mut checked = 0;
    for (name, model) in &results {
        let Some(model) = model else { continue };
        let records = allocs.get(name).cloned().unwrap_or_default();
        let have: BTreeMap<u64, u64> = records.iter().map(|(&a, r)| (a, r.len)).collect();
        assert_eq!(&have, model, "{name}: its allocations");
        checked += 1;
    }

    let (stale, started, finished, zeroed) = *repaired.lock().unwrap();
    let errors = errors.lock().unwrap().clone();
    let report = serde_json::json!({
        "servers": servers, "clients": clients, "rounds": rounds, "seed": seed,
        "clients_secs": (clients_secs * 10.0).round() / 10.0,
        "register_us": register_us.round(),
        "events": *events.lock().unwrap(),
        "repair": { "marked_stale": stale, "started": started, "finished": finished },
        "zeroed": zeroed,
        "errors": errors,
        "records": all_len, "record_bytes": bytes, "largest_record": largest,
        "stripes_held": stripes_held, "models_checked": checked,
        "costs": costs.json(),
    });
    eprintln!("control-scale: {report}");
    assert!(checked * 2 >= clients, "most clients know their allocations: {checked} of {clients}");
    assert!(stripes_held > 0 && started > 0 && finished > 0, "the run did something: {report}");
}
