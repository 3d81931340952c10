//! `skiff ns`: RStore namespaces on the coordinator (etcd): create, reserve, allocate, list,
//! delete, and the memory servers that donate their chunks (docs/RSTORE.md).

use std::process::ExitCode;

use clap::{Args, Subcommand};
use coord::{Namespace, Scope, ServerInfo};
use rstore::Coordinator;

use crate::CliResult;

/// `--coordinator URLS`, for the commands that talk to one.
#[derive(Args)]
pub struct CoordinatorArg {
    /// The coordinator: etcd's client URLs, comma-separated [default: $SKIFF_COORDINATOR, or
    /// http://127.0.0.1:2379].
    #[arg(long = "coordinator", value_name = "URLS", global = true)]
    urls: Option<String>,
    #[command(flatten)]
    pub tls: CoordinatorTls,
}

impl CoordinatorArg {
    /// The coordinator named, and its URLs.
    pub fn connect(&self) -> Result<(Coordinator, String), Box<dyn std::error::Error>> {
        coordinator(self.urls.as_deref(), &self.tls)
    }

    /// The command of worker `id` of `workers` of application `app` (`rsort`, `carafe`) on the
    /// namespaces `name`: this executable again, on the same coordinator (`urls`, TLS).
    pub fn worker_command(
        &self,
        app: &str,
        urls: &str,
        name: &str,
        id: usize,
        workers: usize,
    ) -> std::io::Result<std::process::Command> {
        let mut w = std::process::Command::new(std::env::current_exe()?);
        w.args([app, "--coordinator", urls, "--name", name]);
        w.args(self.tls.args());
        w.args(["worker", "--id", &id.to_string(), "--workers", &workers.to_string()]);
        Ok(w)
    }
}

/// etcd over TLS: for `https://` coordinator URLs. Without the options, from
/// `$SKIFF_COORDINATOR_CA`, `$SKIFF_COORDINATOR_CERT` and `$SKIFF_COORDINATOR_KEY`.
#[derive(Args, Clone, Debug, Default)]
pub struct CoordinatorTls {
    /// The CA certificate (PEM) that signed the etcd members' certificates.
    #[arg(long = "coordinator-ca", value_name = "PEM", global = true)]
    pub coordinator_ca: Option<std::path::PathBuf>,
    /// A client certificate (PEM) for members that ask for one (etcd --client-cert-auth).
    #[arg(long = "coordinator-cert", value_name = "PEM", global = true, requires = "coordinator_ca")]
    pub coordinator_cert: Option<std::path::PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long = "coordinator-key", value_name = "PEM", global = true, requires = "coordinator_cert")]
    pub coordinator_key: Option<std::path::PathBuf>,
}

impl CoordinatorTls {
    pub fn get(&self) -> Option<coord::etcd::Tls> {
        let Some(ca) = self.coordinator_ca.clone() else { return coord::etcd::Tls::from_env() };
        Some(coord::etcd::Tls { ca, cert: self.coordinator_cert.clone(), key: self.coordinator_key.clone() })
    }

    /// The same options for a child process's command line.
    pub fn args(&self) -> Vec<std::ffi::OsString> {
        let mut out = Vec::new();
        for (flag, v) in [
            ("--coordinator-ca", &self.coordinator_ca),
            ("--coordinator-cert", &self.coordinator_cert),
            ("--coordinator-key", &self.coordinator_key),
        ] {
            if let Some(v) = v {
                out.push(flag.into());
                out.push(v.clone().into());
            }
        }
        out
    }
}

#[derive(Args)]
pub struct NsArgs {
    #[command(flatten)]
    coordinator: CoordinatorArg,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand)]
