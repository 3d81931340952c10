//! A C ABI over skiff's initiator, declared in `include/skiff.h`.
//!
//! The C caller owns its buffers; a lane holds a pointer to each until the request's
//! completion has been reaped ([`RawBuf`]), so read data lands in the caller's memory with no
//! copy in between. Errors are negative errno values with a per-thread message; no panic
//! crosses the boundary. This crate has no logic of its own beyond translation.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use initiator::{
    BatchConfig, Batching, Completion, Doorbell, Endpoint, Error, ExportInfo, Lane, LaneConfig, Limits,
    PollMode, ReqFlags, SharedHandle, SharedLanes,
};
use wire::Opcode;

/// Request flags, as in `skiff.h`.
pub const SKIFF_FLAG_FUA: u32 = 0x01;
pub const SKIFF_FLAG_NO_DELAY: u32 = 0x02;

/// Batching modes, as in `skiff.h`.
pub const SKIFF_BATCHING_STATIC: u32 = 0;
pub const SKIFF_BATCHING_OFF: u32 = 1;
pub const SKIFF_BATCHING_ADAPTIVE: u32 = 2;

/// Hybrid polling modes, as in `skiff.h`.
pub const SKIFF_POLL_OFF: u32 = 0;
pub const SKIFF_POLL_HYBRID: u32 = 1;
pub const SKIFF_POLL_ADAPTIVE: u32 = 2;
/// The spin bound when `poll_spin_us` is 0.
const POLL_SPIN_DEFAULT_US: u32 = 50;

/// `skiff_lane_config` in `skiff.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SkiffLaneConfig {
    pub queue_depth: u32,
    pub aggregation_reqs: u32,
    pub aggregation_bytes: u32,
    pub doorbell_us: u32,
    pub timeout_ms: u32,
    pub batching: u32,
    pub shared_lanes: u32,
    pub reconnect_delay_ms: u32,
    pub ctrl_loss_timeout_ms: u32,
    pub fast_io_fail_timeout_ms: u32,
    pub directory_entries: u32,
    pub key_file: *const c_char,
    pub key_name: *const c_char,
    pub tls_certificates: *const c_char,
    pub poll: u32,
    pub poll_spin_us: u32,
    pub batch_log: *const c_char,
}

/// `skiff_completion` in `skiff.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SkiffCompletion {
    pub user_data: u64,
    pub result: i32,
    pub reserved: u32,
}

/// A caller's buffer, held by the lane between submit and reap.
pub struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

impl AsRef<[u8]> for RawBuf {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: skiff_lane_submit's contract (skiff.h): the buffer is valid for `len` bytes
        // and untouched by the caller until its completion is reaped, which is as long as the
        // lane holds this RawBuf.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl AsMut<[u8]> for RawBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `as_ref`; the lane is the buffer's only user until the completion.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

// SAFETY: a RawBuf is the memory of one request, which skiff_lane_submit's contract hands to
// the lane until the completion is reaped; on a shared lane another caller's thread may send
// from it or receive into it meanwhile, and the caller does not touch it then.
unsafe impl Send for RawBuf {}

type Group = SharedLanes<RawBuf>;

/// Shared-lane groups of this process, by target, export and configuration: every
/// `skiff_lane_open` with the same three and `shared_lanes > 0` gets a handle on one group,
/// which lives as long as one of its handles.
static GROUPS: Mutex<Vec<(String, Weak<Group>)>> = Mutex::new(Vec::new());

fn group(
    endpoint: &Endpoint,
    key: String,
    export: &str,
    config: &LaneConfig,
    lanes: usize,
) -> Result<Arc<Group>, Error> {
    let mut groups = GROUPS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    groups.retain(|(_, g)| g.strong_count() > 0);
    if let Some(g) = groups.iter().find(|(k, _)| *k == key).and_then(|(_, g)| g.upgrade()) {
        return Ok(g);
    }
    let g = Arc::new(SharedLanes::connect(endpoint, export, config, lanes)?);
    groups.push((key, Arc::downgrade(&g)));
    Ok(g)
}

/// What a `skiff_lane *` sends through.
enum Queue {
    /// A lane of its own.
    Private(Box<Lane<RawBuf>>),
    /// A handle on a process-wide group of shared lanes.
    Shared { handle: SharedHandle<RawBuf>, _group: Arc<Group>, export: ExportInfo },
}

impl Queue {
    fn export(&self) -> &ExportInfo {
        match self {
            Queue::Private(lane) => lane.export(),
            Queue::Shared { export, .. } => export,
        }
    }

    fn queue_depth(&self) -> usize {
        match self {
            Queue::Private(lane) => lane.queue_depth(),
            Queue::Shared { handle, .. } => handle.queue_depth(),
        }
    }

    /// Submitting and reaping, the same for both kinds.
    fn io(&mut self) -> &mut dyn initiator::Queue<RawBuf> {
        match self {
            Queue::Private(lane) => lane.as_mut(),
            Queue::Shared { handle, .. } => handle,
        }
    }

    fn in_flight(&mut self) -> usize {
        self.io().in_flight()
    }

