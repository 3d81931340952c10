//! Conformance of skiff's NBD front end to the NBD protocol (NetworkBlockDevice/nbd,
//! doc/proto.md), through a raw TCP socket.
//!
//! Every message is encoded and decoded by hand from the specification, never through the
//! `nbd` crate. Test names start with the part of the specification they check: `hs_` the
//! handshake ("Newstyle negotiation", "Fixed newstyle negotiation", "Handshake flags",
//! "Client flags"), `opt_` option haggling ("Option types", "Option reply types"), `tx_`
//! the transmission phase ("Transmission", "Request types", "Error values", "Size
//! constraints"). MUST rules are asserted as written; SHOULD rules are asserted where skiff's
//! docs/NBD.md promises the behaviour. Every read has a timeout, so a server that fails to
//! answer fails a test instead of hanging it.
//!
//! `nbd_bad_input.rs` already covers reads and writes past the end, over the maximum payload,
//! misaligned reads, an unknown command, an unknown READ flag, BLOCK_STATUS without a meta
//! context, writes to a read-only export, a bad request magic and garbage in the handshake;
//! they are not repeated here.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use server::Target;
use skiff_tests::start_nbd_target;

/// How long a read waits before the test calls the target silent: a guard against hanging,
/// far above any answer time, so that a loaded machine never decides a test. Only a target
/// that never answers (one waiting for a body it should refuse from the header) reaches it.
const TIMEOUT: Duration = Duration::from_secs(10);

// Magic numbers.
const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake and client flags.
const FIXED_NEWSTYLE: u32 = 1 << 0;
const NO_ZEROES: u32 = 1 << 1;

// Option types.
const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_PEEK_EXPORT: u32 = 4;
const OPT_STARTTLS: u32 = 5;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const OPT_LIST_META_CONTEXT: u32 = 9;
const OPT_SET_META_CONTEXT: u32 = 10;

// Option reply types.
const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_META_CONTEXT: u32 = 4;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const REP_ERR_POLICY: u32 = (1 << 31) + 2;
const REP_ERR_INVALID: u32 = (1 << 31) + 3;
const REP_ERR_PLATFORM: u32 = (1 << 31) + 4;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

// Information types.
const INFO_EXPORT: u16 = 0;
const INFO_NAME: u16 = 1;
const INFO_DESCRIPTION: u16 = 2;
const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
const HAS_FLAGS: u16 = 1 << 0;
const T_READ_ONLY: u16 = 1 << 1;
const SEND_FLUSH: u16 = 1 << 2;
const SEND_FUA: u16 = 1 << 3;
const SEND_TRIM: u16 = 1 << 5;
const SEND_WRITE_ZEROES: u16 = 1 << 6;
const SEND_DF: u16 = 1 << 7;
const CAN_MULTI_CONN: u16 = 1 << 8;
const SEND_CACHE: u16 = 1 << 10;
const SEND_FAST_ZERO: u16 = 1 << 11;

// Commands and command flags.
const READ: u16 = 0;
const WRITE: u16 = 1;
const DISC: u16 = 2;
const FLUSH: u16 = 3;
const TRIM: u16 = 4;
const CACHE: u16 = 5;
const WRITE_ZEROES: u16 = 6;
const BLOCK_STATUS: u16 = 7;
const F_FUA: u16 = 1 << 0;
const F_NO_HOLE: u16 = 1 << 1;
const F_DF: u16 = 1 << 2;
const F_REQ_ONE: u16 = 1 << 3;
const F_FAST_ZERO: u16 = 1 << 4;

// Structured reply flags and chunk types.
const REPLY_FLAG_DONE: u16 = 1 << 0;
const CHUNK_NONE: u16 = 0;
const CHUNK_OFFSET_DATA: u16 = 1;
const CHUNK_OFFSET_HOLE: u16 = 2;
const CHUNK_BLOCK_STATUS: u16 = 5;
const CHUNK_ERROR: u16 = (1 << 15) + 1;
const CHUNK_ERROR_OFFSET: u16 = (1 << 15) + 2;

// base:allocation states.
const STATE_HOLE: u32 = 1 << 0;
const STATE_ZERO: u32 = 1 << 1;

// Error values.
const EPERM: u32 = 1;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;
const EOVERFLOW: u32 = 75;
const ENOTSUP: u32 = 95;

const VOL_BYTES: u64 = 4 << 20;

/// A writable RAM export, a read-only one, and a file (whose write-zeroes is not fast).
fn start() -> (Target, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
    let file = format!("file=file:{}", path.display());
    let (t, addr) = start_nbd_target(&["vol=ram:4M", "ro=ram:1M,ro", &file]);
    (t, addr, dir)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed ^ (i as u8).wrapping_mul(29) ^ ((i >> 9) as u8)).collect()
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes(b[..2].try_into().unwrap())
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

/// The data of OPT_INFO and OPT_GO: name, then information requests.
fn info_data(name: &[u8], requests: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name);
    d.extend_from_slice(&(requests.len() as u16).to_be_bytes());
    for r in requests {
        d.extend_from_slice(&r.to_be_bytes());
    }
    d
}

/// The data of the META_CONTEXT options: export name, then queries.
fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        d.extend_from_slice(q.as_bytes());
    }
    d
}

#[derive(Debug)]
struct OptReply {
    option: u32,
    kind: u32,
    data: Vec<u8>,
}

impl OptReply {
    fn is_error(&self) -> bool {
        self.kind & (1 << 31) != 0
    }
}

#[derive(Debug)]
struct Chunk {
    flags: u16,
    kind: u16,
    cookie: u64,
    payload: Vec<u8>,
}

impl Chunk {
    fn is_error(&self) -> bool {
        self.kind & (1 << 15) != 0
    }

    /// The error of an error chunk, checking its layout.
    fn error(&self) -> u32 {
        assert!(matches!(self.kind, CHUNK_ERROR | CHUNK_ERROR_OFFSET), "not a defined error chunk: {self:?}");
        assert!(self.payload.len() >= 6, "error chunk of {} bytes", self.payload.len());
        let msg_len = be16(&self.payload[4..]) as usize;
        let fixed = if self.kind == CHUNK_ERROR_OFFSET { 14 } else { 6 };
        assert!(msg_len + fixed <= self.payload.len(), "error message overruns its chunk");
        assert!(msg_len <= 4096, "error message over 4096 bytes");
        let e = be32(&self.payload);
        assert_ne!(e, 0, "an error chunk's error MUST be nonzero");
        e
    }
}

enum Reply {
    Simple { error: u32, cookie: u64 },
    Chunk(Chunk),
}

/// A raw NBD client.
struct Nbd {
    s: TcpStream,
    /// Structured replies were negotiated; until then the server MUST NOT send a chunk.
    structured: bool,
}

impl Nbd {
    /// Connect and read the greeting; returns the handshake flags.
    fn greet(addr: &str) -> (Nbd, u16) {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        s.set_nodelay(true).unwrap();
        let mut c = Nbd { s, structured: false };
        let g = c.take(18);
        assert_eq!(be64(&g), NBDMAGIC, "greeting");
        assert_eq!(be64(&g[8..]), IHAVEOPT, "newstyle magic");
        let flags = be16(&g[16..]);
        (c, flags)
    }

    /// Greet and send client flags.
    fn handshake(addr: &str, client_flags: u32) -> Nbd {
        let (mut c, _) = Nbd::greet(addr);
        c.send(&client_flags.to_be_bytes());
        c
    }

