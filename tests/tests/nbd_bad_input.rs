//! Requests that real NBD clients refuse to send, through a raw socket: each gets the errno
//! the spec asks for, a refused write's payload is drained so the next request is understood,
//! and broken framing closes only its own connection.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use skiff_tests::start_nbd_target;

const EPERM: u32 = 1;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;
const READ: u16 = 0;
const WRITE: u16 = 1;
const DISC: u16 = 2;
const BLOCK_STATUS: u16 = 7;

/// A minimal fixed-newstyle client: EXPORT_NAME (or GO) with NO_ZEROES, simple replies.
struct RawNbd {
    s: TcpStream,
    size: u64,
}

impl RawNbd {
    /// Through `GO` asking for `NBD_INFO_BLOCK_SIZE`: a client that agrees to keep to the
    /// block sizes the target sends.
    fn connect_agreeing(addr: &str, export: &str) -> RawNbd {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).unwrap();
        s.write_all(&3u32.to_be_bytes()).unwrap();
        let mut data = (export.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&1u16.to_be_bytes());
        data.extend_from_slice(&3u16.to_be_bytes()); // NBD_INFO_BLOCK_SIZE
        let mut opt = 0x49484156454F5054u64.to_be_bytes().to_vec();
        opt.extend_from_slice(&7u32.to_be_bytes()); // GO
        opt.extend_from_slice(&(data.len() as u32).to_be_bytes());
        opt.extend_from_slice(&data);
        s.write_all(&opt).unwrap();
        let mut size = 0;
        loop {
            let mut head = [0u8; 20];
            s.read_exact(&mut head).unwrap();
            let kind = u32::from_be_bytes(head[12..16].try_into().unwrap());
            let mut body = vec![0u8; u32::from_be_bytes(head[16..20].try_into().unwrap()) as usize];
            s.read_exact(&mut body).unwrap();
            if kind == 3 && body[..2] == [0, 0] {
                size = u64::from_be_bytes(body[2..10].try_into().unwrap());
            }
            if kind == 1 {
                return RawNbd { s, size };
            }
            assert_eq!(kind, 3, "GO answered with an error");
        }
    }

    fn connect(addr: &str, export: &str) -> RawNbd {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        assert_eq!(u64::from_be_bytes(greeting[8..16].try_into().unwrap()), 0x49484156454F5054);
        s.write_all(&3u32.to_be_bytes()).unwrap(); // FIXED_NEWSTYLE | NO_ZEROES
        let mut opt = Vec::new();
        opt.extend_from_slice(&0x49484156454F5054u64.to_be_bytes());
        opt.extend_from_slice(&1u32.to_be_bytes()); // EXPORT_NAME
        opt.extend_from_slice(&(export.len() as u32).to_be_bytes());
        opt.extend_from_slice(export.as_bytes());
        s.write_all(&opt).unwrap();
        let mut reply = [0u8; 10];
        s.read_exact(&mut reply).unwrap();
        RawNbd { size: u64::from_be_bytes(reply[..8].try_into().unwrap()), s }
    }

    fn send(&mut self, cmd: u16, flags: u16, cookie: u64, offset: u64, len: u32, payload: &[u8]) {
        self.s.write_all(&skiff_tests::nbd_request(cmd, flags, cookie, offset, len, payload)).unwrap();
    }

    /// A simple reply: (cookie, error).
    fn reply(&mut self) -> (u64, u32) {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(u32::from_be_bytes(h[..4].try_into().unwrap()), 0x67446698, "simple reply magic");
        (u64::from_be_bytes(h[8..16].try_into().unwrap()), u32::from_be_bytes(h[4..8].try_into().unwrap()))
    }

    fn read(&mut self, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
        self.send(READ, 0, cookie, offset, len, &[]);
        assert_eq!(self.reply(), (cookie, 0));
        let mut data = vec![0; len as usize];
        self.s.read_exact(&mut data).unwrap();
        data
    }

    fn write(&mut self, cookie: u64, offset: u64, data: &[u8]) -> u32 {
        self.send(WRITE, 0, cookie, offset, data.len() as u32, data);
        let (c, err) = self.reply();
        assert_eq!(c, cookie);
        err
    }

    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0) | Err(_))
    }
}