    /// On a shared lane the doorbell alone decides: other threads' requests may still join.
    fn commit(&mut self) -> Result<(), Error> {
        match self {
            Queue::Private(lane) => lane.commit(),
            Queue::Shared { .. } => Ok(()),
        }
    }
}

/// The handle behind `skiff_lane *`.
pub struct SkiffLane {
    lane: Queue,
    /// Completions collected but not yet handed out (the caller asked for fewer).
    ready: VecDeque<Completion<RawBuf>>,
    scratch: Vec<Completion<RawBuf>>,
    /// Where the adaptive controller's decisions go when this lane (or, shared, its group)
    /// closes (`skiff_lane_config.batch_log`).
    batch_log: Option<PathBuf>,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(message: String) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// The one mapping from initiator errors to errno.
fn errno_of(e: &Error) -> i32 {
    match e {
        Error::Io(io) => io.raw_os_error().unwrap_or(libc::EIO),
        Error::Protocol(_) => libc::EPROTO,
        Error::Refused(status) | Error::Status(status) | Error::VolumeRefused { status, .. } => {
            status.errno()
        }
        Error::GoAway { .. } | Error::Closed => libc::ECONNRESET,
        Error::TimedOut(_) => libc::ETIMEDOUT,
        Error::InvalidArgument(_) => libc::EINVAL,
        Error::QueueFull(_) => libc::EAGAIN,
        Error::Lost(_) => libc::ENOTCONN,
    }
}

fn fail(e: &Error) -> c_int {
    set_error(e.to_string());
    -errno_of(e)
}

/// Run `f`, turning a panic into -EIO so that it never unwinds into C.
fn guard(f: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        set_error("internal error (panic) in skiff".into());
        -libc::EIO
    })
}

fn defaults() -> SkiffLaneConfig {
    let d = LaneConfig::default();
    SkiffLaneConfig {
        queue_depth: d.limits.queue_depth,
        aggregation_reqs: d.doorbell.aggregation_reqs,
        aggregation_bytes: d.doorbell.aggregation_bytes,
        doorbell_us: d.doorbell.delay_us as u32,
        timeout_ms: d.timeout.as_millis() as u32,
        batching: SKIFF_BATCHING_STATIC,
        shared_lanes: 0,
        reconnect_delay_ms: (d.reconnect.reconnect_delay_us / 1000) as u32,
        ctrl_loss_timeout_ms: (d.reconnect.ctrl_loss_timeout_us / 1000) as u32,
        fast_io_fail_timeout_ms: d.reconnect.fast_io_fail_timeout_us.map_or(0, |us| (us / 1000) as u32),
        directory_entries: d.directory_entries,
        key_file: std::ptr::null(),
        key_name: std::ptr::null(),
        tls_certificates: std::ptr::null(),
        poll: SKIFF_POLL_OFF,
        poll_spin_us: POLL_SPIN_DEFAULT_US,
        batch_log: std::ptr::null(),
    }
}

