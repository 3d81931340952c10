//! The pool service of a memory server of RStore namespaces (`skiff serve --pool SPEC
//! --coordinator URLS`). The pool is an ordinary export (`pool`) that initiators reach on the
//! data path like any other; the server registers it with the coordinator (etcd) under a lease
//! and renews the lease from a thread of its own, so that the control plane never runs on a
//! worker (docs/RSTORE.md). A thread of its own zeroes the chunks namespaces gave back
//! (through a lane to its own export, WRITE_ZEROES) before the coordinator hands them out
//! again, and another runs the repair agent ([`crate::agent`]).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use coord::{Scope, ServerInfo};

use crate::agent;
use crate::control::{Coordinator, Registration};

/// The export a pool is served as.
pub const POOL_EXPORT: &str = "pool";

/// What `--pool` asked for.
pub struct Pool {
    /// The export that serves a `ram:` or `file:` pool; `None` for `flash:`, a volume of the
    /// target's flash array ([`server::PoolVolume`]).
    pub export: Option<server::ExportConfig>,
    pub scope: Scope,
    pub bytes: u64,
    /// Every change durable before it is acknowledged (`,sync`): a flash pool so served keeps
    /// its chunks across a `kill -9` ([`server::PoolVolume::sync`]).
    pub sync: bool,
}

/// `ram:SIZE`, `file:PATH` (the file's size is the pool's) or `flash:SIZE` (a volume of the
/// target's flash array, `--flash`), each with `,sync` after it if every change must be
/// durable before it is acknowledged.
pub fn parse(spec: &str) -> Result<Pool, String> {
    if let Some(size) = spec.strip_prefix("flash:") {
        let (size, sync) = match size.strip_suffix(",sync") {
            Some(size) => (size, true),
            None => (size, false),
        };
        let bytes = backend::parse_size(size).map_err(|e| format!("--pool {spec}: {e}"))?;
        if bytes == 0 {
            return Err(format!("--pool {spec}: a pool must hold data"));
        }
        return Ok(Pool { export: None, scope: Scope::Flash, bytes, sync });
    }
    let mut export: server::ExportConfig =
        format!("{POOL_EXPORT}={spec}").parse().map_err(|e| format!("--pool {spec}: {e}"))?;
    // RStore addresses bytes: reads and writes at any offset and length, one-byte flags.
    export.block_bytes.get_or_insert(1);
    let (scope, bytes) = match &export.spec {
        backend::BackendSpec::Ram { size_bytes } => (Scope::Ram, *size_bytes),
        backend::BackendSpec::File { path } => {
            let len = std::fs::metadata(path).map_err(|e| format!("--pool {spec}: {e}"))?.len();
            (Scope::File, len)
        }
        backend::BackendSpec::Null { .. } => {
            return Err(format!("--pool {spec}: a pool must hold data (ram:, file: or flash:)"))
        }
    };
    let sync = export.sync;
    Ok(Pool { export: Some(export), scope, bytes, sync })
}

/// The extended attribute that names a file pool: drawn when the file first serves as a pool.
const POOL_ID_XATTR: &str = "user.skiff.pool";

/// This process's incarnation of `pool`: new for RAM, whose data dies with the process. A
/// flash pool's is its volume's (`engine::volumes::FlashVolumes::pool_incarnation`), not
/// this function's. A file's is its pool id, kept in an extended attribute of the file (`user.skiff.pool`): the
/// same file comes back with the same one, so namespaces find their chunks' data there; a file
/// that is not the one the server left with (replaced, recreated, restored from elsewhere)
/// has none, draws a new one, and every copy namespaces held on it is rebuilt in full.
pub fn incarnation(pool: &Pool) -> Result<u64, String> {
    let random = || rt::random::bytes::<8>().map(|b| u64::from_le_bytes(b) | 1).map_err(|e| e.to_string());
    let Some(backend::BackendSpec::File { path }) = pool.export.as_ref().map(|e| &e.spec) else {
        return random();
    };
    let file = std::fs::File::open(path).map_err(|e| format!("--pool file:{}: {e}", path.display()))?;
    let cannot = |e: std::io::Error| {
        format!(
            "--pool file:{}: cannot keep the pool's id in an extended attribute ({e}): put the pool on a file system that has them (ext4, xfs, btrfs, tmpfs)",
            path.display()
        )
    };
    match rt::fs::xattr(&file, POOL_ID_XATTR).map_err(cannot)? {
        Some(id) if id.len() == 8 => Ok(u64::from_le_bytes(id.try_into().expect("8 bytes")) | 1),
        _ => {
            let id = random()?;
            rt::fs::set_xattr(&file, POOL_ID_XATTR, &id.to_le_bytes()).map_err(cannot)?;
            tracing::info!(pool = %path.display(), id = format!("{id:x}"), "a new file pool: copies namespaces held here are rebuilt in full");
            Ok(id)
        }
    }
}

