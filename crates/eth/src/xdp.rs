//! Raw Ethernet frames through AF_XDP: the measured alternative to [`crate::packet`]'s
//! AF_PACKET rings under a raw-Ethernet session (`SKIFF_ETH_DRIVER=xdp`).
//!
//! An [`XdpSocket`] carries one session on one interface. It shares four rings and a region of
//! frame buffers (the UMEM) with the kernel:
//!
//! - **Receive.** An XDP program on the interface (one per interface, loaded by the first
//!   session of this process there and kept until the process exits: attaching and detaching
//!   XDP makes many NIC drivers reset their queues; it is attached through a BPF link, so it
//!   goes when the process does, even by a crash) looks at every frame
//!   the interface receives: a frame of skiff's EtherType whose session id is in its `sessions`
//!   map, arriving on the queue that map names, is redirected to that queue's socket in its
//!   `xsks` map; every other frame goes on to the kernel's stack as before (TCP, AF_PACKET
//!   listeners and sessions). The kernel copies a redirected frame into buffers this socket
//!   handed it through the fill ring, and posts their descriptors on the receive ring; a jumbo
//!   frame takes several buffers (multi-buffer AF_XDP, `XDP_USE_SG`), which
//!   [`XdpSocket::receive`] joins.
//! - **Transmit.** [`XdpSocket::queue_with`] writes a frame into a slot of consecutive buffers
//!   and posts its descriptors (several for a jumbo frame) on the transmit ring;
//!   [`XdpSocket::flush`] kicks the kernel with `sendto` until the ring is empty or the kernel
//!   stops taking descriptors; the completion ring gives the buffers back.
//!
//! An interface has one XDP program at a time: where another process (another skiff among
//! them) has one attached, attaching fails and sessions fall back to AF_PACKET.
//!
//! Only copy mode is used (`XDP_COPY`): veth has no zero-copy AF_XDP. And only interfaces with
//! one receive queue: a session's frames must arrive on the queue its socket is bound to, and on
//! a multi-queue NIC that takes flow-steering rules (by EtherType and session) this module does
//! not set. So one socket per interface per process can be bound at a time; a second session
//! on the interface gets an error and its caller falls back to AF_PACKET
//! (`eth::session` does, with one log line). docs/ETHERNET.md has the measurements.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::packet::{getsockopt, setsockopt, write_eth_header, Mac, ETHERTYPE, ETH_HEADER_LEN};

/// Bytes per UMEM buffer (the page size: aligned mode's largest).
const CHUNK: usize = 4096;
/// Buffers the kernel may fill with received frames, and descriptors per ring.
const RX_CHUNKS: usize = 512;
const RING_SIZE: u32 = 1024;
/// Frames the transmit side holds at once (each a slot of consecutive buffers).
const TX_SLOTS: usize = 64;

/// `bpf(2)` commands, map and program types, helpers and flags (linux/bpf.h).
mod sys {
    pub const BPF_MAP_CREATE: libc::c_long = 0;
    pub const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
    pub const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
    pub const BPF_PROG_LOAD: libc::c_long = 5;
    pub const BPF_LINK_CREATE: libc::c_long = 28;
    pub const BPF_MAP_TYPE_HASH: u32 = 1;
    pub const BPF_MAP_TYPE_XSKMAP: u32 = 17;
    pub const BPF_PROG_TYPE_XDP: u32 = 6;
    pub const BPF_XDP: u32 = 37;
    pub const BPF_F_XDP_HAS_FRAGS: u32 = 1 << 5;
    pub const BPF_FUNC_MAP_LOOKUP_ELEM: i32 = 1;
    pub const BPF_FUNC_REDIRECT_MAP: i32 = 51;
    pub const XDP_PASS: i32 = 2;
}

/// One eBPF instruction (`struct bpf_insn`): opcode, destination and source registers, offset,
/// immediate.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn { code, regs: (src << 4) | dst, off, imm }
}