enum Action {
    /// Create a namespace and reserve --size in it.
    Create {
        name: String,
        /// Capacity to reserve at once (e.g. 1G; 0: none yet).
        #[arg(long, value_parser = crate::units::parse_size, default_value = "0")]
        size: u64,
        /// Chunk size (a power of two; memory servers must use the same) [default: the
        /// registered memory servers' chunk size].
        #[arg(long, value_parser = crate::units::parse_size)]
        chunk: Option<u64>,
        /// Copies of every chunk, on distinct servers.
        #[arg(long, default_value_t = 1)]
        replicas: u32,
        /// ram (servers' memory), file (their files) or flash (their flash volumes, `serve
        /// --pool flash:SIZE`: FlashNet's flash namespaces).
        #[arg(long, default_value = "ram")]
        scope: Scope,
    },
    /// Reserve more capacity in a namespace.
    Reserve {
        name: String,
        #[arg(value_parser = crate::units::parse_size)]
        size: u64,
    },
    /// Give unallocated capacity back to the servers.
    Release {
        name: String,
        #[arg(value_parser = crate::units::parse_size)]
        size: u64,
    },
    /// Allocate an raddress segment (at --at, or after the last one).
    Alloc {
        name: String,
        #[arg(value_parser = crate::units::parse_size)]
        size: u64,
        #[arg(long, value_parser = crate::units::parse_size)]
        at: Option<u64>,
    },
    /// Free the raddress segment at ADDR.
    Free {
        name: String,
        #[arg(value_parser = crate::units::parse_size)]
        addr: u64,
    },
    /// List the namespaces (with --json, each whole: reserve, allocations, chunk maps).
    List,
    /// Delete a namespace; its chunks go back to the servers.
    Delete { name: String },
    /// List the memory servers registered now.
    Servers,
    /// A namespace's health: healthy, degraded, rebuilding or unavailable stripes, the copies
    /// that are not healthy (their servers and states), and the progress and rate of repairs.
    Status { name: String },
    /// Measure the control path against the data path: create, reserve, alloc, init (lookup),
    /// map and the first read of a scratch namespace of --size, then 4 KiB reads one at a
    /// time; everything is given back after.
    Costs {
        #[arg(long, value_parser = crate::units::parse_size, default_value = "256M")]
        size: u64,
        #[arg(long, value_parser = crate::units::parse_size, default_value = "4M")]
        chunk: u64,
        /// 4 KiB reads timed on the data path.
        #[arg(long, default_value_t = 2000)]
        reads: u32,
        /// Copies of each chunk.
        #[arg(long, default_value_t = 1)]
        replicas: u32,
        /// Time the control path only (create, reserve, alloc, init, free, release, delete):
        /// no lane is opened, so it runs against servers that hold no data (`ns phantom`).
        #[arg(long)]
        control_only: bool,
        /// The scratch namespace's scope: on servers with pools of that scope.
        #[arg(long, default_value = "ram")]
        scope: Scope,
    },
    /// Register --servers memory servers that hold no data, and keep them registered until
    /// stopped (SIGINT or SIGTERM): for sizing the control plane at scale without the memory
    /// (`ns costs --control-only` against them). Chunks given back are taken as zeroed at
    /// once. A client that maps their chunks fails. Their pool records stay in etcd after;
    /// use a scratch coordinator.
    Phantom {
        #[arg(long, default_value_t = 64)]
        servers: u32,
        /// Each server's pool.
        #[arg(long, value_parser = crate::units::parse_size, default_value = "16G")]
        pool: u64,
        #[arg(long, value_parser = crate::units::parse_size, default_value = "4M")]
        chunk: u64,
        /// Their ids: PREFIX0000, PREFIX0001...
        #[arg(long, default_value = "phantom")]
        prefix: String,
    },
}

/// `skiff ns costs`: each control-path step timed once, against the data path's per-I/O time.
/// What `skiff ns costs` measures.
struct Costing {
    size: u64,
    chunk: u64,
    reads: u32,
    replicas: u32,
    control_only: bool,
    scope: Scope,
}