/// A config string: `None` for null.
///
/// # Safety
/// `s` is null or a NUL-terminated string.
unsafe fn c_string(s: *const c_char) -> Option<String> {
    // SAFETY: non-null, so NUL-terminated per the contract.
    (!s.is_null()).then(|| unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
}

/// What makes two `skiff_lane_open` calls share a group: target, export and every setting,
/// strings by their contents (fio hands each job its own copy of a string option, so the
/// pointers of jobs that asked for the same file differ).
///
/// # Safety
/// The config's strings are null or NUL-terminated.
unsafe fn group_key(target: &str, export: &str, c: &SkiffLaneConfig) -> String {
    let numbers = SkiffLaneConfig {
        key_file: std::ptr::null(),
        key_name: std::ptr::null(),
        tls_certificates: std::ptr::null(),
        batch_log: std::ptr::null(),
        ..*c
    };
    // SAFETY: per the contract.
    let strings = unsafe { [c.key_file, c.key_name, c.tls_certificates, c.batch_log].map(|s| c_string(s)) };
    format!("{target}\0{export}\0{numbers:?}\0{strings:?}")
}

/// Appends the adaptive batch controller's decisions to `path`, one JSON object a line:
/// `{"lane":I,"at_us":T,"level":L,"delay_us":D,"bytes_per_s":X,"a_out":A}` (Tyche's Figure 6
/// through any C caller; `skiff bench --json` has the same as `batch_level_log`).
fn write_batch_log(path: &std::path::Path, lanes: &[Vec<initiator::BatchDecision>]) -> std::io::Result<()> {
    use std::fmt::Write as _;
    use std::io::Write as _;
    let mut text = String::new();
    for (lane, decisions) in lanes.iter().enumerate() {
        for d in decisions {
            let _ = writeln!(
                text,
                "{{\"lane\":{lane},\"at_us\":{},\"level\":{},\"delay_us\":{},\"bytes_per_s\":{:.0},\"a_out\":{:.2}}}",
                d.at_us, d.level, d.delay_us, d.bytes_per_s, d.a_out
            );
        }
    }
    std::fs::OpenOptions::new().create(true).append(true).open(path)?.write_all(text.as_bytes())
}

/// The key `config` names, if any.
///
/// # Safety
/// `key_file` and `key_name` are null or NUL-terminated strings.
unsafe fn config_key(
    c: &SkiffLaneConfig,
) -> std::result::Result<Option<std::sync::Arc<proto::auth::Key>>, String> {
    if c.key_file.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null, so NUL-terminated per the contract.
    let path = unsafe { CStr::from_ptr(c.key_file) }.to_string_lossy().into_owned();
    let name = if c.key_name.is_null() {
        None
    } else {
        // SAFETY: as above.
        Some(unsafe { CStr::from_ptr(c.key_name) }.to_string_lossy().into_owned())
    };
    let text = std::fs::read_to_string(&path).map_err(|e| format!("key file {path}: {e}"))?;
    let keys = proto::auth::Key::parse_file(&text).map_err(|e| format!("key file {path}: {e}"))?;
    let key = match name {
        Some(name) => keys
            .into_iter()
            .find(|k| k.name == name)
            .ok_or_else(|| format!("key file {path}: no key {name:?}"))?,
        None if keys.len() == 1 => keys.into_iter().next().expect("one key"),
        None => return Err(format!("key file {path} holds {} keys: set key_name", keys.len())),
    };
    Ok(Some(std::sync::Arc::new(key)))
}

/// The TLS client configuration `config` asks for, if any.
///
/// # Safety
/// `tls_certificates` is null or a NUL-terminated string.
unsafe fn config_tls(c: &SkiffLaneConfig) -> std::result::Result<Option<initiator::TlsConfig>, String> {
    if c.tls_certificates.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null, so NUL-terminated per the contract.
    let dir = unsafe { CStr::from_ptr(c.tls_certificates) }.to_string_lossy().into_owned();
    let certs = transport::tls::CertDir::new(dir);
    certs.client_config().map(Some).map_err(|e| format!("TLS certificates: {e}"))
}

fn lane_config(c: &SkiffLaneConfig) -> Option<LaneConfig> {
    let d = LaneConfig::default();
    let batching = match c.batching {
        SKIFF_BATCHING_STATIC => Batching::Static,
        SKIFF_BATCHING_OFF => Batching::Off,
        SKIFF_BATCHING_ADAPTIVE => Batching::Adaptive(BatchConfig::default()),
        _ => return None,
    };
    let spin =
        Duration::from_micros(if c.poll_spin_us == 0 { POLL_SPIN_DEFAULT_US } else { c.poll_spin_us }.into());
    let poll = match c.poll {
        SKIFF_POLL_OFF => PollMode::Off,
        SKIFF_POLL_HYBRID => PollMode::Fixed(spin),
        SKIFF_POLL_ADAPTIVE => PollMode::Adaptive(spin),
        _ => return None,
    };
    Some(LaneConfig {
        poll,
        limits: Limits { queue_depth: c.queue_depth, ..d.limits },
        doorbell: Doorbell {
            aggregation_reqs: c.aggregation_reqs.max(1),
            aggregation_bytes: c.aggregation_bytes.max(1),
            delay_us: c.doorbell_us.into(),
        },
        timeout: Duration::from_millis(c.timeout_ms.max(1).into()),
        batching,
        reconnect: initiator::ReconnectConfig {
            reconnect_delay_us: u64::from(c.reconnect_delay_ms) * 1000,
            ctrl_loss_timeout_us: u64::from(c.ctrl_loss_timeout_ms) * 1000,
            fast_io_fail_timeout_us: (c.fast_io_fail_timeout_ms > 0)
                .then(|| u64::from(c.fast_io_fail_timeout_ms) * 1000),
        },
        directory_entries: c.directory_entries,
        ..d
    })
}

/// # Safety
/// `config` must point to a writable `skiff_lane_config`.
#[no_mangle]
pub unsafe extern "C" fn skiff_lane_config_default(config: *mut SkiffLaneConfig) {
    if !config.is_null() {
        // SAFETY: non-null and writable per the contract.
        unsafe { config.write(defaults()) };
    }
}

/// # Safety
/// `target` and `export_name` must be NUL-terminated strings; `config` null or valid; `out`
/// a valid pointer to write the handle to.
#[no_mangle]
pub unsafe extern "C" fn skiff_lane_open(
    target: *const c_char,
    export_name: *const c_char,
    config: *const SkiffLaneConfig,
    out: *mut *mut SkiffLane,
) -> c_int {
    guard(|| {
        if target.is_null() || export_name.is_null() || out.is_null() {
            return fail(&Error::InvalidArgument("null argument"));
        }
        // SAFETY: non-null NUL-terminated strings per the contract.
        let (target, export) = unsafe { (CStr::from_ptr(target), CStr::from_ptr(export_name)) };
        let (Ok(target), Ok(export)) = (target.to_str(), export.to_str()) else {
            return fail(&Error::InvalidArgument("target and export must be UTF-8"));
        };
        // SAFETY: non-null, so a valid `skiff_lane_config` per the contract.
        let config = if config.is_null() { defaults() } else { unsafe { *config } };
        let Some(mut lane_config) = lane_config(&config) else {
            return fail(&Error::InvalidArgument(
                "skiff_lane_config.batching or .poll is not a SKIFF_BATCHING_* or SKIFF_POLL_* value",
            ));
        };
        // SAFETY: the config's strings are null or NUL-terminated per the contract.
        match unsafe { config_key(&config) } {
            Ok(key) => lane_config.key = key,
            Err(message) => {
                set_error(message);
                return -libc::EINVAL;
            }
        }
        // SAFETY: as above.
        match unsafe { config_tls(&config) } {
            Ok(tls) => lane_config.tls = tls,
            Err(message) => {
                set_error(message);
                return -libc::EINVAL;
            }
        }
        let endpoint = match Endpoint::parse(target) {
            Ok(e) => e,
            Err(msg) => {
                set_error(format!("target {target:?}: {msg}"));
                return -libc::EINVAL;
            }
        };
        // SAFETY: as above.
        let batch_log = unsafe { c_string(config.batch_log) }.map(PathBuf::from);
        if let Some(path) = &batch_log {
            // Refused now rather than lost at the close.
            if let Err(e) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
                set_error(format!("batch log {}: {e}", path.display()));
                return -libc::EINVAL;
            }
        }
        let opened = if config.shared_lanes == 0 {
            Lane::connect_with(&endpoint, export, &lane_config).map(|l| Queue::Private(Box::new(l)))
        } else {
            // SAFETY: as above.
            let key = unsafe { group_key(target, export, &config) };
            group(&endpoint, key, export, &lane_config, config.shared_lanes as usize).and_then(|g| {
                Ok(Queue::Shared { handle: g.handle()?, export: g.export().clone(), _group: g })
            })
        };
        match opened {
            Ok(lane) => {
                let handle =
                    Box::new(SkiffLane { lane, ready: VecDeque::new(), scratch: Vec::new(), batch_log });
                // SAFETY: `out` is valid for a write per the contract.
                unsafe { out.write(Box::into_raw(handle)) };
                0
            }
            Err(e) => fail(&e),
        }
    })
}