/// The program, as the kernel's verifier reads it. `r1` holds the `xdp_md` context: `data` at
/// offset 0, `data_end` at 4, `rx_queue_index` at 16.
///
/// ```text
///     r6 = r1
///     r2 = ctx->data;  r3 = ctx->data_end
///     if r2 + 22 > r3: pass             (Ethernet header + the datagram's first 8 bytes)
///     if *(u16 *)(r2 + 12) != 0x88B5 (as a native load of the wire's bytes): pass
///     key = *(u32 *)(r2 + 18)           (the session id, as it is on the wire)
///     queue = sessions[key];  if none: pass
///     if *queue != ctx->rx_queue_index: pass
///     return bpf_redirect_map(xsks, ctx->rx_queue_index, XDP_PASS)
/// pass:
///     return XDP_PASS
/// ```
fn program(sessions_fd: RawFd, xsks_fd: RawFd) -> Vec<Insn> {
    const MOV_X: u8 = 0xbf;
    const MOV_K: u8 = 0xb7;
    const ADD_K: u8 = 0x07;
    const LDX_W: u8 = 0x61;
    const LDX_H: u8 = 0x69;
    const STX_W: u8 = 0x63;
    const JGT_X: u8 = 0x2d;
    const JNE_K: u8 = 0x55;
    const JEQ_K: u8 = 0x15;
    const JNE_X: u8 = 0x5d;
    const CALL: u8 = 0x85;
    const EXIT: u8 = 0x95;
    const LD_MAP: u8 = 0x18;
    const PSEUDO_MAP_FD: u8 = 1;
    // Jump offsets count instructions after the jump; `pass` is the last two.
    vec![
        insn(MOV_X, 6, 1, 0, 0),                                                       // 0
        insn(LDX_W, 2, 6, 0, 0),                                                       // 1
        insn(LDX_W, 3, 6, 4, 0),                                                       // 2
        insn(MOV_X, 4, 2, 0, 0),                                                       // 3
        insn(ADD_K, 4, 0, 0, 22),                                                      // 4
        insn(JGT_X, 4, 3, 19, 0),                                                      // 5 -> 25
        insn(LDX_H, 4, 2, 12, 0),                                                      // 6
        insn(JNE_K, 4, 0, 17, i32::from(u16::from_ne_bytes(ETHERTYPE.to_be_bytes()))), // 7 -> 25
        insn(LDX_W, 4, 2, 18, 0),                                                      // 8
        insn(STX_W, 10, 4, -4, 0),                                                     // 9
        insn(MOV_X, 2, 10, 0, 0),                                                      // 10
        insn(ADD_K, 2, 0, 0, -4),                                                      // 11
        insn(LD_MAP, 1, PSEUDO_MAP_FD, 0, sessions_fd),                                // 12
        insn(0, 0, 0, 0, 0),                                                           // 13
        insn(CALL, 0, 0, 0, sys::BPF_FUNC_MAP_LOOKUP_ELEM),                            // 14
        insn(JEQ_K, 0, 0, 9, 0),                                                       // 15 -> 25
        insn(LDX_W, 4, 0, 0, 0),                                                       // 16
        insn(LDX_W, 5, 6, 16, 0),                                                      // 17
        insn(JNE_X, 4, 5, 6, 0),                                                       // 18 -> 25
        insn(LD_MAP, 1, PSEUDO_MAP_FD, 0, xsks_fd),                                    // 19
        insn(0, 0, 0, 0, 0),                                                           // 20
        insn(MOV_X, 2, 5, 0, 0),                                                       // 21
        insn(MOV_K, 3, 0, 0, sys::XDP_PASS),                                           // 22
        insn(CALL, 0, 0, 0, sys::BPF_FUNC_REDIRECT_MAP),                               // 23
        insn(EXIT, 0, 0, 0, 0),                                                        // 24
        insn(MOV_K, 0, 0, 0, sys::XDP_PASS),                                           // 25: pass
        insn(EXIT, 0, 0, 0, 0),                                                        // 26
    ]
}