    /// The usual start: fixed newstyle with NO_ZEROES.
    fn haggling(addr: &str) -> Nbd {
        Nbd::handshake(addr, FIXED_NEWSTYLE | NO_ZEROES)
    }

    fn send(&mut self, b: &[u8]) {
        self.s.write_all(b).expect("send");
    }

    fn take(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.s.read_exact(&mut b).unwrap_or_else(|e| panic!("reading {n} bytes: {e}"));
        b
    }

    /// True when the server has closed the connection (a timeout is not a close).
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        match self.s.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted),
        }
    }

    fn option(&mut self, option: u32, data: &[u8]) {
        let mut o = IHAVEOPT.to_be_bytes().to_vec();
        o.extend_from_slice(&option.to_be_bytes());
        o.extend_from_slice(&(data.len() as u32).to_be_bytes());
        o.extend_from_slice(data);
        self.send(&o);
    }

    fn opt_reply(&mut self) -> OptReply {
        let h = self.take(20);
        assert_eq!(be64(&h), OPT_REPLY_MAGIC, "option reply magic");
        let (option, kind, len) = (be32(&h[8..]), be32(&h[12..]), be32(&h[16..]));
        OptReply { option, kind, data: self.take(len as usize) }
    }

    /// Send an option and read replies up to the final one (ACK or an error); every reply
    /// must echo the option.
    fn ask(&mut self, option: u32, data: &[u8]) -> Vec<OptReply> {
        self.option(option, data);
        let mut all = Vec::new();
        loop {
            let r = self.opt_reply();
            assert_eq!(r.option, option, "a reply MUST carry the option it answers: {r:?}");
            let last = r.kind == REP_ACK || r.is_error();
            all.push(r);
            if last {
                return all;
            }
        }
    }

    /// The final reply type of an option.
    fn final_reply(&mut self, option: u32, data: &[u8]) -> u32 {
        self.ask(option, data).last().unwrap().kind
    }

    /// Haggling still works: LIST is answered.
    fn still_haggling(&mut self) {
        assert_eq!(self.final_reply(OPT_LIST, &[]), REP_ACK, "negotiation goes on");
    }

    fn request(&mut self, cmd: u16, flags: u16, cookie: u64, offset: u64, len: u32, payload: &[u8]) {
        self.send(&skiff_tests::nbd_request(cmd, flags, cookie, offset, len, payload));
    }

    /// The next reply header: a simple reply (its data, if any, left unread) or a chunk.
    fn reply(&mut self) -> Reply {
        let magic = be32(&self.take(4));
        match magic {
            SIMPLE_REPLY_MAGIC => {
                let h = self.take(12);
                Reply::Simple { error: be32(&h), cookie: be64(&h[4..]) }
            }
            STRUCTURED_REPLY_MAGIC => {
                assert!(self.structured, "a structured reply chunk MUST NOT be sent unless negotiated");
                let h = self.take(16);
                let len = be32(&h[12..]) as usize;
                Reply::Chunk(Chunk {
                    flags: be16(&h),
                    kind: be16(&h[2..]),
                    cookie: be64(&h[4..]),
                    payload: self.take(len),
                })
            }
            other => panic!("reply magic {other:#x}"),
        }
    }

    /// The error of a reply without data, simple or structured (for structured replies the
    /// chunks up to the one marked DONE).
    fn status(&mut self, cookie: u64) -> u32 {
        match self.reply() {
            Reply::Simple { error, cookie: c } => {
                assert_eq!(c, cookie, "the reply MUST carry the request's cookie");
                error
            }
            Reply::Chunk(first) => {
                let chunks = self.rest_of(first, cookie);
                chunks.iter().find(|c| c.is_error()).map_or(0, Chunk::error)
            }
        }
    }

    fn call(&mut self, cmd: u16, flags: u16, cookie: u64, offset: u64, len: u32, payload: &[u8]) -> u32 {
        self.request(cmd, flags, cookie, offset, len, payload);
        self.status(cookie)
    }

    /// The chunks of one structured reply, `first` included, through the one marked DONE.
    fn rest_of(&mut self, first: Chunk, cookie: u64) -> Vec<Chunk> {
        let mut chunks = vec![first];
        while chunks.last().unwrap().flags & REPLY_FLAG_DONE == 0 {
            match self.reply() {
                Reply::Chunk(c) => chunks.push(c),
                Reply::Simple { .. } => panic!("a simple reply inside a structured one"),
            }
        }
        for c in &chunks {
            assert_eq!(c.cookie, cookie, "chunk cookie");
        }
        if let Some(none) = chunks.iter().position(|c| c.kind == CHUNK_NONE) {
            assert_eq!(none, chunks.len() - 1, "NBD_REPLY_TYPE_NONE is only valid as the final chunk");
            assert!(chunks[none].payload.is_empty(), "NBD_REPLY_TYPE_NONE has length 0");
        }
        chunks
    }

    fn structured(&mut self, cookie: u64) -> Vec<Chunk> {
        match self.reply() {
            Reply::Chunk(first) => self.rest_of(first, cookie),
            Reply::Simple { error, .. } => {
                panic!("a simple reply (error {error}) where a structured one is due")
            }
        }
    }

    /// A successful READ with simple replies.
    fn read(&mut self, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
        self.request(READ, 0, cookie, offset, len, &[]);
        match self.reply() {
            Reply::Simple { error: 0, cookie: c } if c == cookie => self.take(len as usize),
            Reply::Simple { error, .. } => panic!("READ at {offset}: error {error}"),
            Reply::Chunk(c) => panic!("a structured chunk without structured replies: {c:?}"),
        }
    }

    fn write(&mut self, cookie: u64, offset: u64, data: &[u8]) -> u32 {
        self.call(WRITE, 0, cookie, offset, data.len() as u32, data)
    }
}

/// What GO told us.
struct Export {
    size: u64,
    flags: u16,
    block: Option<(u32, u32, u32)>,
}

/// Decode the NBD_REP_INFO replies before an ACK, checking each one's length.
fn infos(replies: &[OptReply]) -> Export {
    assert_eq!(replies.last().unwrap().kind, REP_ACK, "{replies:?}");
    let mut e = None;
    let mut block = None;
    for r in &replies[..replies.len() - 1] {
        assert_eq!(r.kind, REP_INFO, "{r:?}");
        let d = &r.data;
        match be16(d) {
            INFO_EXPORT => {
                assert_eq!(d.len(), 12, "NBD_INFO_EXPORT length MUST be 12");
                assert!(e.is_none(), "NBD_INFO_EXPORT twice");
                e = Some((be64(&d[2..]), be16(&d[10..])));
            }
            INFO_BLOCK_SIZE => {
                assert_eq!(d.len(), 14, "NBD_INFO_BLOCK_SIZE length MUST be 14");
                block = Some((be32(&d[2..]), be32(&d[6..]), be32(&d[10..])));
            }
            INFO_NAME | INFO_DESCRIPTION => {
                assert!(d.len() >= 2);
                String::from_utf8(d[2..].to_vec()).expect("a UTF-8 string");
            }
            _ => {}
        }
    }
    let (size, flags) = e.expect("a successful INFO or GO MUST include NBD_INFO_EXPORT");
    Export { size, flags, block }
}

/// A session in transmission, reached through GO.
struct Session {
    c: Nbd,
    e: Export,
    context: Option<u32>,
}