/// # Safety
/// `lane` must come from `skiff_lane_open` and not be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn skiff_lane_close(lane: *mut SkiffLane) {
    if !lane.is_null() {
        // SAFETY: the handle was made by Box::into_raw in skiff_lane_open and is closed once.
        let SkiffLane { lane, batch_log, .. } = *unsafe { Box::from_raw(lane) };
        let Some(path) = batch_log else { return };
        // A private lane's decisions, or a shared group's when its last handle goes.
        let decisions = match lane {
            Queue::Private(lane) => vec![lane.batch_level_log().to_vec()],
            Queue::Shared { handle, _group: group, .. } => {
                drop(handle);
                Arc::into_inner(group)
                    .map(|g| (0..g.lanes()).map(|i| g.batch_level_log(i)).collect())
                    .unwrap_or_default()
            }
        };
        if !decisions.is_empty() {
            if let Err(e) = write_batch_log(&path, &decisions) {
                set_error(format!("batch log {}: {e}", path.display()));
            }
        }
    }
}

/// Borrow the handle behind a C pointer.
///
/// # Safety
/// `lane` must be null or a live handle from `skiff_lane_open`, used by one thread at a time.
unsafe fn handle<'a>(lane: *const SkiffLane) -> Option<&'a mut SkiffLane> {
    // SAFETY: per the contract; the C API never hands out two mutable views at once.
    unsafe { (lane as *mut SkiffLane).as_mut() }
}

/// # Safety
/// `lane` must be a live handle.
#[no_mangle]
pub unsafe extern "C" fn skiff_lane_size(lane: *const SkiffLane) -> u64 {
    // SAFETY: null or a live handle per the contract; the view ends with this call.
    unsafe { handle(lane) }.map_or(0, |l| l.lane.export().size_bytes)
}

/// # Safety
/// `lane` must be a live handle.
#[no_mangle]
pub unsafe extern "C" fn skiff_lane_block_size(lane: *const SkiffLane) -> u32 {
    // SAFETY: null or a live handle per the contract; the view ends with this call.
    unsafe { handle(lane) }.map_or(0, |l| l.lane.export().block_size)
}

/// # Safety
/// `lane` must be a live handle.
#[no_mangle]
pub unsafe extern "C" fn skiff_lane_queue_depth(lane: *const SkiffLane) -> u32 {
    // SAFETY: null or a live handle per the contract; the view ends with this call.
    unsafe { handle(lane) }.map_or(0, |l| l.lane.queue_depth() as u32)
}

/// # Safety
/// `lane` must be a live handle.
#[no_mangle]
pub unsafe extern "C" fn skiff_lane_in_flight(lane: *const SkiffLane) -> u32 {
    // SAFETY: null or a live handle per the contract; the view ends with this call.
    unsafe { handle(lane) }.map_or(0, |l| (l.lane.in_flight() + l.ready.len()) as u32)
}