/// How often the server looks for chunks given back, to zero them.
const ZERO_EVERY: Duration = Duration::from_millis(500);

/// Zero the chunks of this server's pool that namespaces gave back, then tell the coordinator
/// they are free: through a lane to the server's own pool export, so the bytes of a deleted
/// namespace never reach the next one. Each chunk is retired first ([`server::Pool::retire`]:
/// its generation moves on, and requests its last owner sent before are done): nothing they
/// send lands after the zeroes, and the coordinator records the new generation for the next
/// owner's grants.
fn zero_dirty(
    coord: &Coordinator,
    info: &ServerInfo,
    pool: &server::Pool,
    stop: &AtomicBool,
) -> Result<(), Box<dyn std::error::Error>> {
    use initiator::Queue;
    let dirty = coord.dirty(&info.id)?;
    if dirty.is_empty() {
        return Ok(());
    }
    let endpoint = initiator::Endpoint::parse(&info.endpoint)?;
    let rw = wire::CapRights::READ.union(wire::CapRights::WRITE);
    let mut out = Vec::new();
    // A batch at a time, each handed back as soon as it is zero.
    for batch in dirty.chunks(64) {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let generations = pool.retire(batch);
        let config = initiator::LaneConfig {
            grants: batch.iter().filter_map(|&c| pool.grants().mint(c, rw)).collect(),
            ..initiator::LaneConfig::default()
        };
        let mut l = initiator::Lane::connect(&endpoint, &info.export, &config)?;
        let depth = l.queue_depth().max(1);
        let piece = u64::from(l.limits().io_bytes_max).clamp(512, 1 << 20);
        for &chunk in batch {
            let mut at = chunk * info.chunk_bytes;
            let end = at + info.chunk_bytes;
            while at < end {
                let n = piece.min(end - at);
                while l.in_flight() >= depth {
                    l.wait(1, &mut out)?;
                }
                l.submit_write_zeroes(at, n as u32, initiator::ReqFlags::empty(), 0).map_err(|r| r.error)?;
                at += n;
            }
        }
        l.wait(usize::MAX, &mut out)?;
        if let Some(c) = out.iter().find(|c| c.status != initiator::Status::Ok) {
            return Err(format!("WRITE_ZEROES failed: {}", c.status).into());
        }
        out.clear();
        coord.cleaned(&info.id, &generations)?;
        tracing::debug!(chunks = batch.len(), "zeroed chunks given back");
    }
    Ok(())
}

/// A registration kept alive by a thread until [`Registered::end`].
pub struct Registered {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Option<Registration>>>,
    zeroer: Option<std::thread::JoinHandle<()>>,
    repairer: Option<std::thread::JoinHandle<()>>,
    coord: Arc<Coordinator>,
    pool: server::Pool,
}

/// Register `info` with the coordinator at `urls`, and renew it every third of `lease` from a
/// thread; a lease found expired (etcd unreachable for longer than `lease`) is taken again.
pub fn register(
    urls: &str,
    tls: Option<coord::etcd::Tls>,
    info: ServerInfo,
    pool: server::Pool,
    lease: Duration,
    repair: agent::Config,
) -> Result<Registered, Box<dyn std::error::Error>> {
    let coord = Arc::new(Coordinator::connect_with(&[urls.to_owned()], tls)?);
    // Take up the generations the coordinator recorded before publishing the key: grants
    // minted from them must be current here (a file pool's chunks outlive a restart).
    let generations =
        coord.generations(&info.id).map_err(|e| format!("registering with the coordinator {urls}: {e}"))?;
    for (chunk, generation) in generations {
        pool.grants().set_generation(chunk, generation);
    }
    let first =
        coord.register(&info, lease).map_err(|e| format!("registering with the coordinator {urls}: {e}"))?;
    tracing::info!(id = %info.id, endpoint = %info.endpoint, bytes = info.bytes, chunk = info.chunk_bytes, scope = %info.scope,
        "registered with the coordinator");
    let stop = Arc::new(AtomicBool::new(false));
    let zero_info = info.clone();
    let agent_info = info.clone();
    // The lease the registration holds now (0: none), for the repair leader's key.
    let current = Arc::new(AtomicI64::new(first.lease()));
    let thread = {
        let (stop, coord, current) = (stop.clone(), coord.clone(), current.clone());
        std::thread::Builder::new().name("skiff-lease".into()).spawn(move || {
            let mut reg = Some(first);
            let tick = Duration::from_millis(50);
            let mut waited = Duration::ZERO;
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(tick);
                waited += tick;
                let interval = reg.as_ref().map_or(Duration::from_secs(1), Registration::interval);
                if waited < interval {
                    continue;
                }
                waited = Duration::ZERO;
                match reg.as_ref().map(|r| r.keep_alive(&coord)) {
                    Some(Ok(true)) => {}
                    Some(Err(e)) => tracing::warn!(error = %e, "cannot renew the registration; trying again"),
                    Some(Ok(false)) | None => {
                        tracing::warn!("the registration lapsed: registering again");
                        reg = coord
                            .register(&info, lease)
                            .inspect_err(|e| tracing::warn!(error = %e, "cannot register again"))
                            .ok();
                        current.store(reg.as_ref().map_or(0, Registration::lease), Ordering::Relaxed);
                    }
                }
            }
            reg
        })?
    };
    // Zeroing has a thread of its own: a large namespace given back takes a while to zero,
    // and the lease must be renewed meanwhile.
    let zeroer = {
        let (stop, coord, info, pool) = (stop.clone(), coord.clone(), zero_info, pool.clone());
        std::thread::Builder::new().name("skiff-zero".into()).spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(ZERO_EVERY);
                if let Err(e) = zero_dirty(&coord, &info, &pool, &stop) {
                    tracing::warn!(error = %e, "cannot zero the chunks given back; trying again");
                }
            }
        })?
    };
    // Repair too: a copy takes a while, and neither lease nor zeroing may wait for it.
    let repairer = agent::spawn(coord.clone(), agent_info, pool.clone(), repair, current, stop.clone())?;
    Ok(Registered { stop, thread: Some(thread), zeroer: Some(zeroer), repairer: Some(repairer), coord, pool })
}