fn go(addr: &str, export: &str, structured: bool, meta: bool) -> Session {
    let mut c = Nbd::haggling(addr);
    if structured {
        assert_eq!(c.final_reply(OPT_STRUCTURED_REPLY, &[]), REP_ACK);
        c.structured = true;
    }
    let mut context = None;
    if meta {
        let r = c.ask(OPT_SET_META_CONTEXT, &meta_data(export, &["base:allocation"]));
        assert_eq!((r.len(), r[0].kind, r[1].kind), (2, REP_META_CONTEXT, REP_ACK), "{r:?}");
        assert_eq!(&r[0].data[4..], b"base:allocation");
        context = Some(be32(&r[0].data));
    }
    let e = infos(&c.ask(OPT_GO, &info_data(export.as_bytes(), &[INFO_BLOCK_SIZE])));
    Session { c, e, context }
}

// ---------------------------------------------------------------------------------------------
// Handshake.

/// "Handshake flags": FIXED_NEWSTYLE MUST be set by a fixed-newstyle server; no flag but
/// FIXED_NEWSTYLE and NO_ZEROES may be set.
#[test]
fn hs_greeting_sets_fixed_newstyle_and_no_unknown_flags() {
    let (_t, addr, _d) = start();
    let (_c, flags) = Nbd::greet(&addr);
    assert_eq!(flags & FIXED_NEWSTYLE as u16, FIXED_NEWSTYLE as u16);
    assert_eq!(flags & !0b11, 0, "handshake flags {flags:#x}");
}

/// "Newstyle negotiation": the server MUST close the connection if it does not recognize the
/// client's flags ("Client flags": an unknown flag, or one not advertised).
#[test]
fn hs_unknown_client_flags_close_the_connection() {
    let (_t, addr, _d) = start();
    for flags in [FIXED_NEWSTYLE | 1 << 2, 1 << 31, u32::MAX] {
        let mut c = Nbd::handshake(&addr, flags);
        assert!(c.closed(), "client flags {flags:#x}");
    }
}

/// Options before the client flags: the option magic is read as client flags full of unknown
/// bits, so the connection closes.
#[test]
fn hs_an_option_before_the_client_flags_closes_the_connection() {
    let (_t, addr, _d) = start();
    let (mut c, _) = Nbd::greet(&addr);
    c.option(OPT_LIST, &[]);
    assert!(c.closed());
}

/// "NBD_OPT_EXPORT_NAME": without NBD_FLAG_C_NO_ZEROES the reply ends with 124 zero bytes.
#[test]
fn hs_export_name_without_no_zeroes_sends_124_zero_bytes() {
    let (_t, addr, _d) = start();
    // Both with fixed newstyle and without it: EXPORT_NAME is the non-fixed client's option.
    for flags in [FIXED_NEWSTYLE, 0] {
        let mut c = Nbd::handshake(&addr, flags);
        c.option(OPT_EXPORT_NAME, b"vol");
        let r = c.take(10 + 124);
        assert_eq!(be64(&r), VOL_BYTES, "export size");
        assert_eq!(be16(&r[8..]) & HAS_FLAGS, HAS_FLAGS);
        assert!(r[10..].iter().all(|&b| b == 0), "124 zero bytes");
        c.write(1, 0, &[5; 512]);
        assert_eq!(c.read(2, 0, 512), vec![5; 512], "transmission starts right after the zeroes");
    }
}

#[test]
fn hs_export_name_with_no_zeroes_sends_no_padding() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    c.option(OPT_EXPORT_NAME, b"vol");
    let r = c.take(10);
    assert_eq!(be64(&r), VOL_BYTES);
    assert_eq!(c.read(1, 0, 512), vec![0; 512]);
}

/// "NBD_OPT_EXPORT_NAME": an export that does not exist MUST terminate the session.
#[test]
fn hs_export_name_for_an_unknown_export_terminates_the_session() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    c.option(OPT_EXPORT_NAME, b"nope");
    assert!(c.closed());
}

// ---------------------------------------------------------------------------------------------
// Option haggling.

/// "Fixed newstyle negotiation" and NBD_REP_ERR_UNSUP: an option the server does not know
/// gets ERR_UNSUP, echoing the option, and negotiation goes on.
#[test]
fn opt_an_unknown_option_is_err_unsup_and_haggling_goes_on() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    for option in [0u32, OPT_PEEK_EXPORT, 12, 99, 0x7FFF_FFFF, 0x8000_0001, u32::MAX] {
        let r = c.ask(option, b"some data");
        assert_eq!((r.len(), r[0].kind), (1, REP_ERR_UNSUP), "option {option:#x}");
    }
    c.still_haggling();
    let s = infos(&c.ask(OPT_GO, &info_data(b"vol", &[])));
    assert_eq!(s.size, VOL_BYTES);
}

/// "NBD_OPT_LIST": one NBD_REP_SERVER per export, then ACK.
#[test]
fn opt_list_names_every_export_then_acks() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    let r = c.ask(OPT_LIST, &[]);
    let (last, servers) = r.split_last().unwrap();
    assert_eq!(last.kind, REP_ACK);
    let names: Vec<String> = servers
        .iter()
        .map(|s| {
            assert_eq!(s.kind, REP_SERVER);
            let n = be32(&s.data) as usize;
            assert!(n <= s.data.len() - 4, "name length MUST be no larger than the reply length - 4");
            String::from_utf8(s.data[4..4 + n].to_vec()).unwrap()
        })
        .collect();
    assert_eq!(names, ["vol", "ro", "file"]);
}

/// "NBD_OPT_LIST" and "NBD_OPT_STRUCTURED_REPLY": data with the option SHOULD be rejected with
/// ERR_INVALID.
#[test]
fn opt_list_and_structured_reply_with_data_are_err_invalid() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    assert_eq!(c.final_reply(OPT_LIST, b"x"), REP_ERR_INVALID);
    assert_eq!(c.final_reply(OPT_STRUCTURED_REPLY, &[0; 4]), REP_ERR_INVALID);
    c.still_haggling();
}

/// "NBD_OPT_STARTTLS" on a server without TLS: an error the document permits, and
/// negotiation goes on.
#[test]
fn opt_starttls_without_tls_is_refused_and_haggling_goes_on() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    let r = c.final_reply(OPT_STARTTLS, &[]);
    assert!(matches!(r, REP_ERR_UNSUP | REP_ERR_POLICY | REP_ERR_PLATFORM), "STARTTLS: {r:#x}");
    let r = c.final_reply(OPT_STARTTLS, b"data");
    assert!(matches!(r, REP_ERR_UNSUP | REP_ERR_POLICY | REP_ERR_PLATFORM | REP_ERR_INVALID), "{r:#x}");
    c.still_haggling();
}

/// "NBD_OPT_INFO and NBD_OPT_GO": an export that does not exist gets ERR_UNKNOWN, with no
/// NBD_REP_INFO before it (SHOULD NOT), and negotiation goes on.
#[test]
fn opt_info_and_go_for_an_unknown_export_are_err_unknown() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    for option in [OPT_INFO, OPT_GO] {
        for name in [&b"nope"[..], b"VOL", b"vol\0", &[b'x'; 300]] {
            let r = c.ask(option, &info_data(name, &[INFO_BLOCK_SIZE]));
            assert_eq!((r.len(), r[0].kind), (1, REP_ERR_UNKNOWN), "option {option}: {r:?}");
        }
    }
    c.still_haggling();
}