/// # Safety
/// `lane` must be a live handle; `buf` must be valid for `len` bytes (reads: writable) until
/// the completion is reaped, or null for flush, trim and write-zeroes.
#[no_mangle]
pub unsafe extern "C" fn skiff_lane_submit(
    lane: *mut SkiffLane,
    op: u32,
    flags: u32,
    offset: u64,
    buf: *mut c_void,
    len: u32,
    user_data: u64,
) -> c_int {
    guard(|| {
        // SAFETY: null or a live handle per the contract; the view ends with this call.
        let Some(l) = (unsafe { handle(lane) }) else {
            return fail(&Error::InvalidArgument("null lane"));
        };
        let Some(opcode) = u8::try_from(op).ok().and_then(Opcode::from_u8) else {
            return fail(&Error::InvalidArgument("unknown operation"));
        };
        if flags & !(SKIFF_FLAG_FUA | SKIFF_FLAG_NO_DELAY) != 0 {
            return fail(&Error::InvalidArgument("unknown flag"));
        }
        let mut req_flags = ReqFlags::empty();
        if flags & SKIFF_FLAG_FUA != 0 {
            req_flags = req_flags | ReqFlags::FUA;
        }
        if flags & SKIFF_FLAG_NO_DELAY != 0 {
            req_flags = req_flags | ReqFlags::NO_DELAY;
        }
        let carries_data = matches!(opcode, Opcode::Read | Opcode::Write);
        if carries_data && buf.is_null() && len > 0 {
            return fail(&Error::InvalidArgument("null buffer for a read or write"));
        }
        let raw = carries_data.then(|| RawBuf { ptr: buf.cast(), len: len as usize });
        match l.lane.io().submit(opcode, req_flags, offset, len as usize, raw, user_data) {
            Ok(()) => 0,
            Err(rejected) => fail(&rejected.error),
        }
    })
}

/// # Safety
/// `lane` must be a live handle.
#[no_mangle]
pub unsafe extern "C" fn skiff_lane_commit(lane: *mut SkiffLane) -> c_int {
    // SAFETY: null or a live handle per the contract; the view ends with this call.
    guard(|| match unsafe { handle(lane) } {
        None => fail(&Error::InvalidArgument("null lane")),
        Some(l) => l.lane.commit().map_or_else(|e| fail(&e), |()| 0),
    })
}

/// # Safety
/// `lane` must be a live handle; `out` valid for `max` completions.
#[no_mangle]
pub unsafe extern "C" fn skiff_lane_reap(
    lane: *mut SkiffLane,
    out: *mut SkiffCompletion,
    max: u32,
    min: u32,
) -> c_int {
    guard(|| {
        // SAFETY: null or a live handle per the contract; the view ends with this call.
        let Some(l) = (unsafe { handle(lane) }) else {
            return fail(&Error::InvalidArgument("null lane"));
        };
        if out.is_null() && max > 0 {
            return fail(&Error::InvalidArgument("null completion array"));
        }
        let want = (min.min(max) as usize).saturating_sub(l.ready.len());
        let collected =
            if want > 0 { l.lane.io().wait(want, &mut l.scratch) } else { l.lane.io().poll(&mut l.scratch) };
        l.ready.extend(l.scratch.drain(..));
        if let Err(e) = collected {
            // Completions gathered before the failure are still handed out below.
            if l.ready.is_empty() {
                return fail(&e);
            }
        }
        let n = l.ready.len().min(max as usize);
        for (i, c) in l.ready.drain(..n).enumerate() {
            let result = if c.status.is_ok() { 0 } else { -c.status.errno() };
            // SAFETY: `out` holds `max` entries per the contract and `i < n <= max`.
            unsafe { out.add(i).write(SkiffCompletion { user_data: c.user_data, result, reserved: 0 }) };
        }
        n as c_int
    })
}

// ---- RStore namespaces (docs/RSTORE.md) ----

/// Scopes of `skiff_rstore_create_ns`, as in `skiff.h`.
pub const SKIFF_SCOPE_RAM: u32 = 0;
pub const SKIFF_SCOPE_FILE: u32 = 1;
pub const SKIFF_SCOPE_FLASH: u32 = 2;
/// `skiff_rstore_alloc` flag: allocate at `at`, not after the last allocation.
pub const SKIFF_ALLOC_AT: u32 = 0x01;

/// The handle behind `skiff_rstore *`: a client of one coordinator.
pub struct SkiffRstore {
    coord: rstore::Coordinator,
}

/// The handle behind `skiff_segment *`: a mapped allocation, and its asynchronous requests.
pub struct SkiffSegment {
    segment: rstore::Segment,
    /// Requests submitted with `skiff_segment_submit`, by the tag the segment carries (an
    /// index here): the caller's buffer, its length and user data.
    pending: Vec<Option<Pending>>,
    free: Vec<usize>,
    /// Buffers the segment's requests travel in, kept for the next ones.
    bufs: Vec<Vec<u8>>,
    /// Completions collected and not yet handed out, and the segment's own scratch.
    ready: std::collections::VecDeque<SkiffCompletion>,
    scratch: Vec<initiator::Completion>,
}

/// An asynchronous segment request in flight.
struct Pending {
    user_data: u64,
    /// A read's destination, to copy its data into when it completes.
    read_into: Option<*mut u8>,
    len: usize,
}

impl SkiffSegment {
    fn new(segment: rstore::Segment) -> SkiffSegment {
        SkiffSegment {
            segment,
            pending: Vec::new(),
            free: Vec::new(),
            bufs: Vec::new(),
            ready: Default::default(),
            scratch: Vec::new(),
        }
    }

    /// Take in what the segment completed: copy reads out to their callers' buffers, keep the
    /// buffers, and queue the completions.
    fn collect(&mut self) {
        for c in self.scratch.drain(..) {
            let tag = c.user_data as usize;
            let Some(p) = self.pending.get_mut(tag).and_then(Option::take) else { continue };
            self.free.push(tag);
            let ok = c.status.is_ok();
            if let Some(buf) = c.buf {
                if let (true, Some(dst)) = (ok, p.read_into) {
                    // SAFETY: the caller keeps `dst` valid for `len` bytes until this
                    // completion is reaped (skiff.h), and the segment returned `len` bytes.
                    unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), dst, p.len.min(buf.len())) };
                }
                self.bufs.push(buf);
            }
            let result = if ok { 0 } else { -c.status.errno() };
            self.ready.push_back(SkiffCompletion { user_data: p.user_data, result, reserved: 0 });
        }
    }
}

