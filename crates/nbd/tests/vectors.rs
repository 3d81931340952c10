//! Byte vectors computed by hand from the NBD spec (`doc/proto.md`), and whole negotiations
//! run in memory. Every handshake transcript is also replayed split into pieces of every size
//! (down to one byte at a time) and must give the same replies and outcome.

use std::sync::Arc;

use skiff_nbd as nbd;

use nbd::fuzz_api::{run_handshake, End, Transcript};
use nbd::transmission::{self as tx, EINVAL, EIO, ENOSPC, ENOTSUP, EPERM};
use nbd::{parse_request, Cmd, CmdFlags, ExportDesc, Handshake, HandshakeConfig, NbdError, Request, Session};
use wire::Status;

/// Hex digits to bytes; whitespace is for reading only.
fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    assert!(digits.len().is_multiple_of(2), "odd hex string {s:?}");
    digits.chunks(2).map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap()).collect()
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// "disk": 1 GiB, writable, default block sizes, flush/FUA/trim/zeroes/multi-conn: transmission
/// flags 0x016d (0x01ed with SEND_DF once structured replies are on).
/// "ro": 1 MiB, read-only, blocks 512/4096/1 MiB, flush: flags 0x0007.
fn config() -> Arc<HandshakeConfig> {
    let disk = ExportDesc {
        description: "scratch disk".into(),
        can_flush: true,
        can_fua: true,
        can_trim: true,
        can_write_zeroes: true,
        can_multi_conn: true,
        ..ExportDesc::new("disk", 1 << 30)
    };
    let ro = ExportDesc {
        block_min: 512,
        block_preferred: 4096,
        block_max: 1 << 20,
        read_only: true,
        can_flush: true,
        ..ExportDesc::new("ro", 1 << 20)
    };
    Arc::new(HandshakeConfig::new(vec![disk, ro], Some(0)).unwrap())
}

/// Run `client` through a handshake whole, then again in pieces, and insist they agree.
fn run(client: &[u8]) -> Transcript {
    let config = config();
    let whole = run_handshake(&config, client, usize::MAX);
    // Every piece size for short transcripts; one byte at a time for long ones.
    let piece_lens = if client.len() <= 512 { 1..client.len() + 1 } else { 1..2 };
    for piece_len in piece_lens {
        assert_eq!(run_handshake(&config, client, piece_len), whole, "pieces of {piece_len}");
    }
    whole
}

const NO_ZEROES: &str = "00000003";
const FIXED_ONLY: &str = "00000001";

fn session(export_index: usize, structured_replies: bool, id: Option<u32>, flags: u16) -> Session {
    Session {
        export_index,
        structured_replies,
        base_allocation_id: id,
        transmission_flags: flags,
        sizes_agreed: false,
    }
}

// ---- Handshake ----

#[test]
fn greeting() {
    let mut out = Vec::new();
    Handshake::new(config()).greeting(&mut out);
    assert_eq!(out, hex("4e42444d41474943 49484156454f5054 0003"));
}

#[test]
fn export_name_with_no_zeroes() {
    let client = cat(&[&hex(NO_ZEROES), &hex("49484156454f5054 00000001 00000004"), b"disk"]);
    let t = run(&client);
    assert_eq!(t.replies, hex("0000000040000000 016d"));
    assert_eq!(t.end, End::Done { consumed: 24, session: session(0, false, None, 0x016d) });
}

#[test]
fn export_name_without_no_zeroes_pads_124_bytes() {
    // The empty name selects the default export, "disk".
    let client = cat(&[&hex(FIXED_ONLY), &hex("49484156454f5054 00000001 00000000")]);
    let t = run(&client);
    assert_eq!(t.replies, cat(&[&hex("0000000040000000 016d"), &[0; 124]]));
    assert_eq!(t.end, End::Done { consumed: 20, session: session(0, false, None, 0x016d) });
}