/// "NBD_OPT_INFO and NBD_OPT_GO": the name length MUST be no larger than the option length
/// minus 6; the request list must fit. Syntactically invalid data is ERR_INVALID.
#[test]
fn opt_info_and_go_with_malformed_lengths_are_err_invalid() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    let mut trailing = info_data(b"vol", &[INFO_BLOCK_SIZE]);
    trailing.push(0);
    let mut short_list = info_data(b"vol", &[INFO_BLOCK_SIZE]);
    short_list[7..9].copy_from_slice(&2u16.to_be_bytes());
    let mut name_overruns = info_data(b"vol", &[]);
    name_overruns[..4].copy_from_slice(&100u32.to_be_bytes());
    let mut name_huge = info_data(b"vol", &[]);
    name_huge[..4].copy_from_slice(&u32::MAX.to_be_bytes());
    let cases: [(&str, Vec<u8>); 7] = [
        ("no data", vec![]),
        ("only a name length", vec![0, 0, 0, 0]),
        ("five bytes", vec![0, 0, 0, 0, 0]),
        ("name longer than the option", name_overruns),
        ("name length 2^32-1", name_huge),
        ("fewer requests than counted", short_list),
        ("a byte after the requests", trailing),
    ];
    for option in [OPT_INFO, OPT_GO] {
        for (what, data) in &cases {
            let r = c.ask(option, data);
            assert_eq!((r.len(), r[0].kind), (1, REP_ERR_INVALID), "option {option} with {what}: {r:?}");
        }
    }
    c.still_haggling();
}

/// "NBD_OPT_INFO": success is NBD_REP_INFO replies including NBD_INFO_EXPORT, then ACK, and
/// the client stays in negotiation. "NBD_INFO_BLOCK_SIZE" and "Size constraints": minimum a
/// power of 2 no larger than 64 KiB, preferred a power of 2 at least max(minimum, 512),
/// maximum at least the preferred.
#[test]
fn opt_info_describes_the_export_and_stays_in_negotiation() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    let requests = [INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION, 0x7777];
    let e = infos(&c.ask(OPT_INFO, &info_data(b"vol", &requests)));
    assert_eq!(e.size, VOL_BYTES);
    assert_eq!(e.flags & HAS_FLAGS, HAS_FLAGS, "NBD_FLAG_HAS_FLAGS MUST always be 1");
    let (min, preferred, max) = e.block.expect("block size asked for");
    assert!(min.is_power_of_two() && min <= 65536, "minimum block {min}");
    assert!(preferred.is_power_of_two() && preferred >= min.max(512), "preferred block {preferred}");
    assert!(max >= preferred, "maximum payload {max}");
    assert_eq!(e.size % u64::from(min), 0, "export size a multiple of the minimum block");
    // Still negotiating: the same INFO again, then GO with the same parameters gives the
    // same information (MUST, with no option in between).
    let again = infos(&c.ask(OPT_INFO, &info_data(b"vol", &requests)));
    let going = infos(&c.ask(OPT_GO, &info_data(b"vol", &requests)));
    assert_eq!((again.size, again.flags, again.block), (going.size, going.flags, going.block));
}

/// "Transmission flags": NBD_FLAG_SEND_DF MUST be clear without structured replies;
/// NBD_FLAG_SEND_FAST_ZERO MUST be clear without NBD_FLAG_SEND_WRITE_ZEROES; READ_ONLY marks
/// the read-only export.
#[test]
fn opt_go_transmission_flags_follow_the_rules() {
    let (_t, addr, _d) = start();
    for (export, ro) in [("vol", false), ("ro", true), ("file", false)] {
        for structured in [false, true] {
            let s = go(&addr, export, structured, false);
            let f = s.e.flags;
            assert_eq!(f & HAS_FLAGS, HAS_FLAGS);
            assert_eq!(f & T_READ_ONLY != 0, ro, "{export}: READ_ONLY");
            if !structured {
                assert_eq!(f & SEND_DF, 0, "{export}: SEND_DF without structured replies");
            }
            if f & SEND_WRITE_ZEROES == 0 {
                assert_eq!(f & SEND_FAST_ZERO, 0, "{export}: SEND_FAST_ZERO without SEND_WRITE_ZEROES");
            }
        }
    }
}

/// "NBD_OPT_GO": after the ACK the server MUST NOT send zero padding, whether or not
/// NO_ZEROES was negotiated.
#[test]
fn opt_go_enters_transmission_without_padding() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::handshake(&addr, FIXED_NEWSTYLE);
    infos(&c.ask(OPT_GO, &info_data(b"vol", &[])));
    assert_eq!(c.write(1, 0, &[6; 512]), 0);
    assert_eq!(c.read(2, 0, 512), vec![6; 512]);
}

/// "NBD_OPT_INFO and NBD_OPT_GO": an empty name is the default export (the first one, by
/// docs/NBD.md).
#[test]
fn opt_go_with_an_empty_name_selects_the_default_export() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    let e = infos(&c.ask(OPT_GO, &info_data(b"", &[])));
    assert_eq!(e.size, VOL_BYTES);
    assert_eq!(c.write(1, 0, &[1; 512]), 0);
}

/// "NBD_OPT_ABORT": the server MUST reply with ACK (and SHOULD ignore data), then the session
/// ends.
#[test]
fn opt_abort_is_acked_then_the_connection_closes() {
    let (_t, addr, _d) = start();
    for data in [&b""[..], b"ignored"] {
        let mut c = Nbd::haggling(&addr);
        let r = c.ask(OPT_ABORT, data);
        assert_eq!((r.len(), r[0].kind), (1, REP_ACK), "ABORT with {} bytes of data", data.len());
        assert!(c.closed(), "the session ends after ABORT");
    }
}

/// Over-long option data: the option length lets the server skip what it will not read
/// ("Newstyle negotiation"), answering ERR_TOO_BIG ("the request is too large to process")
/// or the option's usual error; negotiation goes on in step.
#[test]
fn opt_over_long_option_data_is_refused_and_skipped() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    let big = vec![0x5A; 100 << 10];
    let r = c.final_reply(0x4242, &big);
    assert!(matches!(r, REP_ERR_TOO_BIG | REP_ERR_UNSUP), "unknown option with 100 KiB: {r:#x}");
    let r = c.final_reply(OPT_LIST, &big);
    assert!(matches!(r, REP_ERR_TOO_BIG | REP_ERR_INVALID), "LIST with 100 KiB: {r:#x}");
    let r = c.final_reply(OPT_GO, &info_data(&big, &[]));
    assert!(
        matches!(r, REP_ERR_TOO_BIG | REP_ERR_INVALID | REP_ERR_UNKNOWN),
        "GO with a 100 KiB name: {r:#x}"
    );
    c.still_haggling();
    infos(&c.ask(OPT_GO, &info_data(b"vol", &[])));
    assert_eq!(c.read(1, 0, 512), vec![0; 512]);
}

/// "NBD_OPT_SET_META_CONTEXT": MUST NOT be requested before structured replies; the server
/// SHOULD answer ERR_INVALID.
#[test]
fn opt_set_meta_context_before_structured_replies_is_err_invalid() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    let r = c.ask(OPT_SET_META_CONTEXT, &meta_data("vol", &["base:allocation"]));
    assert_eq!((r.len(), r[0].kind), (1, REP_ERR_INVALID), "{r:?}");
    c.still_haggling();
}

