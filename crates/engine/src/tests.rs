use super::*;
use backend::BackendSpec;

fn export(spec: &str, read_only: bool) -> Export {
    let spec = BackendSpec::parse(spec).unwrap();
    Export::new("t", backend::open(&spec, false).unwrap(), read_only)
}

fn io(opcode: Opcode, offset: u64, length: u32) -> Io {
    Io { opcode, flags: ReqFlags::empty(), offset, length }
}

#[test]
fn validation_gives_precise_statuses() {
    let e = export("ram:1M", false);
    let max = 64 << 10;
    assert_eq!(validate(&e, &io(Opcode::Read, 0, 4096), max), Ok(()));
    assert_eq!(validate(&e, &io(Opcode::Read, (1 << 20) - 512, 512), max), Ok(()), "last block");
    assert_eq!(validate(&e, &io(Opcode::Read, 1 << 20, 512), max), Err(Status::OutOfRange));
    assert_eq!(
        validate(&e, &io(Opcode::Read, u64::MAX - 511, 512), max),
        Err(Status::OutOfRange),
        "no overflow"
    );
    assert_eq!(validate(&e, &io(Opcode::Write, 100, 512), max), Err(Status::Misaligned));
    assert_eq!(validate(&e, &io(Opcode::Write, 0, 100), max), Err(Status::Misaligned));
    assert_eq!(validate(&e, &io(Opcode::Read, 0, max + 512), max), Err(Status::TooLarge));
    assert_eq!(validate(&e, &io(Opcode::Trim, 0, 1 << 20), max), Ok(()), "trim is not bound by io_bytes_max");
    assert_eq!(validate(&e, &io(Opcode::Read, 0, 0), max), Err(Status::Invalid));
    assert_eq!(validate(&e, &io(Opcode::Flush, 0, 0), max), Ok(()));
    assert_eq!(validate(&e, &io(Opcode::Flush, 4096, 0), max), Err(Status::Invalid));

    let ro = export("ram:1M", true);
    assert_eq!(validate(&ro, &io(Opcode::Write, 0, 512), max), Err(Status::ReadOnly));
    assert_eq!(validate(&ro, &io(Opcode::Trim, 0, 512), max), Err(Status::ReadOnly));
    assert_eq!(validate(&ro, &io(Opcode::WriteZeroes, 0, 512), max), Err(Status::ReadOnly));
    assert_eq!(validate(&ro, &io(Opcode::Read, 0, 512), max), Ok(()));
    assert!(ro.flags().has(ExportFlags::READ_ONLY));
    assert!(!ro.flags().has(ExportFlags::CAN_TRIM));
}

/// An export served at a one-byte block takes requests of any offset and length, and the
/// bytes beside a one-byte write stay as they were; a block coarser than the backend's, or
/// not a power of two, is refused.
#[test]
fn a_one_byte_block_takes_any_range() {
    let max = 1 << 20;
    let e = export("ram:1M", false).with_block_bytes(1).unwrap();
    assert_eq!((e.block_size(), e.info().block_size), (1, 1));
    assert_eq!(validate(&e, &io(Opcode::Write, 4097, 1), max), Ok(()));
    assert_eq!(validate(&e, &io(Opcode::Read, 3, 700), max), Ok(()));
    assert_eq!(validate(&e, &io(Opcode::Read, (1 << 20) - 1, 2), max), Err(Status::OutOfRange));
    e.backend.write_at(&[7; 3], 4096, false).unwrap();
    e.backend.write_at(&[9], 4097, false).unwrap();
    let mut back = [0u8; 4];
    e.backend.read_at(&mut back, 4095).unwrap();
    assert_eq!(back, [0, 7, 9, 7]);
    for bad in [0, 3, 1024] {
        assert!(export("ram:1M", false).with_block_bytes(bad).is_err(), "block {bad}");
    }
    assert_eq!(export("ram:1M", false).block_size(), 512, "the backend's block by default");
}