#[test]
fn client_without_fixed_newstyle_may_still_use_export_name() {
    let client = cat(&[&hex("00000000 49484156454f5054 00000001 00000002"), b"ro"]);
    let t = run(&client);
    assert_eq!(t.replies, cat(&[&hex("0000000000100000 0007"), &[0; 124]]));
    assert_eq!(t.end, End::Done { consumed: 22, session: session(1, false, None, 0x0007) });
}

#[test]
fn list_then_abort() {
    let client = cat(&[
        &hex(NO_ZEROES),
        &hex("49484156454f5054 00000003 00000000"),
        &hex("49484156454f5054 00000002 00000000"),
    ]);
    let t = run(&client);
    let expected = cat(&[
        &hex("0003e889045565a9 00000003 00000002 00000014 00000004"),
        b"disk",
        b"scratch disk",
        &hex("0003e889045565a9 00000003 00000002 00000006 00000002"),
        b"ro",
        &hex("0003e889045565a9 00000003 00000001 00000000"),
        &hex("0003e889045565a9 00000002 00000001 00000000"),
    ]);
    assert_eq!(t.replies, expected);
    assert_eq!(t.end, End::Close { consumed: 36 });
}

#[test]
fn abort_is_acknowledged_and_its_data_ignored() {
    let client = cat(&[&hex(NO_ZEROES), &hex("49484156454f5054 00000002 00000003"), b"xyz"]);
    let t = run(&client);
    assert_eq!(t.replies, hex("0003e889045565a9 00000002 00000001 00000000"));
    assert_eq!(t.end, End::Close { consumed: 20 });
}

#[test]
fn info_then_go_with_block_size() {
    let ask = |option: &str| {
        cat(&[&hex(&format!("49484156454f5054 {option} 0000000a 00000002")), b"ro", &hex("0001 0003")])
    };
    let answer = |option: &str| {
        hex(&format!(
            "0003e889045565a9 {option} 00000003 0000000c 0000 0000000000100000 0007
             0003e889045565a9 {option} 00000003 0000000e 0003 00000200 00001000 00100000
             0003e889045565a9 {option} 00000001 00000000"
        ))
    };
    let client = cat(&[&hex(NO_ZEROES), &ask("00000006"), &ask("00000007")]);
    let t = run(&client);
    assert_eq!(t.replies, cat(&[&answer("00000006"), &answer("00000007")]));
    // A GO that asked for block sizes binds the client to them.
    let agreed = Session { sizes_agreed: true, ..session(1, false, None, 0x0007) };
    assert_eq!(t.end, End::Done { consumed: 56, session: agreed });
}

#[test]
fn go_with_name_and_description_for_the_default_export() {
    // Default block sizes: no NBD_INFO_BLOCK_SIZE unless asked.
    let client = cat(&[&hex(NO_ZEROES), &hex("49484156454f5054 00000007 0000000a 00000000 0002 0001 0002")]);
    let t = run(&client);
    let expected = cat(&[
        &hex("0003e889045565a9 00000007 00000003 0000000c 0000 0000000040000000 016d"),
        &hex("0003e889045565a9 00000007 00000003 00000006 0001"),
        b"disk",
        &hex("0003e889045565a9 00000007 00000003 0000000e 0002"),
        b"scratch disk",
        &hex("0003e889045565a9 00000007 00000001 00000000"),
    ]);
    assert_eq!(t.replies, expected);
    assert_eq!(t.end, End::Done { consumed: 30, session: session(0, false, None, 0x016d) });
}

fn structured_reply() -> Vec<u8> {
    hex("49484156454f5054 00000008 00000000")
}

fn set_base_allocation(export: &[u8]) -> Vec<u8> {
    let len = 4 + export.len() + 4 + 4 + 15;
    cat(&[
        &hex("49484156454f5054 0000000a"),
        &(len as u32).to_be_bytes(),
        &(export.len() as u32).to_be_bytes(),
        export,
        &hex("00000001 0000000f"),
        b"base:allocation",
    ])
}