fn costs(c: &Coordinator, k: &Costing, json: bool) -> Result<(), Box<dyn std::error::Error>> {
    use std::time::Instant;
    let (size, chunk, reads) = (k.size, k.chunk, k.reads);
    let name = format!("costs-{}", std::process::id());
    let mut steps: Vec<(&str, f64)> = Vec::new();
    let us = |t: Instant| t.elapsed().as_secs_f64() * 1e6;
    let t = Instant::now();
    c.create_ns(&name, k.scope, chunk, k.replicas)?;
    steps.push(("create_ns", us(t)));
    let result = (|| -> Result<(), Box<dyn std::error::Error>> {
        let t = Instant::now();
        c.reserve(&name, size)?;
        steps.push(("reserve", us(t)));
        let t = Instant::now();
        c.alloc(&name, size, Some(0))?;
        steps.push(("alloc", us(t)));
        let t = Instant::now();
        let (map, _) = resolve(c, &name, 0)?;
        steps.push(("init (lookup and place)", us(t)));
        if k.control_only {
            let t = Instant::now();
            c.free(&name, 0)?;
            steps.push(("free", us(t)));
            let t = Instant::now();
            c.release(&name, size)?;
            steps.push(("release", us(t)));
            return Ok(());
        }
        let t = Instant::now();
        let mut seg = rstore::Segment::map(map, &initiator::LaneConfig::default())?;
        steps.push(("map (a lane to each server)", us(t)));
        let mut buf = vec![0u8; 4096];
        let t = Instant::now();
        seg.read(0, &mut buf)?;
        steps.push(("first 4 KiB read", us(t)));
        let blocks = size / 4096;
        let t = Instant::now();
        for i in 0..u64::from(reads) {
            seg.read((i.wrapping_mul(2_654_435_761) % blocks) * 4096, &mut buf)?;
        }
        steps.push((
            "4 KiB read, data path (mean)",
            t.elapsed().as_secs_f64() * 1e6 / f64::from(reads.max(1)),
        ));
        drop(seg);
        // Through the coordinator, which keeps the map and the lanes of an unmapped segment
        // (thesis 6.3.2): the second map reads only the allocation's and its groups'
        // revisions, and opens its lanes (new connections) or, the third, takes them up again
        // with its grants.
        let config = initiator::LaneConfig::default();
        drop(c.map(&name, 0, &config).map_err(|e| e.to_string())?);
        c.connections().close_idle();
        let t = Instant::now();
        let again = c.map(&name, 0, &config).map_err(|e| e.to_string())?;
        steps.push(("map again (cached map)", us(t)));
        drop(again);
        let t = Instant::now();
        let again = c.map(&name, 0, &config).map_err(|e| e.to_string())?;
        steps.push(("map again (cached map, kept lanes)", us(t)));
        drop(again);
        let t = Instant::now();
        c.free(&name, 0)?;
        steps.push(("free", us(t)));
        Ok(())
    })();
    let t = Instant::now();
    let deleted = c.delete_ns(&name);
    steps.push(("delete_ns (release everything)", us(t)));
    result?;
    deleted?;
    if json {
        let map: serde_json::Map<String, serde_json::Value> =
            steps.iter().map(|(k, v)| ((*k).to_owned(), serde_json::json!(v))).collect();
        print_json(&serde_json::json!({
            "size": size, "chunk": chunk, "replicas": k.replicas, "servers": c.servers()?.len(), "us": map
        }));
    } else {
        println!("{} MiB in chunks of {} KiB over {} servers:", size >> 20, chunk >> 10, c.servers()?.len());
        for (what, us) in &steps {
            println!("  {what:<32} {us:>10.1} us");
        }
    }
    Ok(())
}