/// "NBD_OPT_LIST_META_CONTEXT": a syntactically invalid request MUST fail with ERR_INVALID;
/// query strings of an unknown namespace MUST be ignored (a lone ACK when nothing matches);
/// zero queries list every context.
#[test]
fn opt_meta_context_requests_follow_the_rules() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    assert_eq!(c.final_reply(OPT_STRUCTURED_REPLY, &[]), REP_ACK);
    let good = meta_data("vol", &["base:allocation"]);
    let mut overrun = good.clone();
    let at = overrun.len() - "base:allocation".len() - 4;
    overrun[at..at + 4].copy_from_slice(&100u32.to_be_bytes());
    let mut miscounted = good.clone();
    miscounted[7..11].copy_from_slice(&2u32.to_be_bytes());
    let mut trailing = good.clone();
    trailing.push(0);
    let mut name_overrun = good.clone();
    name_overrun[..4].copy_from_slice(&1000u32.to_be_bytes());
    for option in [OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT] {
        for (what, data) in [
            ("a query longer than the option", &overrun),
            ("more queries counted than sent", &miscounted),
            ("a byte after the queries", &trailing),
            ("a name longer than the option", &name_overrun),
            ("no data", &Vec::new()),
        ] {
            let r = c.ask(option, data);
            assert_eq!((r.len(), r[0].kind), (1, REP_ERR_INVALID), "option {option} with {what}: {r:?}");
        }
        let r = c.ask(option, &meta_data("vol", &["x-nobody:thing"]));
        assert_eq!((r.len(), r[0].kind), (1, REP_ACK), "option {option}, unknown namespace: {r:?}");
    }
    // "The base: metadata namespace": an unknown leaf MUST be ignored, and "base:" MUST be
    // ignored by SET but listed as a wildcard by LIST.
    for option in [OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT] {
        let r = c.ask(option, &meta_data("vol", &["base:no-such-leaf"]));
        assert_eq!((r.len(), r[0].kind), (1, REP_ACK), "option {option}, unknown base: leaf: {r:?}");
    }
    let r = c.ask(OPT_SET_META_CONTEXT, &meta_data("vol", &["base:"]));
    assert_eq!((r.len(), r[0].kind), (1, REP_ACK), "SET with the base: wildcard: {r:?}");
    for queries in [&[][..], &["base:"][..]] {
        let r = c.ask(OPT_LIST_META_CONTEXT, &meta_data("vol", queries));
        let names: Vec<&[u8]> =
            r.iter().filter(|r| r.kind == REP_META_CONTEXT).map(|r| &r.data[4..]).collect();
        assert!(names.contains(&&b"base:allocation"[..]), "LIST with {queries:?}: {r:?}");
        assert_eq!(r.last().unwrap().kind, REP_ACK);
    }
}

/// "Fixed newstyle negotiation": a repeated state-changing option MAY fail with ERR_INVALID;
/// either way negotiation goes on.
#[test]
fn opt_a_repeated_structured_reply_is_acked_or_invalid() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    assert_eq!(c.final_reply(OPT_STRUCTURED_REPLY, &[]), REP_ACK);
    let r = c.final_reply(OPT_STRUCTURED_REPLY, &[]);
    assert!(matches!(r, REP_ACK | REP_ERR_INVALID), "{r:#x}");
    c.still_haggling();
}

/// A bad option magic breaks a MUST; the server MAY hard-disconnect, and docs/NBD.md says it
/// does.
#[test]
fn opt_a_bad_option_magic_closes_the_connection() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    let mut o = 0x1122_3344_5566_7788u64.to_be_bytes().to_vec();
    o.extend_from_slice(&OPT_LIST.to_be_bytes());
    o.extend_from_slice(&0u32.to_be_bytes());
    c.send(&o);
    assert!(c.closed());
}

/// "NBD_OPT_GO": after a successful GO the client MUST NOT send options. One sent anyway is a
/// request with a bad magic in the transmission phase, and the connection closes.
#[test]
fn opt_an_option_after_go_closes_the_connection() {
    let (_t, addr, _d) = start();
    let mut c = Nbd::haggling(&addr);
    infos(&c.ask(OPT_GO, &info_data(b"vol", &[])));
    c.option(OPT_LIST, &[0; 12]);
    assert!(c.closed());
}

// ---------------------------------------------------------------------------------------------
// Transmission.

/// "Transmission": the server MUST echo the cookie, treating it as opaque; replies may come
/// in any order.
#[test]
fn tx_cookies_are_echoed_whatever_their_value() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", false, false);
    let cookies = [0u64, 1, u64::MAX, 0x8000_0000_0000_0000, 0xDEAD_BEEF_CAFE_F00D, 7];
    for (i, &cookie) in cookies.iter().enumerate() {
        s.c.request(WRITE, 0, cookie, i as u64 * 512, 512, &pattern(i as u8, 512));
    }
    let mut seen: Vec<u64> = (0..cookies.len())
        .map(|_| match s.c.reply() {
            Reply::Simple { error: 0, cookie } => cookie,
            _ => panic!("a WRITE failed"),
        })
        .collect();
    seen.sort_unstable();
    let mut want = cookies.to_vec();
    want.sort_unstable();
    assert_eq!(seen, want);
    // Reads pipelined: each reply's data belongs to its cookie.
    for (i, &cookie) in cookies.iter().enumerate() {
        s.c.request(READ, 0, cookie, i as u64 * 512, 512, &[]);
    }
    let by_cookie: HashMap<u64, usize> = cookies.iter().enumerate().map(|(i, &c)| (c, i)).collect();
    for _ in 0..cookies.len() {
        let Reply::Simple { error: 0, cookie } = s.c.reply() else { panic!("a READ failed") };
        let i = by_cookie[&cookie];
        assert_eq!(s.c.take(512), pattern(i as u8, 512), "data of cookie {cookie:#x}");
    }
}

/// "Error values": the server SHOULD return EINVAL for a flag not documented as applicable to
/// the request. A refused WRITE's payload is still consumed.
#[test]
fn tx_flags_that_do_not_apply_to_the_command_are_einval() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", false, false);
    let cases = [
        (READ, F_NO_HOLE),
        (READ, F_REQ_ONE),
        (READ, F_FAST_ZERO),
        (READ, 1 << 6),
        (WRITE, F_DF),
        (WRITE, F_NO_HOLE),
        (WRITE, F_REQ_ONE | F_FAST_ZERO),
        (FLUSH, F_NO_HOLE),
        (TRIM, F_DF),
        (TRIM, F_FAST_ZERO),
        (WRITE_ZEROES, F_DF),
        (WRITE_ZEROES, F_REQ_ONE),
    ];
    for (i, (cmd, flags)) in cases.into_iter().enumerate() {
        let (offset, len) = if cmd == FLUSH { (0, 0) } else { (0, 4096) };
        let payload = if cmd == WRITE { vec![0xEE; 4096] } else { vec![] };
        assert_eq!(
            s.c.call(cmd, flags, i as u64, offset, len, &payload),
            EINVAL,
            "command {cmd} flags {flags:#x}"
        );
    }
    assert_eq!(s.c.read(99, 0, 4096), vec![0; 4096], "refused requests changed nothing");
}

/// "Command flags": NBD_CMD_FLAG_DF MUST NOT be set unless NBD_FLAG_SEND_DF was, which needs
/// structured replies; docs/NBD.md answers a flag the session did not negotiate with EINVAL.
#[test]
fn tx_df_without_structured_replies_is_einval() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", false, false);
    assert_eq!(s.e.flags & SEND_DF, 0);
    assert_eq!(s.c.call(READ, F_DF, 1, 0, 512, &[]), EINVAL);
    assert_eq!(s.c.read(2, 0, 512).len(), 512);
}