fn go(export: &[u8]) -> Vec<u8> {
    let len = 4 + export.len() + 2;
    cat(&[
        &hex("49484156454f5054 00000007"),
        &(len as u32).to_be_bytes(),
        &(export.len() as u32).to_be_bytes(),
        export,
        &hex("0000"),
    ])
}

#[test]
fn structured_replies_and_base_allocation_then_go() {
    let client = cat(&[&hex(NO_ZEROES), &structured_reply(), &set_base_allocation(b"disk"), &go(b"disk")]);
    assert_eq!(set_base_allocation(b"disk")[8..16], hex("0000000a 0000001f"));
    let t = run(&client);
    let expected = cat(&[
        &hex("0003e889045565a9 00000008 00000001 00000000"),
        &hex("0003e889045565a9 0000000a 00000004 00000013 00000001"),
        b"base:allocation",
        &hex("0003e889045565a9 0000000a 00000001 00000000"),
        &hex("0003e889045565a9 00000007 00000003 0000000c 0000 0000000040000000 01ed"),
        &hex("0003e889045565a9 00000007 00000001 00000000"),
    ]);
    assert_eq!(t.replies, expected);
    assert_eq!(t.end, End::Done { consumed: 93, session: session(0, true, Some(1), 0x01ed) });
}

#[test]
fn a_context_set_for_another_export_does_not_carry_over() {
    let client = cat(&[&hex(NO_ZEROES), &structured_reply(), &set_base_allocation(b"disk"), &go(b"ro")]);
    let End::Done { session, .. } = run(&client).end else { panic!("GO failed") };
    assert_eq!(session, self::session(1, true, None, 0x0087));
}

#[test]
fn list_meta_context() {
    let list = |queries: &[&[u8]]| {
        let mut data = cat(&[&hex("00000004"), b"disk", &(queries.len() as u32).to_be_bytes()]);
        for q in queries {
            data.extend_from_slice(&(q.len() as u32).to_be_bytes());
            data.extend_from_slice(q);
        }
        cat(&[&hex("49484156454f5054 00000009"), &(data.len() as u32).to_be_bytes(), &data])
    };
    let client = cat(&[
        &hex(NO_ZEROES),
        &structured_reply(),
        &list(&[]),
        &list(&[b"base:"]),
        &list(&[b"qemu:dirty-bitmap:x", b"base:dirty"]),
    ]);
    assert_eq!(list(&[]), hex("49484156454f5054 00000009 0000000c 00000004 6469736b 00000000"));
    let listed = cat(&[
        &hex("0003e889045565a9 00000009 00000004 00000013 00000000"),
        b"base:allocation",
        &hex("0003e889045565a9 00000009 00000001 00000000"),
    ]);
    let t = run(&client);
    let expected = cat(&[
        &hex("0003e889045565a9 00000008 00000001 00000000"),
        &listed,
        &listed,
        &hex("0003e889045565a9 00000009 00000001 00000000"),
    ]);
    assert_eq!(t.replies, expected);
    assert_eq!(t.end, End::NeedMore { consumed: client.len() });
}

#[test]
fn set_meta_context_before_structured_replies_is_invalid() {
    let client = cat(&[&hex(NO_ZEROES), &set_base_allocation(b"disk"), &go(b"disk")]);
    let t = run(&client);
    let expected = cat(&[
        &hex("0003e889045565a9 0000000a 80000003 00000022"),
        b"negotiate structured replies first",
        &hex("0003e889045565a9 00000007 00000003 0000000c 0000 0000000040000000 016d"),
        &hex("0003e889045565a9 00000007 00000001 00000000"),
    ]);
    assert_eq!(t.replies, expected);
    let End::Done { session, .. } = t.end else { panic!("GO failed") };
    assert_eq!(session.base_allocation_id, None);
}

