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