/// "Command flags": with NBD_FLAG_SEND_FUA the server MUST accept NBD_CMD_FLAG_FUA on every
/// command (even by ignoring it).
#[test]
fn tx_fua_is_accepted_on_every_command() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", false, false);
    assert_eq!(s.e.flags & SEND_FUA, SEND_FUA);
    assert_eq!(s.c.call(WRITE, F_FUA, 1, 0, 512, &[3; 512]), 0, "WRITE");
    s.c.request(READ, F_FUA, 2, 0, 512, &[]);
    let Reply::Simple { error, .. } = s.c.reply() else { panic!("a chunk without structured replies") };
    assert_eq!(error, 0, "READ");
    assert_eq!(s.c.take(512), vec![3; 512]);
    assert_eq!(s.c.call(FLUSH, F_FUA, 3, 0, 0, &[]), 0, "FLUSH");
    assert_eq!(s.c.call(TRIM, F_FUA, 4, 4096, 4096, &[]), 0, "TRIM");
    assert_eq!(s.c.call(WRITE_ZEROES, F_FUA, 5, 8192, 4096, &[]), 0, "WRITE_ZEROES");
    if s.e.flags & SEND_CACHE != 0 {
        assert_eq!(s.c.call(CACHE, F_FUA, 6, 0, 4096, &[]), 0, "CACHE");
    }
}

/// "Error values": TRIM past the end SHOULD be EINVAL, WRITE_ZEROES past the end ENOSPC
/// ("NBD_CMD_WRITE_ZEROES"), CACHE past the end EINVAL (docs/NBD.md).
#[test]
fn tx_trim_write_zeroes_and_cache_past_the_end() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", false, false);
    let end = s.e.size;
    assert_eq!(s.c.call(TRIM, 0, 1, end - 512, 1024, &[]), EINVAL, "TRIM");
    assert_eq!(s.c.call(TRIM, 0, 2, end, 512, &[]), EINVAL, "TRIM at the end");
    assert_eq!(s.c.call(WRITE_ZEROES, 0, 3, end - 512, 1024, &[]), ENOSPC, "WRITE_ZEROES");
    assert_eq!(s.c.call(WRITE_ZEROES, 0, 4, u64::MAX - 511, 512, &[]), ENOSPC, "WRITE_ZEROES overflowing");
    assert_eq!(s.c.call(CACHE, 0, 5, end, 512, &[]), EINVAL, "CACHE");
    assert_eq!(s.c.call(WRITE, 0, 6, u64::MAX - 511, 512, &[1; 512]), ENOSPC, "WRITE overflowing");
    assert_eq!(s.c.read(7, end - 512, 512).len(), 512);
}

/// "Size constraints": requests not aligned to the minimum block size SHOULD get EINVAL; a
/// refused WRITE's payload is consumed.
#[test]
fn tx_misaligned_writes_trims_and_zeroes_are_einval() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", false, false);
    let (min, _, _) = s.e.block.unwrap();
    assert!(min > 1);
    assert_eq!(s.c.call(WRITE, 0, 1, 1, min, &vec![9; min as usize]), EINVAL, "WRITE offset");
    assert_eq!(s.c.call(WRITE, 0, 2, 0, min + 1, &vec![9; min as usize + 1]), EINVAL, "WRITE length");
    assert_eq!(s.c.call(TRIM, 0, 3, 1, min, &[]), EINVAL, "TRIM");
    assert_eq!(s.c.call(WRITE_ZEROES, 0, 4, 0, min / 2, &[]), EINVAL, "WRITE_ZEROES");
    assert_eq!(s.c.read(5, 0, 4096), vec![0; 4096]);
}

/// "Error values": the server SHOULD return EPERM for a write or trim on a read-only export,
/// and for WRITE_ZEROES ("NBD_CMD_WRITE_ZEROES"), whether or not it advertised the command.
#[test]
fn tx_changes_to_a_read_only_export_are_eperm() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "ro", false, false);
    assert_eq!(s.e.flags & T_READ_ONLY, T_READ_ONLY);
    assert_eq!(s.c.call(TRIM, 0, 1, 0, 4096, &[]), EPERM, "TRIM");
    assert_eq!(s.c.call(WRITE_ZEROES, 0, 2, 0, 4096, &[]), EPERM, "WRITE_ZEROES");
    assert_eq!(s.c.call(WRITE, F_FUA, 3, 0, 512, &[1; 512]), EPERM, "WRITE with FUA");
    assert_eq!(s.c.read(4, 0, 512), vec![0; 512]);
    if s.e.flags & SEND_FLUSH != 0 {
        assert_eq!(s.c.call(FLUSH, 0, 5, 0, 0, &[]), 0, "FLUSH is not a write");
    }
}

/// TRIM and WRITE_ZEROES where the export does not advertise them: the client MUST NOT send
/// them; the server refuses them cleanly and SHOULD NOT use ENOTSUP ("Error values").
#[test]
fn tx_trim_and_write_zeroes_not_advertised_are_refused_cleanly() {
    let (_t, addr, _d) = start();
    let mut checked = 0;
    for export in ["vol", "ro", "file"] {
        let mut s = go(&addr, export, false, false);
        for (cookie, cmd, flag) in [(1, TRIM, SEND_TRIM), (2, WRITE_ZEROES, SEND_WRITE_ZEROES)] {
            if s.e.flags & flag != 0 {
                continue;
            }
            checked += 1;
            let e = s.c.call(cmd, 0, cookie, 0, 4096, &[]);
            assert!(matches!(e, EINVAL | EPERM), "{export}: command {cmd} not advertised: error {e}");
        }
        assert_eq!(s.c.read(3, 0, 512).len(), 512);
    }
    assert!(checked > 0, "every export advertises TRIM and WRITE_ZEROES: nothing checked");
}

/// "NBD_CMD_WRITE_ZEROES": without NBD_FLAG_SEND_FAST_ZERO the server SHOULD fail a request
/// with NBD_CMD_FLAG_FAST_ZERO with EINVAL, not ENOTSUP.
#[test]
fn tx_fast_zero_not_advertised_is_einval() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "file", false, false);
    assert_eq!(s.e.flags & SEND_WRITE_ZEROES, SEND_WRITE_ZEROES);
    assert_eq!(s.e.flags & SEND_FAST_ZERO, 0, "docs/NBD.md: no FAST_ZERO for files");
    assert_eq!(s.c.write(1, 0, &[7; 4096]), 0);
    assert_eq!(s.c.call(WRITE_ZEROES, F_FAST_ZERO, 2, 0, 4096, &[]), EINVAL);
    assert_eq!(s.c.read(3, 0, 4096), vec![7; 4096], "the refused request changed nothing");
}

/// "NBD_CMD_WRITE_ZEROES": with NBD_FLAG_SEND_FAST_ZERO a fast request succeeds or fails
/// with ENOTSUP, leaving the data alone on ENOTSUP; without the flag it MUST NOT fail with
/// ENOTSUP. NO_HOLE MUST be supported when WRITE_ZEROES is advertised.
#[test]
fn tx_write_zeroes_with_fast_zero_and_no_hole() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", false, false);
    assert_eq!(s.e.flags & (SEND_WRITE_ZEROES | SEND_FAST_ZERO), SEND_WRITE_ZEROES | SEND_FAST_ZERO);
    assert_eq!(s.c.write(1, 0, &[7; 16384]), 0);
    let fast = s.c.call(WRITE_ZEROES, F_FAST_ZERO, 2, 0, 4096, &[]);
    let back = s.c.read(3, 0, 4096);
    match fast {
        0 => assert_eq!(back, vec![0; 4096]),
        ENOTSUP => assert_eq!(back, vec![7; 4096], "ENOTSUP SHOULD NOT alter the export"),
        e => panic!("fast zero: error {e}"),
    }
    assert_eq!(s.c.call(WRITE_ZEROES, F_NO_HOLE, 4, 4096, 4096, &[]), 0, "NO_HOLE");
    let e = s.c.call(WRITE_ZEROES, F_NO_HOLE | F_FAST_ZERO, 5, 8192, 4096, &[]);
    assert!(matches!(e, 0 | ENOTSUP), "fast zero with NO_HOLE: error {e}");
    assert_eq!(s.c.call(WRITE_ZEROES, 0, 6, 12288, 4096, &[]), 0, "plain WRITE_ZEROES");
    assert_eq!(s.c.read(7, 4096, 4096), vec![0; 4096]);
    assert_eq!(s.c.read(8, 12288, 4096), vec![0; 4096]);
}