#[test]
fn unknown_options_get_unsup_and_negotiation_goes_on() {
    let client = cat(&[
        &hex(NO_ZEROES),
        &hex("49484156454f5054 0000002a 00000003"),
        b"xyz",
        &hex("49484156454f5054 00000005 00000000"), // STARTTLS: we run without TLS
        &go(b""),
    ]);
    let t = run(&client);
    let expected = cat(&[
        &hex("0003e889045565a9 0000002a 80000001 00000014"),
        b"option not supported",
        &hex("0003e889045565a9 00000005 80000001 00000014"),
        b"option not supported",
        &hex("0003e889045565a9 00000007 00000003 0000000c 0000 0000000040000000 016d"),
        &hex("0003e889045565a9 00000007 00000001 00000000"),
    ]);
    assert_eq!(t.replies, expected);
    assert_eq!(t.end, End::Done { consumed: 4 + 19 + 16 + 22, session: session(0, false, None, 0x016d) });
}

#[test]
fn unknown_export_is_an_error_reply_for_go_and_a_close_for_export_name() {
    let client = cat(&[&hex(NO_ZEROES), &go(b"nope"), &hex("49484156454f5054 00000001 00000004"), b"nope"]);
    let t = run(&client);
    assert_eq!(t.replies, cat(&[&hex("0003e889045565a9 00000007 80000006 0000000e"), b"no such export"]));
    assert_eq!(t.end, End::Failed(NbdError::UnknownExport("nope".into())));

    // Without a default export, the empty name is unknown too.
    let config = Arc::new(HandshakeConfig::new(vec![ExportDesc::new("disk", 1 << 20)], None).unwrap());
    let client = cat(&[&hex(NO_ZEROES), &hex("49484156454f5054 00000001 00000000")]);
    assert_eq!(
        run_handshake(&config, &client, usize::MAX).end,
        End::Failed(NbdError::UnknownExport(String::new()))
    );
}

#[test]
fn unknown_client_flags_close_without_a_word() {
    let t = run(&hex("00000004"));
    assert_eq!(t.replies, b"");
    assert_eq!(t.end, End::Failed(NbdError::UnknownClientFlags(4)));
}

#[test]
fn oversized_option_is_refused_and_skipped() {
    let len = nbd::OPTION_LEN_MAX + 1;
    let client = cat(&[
        &hex(NO_ZEROES),
        &hex("49484156454f5054 00000003 00010001"),
        &vec![0xaa; len as usize],
        &go(b""),
    ]);
    let t = run(&client);
    let expected = cat(&[
        &hex("0003e889045565a9 00000003 80000009 00000015"),
        b"option data too large",
        &hex("0003e889045565a9 00000007 00000003 0000000c 0000 0000000040000000 016d"),
        &hex("0003e889045565a9 00000007 00000001 00000000"),
    ]);
    assert_eq!(t.replies, expected);
    assert_eq!(t.end, End::Done { consumed: client.len(), session: session(0, false, None, 0x016d) });
}

#[test]
fn oversized_options_past_the_discard_budget_disconnect() {
    // One option over the whole budget fails at its header, before any data arrives.
    let t = run(&cat(&[&hex(NO_ZEROES), &hex("49484156454f5054 00000003 00100001")]));
    assert_eq!(t.replies, b"");
    assert_eq!(t.end, End::Failed(NbdError::OptionTooLarge { option: 3, len: 0x0010_0001 }));

    // The budget is cumulative: 15 options of 64 KiB + 1 fit in 1 MiB, the 16th does not.
    let mut client = hex(NO_ZEROES);
    for _ in 0..16 {
        client.extend(hex("49484156454f5054 00000003 00010001"));
        client.extend(vec![0; 0x10001]);
    }
    let t = run_handshake(&config(), &client, usize::MAX);
    assert_eq!(t.end, End::Failed(NbdError::OptionTooLarge { option: 3, len: 0x10001 }));
    assert_eq!(t.replies.len(), 15 * (20 + 21));
}