#[test]
fn execute_moves_data_and_counts() {
    let e = export("ram:1M", false);
    let data = vec![0x5A; 4096];
    assert_eq!(execute(&e, &io(Opcode::Write, 8192, 4096), &data, &mut []), Status::Ok);
    let mut back = vec![0; 4096];
    assert_eq!(execute(&e, &io(Opcode::Read, 8192, 4096), &[], &mut back), Status::Ok);
    assert_eq!(back, data);
    assert_eq!(execute(&e, &io(Opcode::WriteZeroes, 8192, 4096), &[], &mut []), Status::Ok);
    execute(&e, &io(Opcode::Read, 8192, 4096), &[], &mut back);
    assert!(back.iter().all(|&b| b == 0));

    let c = OpCounters::default();
    c.record(None, Opcode::Read, 4096, Status::Ok, None);
    c.record(None, Opcode::Read, 4096, Status::OutOfRange, None);
    c.record(None, Opcode::Write, 512, Status::Ok, None);
    assert_eq!((c.reqs(Opcode::Read), c.bytes(Opcode::Read), c.errors()), (2, 4096, 1));
    assert_eq!(c.bytes(Opcode::Write), 512);
}

#[test]
fn backend_errors_map_to_one_status_each() {
    let err = |errno| BackendError::Io(std::io::Error::from_raw_os_error(errno));
    assert_eq!(status_of(&err(28)), Status::NoSpace);
    assert_eq!(status_of(&err(30)), Status::ReadOnly);
    assert_eq!(status_of(&err(5)), Status::IoError);
    assert_eq!(status_of(&BackendError::Unsupported), Status::Unsupported);
}

/// Each export option is a layer: alone, it does what its option says and nothing else.
#[test]
fn each_layer_alone_does_what_its_option_says() {
    use crate::layer::{Access, Block, Grants, Held, ReadOnly};
    let max = 64 << 10;
    let plain = export("ram:1M", false);
    assert_eq!((plain.grant(None), plain.grant(Some("k"))), (Ok(false), Ok(false)), "open to anyone");
    assert!(plain.layers().is_empty() && !plain.judges_requests());

    // ro: read-only for everyone, writes refused, the write flags gone.
    let ro = export("ram:1M", false).with_layer(Arc::new(ReadOnly)).unwrap();
    assert_eq!((ro.grant(None), ro.grant(Some("k"))), (Ok(true), Ok(true)));
    assert_eq!(validate(&ro, &io(Opcode::Write, 0, 512), max), Err(Status::ReadOnly));
    assert_eq!(validate(&ro, &io(Opcode::Read, 0, 512), max), Ok(()));
    assert!(ro.flags().has(ExportFlags::READ_ONLY) && !ro.flags().has(ExportFlags::CAN_TRIM));
    assert!(export("ram:1M", true).layer::<ReadOnly>().is_some(), "Export::new(.., true) stacks ro");

    // allow=: rights by key, refusals by who asks; requests themselves untouched.
    let list = proto::auth::AccessList::parse("alice:rw+bob:ro").unwrap();
    let allow = export("ram:1M", false).with_layer(Arc::new(Access(list))).unwrap();
    assert_eq!(allow.grant(Some("alice")), Ok(false));
    assert_eq!(allow.grant(Some("bob")), Ok(true));
    assert_eq!(allow.grant(Some("eve")), Err(Status::AccessDenied));
    assert_eq!(allow.grant(None), Err(Status::AuthRequired));
    let anyone_reads = proto::auth::AccessList::parse("*:ro").unwrap();
    let public = export("ram:1M", false).with_layer(Arc::new(Access(anyone_reads))).unwrap();
    assert_eq!(public.grant(None), Ok(true));
    assert_eq!(validate(&allow, &io(Opcode::Write, 0, 512), max), Ok(()));

    // block=: the alignment, nothing else.
    let fine = export("ram:1M", false).with_layer(Arc::new(Block(1))).unwrap();
    assert_eq!((fine.block_size(), fine.grant(None)), (1, Ok(false)));
    assert_eq!(validate(&fine, &io(Opcode::Write, 3, 5), max), Ok(()));

    // grants: every request judged by the grant its connection holds for the chunk.
    let key = proto::capability::CapKey::new([7; 32]);
    let pool = Arc::new(proto::grant::PoolGrants::new([7; 32], 256 << 10, 4).unwrap());
    let granted = export("ram:1M", false).with_layer(Arc::new(Grants(pool.clone()))).unwrap();
    assert!(granted.judges_requests() && granted.grants().is_some());
    assert_eq!(granted.grant(None), Ok(false), "grants judge requests, not who opens");
    let mut session = proto::server::ServerSession::new(wire::Limits::default(), 4);
    let handle = session.open_handle(0, false).unwrap();
    let write = io(Opcode::Write, 256 << 10, 512);
    assert_eq!(
        granted.judge(&write, Held { session: &session, handle }),
        Err(Status::BadCapability),
        "no grant held"
    );
    let read_only = proto::grant::seal(&key, 1, 256 << 10, 0, wire::CapRights::READ);
    session.bind(handle, pool.admit(&read_only).unwrap());
    assert_eq!(granted.judge(&io(Opcode::Read, 256 << 10, 512), Held { session: &session, handle }), Ok(()));
    assert_eq!(
        granted.judge(&write, Held { session: &session, handle }),
        Err(Status::BadCapability),
        "a read grant"
    );
    assert_eq!(
        granted.judge(&io(Opcode::Read, 0, 512), Held { session: &session, handle }),
        Err(Status::BadCapability),
        "chunk 0"
    );
    assert_eq!(
        granted.judge(&io(Opcode::Flush, 0, 0), Held { session: &session, handle }),
        Ok(()),
        "flush: any grant"
    );
    assert_eq!(
        plain.judge(&write, Held { session: &session, handle }),
        Ok(()),
        "no layer judges a plain export"
    );
}

