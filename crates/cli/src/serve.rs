//! `skiff serve`.

mod config;

use std::process::ExitCode;
use std::time::Duration;

use clap::{ArgMatches, Args};
use initiator::Endpoint;
use rstore::pool;
use server::{ExportConfig, Target, TargetConfig};

use crate::CliResult;

#[derive(Args)]
pub struct ServeArgs {
    /// Read settings from this TOML file (keys are the flags' names; contrib/skiff.toml is an
    /// example). Flags given here override it.
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    /// TCP address to listen on (native protocol).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: String,
    /// Also (or instead, with --no-tcp) listen on this Unix socket path.
    #[arg(long)]
    unix: Option<std::path::PathBuf>,
    /// Do not listen for the native protocol on TCP (use with --unix, --eth or --nbd).
    #[arg(long)]
    no_tcp: bool,
    /// Also serve the native protocol over raw Ethernet on this interface (EtherType 0x88B5;
    /// initiators connect to eth:IFACE/MAC; docs/ETHERNET.md). Repeatable: the interfaces
    /// (also IFACE+IFACE) form one bundle, which initiators with several interfaces use as one
    /// path (eth:IFACE+IFACE/MAC). Needs CAP_NET_RAW.
    #[arg(long, value_name = "IFACE")]
    eth: Vec<String>,
    /// Settings of the raw-Ethernet sessions (--eth): driver=packet|xdp, qdisc=on|off,
    /// frame=BYTES (largest datagram payload, 64 to 65507; the MTU lowers it), data-messages=on|off,
    /// data-batching=on|off, crc=full|header, comma-separated (docs/ETHERNET.md, "Settings").
    #[arg(long, value_name = "KEY=VALUE[,...]", value_parser = transport::EthOptions::parse)]
    eth_options: Option<transport::EthOptions>,
    /// Serve NBD clients on this TCP address (NBD's port is 10809). Repeatable.
    #[arg(long, value_name = "ADDR")]
    nbd: Vec<String>,
    /// Serve NBD clients on this Unix socket path.
    #[arg(long, value_name = "PATH")]
    nbd_unix: Option<std::path::PathBuf>,
    /// An export: NAME=SPEC[,OPTION...], SPEC being ram:SIZE, file:PATH or null:SIZE; options
    /// are ro (read-only), cache=SIZE (direct-read cache of a file export), direct=off (page
    /// cache instead of O_DIRECT), send=sendfile (a file export's reads by sendfile(2)),
    /// block=N (a finer block than 512 bytes; 1 takes any byte range), sync (every change
    /// durable before it is acknowledged, FUA or not) and allow=NAME:rw+NAME:ro+*:ro (who may
    /// open it, with which rights; * is anyone without a key). Repeatable.
    #[arg(long = "export", value_name = "NAME=SPEC", required_unless_present_any = ["config", "pool", "flash"])]
    exports: Vec<ExportConfig>,
    /// Serve the volumes of the flash array on these devices (files or block devices, as
    /// given to `skiff flash format`), each volume as an export of its name; `skiff vol`
    /// creates, resizes, snapshots, clones and deletes them while the target runs.
    #[arg(long, value_name = "PATH[,PATH...]", value_delimiter = ',')]
    flash: Vec<std::path::PathBuf>,
    /// DRAM for the flash array's page pool (its only cache of flash pages).
    #[arg(long, value_name = "SIZE", value_parser = crate::units::parse_size, default_value = "256M")]
    flash_cache: u64,
    /// Memory for the flash array's map (its leaves and per-page side tables). Past it, map
    /// leaves stored in the last checkpoint are dropped and read back when wanted. 0: no bound
    /// (docs/FLASH.md, "Memory").
    #[arg(long, value_name = "SIZE", value_parser = crate::units::parse_size, default_value = "1G")]
    flash_map_budget: u64,
    /// Flash pool misses read asynchronously at once (io_uring): a worker parks a request
    /// whose pages are on flash and serves other connections until they land. 0 reads them on
    /// the worker's thread instead.
    #[arg(long, value_name = "N", default_value_t = server::FLASH_READ_DEPTH_DEFAULT)]
    flash_read_depth: u32,
    /// Keep the secret that seals the flash volumes' references (extents) and their key
    /// epochs in FILE (made, readable by its owner alone, when missing), so that references
    /// stay valid across a restart while the volume and its epoch are unchanged. Without it a
    /// target's references die with it (docs/DIRECT_READS.md, "Flash volumes").
    #[arg(long, value_name = "FILE", requires = "flash")]
    flash_references: Option<std::path::PathBuf>,
    /// Be a memory server of RStore namespaces: donate RAM (ram:SIZE), a file (file:PATH) or a
    /// thin volume of the --flash array (flash:SIZE, volume `pool`) as a pool of chunks, served
    /// as export `pool` and registered with --coordinator (docs/RSTORE.md). `,sync` after it
    /// makes every change durable before it is acknowledged: a flash pool then keeps its
    /// chunks across a kill -9.
    #[arg(long, value_name = "SPEC", requires = "coordinator")]
    pool: Option<String>,
    /// The coordinator a pool registers with: etcd's client URLs, comma-separated.
    #[arg(long, value_name = "URLS")]
    coordinator: Option<String>,
    #[command(flatten)]
    coordinator_tls: crate::ns::CoordinatorTls,
    /// The pool's chunk size (a power of two; namespaces use servers of their chunk size).
    #[arg(long, value_parser = crate::units::parse_size, default_value = "4M")]
    chunk: u64,
    /// Where initiators reach this memory server, as registered [default: the TCP address it
    /// listens on].
    #[arg(long, value_name = "HOST:PORT")]
    advertise: Option<String>,
    /// The registration's lease: this long after the server stops renewing it, its chunks are
    /// lost to their namespaces.
    #[arg(long, value_name = "DURATION", value_parser = crate::units::parse_duration, default_value = "10s")]
    lease: Duration,
    /// How long a copy's memory server may stay away before the repair rebuilds the copy on
    /// another server with free pool space (docs/RSTORE.md, "Healing").
    #[arg(long, value_name = "DURATION", value_parser = crate::units::parse_duration, default_value = "10m")]
    rebuild_after: Duration,
    /// Bytes a second this server copies out at most when it repairs a copy (0: no bound), so
    /// that the foreground keeps its IOPS.
    #[arg(long, value_name = "SIZE", value_parser = crate::units::parse_size, default_value = "100M")]
    rebuild_rate: u64,
    /// Whether a partial repair (a copy whose server came back with its pool) also compares
    /// the regions it does not copy with this server's copy, and copies those that differ (a
    /// pool damaged in place while away); the comparison counts against --rebuild-rate
    /// (docs/RSTORE.md, "Verified rejoins").
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    repair_verify: bool,
    /// Serve every export read-only.
    #[arg(long)]
    read_only: bool,
    /// Keys initiators may authenticate with (nbdkit's PSK format, NAME:HEXSECRET per line);
    /// exports name them in allow=. Repeatable.
    #[arg(long = "key-file", value_name = "PATH")]
    key_files: Vec<std::path::PathBuf>,
    /// TLS: off, on (TLS or plaintext: native clients are told apart by their first byte, NBD
    /// clients by STARTTLS) or require (a plaintext native client gets GOAWAY TlsRequired, an
    /// NBD client NBD_REP_ERR_TLS_REQD).
    #[arg(long, value_name = "MODE", default_value = "off")]
    tls: transport::tls::TlsMode,
    /// The target's certificate directory: ca-cert.pem, server-cert.pem, server-key.pem.
    #[arg(long, value_name = "DIR")]
    tls_certificates: Option<std::path::PathBuf>,
    /// Require client certificates signed by DIR/ca-cert.pem; a certificate's CN is then a
    /// principal that allow= may name (the rights of NBD clients over TLS).
    #[arg(long)]
    tls_verify_peer: bool,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    workers: usize,
    /// Largest queue depth a lane may negotiate.
    #[arg(long, default_value_t = wire::Limits::default().queue_depth)]
    queue_depth: u32,
    /// Hybrid polling: off; hybrid (spin 50 us before sleeping; hybrid:US); or adaptive (spin
    /// only while it saves more wake-ups than it wastes, up to 50 us or adaptive:US, and sleep
    /// on a timer through long waits). Lowers latency at low queue depth, at the price of a
    /// worker spinning on a core while it waits.
    #[arg(long, default_value = "off", value_parser = crate::units::parse_poll)]
    poll: rt::poll::PollMode,
    /// How workers divide a request's path among threads, to measure what run to completion
    /// saves (Tyche Tables V and VI): rtc (receive, execute and send on one thread, the
    /// design to run); send-thread (completions sent by a second thread through a queue);
    /// recv-thread (requests received by a second thread and handed over). Native
    /// connections without TLS only.
    #[arg(long, value_name = "DESIGN", default_value = "rtc")]
    stages: server::Stages,
    /// Largest single I/O in bytes (e.g. 1M).
    #[arg(long, value_parser = crate::units::parse_size, default_value = "1M")]
    io_max: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9470); see
    /// docs/METRICS.md.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
    /// Connections open at once; more are refused.
    #[arg(long, value_name = "N", default_value_t = server::Bounds::default().connections_max, value_parser = at_least_one)]
    connections_max: usize,
    /// Connections still in their handshake at once; one more evicts the oldest of them.
    #[arg(long, value_name = "N", default_value_t = server::Bounds::default().handshakes_max, value_parser = at_least_one)]
    handshakes_max: usize,
    /// Connections open at once from one client address.
    #[arg(long, value_name = "N", default_value_t = server::Bounds::default().connections_per_address_max, value_parser = at_least_one)]
    connections_per_address_max: usize,
    /// Close connections that have not finished their handshake after this long [default: 10s].
    #[arg(long, value_name = "DURATION", value_parser = crate::units::parse_duration)]
    handshake_timeout: Option<Duration>,
    /// Close native connections silent this long, or off [default: 1m].
    #[arg(long, value_name = "DURATION", value_parser = crate::units::parse_timeout)]
    idle_timeout: Option<Duration>,
    /// Close NBD connections silent this long, or off [default: off].
    #[arg(long, value_name = "DURATION", value_parser = crate::units::parse_timeout)]
    nbd_idle_timeout: Option<Duration>,
}