#[test]
fn export_name_longer_than_any_name_disconnects_at_once() {
    let t = run(&cat(&[&hex(NO_ZEROES), &hex("49484156454f5054 00000001 00001001")]));
    assert_eq!(t.end, End::Failed(NbdError::ExportNameTooLong(4097)));
}

#[test]
fn transmission_starts_right_after_go() {
    let read = hex("25609513 0000 0000 0102030405060708 0000000000001000 00001000");
    let client = cat(&[&hex(NO_ZEROES), &go(b"disk"), &read]);
    let mut handshake = Handshake::new(config());
    let Ok(nbd::Step::Done { consumed, .. }) = handshake.handle(&client, &mut Vec::new()) else {
        panic!("GO failed")
    };
    let (request, len) = parse_request(&client[consumed..]).unwrap().unwrap();
    assert_eq!((request.cmd, request.cookie, len), (Cmd::Read, 0x0102_0304_0506_0708, 28));
}

// ---- Transmission: requests ----

#[test]
fn request_vectors() {
    let read = hex("25609513 0000 0000 0102030405060708 0000000000001000 00001000");
    let expected = Request {
        flags: CmdFlags::empty(),
        cmd: Cmd::Read,
        cookie: 0x0102_0304_0506_0708,
        offset: 0x1000,
        length: 0x1000,
    };
    assert_eq!(parse_request(&read), Ok(Some((expected, 28))));
    let mut emitted = Vec::new();
    expected.emit(&mut emitted);
    assert_eq!(emitted, read);

    // A WRITE's payload follows; the parser neither needs nor reads it.
    let write = hex("25609513 0001 0001 1112131415161718 0000000000000200 00000200 abab");
    let (w, len) = parse_request(&write).unwrap().unwrap();
    assert_eq!(
        (w.cmd, w.flags, w.offset, w.payload_len(), len),
        (Cmd::Write, CmdFlags::FUA, 0x200, 0x200, 28)
    );

    let status = hex("25609513 0008 0007 0000000000000001 0000000000000000 00010000");
    let (b, _) = parse_request(&status).unwrap().unwrap();
    assert_eq!((b.cmd, b.flags, b.length), (Cmd::BlockStatus, CmdFlags::REQ_ONE, 0x10000));

    let odd = hex("25609513 8000 0009 0000000000000002 0000000000000000 00000000");
    let (u, _) = parse_request(&odd).unwrap().unwrap();
    assert_eq!((u.cmd, u.flags.unknown_bits()), (Cmd::Unknown(9), 0x8000));

    assert_eq!(parse_request(&read[..27]), Ok(None));
    let mut bad = read.clone();
    bad[3] = 0x14;
    assert_eq!(parse_request(&bad), Err(NbdError::BadRequestMagic(0x2560_9514)));
}

// ---- Transmission: replies ----

const COOKIE: u64 = 0x0102_0304_0506_0708;

fn emitted(f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = Vec::new();
    f(&mut out);
    out
}

#[test]
fn simple_reply_vectors() {
    assert_eq!(emitted(|o| tx::simple_reply(o, COOKIE, 0)), hex("67446698 00000000 0102030405060708"));
    assert_eq!(emitted(|o| tx::simple_reply(o, COOKIE, EIO)), hex("67446698 00000005 0102030405060708"));
}