/// "Size constraints": TRIM and WRITE_ZEROES may cover more than the maximum payload; the
/// server SHOULD NOT disconnect (it MAY answer EOVERFLOW or EINVAL), and with FAST_ZERO
/// SHOULD NOT answer EOVERFLOW.
#[test]
fn tx_trim_and_write_zeroes_over_the_maximum_payload_do_not_disconnect() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", false, false);
    let (_, _, max) = s.e.block.unwrap();
    let len = (2 * u64::from(max)).min(VOL_BYTES) as u32;
    for (cookie, cmd, flags) in [(1, WRITE_ZEROES, 0), (2, TRIM, 0), (3, WRITE_ZEROES, F_NO_HOLE)] {
        let e = s.c.call(cmd, flags, cookie, 0, len, &[]);
        assert!(matches!(e, 0 | EOVERFLOW | EINVAL), "command {cmd} of {len} bytes: {e}");
    }
    let e = s.c.call(WRITE_ZEROES, F_FAST_ZERO, 4, 0, len, &[]);
    assert!(matches!(e, 0 | ENOTSUP), "fast zero of {len} bytes: {e}");
    assert_eq!(s.c.read(5, 0, 512).len(), 512, "still connected");
}

/// "Request types": a length of 0 is unspecified, but the server SHOULD NOT disconnect.
#[test]
fn tx_zero_length_requests_do_not_disconnect() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", false, false);
    for (cookie, cmd) in [(1, WRITE), (2, TRIM), (3, WRITE_ZEROES), (4, CACHE)] {
        let _ = s.c.call(cmd, 0, cookie, 0, 0, &[]);
    }
    s.c.request(READ, 0, 5, 0, 0, &[]);
    assert!(matches!(s.c.reply(), Reply::Simple { cookie: 5, .. }));
    assert_eq!(s.c.read(6, 0, 512).len(), 512, "still connected");
}

/// FLUSH's offset and length MUST be zero ("NBD_CMD_FLUSH"); docs/NBD.md refuses others with
/// EINVAL.
#[test]
fn tx_flush_with_an_offset_or_length_is_einval() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", false, false);
    assert_eq!(s.c.call(FLUSH, 0, 1, 0, 0, &[]), 0);
    assert_eq!(s.c.call(FLUSH, 0, 2, 512, 0, &[]), EINVAL);
    assert_eq!(s.c.call(FLUSH, 0, 3, 0, 512, &[]), EINVAL);
}

/// "Error values": an unknown command SHOULD be EINVAL; "NBD_CMD_CACHE": an advertised CACHE
/// MUST reject flags it does not recognize. With structured replies too.
#[test]
fn tx_unknown_commands_and_cache_flags_are_einval() {
    let (_t, addr, _d) = start();
    for structured in [false, true] {
        let mut s = go(&addr, "vol", structured, false);
        assert_eq!(s.c.call(8, 0, 1, 0, 512, &[]), EINVAL, "RESIZE, not negotiated");
        assert_eq!(s.c.call(0xFFFF, 0, 2, 0, 0, &[]), EINVAL, "command 0xffff");
        if s.e.flags & SEND_CACHE != 0 {
            assert_eq!(s.c.call(CACHE, 1 << 15, 3, 0, 512, &[]), EINVAL, "CACHE with an unknown flag");
            assert_eq!(s.c.call(CACHE, F_DF, 4, 0, 512, &[]), EINVAL, "CACHE with DF");
            assert_eq!(s.c.call(CACHE, 0, 5, 0, 512, &[]), 0, "CACHE");
        }
    }
}

/// Structured READ replies ("Structured reply chunk message", "NBD_CMD_READ"): content chunks
/// cover exactly the request, without overlap or data outside it, the last chunk is DONE,
/// and no chunk's data exceeds the maximum payload.
#[test]
fn tx_structured_read_covers_the_range_exactly() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", true, false);
    let (_, _, max) = s.e.block.unwrap();
    let data = pattern(8, 64 << 10);
    assert_eq!(s.c.write(1, 128 << 10, &data), 0);
    for (cookie, offset, len) in [(2u64, 128u64 << 10, 64u32 << 10), (3, 0, max), (4, 128 << 10, 512)] {
        s.c.request(READ, 0, cookie, offset, len, &[]);
        let chunks = s.c.structured(cookie);
        let mut got = vec![None; len as usize];
        for c in &chunks {
            assert!(!c.is_error(), "READ at {offset}: {c:?}");
            let (at, bytes) = match c.kind {
                CHUNK_OFFSET_DATA => {
                    assert!(c.payload.len() >= 9, "OFFSET_DATA length MUST be at least 9");
                    assert!(c.payload.len() - 8 <= max as usize, "chunk data over the maximum payload");
                    (be64(&c.payload), c.payload[8..].to_vec())
                }
                CHUNK_OFFSET_HOLE => {
                    assert_eq!(c.payload.len(), 12, "OFFSET_HOLE length MUST be 12");
                    let n = be32(&c.payload[8..]);
                    assert_ne!(n, 0, "hole size MUST be nonzero");
                    (be64(&c.payload), vec![0; n as usize])
                }
                CHUNK_NONE => continue,
                other => panic!("chunk type {other} in a READ reply"),
            };
            assert!(
                at >= offset && at + bytes.len() as u64 <= offset + u64::from(len),
                "chunk outside the request"
            );
            for (i, b) in bytes.into_iter().enumerate() {
                let slot = &mut got[(at - offset) as usize + i];
                assert!(slot.is_none(), "overlapping content chunks");
                *slot = Some(b);
            }
        }
        let got: Vec<u8> = got.into_iter().map(|b| b.expect("a byte no chunk covered")).collect();
        let want: Vec<u8> = (offset..offset + u64::from(len))
            .map(|o| if (128 << 10..192 << 10).contains(&o) { data[(o - (128 << 10)) as usize] } else { 0 })
            .collect();
        assert!(got == want, "READ at {offset} of {len} bytes returned the wrong data");
    }
}