fn bpf(cmd: libc::c_long, attr: &mut [u64]) -> io::Result<RawFd> {
    // SAFETY: bpf(2) reads (and for some commands writes) `attr`, which lives for the call and
    // is as long as the size given.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), std::mem::size_of_val(attr)) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as RawFd)
}

fn owned(fd: RawFd) -> OwnedFd {
    // SAFETY: `fd` is a new descriptor from bpf(2) that nothing else owns.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// `union bpf_attr` for BPF_MAP_CREATE: map_type, key_size, value_size, max_entries (u32 each).
fn map_create(map_type: u32, key: u32, value: u32, entries: u32) -> io::Result<OwnedFd> {
    let mut attr = [0u64; 16];
    attr[0] = u64::from(map_type) | (u64::from(key) << 32);
    attr[1] = u64::from(value) | (u64::from(entries) << 32);
    bpf(sys::BPF_MAP_CREATE, &mut attr).map(owned)
}

/// BPF_MAP_UPDATE_ELEM / DELETE_ELEM: map_fd (u32, padded), key pointer, value pointer, flags.
fn map_update(map: &OwnedFd, key: &[u8; 4], value: &[u8; 4]) -> io::Result<()> {
    let mut attr = [0u64; 4];
    attr[0] = map.as_raw_fd() as u64;
    attr[1] = key.as_ptr() as u64;
    attr[2] = value.as_ptr() as u64;
    bpf(sys::BPF_MAP_UPDATE_ELEM, &mut attr).map(|_| ())
}

fn map_delete(map: &OwnedFd, key: &[u8; 4]) {
    let mut attr = [0u64; 4];
    attr[0] = map.as_raw_fd() as u64;
    attr[1] = key.as_ptr() as u64;
    let _ = bpf(sys::BPF_MAP_DELETE_ELEM, &mut attr);
}

/// This process's programs, by (network namespace inode, interface index).
type Attached = Mutex<HashMap<(u64, u32), Arc<Program>>>;

/// The XDP program attached to one interface, with its two maps. Detached when the process
/// exits (its BPF link closes).
struct Program {
    sessions: OwnedFd,
    xsks: OwnedFd,
    _prog: OwnedFd,
    _link: OwnedFd,
    /// Queue 0 has a socket bound.
    busy: AtomicBool,
}

impl Program {
    fn attach(ifindex: u32) -> io::Result<Program> {
        let sessions = map_create(sys::BPF_MAP_TYPE_HASH, 4, 4, 1024)?;
        let xsks = map_create(sys::BPF_MAP_TYPE_XSKMAP, 4, 4, 1)?;
        let code = program(sessions.as_raw_fd(), xsks.as_raw_fd());
        let license = c"Apache-2.0";
        let mut log = vec![0u8; 64 << 10];
        // BPF_PROG_LOAD: prog_type, insn_cnt, insns, license, log_level, log_size, log_buf,
        // kern_version, prog_flags.
        let mut attr = [0u64; 16];
        attr[0] = u64::from(sys::BPF_PROG_TYPE_XDP) | ((code.len() as u64) << 32);
        attr[1] = code.as_ptr() as u64;
        attr[2] = license.as_ptr() as u64;
        attr[3] = 1 | ((log.len() as u64) << 32);
        attr[4] = log.as_mut_ptr() as u64;
        attr[5] = u64::from(sys::BPF_F_XDP_HAS_FRAGS) << 32;
        let prog = bpf(sys::BPF_PROG_LOAD, &mut attr).map(owned).map_err(|e| {
            let text =
                String::from_utf8_lossy(&log[..log.iter().position(|&b| b == 0).unwrap_or(0)]).into_owned();
            io::Error::new(e.kind(), format!("loading the XDP program: {e}: {text}"))
        })?;
        // BPF_LINK_CREATE: prog_fd, target_ifindex, attach_type, flags.
        let mut attr = [0u64; 8];
        attr[0] = prog.as_raw_fd() as u64 | (u64::from(ifindex) << 32);
        attr[1] = u64::from(sys::BPF_XDP);
        let link = bpf(sys::BPF_LINK_CREATE, &mut attr)
            .map(owned)
            .map_err(|e| io::Error::new(e.kind(), format!("attaching the XDP program: {e}")))?;
        Ok(Program { sessions, xsks, _prog: prog, _link: link, busy: AtomicBool::new(false) })
    }

    /// This process's program on interface `ifindex` of the calling thread's network
    /// namespace, attached on first use and kept.
    fn on(ifindex: u32) -> io::Result<Arc<Program>> {
        static ATTACHED: OnceLock<Attached> = OnceLock::new();
        // Interface indices are per namespace: the namespace's inode tells them apart.
        let netns = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata("/proc/thread-self/ns/net")?);
        let mut attached = ATTACHED.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = attached.get(&(netns, ifindex)) {
            return Ok(p.clone());
        }
        let p = Arc::new(Program::attach(ifindex)?);
        attached.insert((netns, ifindex), p.clone());
        Ok(p)
    }
}