/// Layers stack: each narrows what the others allow, in any order, and a layer that judges
/// requests keeps the export from NBD (`judges_requests`).
#[test]
fn layers_combine_and_only_narrow() {
    use crate::layer::{Access, Block, Grants, ReadOnly};
    let max = 64 << 10;
    let list = || Arc::new(Access(proto::auth::AccessList::parse("alice:rw+*:ro").unwrap()));
    let a =
        export("ram:1M", false).with_layer(Arc::new(ReadOnly)).and_then(|e| e.with_layer(list())).unwrap();
    let b =
        export("ram:1M", false).with_layer(list()).and_then(|e| e.with_layer(Arc::new(ReadOnly))).unwrap();
    for e in [&a, &b] {
        assert_eq!(e.grant(Some("alice")), Ok(true), "ro narrows alice's rw, in either order");
        assert_eq!(e.grant(None), Ok(true));
        assert_eq!(e.grant(Some("eve")), Ok(true), "a key the list does not name gets *'s rights");
        assert_eq!(validate(e, &io(Opcode::Write, 0, 512), max), Err(Status::ReadOnly));
    }
    let names: Vec<String> = a.layers().iter().map(|l| l.describe()).collect();
    assert_eq!(names, ["ro", "allow=alice:rw+*:ro"]);

    // A pool as RStore serves it: byte-granular, granted, and open to anyone who holds grants.
    let pool = Arc::new(proto::grant::PoolGrants::new([1; 32], 256 << 10, 4).unwrap());
    let e = export("ram:1M", false)
        .with_layer(Arc::new(Block(1)))
        .and_then(|e| e.with_layer(Arc::new(Grants(pool))))
        .and_then(|e| e.with_layer(list()))
        .unwrap();
    assert_eq!((e.block_size(), e.judges_requests(), e.grant(Some("alice"))), (1, true, Ok(false)));
    assert_eq!(validate(&e, &io(Opcode::Write, 5, 3), max), Ok(()));
    // A block the backend cannot take is refused whatever else is stacked.
    assert!(e.with_layer(Arc::new(Block(4096))).is_err());
}