/// "Structured reply chunk message": with structured replies a READ error MUST be a
/// structured reply, even an early EINVAL for bad flags, using an error chunk with a nonzero
/// error.
#[test]
fn tx_structured_read_errors_are_error_chunks() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", true, false);
    let end = s.e.size;
    let (_, _, max) = s.e.block.unwrap();
    for (cookie, flags, offset, len) in
        [(1u64, 0u16, end, 512u32), (2, 0, 100, 512), (3, F_NO_HOLE, 0, 512), (4, 1 << 15, 0, 512)]
    {
        s.c.request(READ, flags, cookie, offset, len, &[]);
        let chunks = s.c.structured(cookie);
        let errors: Vec<u32> = chunks.iter().filter(|c| c.is_error()).map(Chunk::error).collect();
        assert_eq!(errors, [EINVAL], "READ {cookie}: {chunks:?}");
        assert!(
            chunks.iter().all(|c| c.is_error() || c.kind == CHUNK_NONE),
            "no content chunk for a refused READ: {chunks:?}"
        );
    }
    // Over the maximum payload the spec also allows EOVERFLOW up front.
    s.c.request(READ, 0, 5, 0, max + 512, &[]);
    let chunks = s.c.structured(5);
    let errors: Vec<u32> = chunks.iter().filter(|c| c.is_error()).map(Chunk::error).collect();
    assert!(errors == [EINVAL] || errors == [EOVERFLOW], "READ over the maximum payload: {chunks:?}");
    assert_eq!(s.c.call(WRITE, 0, 6, end, 512, &[0; 512]), ENOSPC, "WRITE past the end, simple or chunk");
}

/// "NBD_CMD_READ" with NBD_CMD_FLAG_DF: at most one content chunk, OFFSET_DATA when the area
/// mixes data and a hole, and unfragmented reads of up to 65,536 bytes MUST be supported.
#[test]
fn tx_df_reads_come_in_one_chunk() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", true, false);
    assert_eq!(s.e.flags & SEND_DF, SEND_DF, "DF advertised with structured replies");
    assert_eq!(s.c.write(1, 1 << 20, &[4; 4096]), 0);
    s.c.request(READ, F_DF, 2, 1 << 20, 65536, &[]);
    let chunks = s.c.structured(2);
    let content: Vec<&Chunk> =
        chunks.iter().filter(|c| c.kind == CHUNK_OFFSET_DATA || c.kind == CHUNK_OFFSET_HOLE).collect();
    assert_eq!(content.len(), 1, "{chunks:?}");
    assert_eq!(content[0].kind, CHUNK_OFFSET_DATA);
    assert_eq!(be64(&content[0].payload), 1 << 20);
    let data = &content[0].payload[8..];
    assert_eq!(data.len(), 65536);
    assert!(data[..4096].iter().all(|&b| b == 4) && data[4096..].iter().all(|&b| b == 0));
}

/// "NBD_CMD_BLOCK_STATUS": exactly one BLOCK_STATUS chunk per selected context, with
/// nonzero extent lengths, the first n-1 summing to less than the request; REQ_ONE gives one
/// extent no longer than the request; past the end SHOULD be EINVAL.
#[test]
fn tx_block_status_follows_the_rules() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", true, true);
    let id = s.context.unwrap();
    assert_eq!(s.c.write(1, 8192, &[1; 4096]), 0);
    for (cookie, flags, offset, len) in
        [(2u64, 0u16, 0u64, 65536u32), (3, F_REQ_ONE, 0, 65536), (4, F_REQ_ONE, 8192, 512)]
    {
        s.c.request(BLOCK_STATUS, flags, cookie, offset, len, &[]);
        let chunks = s.c.structured(cookie);
        let status: Vec<&Chunk> = chunks.iter().filter(|c| c.kind == CHUNK_BLOCK_STATUS).collect();
        assert_eq!(status.len(), 1, "one chunk per context: {chunks:?}");
        assert!(chunks.iter().all(|c| c.kind == CHUNK_BLOCK_STATUS || c.kind == CHUNK_NONE), "{chunks:?}");
        let p = &status[0].payload;
        assert!(
            p.len() >= 12 && (p.len() - 4).is_multiple_of(8),
            "BLOCK_STATUS length MUST be 4 + 8n, n > 0"
        );
        assert_eq!(be32(p), id, "context id");
        let extents: Vec<u32> = p[4..].chunks(8).map(be32).collect();
        let states: Vec<u32> = p[4..].chunks(8).map(|d| be32(&d[4..])).collect();
        assert!(extents.iter().all(|&l| l > 0), "extent lengths MUST be nonzero");
        assert!(
            states.iter().all(|&f| f & !(STATE_HOLE | STATE_ZERO) == 0),
            "reserved state bits: {states:?}"
        );
        // NBD_STATE_ZERO means the extent reads as zeroes: never so where data was written.
        let mut at = offset;
        for (&l, &f) in extents.iter().zip(&states) {
            let written = at < 12288 && at + u64::from(l) > 8192;
            assert!(!(written && f & STATE_ZERO != 0), "written data reported as zeroes at {at}");
            at += u64::from(l);
        }
        let before_last: u64 = extents[..extents.len() - 1].iter().map(|&l| u64::from(l)).sum();
        assert!(before_last < u64::from(len), "extents before the last cover less than the request");
        if flags & F_REQ_ONE != 0 {
            assert_eq!(extents.len(), 1, "REQ_ONE: exactly one extent");
            assert!(extents[0] <= len, "REQ_ONE: extent no longer than the request");
        }
    }
    assert_eq!(s.c.call(BLOCK_STATUS, 0, 5, s.e.size, 512, &[]), EINVAL, "past the end");
    assert_eq!(s.c.call(BLOCK_STATUS, F_DF, 6, 0, 512, &[]), EINVAL, "a READ flag on BLOCK_STATUS");
}

/// "NBD_CMD_DISC": the server MUST handle all outstanding requests, then close; there is no
/// reply to DISC itself.
#[test]
fn tx_disc_finishes_outstanding_requests_then_closes() {
    let (_t, addr, _d) = start();
    let mut s = go(&addr, "vol", false, false);
    let mut burst = Vec::new();
    for (i, cookie) in [10u64, 11, 12].into_iter().enumerate() {
        burst.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        burst.extend_from_slice(&0u16.to_be_bytes());
        burst.extend_from_slice(&WRITE.to_be_bytes());
        burst.extend_from_slice(&cookie.to_be_bytes());
        burst.extend_from_slice(&(i as u64 * 4096).to_be_bytes());
        burst.extend_from_slice(&4096u32.to_be_bytes());
        burst.extend(pattern(cookie as u8, 4096));
    }
    s.c.send(&burst);
    s.c.request(DISC, 0, 13, 0, 0, &[]);
    let mut cookies: Vec<u64> = (0..3)
        .map(|_| match s.c.reply() {
            Reply::Simple { error: 0, cookie } => cookie,
            _ => panic!("a WRITE before DISC failed"),
        })
        .collect();
    cookies.sort_unstable();
    assert_eq!(cookies, [10, 11, 12]);
    assert!(s.c.closed(), "no reply to DISC, then the close");
    let mut other = go(&addr, "vol", false, false);
    for (i, cookie) in [10u64, 11, 12].into_iter().enumerate() {
        assert_eq!(other.c.read(cookie, i as u64 * 4096, 4096), pattern(cookie as u8, 4096));
    }
}

/// "Transmission flags", NBD_FLAG_CAN_MULTI_CONN: a FLUSH on one connection covers writes
/// completed on another, and the data is visible there.
#[test]
fn tx_multi_conn_flush_covers_other_connections() {
    let (_t, addr, _d) = start();
    let mut a = go(&addr, "vol", false, false);
    let mut b = go(&addr, "vol", false, false);
    assert_eq!(a.e.flags & CAN_MULTI_CONN, CAN_MULTI_CONN);
    assert_eq!(a.c.write(1, 65536, &pattern(2, 4096)), 0);
    assert_eq!(b.c.call(FLUSH, 0, 2, 0, 0, &[]), 0);
    assert_eq!(b.c.read(3, 65536, 4096), pattern(2, 4096));
}