/// `skiff ns phantom`: servers that hold no data, registered until a signal.
fn phantom(
    c: &Coordinator,
    servers: u32,
    pool: u64,
    chunk: u64,
    prefix: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    use std::time::Duration;
    let ttl = Duration::from_secs(10);
    let mut held = Vec::new();
    for i in 0..servers {
        // A socket that takes connections: the repair leader counts a server it reaches.
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let info = ServerInfo {
            id: format!("{prefix}{i:04}"),
            endpoint: listener.local_addr()?.to_string(),
            export: "phantom".into(),
            scope: Scope::Ram,
            bytes: pool,
            chunk_bytes: chunk,
            incarnation: 1,
            grant_key: String::new(),
            boot: 1,
        };
        let registration = c.register(&info, ttl)?;
        held.push((listener, registration, info));
    }
    println!("registered {servers} phantom servers of {} MiB each", pool >> 20);
    // Renewed from one thread and zeroed from another (a zeroing that conflicts with a
    // reserve must not hold a renewal back); this one waits for the signal (blocked first, so
    // that every thread inherits the mask).
    rt::signals::block_termination()?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ids: Vec<String> = held.iter().map(|h| h.2.id.clone()).collect();
    let renew = {
        let (stop, c) = (stop.clone(), c.again());
        std::thread::spawn(move || -> Result<(), String> {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for (listener, registration, info) in &mut held {
                    while listener.accept().is_ok() {}
                    match registration.keep_alive(&c) {
                        Ok(true) => {}
                        // Lapsed: registered again, as a memory server does.
                        Ok(false) => match c.register(info, ttl) {
                            Ok(r) => *registration = r,
                            Err(e) => eprintln!("skiff ns phantom: registering {} again: {e}", info.id),
                        },
                        Err(e) => eprintln!("skiff ns phantom: renewing {}: {e}", info.id),
                    }
                }
                // Renewed every third of the lease, as a memory server does.
                for _ in 0..10 {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    std::thread::sleep(ttl / 30);
                }
            }
            for (_, registration, _) in held {
                registration.revoke(&c).map_err(|e| e.to_string())?;
            }
            Ok(())
        })
    };
    let zeroer = {
        let (stop, c) = (stop.clone(), c.again());
        std::thread::spawn(move || {
            // Chunks given back are "zeroed" at once: at the next generation, as a server would.
            let mut generations: std::collections::HashMap<(String, u64), u32> =
                std::collections::HashMap::new();
            let mut known: std::collections::HashSet<String> = std::collections::HashSet::new();
            let mut zero = |id: &String| -> Result<(), coord::CoordError> {
                let dirty = c.dirty(id)?;
                if known.insert(id.clone()) {
                    for (chunk, g) in c.generations(id)? {
                        generations.insert((id.clone(), chunk), g);
                    }
                }
                let zeroed: Vec<(u64, u32)> = dirty
                    .into_iter()
                    .map(|chunk| {
                        let g = generations.entry((id.clone(), chunk)).or_insert(0);
                        *g += 1;
                        (chunk, *g)
                    })
                    .collect();
                c.cleaned(id, &zeroed)
            };
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // Which pools have chunks to zero: one read of every head.
                match c.etcd().prefix(coord::schema::POOLS.as_bytes()) {
                    Ok(heads) => {
                        for kv in heads {
                            let id =
                                String::from_utf8_lossy(&kv.key[coord::schema::POOLS.len()..]).into_owned();
                            let dirty =
                                coord::schema::decode::<coord::PoolHead>(&kv).is_ok_and(|h| h.dirty > 0);
                            if dirty && ids.contains(&id) {
                                if let Err(e) = zero(&id) {
                                    eprintln!("skiff ns phantom: zeroing {id}'s chunks: {e}; again shortly");
                                }
                            }
                        }
                    }
                    Err(e) => eprintln!("skiff ns phantom: reading the pools: {e}"),
                }
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
        })
    };
    rt::signals::wait_termination()?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    zeroer.join().map_err(|_| "the zeroing thread panicked")?;
    renew.join().map_err(|_| "the renewing thread panicked")??;
    Ok(())
}

fn print_json(value: &impl serde::Serialize) {
    println!("{}", serde_json::to_string_pretty(value).expect("JSON"));
}