#[test]
fn refused_requests_get_the_spec_errno_and_the_stream_stays_in_step() {
    let (_t, addr) = start_nbd_target(&["vol=ram:4M", "golden=ram:1M,ro"]);
    let mut c = RawNbd::connect_agreeing(&addr, "vol");
    assert_eq!(c.size, 4 << 20);
    assert_eq!(c.write(1, 0, &[0x5A; 4096]), 0);

    // Read past the end: EINVAL. Write past the end: ENOSPC, and its payload is drained.
    c.send(READ, 0, 2, 4 << 20, 4096, &[]);
    assert_eq!(c.reply(), (2, EINVAL));
    assert_eq!(c.write(3, (4 << 20) - 512, &[1; 4096]), ENOSPC);
    assert_eq!(c.read(4, 0, 4096), vec![0x5A; 4096], "the refused payload was not taken as a request");

    // Over the advertised maximum block size (1 MiB): EINVAL, payload drained.
    assert_eq!(c.write(5, 0, &vec![7; 2 << 20]), EINVAL);
    c.send(READ, 0, 6, 0, 2 << 20, &[]);
    assert_eq!(c.reply(), (6, EINVAL));
    assert_eq!(c.read(7, 0, 512), vec![0x5A; 512]);

    // Misaligned, unknown command, unknown flag, block status without a meta context.
    c.send(READ, 0, 8, 100, 512, &[]);
    assert_eq!(c.reply(), (8, EINVAL));
    c.send(99, 0, 9, 0, 512, &[]);
    assert_eq!(c.reply(), (9, EINVAL));
    c.send(READ, 0x8000, 10, 0, 512, &[]);
    assert_eq!(c.reply(), (10, EINVAL));
    c.send(BLOCK_STATUS, 0, 11, 0, 4096, &[]);
    assert_eq!(c.reply(), (11, EINVAL));
    assert_eq!(c.read(12, 0, 4096), vec![0x5A; 4096], "nothing was changed by refused requests");

    // DISC ends the connection cleanly.
    c.send(DISC, 0, 13, 0, 0, &[]);
    assert!(c.closed());
}

/// A client that never agreed to block sizes (`EXPORT_NAME`) has the spec's defaults: any
/// alignment, payloads up to 32 MiB; past that, `EINVAL`, and the payload is drained.
#[test]
fn a_client_without_block_sizes_has_the_spec_defaults() {
    let (_t, addr) = start_nbd_target(&["vol=ram:40M"]);
    let mut c = RawNbd::connect(&addr, "vol");
    let data: Vec<u8> = (0..(2 << 20) + 14).map(|i| (i % 251) as u8).collect();
    assert_eq!(c.write(1, 3, &data), 0, "2 MiB + 14 bytes at offset 3");
    assert_eq!(c.read(2, 3, data.len() as u32), data);
    assert_eq!(c.read(3, 100, 7), data[97..104]);
    assert_eq!(c.write(4, 0, &vec![9; (32 << 20) + 1]), EINVAL, "one byte past 32 MiB");
    assert_eq!(c.read(5, 3, 512), data[..512], "the refused payload was drained");
    assert_eq!(c.write(6, 1, &vec![8; 32 << 20]), 0, "32 MiB at offset 1");
    assert_eq!(c.read(7, (32 << 20) - 2, 4), [8, 8, 8, 0]);
}

#[test]
fn read_only_export_refuses_writes_with_eperm() {
    let (_t, addr) = start_nbd_target(&["vol=ram:4M", "golden=ram:1M,ro"]);
    let mut c = RawNbd::connect(&addr, "golden");
    assert_eq!(c.write(1, 0, &[1; 4096]), EPERM);
    assert_eq!(c.read(2, 0, 4096), vec![0; 4096]);
}

#[test]
fn broken_framing_closes_only_that_connection() {
    let (_t, addr) = start_nbd_target(&["vol=ram:4M"]);
    let mut good = RawNbd::connect(&addr, "vol");
    assert_eq!(good.write(1, 8192, &[3; 4096]), 0);

    let mut bad = RawNbd::connect(&addr, "vol");
    bad.s.write_all(&[0xFF; 28]).unwrap();
    assert!(bad.closed(), "a bad request magic closes the connection");

    // Garbage instead of a handshake.
    let mut junk = TcpStream::connect(&addr).unwrap();
    junk.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; 18];
    junk.read_exact(&mut greeting).unwrap();
    junk.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut rest = Vec::new();
    let _ = junk.read_to_end(&mut rest);

    assert_eq!(good.read(2, 8192, 4096), vec![3; 4096], "the neighbour is untouched");
    assert_eq!(good.write(3, 0, &[4; 512]), 0);
}