/// One of the four rings: producer and consumer indices (free-running) and `size` entries.
struct Ring {
    map: *mut u8,
    map_len: usize,
    producer: *const AtomicU32,
    consumer: *const AtomicU32,
    desc: *mut u8,
    size: u32,
}

impl Ring {
    fn map(fd: &OwnedFd, off: &libc::xdp_ring_offset, entry: usize, pgoff: u64) -> io::Result<Ring> {
        let map_len = off.desc as usize + RING_SIZE as usize * entry;
        // SAFETY: maps the ring the kernel set up on `fd` at `pgoff`, shared, read-write.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                pgoff as libc::off_t,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = map.cast::<u8>();
        // SAFETY: the offsets the kernel gave lie inside the mapping.
        unsafe {
            Ok(Ring {
                map: base,
                map_len,
                producer: base.add(off.producer as usize).cast(),
                consumer: base.add(off.consumer as usize).cast(),
                desc: base.add(off.desc as usize),
                size: RING_SIZE,
            })
        }
    }

    fn producer(&self) -> &AtomicU32 {
        // SAFETY: inside the mapping, aligned (the kernel's layout), alive as long as `self`.
        unsafe { &*self.producer }
    }

    fn consumer(&self) -> &AtomicU32 {
        // SAFETY: as `producer`.
        unsafe { &*self.consumer }
    }