fn summary(ns: &Namespace, live: &[ServerInfo]) -> String {
    let lost = ns.lost(live).count();
    format!(
        "{}: {} x{}, chunks of {} KiB; {} MiB reserved, {} MiB in {} allocation(s){}",
        ns.name,
        ns.scope,
        ns.replicas,
        ns.chunk_bytes >> 10,
        ns.reserved_bytes() >> 20,
        ns.allocated_bytes() >> 20,
        ns.allocs.len(),
        if lost > 0 { format!("; {lost} chunk(s) LOST (their servers are gone)") } else { String::new() }
    )
}

/// `skiff ns status` as text.
fn status_text(s: &rstore::repair::Status, now_ms: u64) -> String {
    use std::fmt::Write;
    let h = &s.stripes;
    let mut out = format!(
        "{}: {} (epoch {}, repair leader {})\n  stripes: {} healthy, {} degraded, {} rebuilding, {} unavailable\n",
        s.name,
        s.health,
        s.epoch,
        s.leader.as_deref().unwrap_or("none"),
        h.healthy,
        h.degraded,
        h.rebuilding,
        h.unavailable
    );
    for c in &s.copies {
        let _ =
            write!(out, "  {:#x} stripe {}: {} chunk {} {}", c.addr, c.stripe, c.server, c.index, c.state);
        if !c.live {
            out.push_str(", server away");
        }
        if let Some(since) = c.since_ms {
            let _ = write!(out, " for {} s", now_ms.saturating_sub(since) / 1000);
            if !c.dirty_on.is_empty() {
                let _ = write!(out, " (tracked by {})", c.dirty_on.join(", "));
            }
        }
        if let Some(from) = &c.from {
            let _ = write!(out, " from {from} ({})", if c.full { "full" } else { "dirty regions" });
        }
        out.push('\n');
    }
    for p in &s.sources {
        let _ = writeln!(
            out,
            "  source {}: {} chunk(s) repaired, {} MiB copied, {:.1} MiB/s last, {} MiB verified, {} region(s) found different",
            p.server,
            p.chunks,
            p.bytes >> 20,
            p.rate as f64 / f64::from(1 << 20),
            p.verified >> 20,
            p.mismatched
        );
    }
    if s.syncing_bytes_max > 0 {
        let _ = writeln!(out, "  left to copy: {} MiB at most", s.syncing_bytes_max >> 20);
    }
    out
}

/// The coordinator at the URLs given, or `$SKIFF_COORDINATOR`, or etcd's default on
/// loopback; and those URLs.
pub fn coordinator(
    given: Option<&str>,
    tls: &CoordinatorTls,
) -> Result<(Coordinator, String), Box<dyn std::error::Error>> {
    let urls = given
        .map(str::to_owned)
        .or_else(|| std::env::var("SKIFF_COORDINATOR").ok())
        .unwrap_or_else(|| "http://127.0.0.1:2379".into());
    Ok((Coordinator::connect_with(std::slice::from_ref(&urls), tls.get())?, urls))
}

/// The chunk size for new namespaces of `scope`: `given`, or else the one the memory servers of
/// that scope registered (the one most of them use, when they differ; 4 MiB, `skiff serve`'s
/// default, when none is registered yet). A namespace reserves only on servers of its chunk
/// size, so guessing a size they do not use would fail every `reserve`.
pub fn chunk_size(
    c: &Coordinator,
    scope: Scope,
    given: Option<u64>,
) -> Result<u64, Box<dyn std::error::Error>> {
    if let Some(chunk) = given {
        return Ok(chunk);
    }
    let mut sizes: Vec<(usize, u64)> = Vec::new();
    for s in c.servers()?.iter().filter(|s| s.scope == scope) {
        match sizes.iter_mut().find(|(_, size)| *size == s.chunk_bytes) {
            Some((n, _)) => *n += 1,
            None => sizes.push((1, s.chunk_bytes)),
        }
    }
    Ok(sizes.iter().max().map_or(4 << 20, |&(_, size)| size))
}