#[test]
fn chunk_vectors() {
    assert_eq!(emitted(|o| tx::chunk_none(o, COOKIE)), hex("668e33ef 0001 0000 0102030405060708 00000000"));
    assert_eq!(
        emitted(|o| tx::chunk_offset_data_header(o, COOKIE, true, 0x1000, 512)),
        hex("668e33ef 0001 0001 0102030405060708 00000208 0000000000001000")
    );
    assert_eq!(
        emitted(|o| tx::chunk_offset_hole(o, COOKIE, false, 0x2000, 0x1000)),
        hex("668e33ef 0000 0002 0102030405060708 0000000c 0000000000002000 00001000")
    );
    assert_eq!(
        emitted(|o| tx::chunk_error(o, COOKIE, EINVAL, "bad")),
        cat(&[&hex("668e33ef 0001 8001 0102030405060708 00000009 00000016 0003"), b"bad"])
    );
    assert_eq!(
        emitted(|o| tx::chunk_error_offset(o, COOKIE, false, EIO, "", 0x3000)),
        hex("668e33ef 0000 8002 0102030405060708 0000000e 00000005 0000 0000000000003000")
    );
    assert_eq!(
        emitted(|o| tx::chunk_block_status(o, COOKIE, true, 1, &[(0x1000, 0), (0x2000, 3)])),
        hex("668e33ef 0001 0005 0102030405060708 00000014 00000001 00001000 00000000 00002000 00000003")
    );
}

#[test]
fn error_reply_follows_the_session() {
    let simple = session(0, false, None, 0x016d);
    let structured = session(0, true, None, 0x01ed);
    assert_eq!(
        emitted(|o| tx::error_reply(o, &simple, COOKIE, EPERM, "read-only")),
        hex("67446698 00000001 0102030405060708")
    );
    assert_eq!(
        emitted(|o| tx::error_reply(o, &structured, COOKIE, EPERM, "ro")),
        cat(&[&hex("668e33ef 0001 8001 0102030405060708 00000008 00000001 0002"), b"ro"])
    );
}

#[test]
fn errno_values_are_the_specs() {
    let values =
        [tx::EPERM, tx::EIO, tx::ENOMEM, tx::EINVAL, tx::ENOSPC, tx::EOVERFLOW, tx::ENOTSUP, tx::ESHUTDOWN];
    assert_eq!(values, [1, 5, 12, 22, 28, 75, 95, 108]);
}

#[test]
fn error_of_follows_the_spec() {
    let none = CmdFlags::empty();
    let cases = [
        (Status::Ok, Cmd::Read, none, 0),
        (Status::ReadOnly, Cmd::Write, none, EPERM),
        (Status::ReadOnly, Cmd::Trim, none, EPERM),
        (Status::OutOfRange, Cmd::Write, none, ENOSPC),
        (Status::OutOfRange, Cmd::WriteZeroes, none, ENOSPC),
        (Status::OutOfRange, Cmd::Read, none, EINVAL),
        (Status::OutOfRange, Cmd::Trim, none, EINVAL),
        (Status::OutOfRange, Cmd::Cache, none, EINVAL),
        (Status::OutOfRange, Cmd::BlockStatus, none, EINVAL),
        (Status::Misaligned, Cmd::Write, none, EINVAL),
        (Status::Invalid, Cmd::Read, none, EINVAL),
        (Status::BadHandle, Cmd::Read, none, EINVAL),
        (Status::UnknownOpcode, Cmd::Unknown(9), none, EINVAL),
        (Status::TooLarge, Cmd::Read, CmdFlags::DF, EINVAL),
        (Status::TooLarge, Cmd::Write, none, EINVAL),
        (Status::Unsupported, Cmd::WriteZeroes, CmdFlags::FAST_ZERO, ENOTSUP),
        (Status::Unsupported, Cmd::WriteZeroes, CmdFlags::NO_HOLE, EINVAL),
        (Status::Unsupported, Cmd::Trim, none, EINVAL),
        (Status::NoSpace, Cmd::Write, none, ENOSPC),
        (Status::IoError, Cmd::Read, none, EIO),
        (Status::Other(99), Cmd::Flush, none, EIO),
    ];
    for (status, cmd, flags, errno) in cases {
        assert_eq!(nbd::error_of(status, cmd, flags), errno, "{status:?} on {cmd:?} {flags:?}");
    }
}