/// Every key of every key file; a name may appear in one file only.
fn load_keys(paths: &[std::path::PathBuf]) -> Result<Vec<proto::auth::Key>, String> {
    let mut keys: Vec<proto::auth::Key> = Vec::new();
    for path in paths {
        for key in crate::keys::load(path)? {
            if keys.iter().any(|k| k.name == key.name) {
                return Err(format!(
                    "key {:?} is given by two key files (the second: {})",
                    key.name,
                    path.display()
                ));
            }
            keys.push(key);
        }
    }
    Ok(keys)
}

fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s:?}: expected a whole number of at least 1")),
    }
}

pub fn run(mut args: ServeArgs, matches: &ArgMatches) -> CliResult {
    let tuning = config::apply(&mut args, matches)?;
    let pool = args.pool.as_deref().map(pool::parse).transpose()?;
    let mut grant_key = None;
    if let Some(p) = &pool {
        if args.exports.iter().any(|e| e.name == pool::POOL_EXPORT) {
            return Err(format!(
                "--pool serves export {:?}: no --export may take that name",
                pool::POOL_EXPORT
            )
            .into());
        }
        if args.chunk == 0 || !args.chunk.is_power_of_two() || p.bytes < args.chunk || args.chunk > 1 << 31 {
            return Err(format!(
                "--chunk {}: a power of two no larger than the pool ({} bytes) nor 2 GiB",
                args.chunk, p.bytes
            )
            .into());
        }
        if p.bytes / args.chunk > coord::POOL_CHUNKS_MAX {
            return Err(format!(
                "--chunk {}: the pool would hold {} chunks, more than {}; use larger chunks",
                args.chunk,
                p.bytes / args.chunk,
                coord::POOL_CHUNKS_MAX
            )
            .into());
        }
        // The pool's chunks are reached with grants sealed under a key drawn here and
        // published in the registration alone (docs/RSTORE.md says who can read it).
        let key: [u8; proto::capability::KEY_LEN] = rt::random::bytes()?;
        match &p.export {
            Some(export) => {
                let grants = Some(server::GrantConfig { key, chunk_bytes: args.chunk });
                args.exports.push(server::ExportConfig { grants, ..export.clone() });
            }
            None if args.flash.is_empty() => {
                return Err(
                    "--pool flash:SIZE donates a volume of the flash array: give --flash DEVICE".into()
                )
            }
            None => {}
        }
        grant_key = Some(key);
    }
    if args.exports.is_empty() && args.flash.is_empty() {
        return Err(
            "no exports: give --export NAME=SPEC or --flash PATH, or `export` or `flash` in the config file"
                .into(),
        );
    }
    let io_bytes_max = u32::try_from(args.io_max).map_err(|_| "--io-max must be below 4 GiB")?;
    let defaults = wire::Limits::default();
    let limits = wire::Limits {
        queue_depth: args.queue_depth.max(1),
        io_bytes_max,
        caravan_bytes_max: defaults.caravan_bytes_max.max(io_bytes_max),
        ..defaults
    };
    let bounds = tuning.apply(bounds(&args, limits))?;
    let mut listen = Vec::new();
    if !args.no_tcp {
        listen.push(Endpoint::parse(&args.listen)?);
    }
    if let Some(path) = args.unix {
        listen.push(Endpoint::Unix(path));
    }
    if args.eth.is_empty() && args.eth_options.is_some() {
        return Err(
            "eth-options without an interface to serve raw Ethernet on (--eth or eth in the file)".into()
        );
    }
    if !args.eth.is_empty() {
        // Every --eth joins one bundle, checked as an eth: endpoint is.
        match Endpoint::parse(&format!("eth:{}", args.eth.join("+")))? {
            Endpoint::Eth { ifaces, .. } => listen.push(Endpoint::Eth {
                ifaces,
                mac: None,
                options: args.eth_options.unwrap_or_default(),
            }),
            _ => unreachable!("an eth: address parses as raw Ethernet"),
        }
    }
    let mut nbd_listen = args.nbd.iter().map(|a| Endpoint::parse(a)).collect::<Result<Vec<_>, _>>()?;
    if let Some(path) = args.nbd_unix {
        nbd_listen.push(Endpoint::Unix(path));
    }
    if listen.is_empty() && nbd_listen.is_empty() {
        return Err("nothing to listen on: --no-tcp needs --unix, --eth, --nbd or --nbd-unix".into());
    }
    // Drawn before it is known whether the flash pool needs it (new, or not stopped cleanly).
    let fresh_incarnation = u64::from_le_bytes(rt::random::bytes::<8>()?) | 1;
    let config = TargetConfig {
        listen,
        nbd_listen,
        exports: args.exports,
        read_only: args.read_only,
        workers: args.workers,
        bounds,
        poll: args.poll,
        stages: args.stages,
        metrics_listen: args.metrics,
        keys: load_keys(&args.key_files)?,
        tls: crate::tls::listen(args.tls, args.tls_certificates.as_ref(), args.tls_verify_peer)?,
        flash: (!args.flash.is_empty()).then(|| server::FlashConfig {
            devices: args.flash.clone(),
            pool_bytes: args.flash_cache,
            map_bytes: args.flash_map_budget,
            read_depth: args.flash_read_depth,
            references: args.flash_references.clone(),
            rstore_pool: match (&pool, &grant_key) {
                (Some(p), Some(key)) if p.export.is_none() => Some(server::PoolVolume {
                    name: pool::POOL_EXPORT.into(),
                    size_bytes: p.bytes,
                    key: *key,
                    chunk_bytes: args.chunk,
                    fresh_incarnation,
                    sync: p.sync,
                }),
                _ => None,
            },
        }),
    };
    // Before any thread starts, so that every thread inherits the blocked mask and the signal
    // is taken synchronously below.
    rt::signals::block_termination()?;
    let target = Target::start(config)?;
    // Every listener accepts connections now: tell systemd (Type=notify), if it is listening.
    let protocols = [server::Protocol::Native, server::Protocol::Nbd];
    let listening: Vec<String> =
        protocols.iter().flat_map(|&p| target.endpoints_of(p)).map(|e| e.to_string()).collect();
    let registered = match (&pool, &args.coordinator, &grant_key) {
        (Some(p), Some(urls), Some(grant_key)) => {
            let endpoint = match &args.advertise {
                Some(a) => a.clone(),
                None => target
                    .endpoints_of(server::Protocol::Native)
                    .into_iter()
                    .find_map(|e| matches!(e, Endpoint::Tcp(_)).then(|| e.to_string()))
                    .ok_or("--pool without TCP: give --advertise")?,
            };
            // An unspecified listen address names no host: initiators could not reach it,
            // and every server listening so would have the same id.
            if endpoint.starts_with("0.0.0.0:") || endpoint.starts_with("[::]:") {
                target.shutdown();
                return Err(format!("--pool listening on {endpoint}: give --advertise HOST:PORT").into());
            }
            let info = coord::ServerInfo {
                id: endpoint.clone(),
                endpoint,
                export: pool::POOL_EXPORT.into(),
                scope: p.scope,
                bytes: p.bytes - p.bytes % args.chunk,
                chunk_bytes: args.chunk,
                incarnation: match p.scope {
                    coord::Scope::Flash => {
                        target.flash_pool_incarnation().ok_or("the flash pool has no volume")?
                    }
                    _ => pool::incarnation(p)?,
                },
                grant_key: coord::encode_key(grant_key),
                boot: u64::from_le_bytes(rt::random::bytes::<8>()?),
            };
            let served = target.pool(pool::POOL_EXPORT).ok_or("the pool export takes no grants")?;
            let repair = rstore::agent::Config {
                rebuild_after: args.rebuild_after,
                rebuild_rate: args.rebuild_rate,
                verify: args.repair_verify,
                ..rstore::agent::Config::default()
            };
            match pool::register(urls, args.coordinator_tls.get(), info, served, args.lease, repair) {
                Ok(r) => Some(r),
                Err(e) => {
                    target.shutdown();
                    return Err(e);
                }
            }
        }
        _ => None,
    };
    let status = format!("listening on {}", listening.join(", "));
    notify(rt::notify::ready(&status));
    let sig = rt::signals::wait_termination()?;
    tracing::info!(signal = sig, "shutting down");
    notify(rt::notify::stopping());
    if let Some(r) = registered {
        r.end();
    }
    target.shutdown();
    tracing::info!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// A failed notification is worth a warning, not an exit: the service manager will time out
/// on its own and say so.
fn notify(sent: std::io::Result<bool>) {
    if let Err(e) = sent {
        tracing::warn!(error = %e, "cannot notify the service manager ($NOTIFY_SOCKET)");
    }
}

/// The bounds the flags (and the config file through them) set.
fn bounds(args: &ServeArgs, limits: wire::Limits) -> server::Bounds {
    let defaults = server::Bounds::default();
    server::Bounds {
        limits,
        connections_max: args.connections_max,
        handshakes_max: args.handshakes_max,
        connections_per_address_max: args.connections_per_address_max,
        handshake_timeout: args.handshake_timeout.unwrap_or(defaults.handshake_timeout),
        idle_timeout: args.idle_timeout.unwrap_or(defaults.idle_timeout),
        nbd_idle_timeout: args.nbd_idle_timeout.unwrap_or(defaults.nbd_idle_timeout),
        ..defaults
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How the help text spells a duration default.
    fn spelled(d: Duration) -> String {
        match d.as_secs() {
            0 => "off".into(),
            s if s % 60 == 0 => format!("{}m", s / 60),
            s => format!("{s}s"),
        }
    }

    /// The timeouts' defaults are written into their help by hand (clap cannot show an
    /// `Option`'s fallback): they must say what `server::Bounds::default()` does.
    #[test]
    fn the_help_states_the_true_timeout_defaults() {
        let cmd = <ServeArgs as clap::Args>::augment_args(clap::Command::new("serve"));
        let b = server::Bounds::default();
        for (flag, default) in [
            ("handshake_timeout", b.handshake_timeout),
            ("idle_timeout", b.idle_timeout),
            ("nbd_idle_timeout", b.nbd_idle_timeout),
        ] {
            let arg = cmd.get_arguments().find(|a| a.get_id() == flag).expect(flag);
            let help = arg.get_help().expect("help").to_string();
            assert!(help.contains(&format!("[default: {}]", spelled(default))), "--{flag}: {help}");
        }
    }
}