/// The one mapping from control-plane errors to errno.
fn coord_errno(e: &coord::CoordError) -> i32 {
    use coord::CoordError as E;
    match e {
        E::Etcd(_) => libc::EHOSTUNREACH,
        E::Exists(_) => libc::EEXIST,
        E::NoNamespace(_) | E::NoAllocation { .. } => libc::ENOENT,
        E::Invalid(_) => libc::EINVAL,
        E::NoCapacity { .. } | E::NotReserved { .. } => libc::ENOSPC,
        E::AddressTaken { .. } => libc::EADDRINUSE,
        E::Corrupt { .. } => libc::EIO,
        E::Contended(_) => libc::EBUSY,
    }
}

fn coord_fail(e: &coord::CoordError) -> c_int {
    set_error(e.to_string());
    -coord_errno(e)
}

/// A C string argument, or -EINVAL.
///
/// # Safety
/// `s` is null or a NUL-terminated string.
unsafe fn text<'a>(s: *const c_char, what: &str) -> std::result::Result<&'a str, c_int> {
    if s.is_null() {
        set_error(format!("{what} is NULL"));
        return Err(-libc::EINVAL);
    }
    // SAFETY: non-null, so NUL-terminated per the contract.
    unsafe { CStr::from_ptr(s) }.to_str().map_err(|_| {
        set_error(format!("{what} is not UTF-8"));
        -libc::EINVAL
    })
}

/// Run `f` on the coordinator behind `r` with the namespace name `ns`, both checked.
///
/// # Safety
/// `r` is null or a live handle; `ns` is null or a NUL-terminated string.
unsafe fn with_ns(
    r: *mut SkiffRstore,
    ns: *const c_char,
    f: impl FnOnce(&rstore::Coordinator, &str) -> c_int,
) -> c_int {
    guard(|| {
        // SAFETY: null or a live handle per the contract, used by one thread at a time.
        let Some(r) = (unsafe { r.as_ref() }) else {
            set_error("skiff_rstore is NULL".into());
            return -libc::EINVAL;
        };
        // SAFETY: per the contract.
        match unsafe { text(ns, "namespace") } {
            Ok(name) => f(&r.coord, name),
            Err(e) => e,
        }
    })
}

/// 0, or the control-plane error as a negative errno.
fn done<T>(result: Result<T, coord::CoordError>) -> c_int {
    result.map_or_else(|e| coord_fail(&e), |_| 0)
}

/// # Safety
/// `coordinator` is a NUL-terminated string; `out` points to writable storage.
#[no_mangle]
pub unsafe extern "C" fn skiff_rstore_connect(
    coordinator: *const c_char,
    out: *mut *mut SkiffRstore,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let urls = match unsafe { text(coordinator, "coordinator") } {
            Ok(u) => u,
            Err(e) => return e,
        };
        if out.is_null() {
            set_error("out is NULL".into());
            return -libc::EINVAL;
        }
        // etcd over TLS: the CA and client certificate from $SKIFF_COORDINATOR_CA, _CERT, _KEY.
        let coord = match rstore::Coordinator::connect_with(&[urls.to_owned()], coord::etcd::Tls::from_env())
        {
            Ok(c) => c,
            Err(e) => return coord_fail(&e),
        };
        // The coordinator answers, or the caller learns now rather than at the first call
        // (the server list is small; the namespaces may not be).
        if let Err(e) = coord.servers() {
            return coord_fail(&e);
        }
        // SAFETY: `out` is writable per the contract.
        unsafe { out.write(Box::into_raw(Box::new(SkiffRstore { coord }))) };
        0
    })
}

/// # Safety
/// `r` must come from `skiff_rstore_connect` and not be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn skiff_rstore_close(r: *mut SkiffRstore) {
    if !r.is_null() {
        // SAFETY: made by Box::into_raw in skiff_rstore_connect and closed once.
        drop(unsafe { Box::from_raw(r) });
    }
}

/// # Safety
/// As `with_ns`.
#[no_mangle]
pub unsafe extern "C" fn skiff_rstore_create_ns(
    r: *mut SkiffRstore,
    ns: *const c_char,
    chunk_bytes: u64,
    replicas: u32,
    scope: u32,
) -> c_int {
    let scope = match scope {
        SKIFF_SCOPE_RAM => coord::Scope::Ram,
        SKIFF_SCOPE_FILE => coord::Scope::File,
        SKIFF_SCOPE_FLASH => coord::Scope::Flash,
        _ => {
            set_error(format!("scope {scope}: SKIFF_SCOPE_RAM, SKIFF_SCOPE_FILE or SKIFF_SCOPE_FLASH"));
            return -libc::EINVAL;
        }
    };
    // SAFETY: per the contract.
    unsafe { with_ns(r, ns, |c, name| done(c.create_ns(name, scope, chunk_bytes, replicas))) }
}