/// The allocation at `addr` of namespace `name`, resolved to the live copies of its chunks
/// for the data path (RStore's `init` and `map`), with a label for reports.
pub fn resolve(
    c: &Coordinator,
    name: &str,
    addr: u64,
) -> Result<(rstore::SegmentMap, String), Box<dyn std::error::Error>> {
    let r = c.lookup(name, addr)?;
    let map = rstore::segment_map(&r, &c.servers()?)?;
    let stripes = &map.stripes;
    let mut servers: Vec<String> = stripes.iter().flatten().map(|l| l.endpoint.to_string()).collect();
    servers.sort();
    servers.dedup();
    let label = format!("namespace {name} at {addr:#x} ({} MiB over {} servers)", r.len >> 20, servers.len());
    Ok((map, label))
}

pub fn run(args: NsArgs) -> CliResult {
    let (c, _) = args.coordinator.connect()?;
    match args.action {
        Action::Create { name, size, chunk, replicas, scope } => {
            c.create_ns(&name, scope, chunk_size(&c, scope, chunk)?, replicas)?;
            if size > 0 {
                c.reserve(&name, size)?;
            }
            let ns = c.join_ns(&name)?;
            if args.json {
                print_json(&ns);
            } else {
                println!("created {}", summary(&ns, &c.servers()?));
            }
        }
        Action::Reserve { name, size } => {
            c.reserve(&name, size)?;
            let ns = c.join_ns(&name)?;
            if args.json {
                print_json(&ns);
            } else {
                println!("{}", summary(&ns, &c.servers()?));
            }
        }
        Action::Release { name, size } => {
            c.release(&name, size)?;
            let ns = c.join_ns(&name)?;
            if args.json {
                print_json(&ns);
            } else {
                println!("{}", summary(&ns, &c.servers()?));
            }
        }
        Action::Alloc { name, size, at } => {
            let r = c.alloc(&name, size, at)?;
            if args.json {
                print_json(&r);
            } else {
                println!("{}: allocated {} bytes at {:#x} ({} chunks)", r.ns, r.len, r.addr, r.stripes.len());
            }
        }
        Action::Free { name, addr } => {
            c.free(&name, addr)?;
            if !args.json {
                println!("{name}: freed the allocation at {addr:#x}");
            }
        }
        Action::List => {
            let all = c.list_ns()?.iter().map(|h| c.join_ns(&h.name)).collect::<Result<Vec<_>, _>>()?;
            if args.json {
                print_json(&all);
            } else {
                let live = c.servers()?;
                for ns in &all {
                    println!("{}", summary(ns, &live));
                }
            }
        }
        Action::Delete { name } => {
            c.delete_ns(&name)?;
            if !args.json {
                println!("deleted {name}");
            }
        }
        Action::Costs { size, chunk, reads, replicas, control_only, scope } => {
            costs(&c, &Costing { size, chunk, reads, replicas, control_only, scope }, args.json)?
        }
        Action::Phantom { servers, pool, chunk, prefix } => phantom(&c, servers, pool, chunk, &prefix)?,
        Action::Status { name } => {
            let status = c.status(&name)?;
            if args.json {
                print_json(&status);
            } else {
                print!("{}", status_text(&status, rstore::control::unix_ms()));
            }
        }
        Action::Servers => {
            let mut servers = c.servers()?;
            if args.json {
                // Whether a server takes grants, never its key: the key mints them.
                for s in &mut servers {
                    if !s.grant_key.is_empty() {
                        s.grant_key = "(set)".into();
                    }
                }
                print_json(&servers);
            } else {
                for s in &servers {
                    println!(
                        "{}: {} export {} ({}, {} MiB in {} chunks of {} KiB)",
                        s.id,
                        s.endpoint,
                        s.export,
                        s.scope,
                        s.bytes >> 20,
                        s.chunks(),
                        s.chunk_bytes >> 10
                    );
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