    /// Entry `i` (taken modulo the size) as a `T`.
    fn entry<T>(&self, i: u32) -> *mut T {
        // SAFETY: `i & (size - 1)` is inside the ring's `size` entries of `T`.
        unsafe { self.desc.cast::<T>().add((i & (self.size - 1)) as usize) }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`.
        unsafe { libc::munmap(self.map.cast(), self.map_len) };
    }
}

/// An AF_XDP socket carrying one session on one interface.
pub struct XdpSocket {
    fd: OwnedFd,
    program: Arc<Program>,
    key: [u8; 4],
    umem: *mut u8,
    umem_len: usize,
    fill: Ring,
    completion: Ring,
    rx: Ring,
    tx: Ring,
    iface: String,
    mac: Mac,
    mtu: usize,
    /// Where the transmit slots start in the UMEM, how many buffers each spans, the free ones,
    /// and the descriptors of each slot still in the kernel's hands.
    tx_base: u64,
    slot_chunks: usize,
    tx_free: VecDeque<usize>,
    tx_pending: Vec<u32>,
    tx_queued: u32,
    /// A jumbo frame being joined from its buffers; or one being dropped, up to its last.
    joined: Vec<u8>,
    skipping: bool,
}

// SAFETY: the rings and the UMEM are owned by this value alone; moving it moves all access.
unsafe impl Send for XdpSocket {}

impl XdpSocket {
    /// A socket on `ifname`'s queue 0 for session `session_id`: frames of that session arrive
    /// here, every other frame as before. Needs CAP_NET_ADMIN and CAP_BPF (root), and an
    /// interface with one receive queue that no other socket of this process is bound to.
    pub fn open(ifname: &str, session_id: u32) -> io::Result<XdpSocket> {
        let query = crate::packet::query_socket()?;
        let (ifindex, mtu, mac) = crate::packet::interface_on(&query, ifname)?;
        let queues = crate::packet::rx_queues(&query, ifname)?;
        if queues != 1 {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{ifname} has {queues} receive queues: AF_XDP here needs one (nothing steers a session's frames to its queue)"),
            ));
        }
        let program = Program::on(ifindex as u32)?;
        if program.busy.swap(true, Ordering::AcqRel) {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{ifname}: queue 0 already has this process's AF_XDP socket"),
            ));
        }
        let socket = XdpSocket::bind(ifname, ifindex as u32, mtu, mac, session_id, program.clone());
        if socket.is_err() {
            program.busy.store(false, Ordering::Release);
        }
        socket
    }

    fn bind(
        ifname: &str,
        ifindex: u32,
        mtu: usize,
        mac: Mac,
        session_id: u32,
        program: Arc<Program>,
    ) -> io::Result<XdpSocket> {
        // SAFETY: plain socket(2); owned below.
        let raw = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("AF_XDP socket: {e}")));
        }
        // SAFETY: a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let slot_chunks = (ETH_HEADER_LEN + mtu).div_ceil(CHUNK);
        let umem_len = (RX_CHUNKS + TX_SLOTS * slot_chunks) * CHUNK;
        // SAFETY: an anonymous private mapping, owned by the socket value.
        let umem = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                umem_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if umem == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let umem = umem.cast::<u8>();
        let reg = libc::xdp_umem_reg {
            addr: umem as u64,
            len: umem_len as u64,
            chunk_size: CHUNK as u32,
            headroom: 0,
            flags: 0,
            tx_metadata_len: 0,
        };
        let result = (|| {
            setsockopt(&fd, libc::SOL_XDP, libc::XDP_UMEM_REG, &reg)?;
            for opt in [
                libc::XDP_UMEM_FILL_RING,
                libc::XDP_UMEM_COMPLETION_RING,
                libc::XDP_RX_RING,
                libc::XDP_TX_RING,
            ] {
                setsockopt(&fd, libc::SOL_XDP, opt, &RING_SIZE)?;
            }
            // SAFETY: zeroed plain data, as the option fills it.
            let off: libc::xdp_mmap_offsets =
                unsafe { getsockopt(&fd, libc::SOL_XDP, libc::XDP_MMAP_OFFSETS, std::mem::zeroed())? };
            let desc = std::mem::size_of::<libc::xdp_desc>();
            let fill = Ring::map(&fd, &off.fr, 8, libc::XDP_UMEM_PGOFF_FILL_RING)?;
            let completion = Ring::map(&fd, &off.cr, 8, libc::XDP_UMEM_PGOFF_COMPLETION_RING)?;
            let rx = Ring::map(&fd, &off.rx, desc, libc::XDP_PGOFF_RX_RING as u64)?;
            let tx = Ring::map(&fd, &off.tx, desc, libc::XDP_PGOFF_TX_RING as u64)?;
            Ok((fill, completion, rx, tx))
        })();
        let (fill, completion, rx, tx) = match result {
            Ok(rings) => rings,
            Err(e) => {
                // SAFETY: the mapping made above, referred to by nothing else.
                unsafe { libc::munmap(umem.cast(), umem_len) };
                return Err(e);
            }
        };
        let socket = XdpSocket {
            fd,
            program,
            key: session_id.to_le_bytes(),
            umem,
            umem_len,
            fill,
            completion,
            rx,
            tx,
            iface: ifname.to_owned(),
            mac,
            mtu,
            tx_base: (RX_CHUNKS * CHUNK) as u64,
            slot_chunks,
            tx_free: (0..TX_SLOTS).collect(),
            tx_pending: vec![0; TX_SLOTS],
            tx_queued: 0,
            joined: Vec::with_capacity(ETH_HEADER_LEN + mtu),
            skipping: false,
        };
        // Every receive buffer to the kernel, then bind.
        let prod = socket.fill.producer().load(Ordering::Relaxed);
        for i in 0..RX_CHUNKS as u32 {
            // SAFETY: the fill ring has RING_SIZE > RX_CHUNKS entries, all ours before bind.
            unsafe { *socket.fill.entry::<u64>(prod.wrapping_add(i)) = u64::from(i) * CHUNK as u64 };
        }
        socket.fill.producer().store(prod.wrapping_add(RX_CHUNKS as u32), Ordering::Release);
        let sxdp = libc::sockaddr_xdp {
            sxdp_family: libc::AF_XDP as u16,
            sxdp_flags: libc::XDP_COPY | libc::XDP_USE_SG,
            sxdp_ifindex: ifindex,
            sxdp_queue_id: 0,
            sxdp_shared_umem_fd: 0,
        };
        // SAFETY: `sxdp` is a valid sockaddr_xdp of the size given.
        let r = unsafe {
            libc::bind(
                socket.fd.as_raw_fd(),
                (&sxdp as *const libc::sockaddr_xdp).cast(),
                std::mem::size_of::<libc::sockaddr_xdp>() as u32,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("binding an AF_XDP socket to {ifname}: {e}")));
        }
        let fd_value = (socket.fd.as_raw_fd() as u32).to_ne_bytes();
        map_update(&socket.program.xsks, &0u32.to_ne_bytes(), &fd_value)?;
        map_update(&socket.program.sessions, &socket.key, &0u32.to_ne_bytes())?;
        Ok(socket)
    }

    pub fn mtu(&self) -> usize {
        self.mtu
    }

    pub fn iface(&self) -> &str {
        &self.iface
    }

    /// Visit every received frame of the session, in order: `f(source MAC, payload)`. Each
    /// buffer goes back to the kernel (the fill ring) after its frame's call.
    pub fn receive(&mut self, mut f: impl FnMut(Mac, &[u8])) -> usize {
        let prod = self.rx.producer().load(Ordering::Acquire);
        let mut cons = self.rx.consumer().load(Ordering::Relaxed);
        let fill_at = self.fill.producer().load(Ordering::Relaxed);
        let mut refilled = 0u32;
        let mut frames = 0;
        while cons != prod {
            // SAFETY: entries between consumer and producer are the kernel's posted descriptors.
            let d = unsafe { *self.rx.entry::<libc::xdp_desc>(cons) };
            cons = cons.wrapping_add(1);
            let (addr, len) = (d.addr as usize, d.len as usize);
            let whole = self.joined.is_empty() && d.options & libc::XDP_PKT_CONTD == 0;
            if addr + len <= self.umem_len {
                // SAFETY: inside the UMEM (checked); the kernel wrote it and handed it over.
                let bytes = unsafe { std::slice::from_raw_parts(self.umem.add(addr), len) };
                let last = d.options & libc::XDP_PKT_CONTD == 0;
                if self.skipping {
                    self.skipping = !last;
                } else if whole {
                    frames += deliver(bytes, &mut f);
                } else if self.joined.len() + len <= ETH_HEADER_LEN + self.mtu {
                    self.joined.extend_from_slice(bytes);
                    if last {
                        frames += deliver(&self.joined, &mut f);
                        self.joined.clear();
                    }
                } else {
                    // Longer than a frame of the MTU: not one of ours. Drop it, up to its
                    // last buffer.
                    self.joined.clear();
                    self.skipping = !last;
                }
            }
            // SAFETY: the fill ring has room: it holds at most RX_CHUNKS < RING_SIZE buffers.
            unsafe { *self.fill.entry::<u64>(fill_at.wrapping_add(refilled)) = (addr & !(CHUNK - 1)) as u64 };
            refilled += 1;
        }
        if refilled > 0 {
            self.rx.consumer().store(cons, Ordering::Release);
            self.fill.producer().store(fill_at.wrapping_add(refilled), Ordering::Release);
        }
        frames
    }

    /// Write a frame to `dst` whose payload `fill` writes in place, straight into a transmit
    /// slot: it gets room for an MTU and returns the bytes it wrote; zero queues nothing.
    /// `Ok(None)`: every slot is in the kernel's hands and `fill` was not called (the kernel
    /// has been kicked, in case what holds them was never sent).
    pub fn queue_with(
        &mut self,
        dst: Mac,
        fill: impl FnOnce(&mut [u8]) -> usize,
    ) -> io::Result<Option<usize>> {
        self.reclaim();
        if self.tx_free.is_empty() {
            self.kick()?;
            self.reclaim();
        }
        let tx_room = self.tx.size
            - self
                .tx
                .producer()
                .load(Ordering::Relaxed)
                .wrapping_sub(self.tx.consumer().load(Ordering::Acquire));
        if tx_room < self.slot_chunks as u32 + self.tx_queued {
            return Ok(None);
        }
        let Some(&slot) = self.tx_free.front() else { return Ok(None) };
        let base = self.tx_base as usize + slot * self.slot_chunks * CHUNK;
        let room = self.mtu;
        // SAFETY: the slot's buffers are free (not in the kernel's hands) and lie inside the UMEM.
        let frame = unsafe { std::slice::from_raw_parts_mut(self.umem.add(base), ETH_HEADER_LEN + room) };
        let len = fill(&mut frame[ETH_HEADER_LEN..]);
        if len == 0 {
            return Ok(Some(0));
        }
        assert!(len <= room, "fill wrote {len} bytes into {room}");
        write_eth_header(frame, dst, self.mac, ETHERTYPE);
        self.tx_free.pop_front();
        let total = ETH_HEADER_LEN + len;
        let pieces = total.div_ceil(CHUNK);
        let at = self.tx.producer().load(Ordering::Relaxed).wrapping_add(self.tx_queued);
        for i in 0..pieces {
            let piece = (total - i * CHUNK).min(CHUNK);
            let options = if i + 1 < pieces { libc::XDP_PKT_CONTD } else { 0 };
            // SAFETY: `tx_room` covers these entries, which no one else writes.
            unsafe {
                *self.tx.entry::<libc::xdp_desc>(at.wrapping_add(i as u32)) =
                    libc::xdp_desc { addr: (base + i * CHUNK) as u64, len: piece as u32, options };
            }
        }
        self.tx_pending[slot] = pieces as u32;
        self.tx_queued += pieces as u32;
        Ok(Some(len))
    }

    /// Hand the queued frames to the kernel and kick it.
    pub fn flush(&mut self) -> io::Result<()> {
        if self.tx_queued > 0 {
            let prod = self.tx.producer().load(Ordering::Relaxed);
            self.tx.producer().store(prod.wrapping_add(self.tx_queued), Ordering::Release);
            self.tx_queued = 0;
        }
        self.kick()
    }

    /// Descriptors wait on the transmit ring that the kernel has not taken: call
    /// [`flush`](Self::flush) even with nothing new to queue.
    pub fn pending(&self) -> bool {
        self.tx_queued > 0
            || self.tx.producer().load(Ordering::Relaxed) != self.tx.consumer().load(Ordering::Acquire)
    }

    /// `sendto` until the transmit ring is empty. In copy mode each call sends at most a
    /// batch of descriptors (32) and says EAGAIN when more wait; EAGAIN also means the device
    /// is busy, so a call that took nothing ends the kicking, as EBUSY and ENOBUFS do (what is
    /// left goes at the next flush: [`pending`](Self::pending)).
    fn kick(&mut self) -> io::Result<()> {
        for _ in 0..RING_SIZE {
            let before = self.tx.consumer().load(Ordering::Acquire);
            if self.tx.producer().load(Ordering::Relaxed) == before {
                break;
            }
            // SAFETY: sendto with no buffer: "send what the TX ring holds".
            let r = unsafe {
                libc::sendto(
                    self.fd.as_raw_fd(),
                    std::ptr::null(),
                    0,
                    libc::MSG_DONTWAIT,
                    std::ptr::null(),
                    0,
                )
            };
            let e = (r < 0).then(io::Error::last_os_error);
            match e.as_ref().and_then(io::Error::raw_os_error) {
                None | Some(libc::EAGAIN | libc::EINTR) => {
                    if self.tx.consumer().load(Ordering::Acquire) == before {
                        break;
                    }
                }
                Some(libc::EBUSY | libc::ENOBUFS) => break,
                Some(_) => return Err(e.expect("an error")),
            }
        }
        Ok(())
    }

    /// Take back the transmit buffers the kernel is done with.
    fn reclaim(&mut self) {
        let prod = self.completion.producer().load(Ordering::Acquire);
        let mut cons = self.completion.consumer().load(Ordering::Relaxed);
        if cons == prod {
            return;
        }
        let slot_bytes = (self.slot_chunks * CHUNK) as u64;
        while cons != prod {
            // SAFETY: a posted completion entry.
            let addr = unsafe { *self.completion.entry::<u64>(cons) };
            cons = cons.wrapping_add(1);
            let Some(slot) = addr.checked_sub(self.tx_base).map(|a| (a / slot_bytes) as usize) else {
                continue;
            };
            if let Some(n) = self.tx_pending.get_mut(slot) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.tx_free.push_back(slot);
                }
            }
        }
        self.completion.consumer().store(cons, Ordering::Release);
    }

    /// Nothing to take: the kernel sets an AF_XDP socket's error only when its device goes
    /// away, and then its kicks fail (`flush` returns the error).
    pub fn take_error(&self) -> io::Result<Option<io::Error>> {
        Ok(None)
    }
}

/// Hand one whole frame of skiff's EtherType to `f`; returns 1 if it did.
fn deliver(frame: &[u8], f: &mut impl FnMut(Mac, &[u8])) -> usize {
    if frame.len() < ETH_HEADER_LEN || frame[12..14] != ETHERTYPE.to_be_bytes() {
        return 0;
    }
    f(frame[6..12].try_into().expect("six bytes"), &frame[ETH_HEADER_LEN..]);
    1
}

impl AsRawFd for XdpSocket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Drop for XdpSocket {
    fn drop(&mut self) {
        map_delete(&self.program.sessions, &self.key);
        map_delete(&self.program.xsks, &0u32.to_ne_bytes());
        self.program.busy.store(false, Ordering::Release);
        // The kernel pinned the UMEM's pages when it was registered and keeps them until the
        // socket closes (after this); the mapping itself is ours to drop. The rings unmap
        // themselves.
        // SAFETY: the UMEM mapping made in `bind`; nothing in this process refers to it after.
        unsafe { libc::munmap(self.umem.cast(), self.umem_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every conditional jump of the program lands on `pass`, and the two map loads take two
    /// slots each: what the offsets were counted for (the kernel's verifier checks the rest,
    /// in tests/tests/eth_xdp.rs).
    #[test]
    fn the_programs_jumps_land_on_pass() {
        let p = program(7, 8);
        let pass = p.len() - 2;
        assert_eq!((p[pass].code, p[pass].imm), (0xb7, sys::XDP_PASS));
        let jumps: Vec<usize> =
            (0..p.len()).filter(|&i| matches!(p[i].code, 0x2d | 0x55 | 0x15 | 0x5d)).collect();
        assert_eq!(jumps.len(), 4);
        for i in jumps {
            assert_eq!(i as i64 + 1 + i64::from(p[i].off), pass as i64, "the jump at {i}");
        }
        let maps: Vec<(usize, i32)> =
            (0..p.len()).filter(|&i| p[i].code == 0x18).map(|i| (i, p[i].imm)).collect();
        assert_eq!(maps, [(12, 7), (19, 8)]);
        assert!(maps.iter().all(|&(i, _)| p[i + 1].code == 0 && p[i + 1].imm == 0));
    }
}