/// # Safety
/// As `with_ns`.
#[no_mangle]
pub unsafe extern "C" fn skiff_rstore_join_ns(r: *mut SkiffRstore, ns: *const c_char) -> c_int {
    // SAFETY: per the contract.
    unsafe { with_ns(r, ns, |c, name| done(c.join_ns(name))) }
}

/// # Safety
/// As `with_ns`.
#[no_mangle]
pub unsafe extern "C" fn skiff_rstore_delete_ns(r: *mut SkiffRstore, ns: *const c_char) -> c_int {
    // SAFETY: per the contract.
    unsafe { with_ns(r, ns, |c, name| done(c.delete_ns(name))) }
}

/// # Safety
/// As `with_ns`.
#[no_mangle]
pub unsafe extern "C" fn skiff_rstore_reserve(r: *mut SkiffRstore, ns: *const c_char, bytes: u64) -> c_int {
    // SAFETY: per the contract.
    unsafe { with_ns(r, ns, |c, name| done(c.reserve(name, bytes))) }
}

/// # Safety
/// As `with_ns`.
#[no_mangle]
pub unsafe extern "C" fn skiff_rstore_release(r: *mut SkiffRstore, ns: *const c_char, bytes: u64) -> c_int {
    // SAFETY: per the contract.
    unsafe { with_ns(r, ns, |c, name| done(c.release(name, bytes))) }
}

/// # Safety
/// As `with_ns`; `addr` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn skiff_rstore_alloc(
    r: *mut SkiffRstore,
    ns: *const c_char,
    len: u64,
    at: u64,
    flags: u32,
    addr: *mut u64,
) -> c_int {
    let at = (flags & SKIFF_ALLOC_AT != 0).then_some(at);
    // SAFETY: per the contract.
    unsafe {
        with_ns(r, ns, |c, name| {
            done(c.alloc(name, len, at).map(|got| {
                if !addr.is_null() {
                    // SAFETY: non-null, so writable per the contract.
                    addr.write(got.addr);
                }
            }))
        })
    }
}

/// # Safety
/// As `with_ns`.
#[no_mangle]
pub unsafe extern "C" fn skiff_rstore_free(r: *mut SkiffRstore, ns: *const c_char, addr: u64) -> c_int {
    // SAFETY: per the contract.
    unsafe { with_ns(r, ns, |c, name| done(c.free(name, addr))) }
}

/// # Safety
/// As `with_ns`; `out` points to writable storage.
#[no_mangle]
pub unsafe extern "C" fn skiff_rstore_map(
    r: *mut SkiffRstore,
    ns: *const c_char,
    addr: u64,
    out: *mut *mut SkiffSegment,
) -> c_int {
    if out.is_null() {
        set_error("out is NULL".into());
        return -libc::EINVAL;
    }
    // SAFETY: per the contract.
    unsafe {
        with_ns(r, ns, |c, name| match c.map(name, addr, &LaneConfig::default()) {
            Ok(segment) => {
                // SAFETY: `out` is writable per the contract.
                out.write(Box::into_raw(Box::new(SkiffSegment::new(segment))));
                0
            }
            Err(e) => match (e.downcast_ref::<coord::CoordError>(), e.downcast_ref::<Error>()) {
                (Some(c), _) => coord_fail(c),
                (_, Some(i)) => fail(i),
                _ => {
                    set_error(e.to_string());
                    -libc::EIO
                }
            },
        })
    }
}

/// # Safety
/// `s` must come from `skiff_rstore_map` and not be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn skiff_segment_unmap(s: *mut SkiffSegment) {
    if !s.is_null() {
        // SAFETY: made by Box::into_raw in skiff_rstore_map and unmapped once.
        drop(unsafe { Box::from_raw(s) });
    }
}

/// # Safety
/// `s` is null or a live segment.
#[no_mangle]
pub unsafe extern "C" fn skiff_segment_len(s: *const SkiffSegment) -> u64 {
    // SAFETY: null or a live handle per the contract.
    unsafe { s.as_ref() }.map_or(0, |s| s.segment.len())
}

/// The block segment offsets and lengths must be multiples of (1 on `skiff serve --pool`
/// pools); 0 for a null handle.
///
/// # Safety
/// `s` is null or a live segment.
#[no_mangle]
pub unsafe extern "C" fn skiff_segment_block_size(s: *const SkiffSegment) -> u32 {
    // SAFETY: null or a live handle per the contract.
    unsafe { s.as_ref() }.map_or(0, |s| s.segment.block_bytes() as u32)
}

/// Run `io` on the segment behind `s`, after checking the handle and that a buffer of `len`
/// bytes was given (`has_buf`).
///
/// # Safety
/// `s` is null or a live segment used by one thread at a time.
unsafe fn segment_io(
    s: *mut SkiffSegment,
    has_buf: bool,
    len: u64,
    io: impl FnOnce(&mut rstore::Segment) -> Result<(), Error>,
) -> c_int {
    guard(|| {
        // SAFETY: null or a live handle per the contract.
        let Some(s) = (unsafe { s.as_mut() }) else {
            set_error("skiff_segment is NULL".into());
            return -libc::EINVAL;
        };
        if !has_buf && len > 0 {
            set_error("buf is NULL".into());
            return -libc::EINVAL;
        }
        io(&mut s.segment).map_or_else(|e| fail(&e), |()| 0)
    })
}