/// A backend that records what it was asked to make durable, and when.
#[derive(Default)]
struct Recorder {
    /// (operation, durable when it returned) in order; a flush is ("flush", true).
    done: std::sync::Mutex<Vec<(&'static str, bool)>>,
    /// Whether it syncs on another thread ([`Backend::syncs_later`]).
    later: bool,
}

impl Recorder {
    fn log(&self, op: &'static str, durable: bool) -> backend::Result<()> {
        self.done.lock().unwrap().push((op, durable));
        Ok(())
    }
    fn take(&self) -> Vec<(&'static str, bool)> {
        std::mem::take(&mut *self.done.lock().unwrap())
    }
}

impl Backend for Recorder {
    fn kind(&self) -> &'static str {
        "recorder"
    }
    fn size_bytes(&self) -> u64 {
        1 << 20
    }
    fn block_size(&self) -> u32 {
        512
    }
    fn is_read_only(&self) -> bool {
        false
    }
    fn capabilities(&self) -> backend::Capabilities {
        backend::Capabilities::ALL
    }
    fn read_at(&self, buf: &mut [u8], _offset: u64) -> backend::Result<()> {
        buf.fill(0);
        Ok(())
    }
    fn write_at(&self, _buf: &[u8], _offset: u64, fua: bool) -> backend::Result<()> {
        self.log("write", fua)
    }
    fn flush(&self) -> backend::Result<()> {
        self.log("flush", true)
    }
    fn trim(&self, _offset: u64, _len: u64) -> backend::Result<()> {
        self.log("trim", false)
    }
    fn write_zeroes(&self, _offset: u64, _len: u64, fua: bool) -> backend::Result<()> {
        self.log("zeroes", fua)
    }
    fn syncs_later(&self) -> bool {
        self.later
    }
    fn sync_later(&self, _batch: &Arc<backend::Batch>) {
        self.done.lock().unwrap().push(("sync_later", true));
    }
}

struct NoWake;
impl backend::Wake for NoWake {
    fn wake(&self, _token: u64) {}
}

/// `sync`: every change is made durable as if it asked for FUA (a trim by a FLUSH after it),
/// on the worker's thread or, where the backend can, on the batch; reads and plain exports are
/// untouched, and a trim that asks for FUA is made durable too.
#[test]
fn a_sync_export_makes_every_change_durable() {
    use crate::layer::SyncWrites;
    let changes = [
        io(Opcode::Write, 0, 512),
        io(Opcode::WriteZeroes, 0, 512),
        io(Opcode::Trim, 0, 512),
        io(Opcode::Read, 0, 512),
    ];
    let run = |e: &Export| {
        for c in &changes {
            let mut buf = vec![0; if c.opcode == Opcode::Read { 512 } else { 0 }];
            let payload = vec![1; if c.opcode == Opcode::Write { 512 } else { 0 }];
            assert_eq!(execute(e, c, &payload, &mut buf), Status::Ok);
        }
    };
    let recorder = Arc::new(Recorder::default());
    let plain = Export::new("p", recorder.clone(), false);
    run(&plain);
    assert_eq!(recorder.take(), [("write", false), ("zeroes", false), ("trim", false)]);
    let fua = Io { flags: ReqFlags::FUA, ..io(Opcode::Trim, 0, 512) };
    assert_eq!(execute(&plain, &fua, &[], &mut []), Status::Ok);
    assert_eq!(recorder.take(), [("trim", false), ("flush", true)], "a FUA trim is flushed");

    let synced = Export::new("s", recorder.clone(), false).with_layer(Arc::new(SyncWrites)).unwrap();
    assert!(synced.wants_durable(&changes[0]) && !synced.wants_durable(&changes[3]));
    run(&synced);
    assert_eq!(recorder.take(), [("write", true), ("zeroes", true), ("trim", false), ("flush", true)]);

    // A backend that syncs on another thread: the change now, its durability on the batch.
    let later = Arc::new(Recorder { later: true, ..Recorder::default() });
    let synced = Export::new("l", later.clone(), false).with_layer(Arc::new(SyncWrites)).unwrap();
    let batch = Arc::new(backend::Batch::new(Arc::new(NoWake), 0));
    let mut held = front::Later::new(Some(&batch));
    for c in &changes[..3] {
        let payload = vec![1; if c.opcode == Opcode::Write { 512 } else { 0 }];
        assert_eq!(execute_later(&synced, c, &payload, &mut held), Status::Ok);
    }
    let plain = Export::new("lp", later.clone(), false);
    assert_eq!(execute_later(&plain, &changes[0], &[0; 512], &mut held), Status::Ok);
    assert_eq!(
        later.take(),
        [
            ("write", false),
            ("sync_later", true),
            ("zeroes", false),
            ("sync_later", true),
            ("trim", false),
            ("sync_later", true),
            ("write", false),
        ],
        "each change of the sync export synced on the batch; the plain export's write not at all"
    );
}