impl Registered {
    /// What this server's repair agent did.
    pub fn progress(&self) -> &agent::Progress {
        self.pool.repair()
    }

    /// Stop renewing and end the registration at once (a clean shutdown).
    pub fn end(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in [self.zeroer.take(), self.repairer.take()].into_iter().flatten() {
            let _ = t.join();
        }
        if let Some(Some(reg)) = self.thread.take().map(|t| t.join().ok().flatten()) {
            if let Err(e) = reg.revoke(&self.coord) {
                tracing::warn!(error = %e, "cannot end the registration; it lapses with its lease");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_is_ram_or_a_file_that_exists() {
        let ram = parse("ram:64M").unwrap();
        let name = |p: &Pool| p.export.as_ref().map(|e| e.name.clone());
        assert_eq!((ram.scope, ram.bytes, name(&ram)), (Scope::Ram, 64 << 20, Some(POOL_EXPORT.into())));
        let file = tempfile::NamedTempFile::new().unwrap();
        file.as_file().set_len(8 << 20).unwrap();
        let f = parse(&format!("file:{}", file.path().display())).unwrap();
        assert_eq!((f.scope, f.bytes), (Scope::File, 8 << 20));
        let block = |p: &Pool| p.export.as_ref().and_then(|e| e.block_bytes);
        assert_eq!((block(&ram), block(&f)), (Some(1), Some(1)), "pools address bytes");
        assert_eq!(block(&parse("ram:1M,block=512").unwrap()), Some(512), "unless told otherwise");
        let flash = parse("flash:64G").unwrap();
        assert_eq!(
            (flash.scope, flash.bytes, name(&flash), flash.sync),
            (Scope::Flash, 64 << 30, None, false),
            "a volume, not an export"
        );
        let synced = parse("flash:64G,sync").unwrap();
        assert_eq!((synced.scope, synced.bytes, synced.sync), (Scope::Flash, 64 << 30, true));
        assert!(parse("ram:1M,sync").unwrap().sync && !ram.sync);
        for (bad, says) in [
            ("null:1M", "must hold data"),
            ("file:/nonexistent/skiff-pool", "No such file"),
            ("ram:", "--pool ram:"),
            ("flash:", "--pool flash:"),
            ("flash:0", "must hold data"),
            ("flash:lots", "--pool flash:lots"),
            ("flash:1G,ro", "--pool flash:1G,ro"),
            ("flash:,sync", "--pool flash:,sync"),
            ("disk:1G", "--pool disk:1G"),
        ] {
            let e = parse(bad).err().unwrap_or_else(|| panic!("{bad} was taken"));
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    /// A file pool keeps its incarnation across restarts (its id is in the file), and a file
    /// put in its place (recreated) is another pool; RAM draws a new one every time.
    #[test]
    fn a_file_pool_is_known_by_the_id_in_its_file_and_a_new_file_is_another_pool() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        std::fs::File::create(&path).unwrap().set_len(8 << 20).unwrap();
        let pool = parse(&format!("file:{}", path.display())).unwrap();
        let first = incarnation(&pool).unwrap();
        assert_ne!(first, 0);
        assert_eq!(incarnation(&pool).unwrap(), first, "the same file, the same pool");
        std::fs::remove_file(&path).unwrap();
        std::fs::File::create(&path).unwrap().set_len(8 << 20).unwrap();
        assert_ne!(incarnation(&pool).unwrap(), first, "a file put in its place is another pool");
        let ram = parse("ram:8M").unwrap();
        assert_ne!(incarnation(&ram).unwrap(), incarnation(&ram).unwrap());
    }
}