/// # Safety
/// `s` is a live segment used by one thread at a time; `buf` is valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn skiff_segment_read(
    s: *mut SkiffSegment,
    offset: u64,
    buf: *mut c_void,
    len: u64,
) -> c_int {
    // SAFETY: per the contract.
    unsafe {
        segment_io(s, !buf.is_null(), len, |seg| {
            let dst: &mut [u8] = if len == 0 {
                &mut []
            } else {
                // SAFETY: non-null and valid for `len` bytes per the contract.
                std::slice::from_raw_parts_mut(buf.cast::<u8>(), len as usize)
            };
            seg.read(offset, dst)
        })
    }
}

/// # Safety
/// `s` is a live segment used by one thread at a time; `buf` is valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn skiff_segment_write(
    s: *mut SkiffSegment,
    offset: u64,
    buf: *const c_void,
    len: u64,
) -> c_int {
    // SAFETY: per the contract.
    unsafe {
        segment_io(s, !buf.is_null(), len, |seg| {
            let src: &[u8] = if len == 0 {
                &[]
            } else {
                // SAFETY: non-null and valid for `len` bytes per the contract.
                std::slice::from_raw_parts(buf.cast::<u8>(), len as usize)
            };
            seg.write(offset, src)
        })
    }
}

/// # Safety
/// `s` is a live segment used by one thread at a time; `buf` is valid for `len` bytes and left
/// alone until the request's completion is reaped.
#[no_mangle]
pub unsafe extern "C" fn skiff_segment_submit(
    s: *mut SkiffSegment,
    op: u32,
    offset: u64,
    buf: *mut c_void,
    len: u64,
    user_data: u64,
) -> c_int {
    guard(|| {
        // SAFETY: null or a live handle per the contract.
        let Some(s) = (unsafe { s.as_mut() }) else {
            set_error("skiff_segment is NULL".into());
            return -libc::EINVAL;
        };
        // SKIFF_OP_READ and SKIFF_OP_WRITE are the wire's opcodes, as for lanes.
        let opcode = match u8::try_from(op).ok().and_then(Opcode::from_u8) {
            Some(o @ (Opcode::Read | Opcode::Write)) => o,
            _ => return fail(&Error::InvalidArgument("a segment takes reads and writes")),
        };
        if buf.is_null() || len == 0 || len > u64::from(u32::MAX) {
            return fail(&Error::InvalidArgument("a segment request needs a buffer of 1 byte to 4 GiB"));
        }
        let len = len as usize;
        let mut data = s.bufs.pop().unwrap_or_default();
        data.clear();
        if opcode == Opcode::Write {
            // SAFETY: non-null and valid for `len` bytes per the contract.
            data.extend_from_slice(unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) });
        } else {
            data.resize(len, 0);
        }
        let tag = s.free.pop().unwrap_or_else(|| {
            s.pending.push(None);
            s.pending.len() - 1
        });
        let read_into = (opcode == Opcode::Read).then_some(buf.cast::<u8>());
        s.pending[tag] = Some(Pending { user_data, read_into, len });
        match initiator::Queue::submit(
            &mut s.segment,
            opcode,
            ReqFlags::empty(),
            offset,
            len,
            Some(data),
            tag as u64,
        ) {
            Ok(()) => 0,
            Err(rejected) => {
                s.pending[tag] = None;
                s.free.push(tag);
                s.bufs.extend(rejected.buf);
                fail(&rejected.error)
            }
        }
    })
}

/// # Safety
/// `s` is a live segment used by one thread at a time; `out` is valid for `max` completions.
#[no_mangle]
pub unsafe extern "C" fn skiff_segment_reap(
    s: *mut SkiffSegment,
    out: *mut SkiffCompletion,
    max: u32,
    min: u32,
) -> c_int {
    guard(|| {
        // SAFETY: null or a live handle per the contract.
        let Some(s) = (unsafe { s.as_mut() }) else {
            set_error("skiff_segment is NULL".into());
            return -libc::EINVAL;
        };
        if out.is_null() && max > 0 {
            return fail(&Error::InvalidArgument("null completion array"));
        }
        let want = (min.min(max) as usize).saturating_sub(s.ready.len());
        let collected = if want > 0 {
            initiator::Queue::wait(&mut s.segment, want, &mut s.scratch)
        } else {
            initiator::Queue::poll(&mut s.segment, &mut s.scratch)
        };
        s.collect();
        if let Err(e) = collected {
            if s.ready.is_empty() {
                return fail(&e);
            }
        }
        let n = s.ready.len().min(max as usize);
        for (i, c) in s.ready.drain(..n).enumerate() {
            // SAFETY: `out` holds `max` entries per the contract and `i < n <= max`.
            unsafe { out.add(i).write(c) };
        }
        n as c_int
    })
}

/// # Safety
/// `s` is a live segment.
#[no_mangle]
pub unsafe extern "C" fn skiff_segment_in_flight(s: *const SkiffSegment) -> u32 {
    // SAFETY: null or a live handle per the contract.
    unsafe { s.as_ref() }.map_or(0, |s| (initiator::Queue::in_flight(&s.segment) + s.ready.len()) as u32)
}

#[no_mangle]
pub extern "C" fn skiff_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}
