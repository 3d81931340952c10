//! Raw Ethernet frames through AF_PACKET's memory-mapped rings: the portable driver under
//! skiff's raw-Ethernet transport (Tyche's design: no TCP/IP, our own EtherType).
//!
//! A [`PacketSocket`] is bound to one interface and one EtherType ([`ETHERTYPE`], 0x88B5, the
//! IEEE's local experimental one). It shares two rings with the kernel, mapped once:
//!
//! - **RX**: the kernel writes each received frame into the next free slot and marks it
//!   ready; [`PacketSocket::receive`] visits the ready frames in order, with no system call,
//!   and hands each slot back. The socket's descriptor is readable while frames wait.
//! - **TX**: [`PacketSocket::queue`] writes a frame (Ethernet header and payload) into the
//!   next free slot, and [`PacketSocket::flush`] tells the kernel to send everything queued
//!   with one `sendto`. A slot is free again once the kernel has sent it.
//!
//! Two ring layouts ([`RingVersion`]): `TPACKET_V2` hands each frame over as it arrives;
//! `TPACKET_V3` packs frames into blocks and hands a block over only when it is full or its
//! timeout (whole milliseconds) runs out. V3 saves work at high frame rates and costs up to
//! that timeout per frame when the traffic is sparse, which is every frame at queue depth 1,
//! so V2 is the default and V3 the measured option (docs/ETHERNET.md has the figures).
//! `PACKET_QDISC_BYPASS` (on by default) sends straight to the driver, past the interface's
//! queueing discipline: turn it off to shape the link with `tc`.
//!
//! This module knows frames and addresses, nothing of skiff's protocol: the datagram header
//! and reliable delivery live in `wire::datagram` and `dgram::reliable`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};

/// skiff's EtherType: IEEE 802 local experimental EtherType 1.
pub const ETHERTYPE: u16 = 0x88B5;
/// Not an EtherType: opened with it, a socket receives frames of every EtherType (ETH_P_ALL),
/// for a bridge that forwards whole frames ([`PacketSocket::receive_frames`],
/// [`PacketSocket::queue_frame`]).
pub const ETHERTYPE_ALL: u16 = libc::ETH_P_ALL as u16;
/// Destination MAC, source MAC, EtherType.
pub const ETH_HEADER_LEN: usize = 14;
/// A MAC address.
pub type Mac = [u8; 6];
/// The broadcast address, for discovery.
pub const BROADCAST: Mac = [0xff; 6];

/// One classic BPF instruction: (code, jump if true, jump if false, k), as `struct
/// sock_filter`; see [`bpf`] for the few a frame filter needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bpf(pub u16, pub u8, pub u8, pub u32);

/// Builders of the instructions frame filters use. Loads read network (big-endian) order.
pub mod bpf {
    use super::Bpf;
    /// A = the 32-bit word at byte `k`.
    pub fn load_word(k: u32) -> Bpf {
        Bpf(0x20, 0, 0, k)
    }
    /// A = the 16-bit half-word at byte `k`.
    pub fn load_half(k: u32) -> Bpf {
        Bpf(0x28, 0, 0, k)
    }
    /// A = the byte at `k`.
    pub fn load_byte(k: u32) -> Bpf {
        Bpf(0x30, 0, 0, k)
    }
    /// If A == k go on, else skip `skip` instructions.
    pub fn require(k: u32, skip: u8) -> Bpf {
        Bpf(0x15, 0, skip, k)
    }
    /// Accept the frame (up to 256 KiB of it).
    pub fn accept() -> Bpf {
        Bpf(0x06, 0, 0, 0x0004_0000)
    }
    /// Drop the frame.
    pub fn reject() -> Bpf {
        Bpf(0x06, 0, 0, 0)
    }

    /// A program that accepts a frame only if every `(load, value)` check holds.
    pub fn all_of(checks: &[(Bpf, u32)]) -> Vec<Bpf> {
        let n = checks.len();
        let mut p = Vec::with_capacity(2 * n + 2);
        for (i, (load, value)) in checks.iter().enumerate() {
            p.push(*load);
            // On a mismatch, skip the rest of the checks and the accept: land on the reject.
            p.push(require(*value, (2 * (n - i - 1) + 1) as u8));
        }
        p.push(accept());
        p.push(reject());
        p
    }
}

/// How the rings are laid out (`PACKET_VERSION`; both rings use the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingVersion {
    /// One frame per slot, handed over as it arrives.
    V2,
    /// Frames packed into blocks, handed over a block at a time.
    V3,
}

impl std::str::FromStr for RingVersion {
    type Err = String;
    fn from_str(s: &str) -> Result<RingVersion, String> {
        match s {
            "v2" => Ok(RingVersion::V2),
            "v3" => Ok(RingVersion::V3),
            _ => Err(format!("{s:?}: expected v2 or v3")),
        }
    }
}

/// The rings' sizes and options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingConfig {
    pub version: RingVersion,
    /// Bytes per slot, ring header included: 0 (the default) for the fewest pages that hold a
    /// frame of the interface's MTU ([`slot_bytes_for`]: 12 KiB at a 9,000-byte MTU, 68 KiB
    /// at 65,535), or a multiple of the page size at least that large.
    pub slot_bytes: usize,
    /// Slots in the receive ring (with V3, `rx_slots × slot_bytes` bytes of blocks).
    pub rx_slots: usize,
    /// Slots in the transmit ring.
    pub tx_slots: usize,
    /// 0 (the default): no cap. Otherwise the most bytes of both rings together: when slots
    /// that fit a large MTU would take more, the receive and transmit rings shrink in
    /// proportion, to no fewer than [`RING_SLOTS_MIN`] and half that.
    pub bytes_max: usize,
    /// V3 only: frames per receive block, and the longest a partly filled block is held.
    pub v3_block_slots: usize,
    pub v3_block_timeout_ms: u32,
    /// Send past the interface's queueing discipline.
    pub qdisc_bypass: bool,
}

/// The fewest receive slots a byte cap leaves a ring ([`RingConfig::bytes_max`]); the transmit
/// ring keeps half as many.
pub const RING_SLOTS_MIN: usize = 32;

impl RingConfig {
    /// These settings on an interface of MTU `mtu` (pages of `page` bytes): slots of the
    /// fewest pages that hold a frame when `slot_bytes` is 0, and slot counts cut to
    /// `bytes_max`. An error when a given `slot_bytes` is too small for the MTU.
    pub fn for_mtu(self, mtu: usize, page: usize) -> Result<RingConfig, String> {
        let fit = slot_bytes_for(mtu, page);
        let mut c = self;
        if c.slot_bytes == 0 {
            c.slot_bytes = fit;
        } else if c.slot_bytes < fit {
            return Err(format!(
                "a frame of MTU {mtu} needs ring slots of {fit} bytes, not {}",
                c.slot_bytes
            ));
        }
        let slots = c.rx_slots + c.tx_slots;
        if c.bytes_max > 0 && slots * c.slot_bytes > c.bytes_max {
            let fits = c.bytes_max / c.slot_bytes;
            let rx = (c.rx_slots * fits / slots).max(RING_SLOTS_MIN).min(c.rx_slots);
            let tx = (c.tx_slots * fits / slots).max(RING_SLOTS_MIN / 2).min(c.tx_slots);
            if c.version == RingVersion::V3 {
                // Whole blocks of frames.
                c.rx_slots = rx.next_multiple_of(c.v3_block_slots).min(c.rx_slots);
            } else {
                c.rx_slots = rx;
            }
            c.tx_slots = tx;
        }
        Ok(c)
    }
}

impl Default for RingConfig {
    fn default() -> RingConfig {
        RingConfig {
            version: RingVersion::V2,
            slot_bytes: 0,
            rx_slots: 512,
            tx_slots: 256,
            bytes_max: 0,
            v3_block_slots: 16,
            v3_block_timeout_ms: 1,
            qdisc_bypass: true,
        }
    }
}

/// What one socket counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PacketStats {
    pub rx_frames: u64,
    pub tx_frames: u64,
    /// `flush` calls that reached the kernel.
    pub tx_kicks: u64,
    /// Frames the kernel dropped because the receive ring was full (`PACKET_STATISTICS`,
    /// read by [`PacketSocket::kernel_drops`]).
    pub rx_ring_drops: u64,
}

/// Byte offsets of the ring headers (linux/if_packet.h).
mod hdr {
    /// `tpacket2_hdr`: status, len, snaplen, mac (u16), net (u16), ...
    pub const V2_STATUS: usize = 0;
    pub const V2_LEN: usize = 4;
    pub const V2_SNAPLEN: usize = 8;
    pub const V2_MAC: usize = 12;
    /// Where a V2 transmit slot's frame starts: `TPACKET2_HDRLEN - sizeof(sockaddr_ll)`.
    pub const V2_TX_DATA: usize = 32;
    /// `tpacket3_hdr`: next_offset, sec, nsec, snaplen, len, status, mac (u16), ...
    pub const V3_NEXT: usize = 0;
    pub const V3_SNAPLEN: usize = 12;
    pub const V3_LEN: usize = 16;
    pub const V3_STATUS: usize = 20;
    pub const V3_MAC: usize = 24;
    /// Where a V3 transmit slot's frame starts: `TPACKET3_HDRLEN - sizeof(sockaddr_ll)`.
    pub const V3_TX_DATA: usize = 48;
    /// `tpacket_block_desc` with `tpacket_hdr_v1`: version, offset_to_priv, block_status,
    /// num_pkts, offset_to_first_pkt, ...
    pub const BLOCK_STATUS: usize = 8;
    pub const BLOCK_NUM_PKTS: usize = 12;
    pub const BLOCK_FIRST: usize = 16;
}

const TP_STATUS_KERNEL: u32 = 0;
const TP_STATUS_USER: u32 = 1;
const TP_STATUS_AVAILABLE: u32 = 0;
const TP_STATUS_SEND_REQUEST: u32 = 1;
const TP_STATUS_WRONG_FORMAT: u32 = 4;

/// An AF_PACKET socket on one interface with its two rings.
pub struct PacketSocket {
    fd: OwnedFd,
    ring: *mut u8,
    ring_len: usize,
    config: RingConfig,
    iface: String,
    mac: Mac,
    mtu: usize,
    ethertype: u16,
    /// Next receive slot (V2) or block (V3) to look at.
    rx_next: usize,
    rx_units: usize,
    rx_unit_bytes: usize,
    /// Next transmit slot to fill.
    tx_next: usize,
    /// Slots queued since the last flush.
    tx_queued: usize,
    stats: PacketStats,
}

// SAFETY: the ring mapping is owned by this value alone (nothing else holds the pointer), so
// moving the socket to another thread moves the sole access with it.
unsafe impl Send for PacketSocket {}

impl PacketSocket {
    /// Open a socket on interface `ifname` for frames of `ethertype`, with rings as `config`
    /// says. Needs CAP_NET_RAW.
    pub fn open(ifname: &str, ethertype: u16, config: RingConfig) -> io::Result<PacketSocket> {
        let page = page_size();
        if !config.slot_bytes.is_multiple_of(page) {
            return Err(invalid(format!(
                "slot_bytes {} is not a multiple of the page size {page}",
                config.slot_bytes
            )));
        }
        if config.rx_slots == 0 || config.tx_slots == 0 {
            return Err(invalid("a ring needs at least one slot".into()));
        }
        if config.version == RingVersion::V3
            && (config.v3_block_slots == 0 || !config.rx_slots.is_multiple_of(config.v3_block_slots))
        {
            return Err(invalid(format!(
                "rx_slots {} is not a multiple of v3_block_slots {}",
                config.rx_slots, config.v3_block_slots
            )));
        }
        // Protocol 0: nothing is received until `bind` names the EtherType and the interface.
        // (A socket opened with the EtherType would take that EtherType's frames from every
        // interface of the namespace into its ring until it is bound.)
        // SAFETY: plain socket(2); the descriptor is owned below.
        let raw = unsafe {
            libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0)
        };
        if raw < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("AF_PACKET socket (needs CAP_NET_RAW): {e}")));
        }
        // SAFETY: `raw` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let (ifindex, mtu, mac) = interface_on(&fd, ifname)?;
        let config = config.for_mtu(mtu, page).map_err(|e| invalid(format!("{ifname}: {e}")))?;
        let version = match config.version {
            RingVersion::V2 => libc::tpacket_versions::TPACKET_V2 as libc::c_int,
            RingVersion::V3 => libc::tpacket_versions::TPACKET_V3 as libc::c_int,
        };
        setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_VERSION, &version)?;
        // Frames this host sends on the interface are not ours to receive.
        let _ = setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, &1 as &libc::c_int);
        if config.qdisc_bypass {
            setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_QDISC_BYPASS, &1 as &libc::c_int)?;
        }
        let slot = config.slot_bytes as u32;
        let (rx_units, rx_unit_bytes) = match config.version {
            RingVersion::V2 => {
                let req = libc::tpacket_req {
                    tp_block_size: slot,
                    tp_block_nr: config.rx_slots as u32,
                    tp_frame_size: slot,
                    tp_frame_nr: config.rx_slots as u32,
                };
                setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_RX_RING, &req)?;
                let req = libc::tpacket_req {
                    tp_block_nr: config.tx_slots as u32,
                    tp_frame_nr: config.tx_slots as u32,
                    ..req
                };
                setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_TX_RING, &req)?;
                (config.rx_slots, config.slot_bytes)
            }
            RingVersion::V3 => {
                let blocks = config.rx_slots / config.v3_block_slots;
                let block_bytes = config.slot_bytes * config.v3_block_slots;
                let req = libc::tpacket_req3 {
                    tp_block_size: block_bytes as u32,
                    tp_block_nr: blocks as u32,
                    tp_frame_size: slot,
                    tp_frame_nr: config.rx_slots as u32,
                    tp_retire_blk_tov: config.v3_block_timeout_ms.max(1),
                    tp_sizeof_priv: 0,
                    tp_feature_req_word: 0,
                };
                setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_RX_RING, &req)?;
                let req = libc::tpacket_req3 {
                    tp_block_size: slot,
                    tp_block_nr: config.tx_slots as u32,
                    tp_frame_size: slot,
                    tp_frame_nr: config.tx_slots as u32,
                    tp_retire_blk_tov: 0,
                    tp_sizeof_priv: 0,
                    tp_feature_req_word: 0,
                };
                setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_TX_RING, &req)?;
                (blocks, block_bytes)
            }
        };
        let ring_len = config.slot_bytes * (config.rx_slots + config.tx_slots);
        // SAFETY: maps the rings the kernel set up on `fd`: shared, read-write, the whole length.
        let ring = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                ring_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_LOCKED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        let ring = if ring == libc::MAP_FAILED {
            // MAP_LOCKED fails under a small RLIMIT_MEMLOCK: map unlocked instead.
            // SAFETY: as above, without MAP_LOCKED.
            let again = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    ring_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_POPULATE,
                    fd.as_raw_fd(),
                    0,
                )
            };
            if again == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            again
        } else {
            ring
        };
        // SAFETY: a sockaddr_ll of zeros is valid; the fields that matter are set below.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = ethertype.to_be();
        sll.sll_ifindex = ifindex;
        let socket = PacketSocket {
            fd,
            ring: ring.cast(),
            ring_len,
            config,
            iface: ifname.to_owned(),
            mac,
            mtu,
            ethertype,
            rx_next: 0,
            rx_units,
            rx_unit_bytes,
            tx_next: 0,
            tx_queued: 0,
            stats: PacketStats::default(),
        };
        // SAFETY: `sll` is a valid sockaddr_ll of the size given.
        let bound = unsafe {
            libc::bind(
                socket.fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if bound < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(socket)
    }

    pub fn mac(&self) -> Mac {
        self.mac
    }

    /// The interface's MTU: the largest payload of one frame.
    pub fn mtu(&self) -> usize {
        self.mtu
    }

    /// The interface's name.
    pub fn iface(&self) -> &str {
        &self.iface
    }

    pub fn stats(&self) -> PacketStats {
        self.stats
    }

    /// Visit every received frame waiting in the ring, in order: `f(source MAC, payload)`
    /// (the payload follows the Ethernet header). Each slot goes back to the kernel after its
    /// call. Returns the frames visited; zero when none wait (the descriptor then becomes
    /// readable when one arrives).
    pub fn receive(&mut self, mut f: impl FnMut(Mac, &[u8])) -> usize {
        debug_assert_ne!(
            self.ethertype, ETHERTYPE_ALL,
            "a bridge's socket takes whole frames: receive_frames"
        );
        let ethertype = self.ethertype.to_be_bytes();
        self.receive_frames(|frame| {
            if frame.len() >= ETH_HEADER_LEN && frame[12..14] == ethertype {
                let src: Mac = frame[6..12].try_into().expect("six bytes");
                f(src, &frame[ETH_HEADER_LEN..]);
            }
        })
    }

    /// As [`receive`](Self::receive), with each whole Ethernet frame (headers included), for
    /// a bridge that forwards frames as they are.
    pub fn receive_frames(&mut self, mut deliver: impl FnMut(&[u8])) -> usize {
        let mut n = 0;
        loop {
            // SAFETY: rx_next < rx_units, so the unit lies inside the receive ring.
            let unit = unsafe { self.ring.add(self.rx_next * self.rx_unit_bytes) };
            match self.config.version {
                RingVersion::V2 => {
                    let status = status_at(unit, hdr::V2_STATUS);
                    if status.load(Ordering::Acquire) & TP_STATUS_USER == 0 {
                        break;
                    }
                    let mac_off = read_u16(unit, hdr::V2_MAC) as usize;
                    let len = read_u32(unit, hdr::V2_SNAPLEN) as usize;
                    if mac_off + len <= self.rx_unit_bytes {
                        // SAFETY: the kernel wrote `len` bytes at `mac_off` inside this slot
                        // and left the slot to us until we hand it back below.
                        deliver(unsafe { std::slice::from_raw_parts(unit.add(mac_off), len) });
                    }
                    n += 1;
                    status.store(TP_STATUS_KERNEL, Ordering::Release);
                }
                RingVersion::V3 => {
                    let status = status_at(unit, hdr::BLOCK_STATUS);
                    if status.load(Ordering::Acquire) & TP_STATUS_USER == 0 {
                        break;
                    }
                    let count = read_u32(unit, hdr::BLOCK_NUM_PKTS) as usize;
                    let mut at = read_u32(unit, hdr::BLOCK_FIRST) as usize;
                    for _ in 0..count {
                        if at + hdr::V3_MAC + 2 > self.rx_unit_bytes {
                            break;
                        }
                        // SAFETY: `at` lies inside the block (checked above).
                        let pkt = unsafe { unit.add(at) };
                        let mac_off = read_u16(pkt, hdr::V3_MAC) as usize;
                        let len = read_u32(pkt, hdr::V3_SNAPLEN) as usize;
                        if at + mac_off + len <= self.rx_unit_bytes {
                            // SAFETY: the kernel wrote the frame inside this block, which is
                            // ours until handed back below.
                            deliver(unsafe { std::slice::from_raw_parts(pkt.add(mac_off), len) });
                        }
                        n += 1;
                        let next = read_u32(pkt, hdr::V3_NEXT) as usize;
                        if next == 0 {
                            break;
                        }
                        at += next;
                    }
                    status.store(TP_STATUS_KERNEL, Ordering::Release);
                }
            }
            self.rx_next = (self.rx_next + 1) % self.rx_units;
        }
        self.stats.rx_frames += n as u64;
        n
    }

    /// Write a frame to `dst` (payload gathered from `parts`) into the next transmit slot.
    /// `Ok(false)`: the ring is full (wait for the descriptor to be writable, after a
    /// [`flush`](Self::flush)); an error when the payload exceeds the MTU.
    pub fn queue(&mut self, dst: Mac, parts: &[&[u8]]) -> io::Result<bool> {
        debug_assert_ne!(self.ethertype, ETHERTYPE_ALL, "a bridge's socket sends whole frames: queue_frame");
        let mut header = [0u8; ETH_HEADER_LEN];
        write_eth_header(&mut header, dst, self.mac, self.ethertype);
        self.queue_parts(&header, parts)
    }

    /// Write a frame to `dst` whose payload `fill` writes in place, straight into the transmit
    /// slot (no staging copy): it gets room for an MTU and returns the bytes it wrote; zero
    /// queues nothing. `Ok(None)`: the ring is full and `fill` was not called.
    pub fn queue_with(
        &mut self,
        dst: Mac,
        fill: impl FnOnce(&mut [u8]) -> usize,
    ) -> io::Result<Option<usize>> {
        let Some((slot, data_off)) = self.free_tx_slot()? else { return Ok(None) };
        let room = self.mtu;
        // SAFETY: the slot is ours (status AVAILABLE) and holds data_off + an Ethernet header
        // + an MTU (checked in `open`).
        let frame = unsafe { std::slice::from_raw_parts_mut(slot.add(data_off), ETH_HEADER_LEN + room) };
        let len = fill(&mut frame[ETH_HEADER_LEN..]);
        if len == 0 {
            return Ok(Some(0));
        }
        assert!(len <= room, "fill wrote {len} bytes into {room}");
        write_eth_header(frame, dst, self.mac, self.ethertype);
        self.commit_tx(slot, ETH_HEADER_LEN + len);
        Ok(Some(len))
    }

    /// Queue a whole Ethernet frame as it is (a bridge forwarding what it received).
    pub fn queue_frame(&mut self, frame: &[u8]) -> io::Result<bool> {
        if frame.len() < ETH_HEADER_LEN {
            return Err(invalid(format!("a {}-byte frame has no Ethernet header", frame.len())));
        }
        self.queue_parts(&frame[..ETH_HEADER_LEN], &[&frame[ETH_HEADER_LEN..]])
    }

    fn queue_parts(&mut self, header: &[u8], parts: &[&[u8]]) -> io::Result<bool> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len > self.mtu {
            return Err(invalid(format!("a {len}-byte payload exceeds the MTU of {}", self.mtu)));
        }
        let Some((slot, data_off)) = self.free_tx_slot()? else { return Ok(false) };
        let frame_len = ETH_HEADER_LEN + len;
        // SAFETY: the slot is ours (status AVAILABLE) and holds data_off + frame_len bytes
        // (the MTU check in `open` and above).
        let frame = unsafe { std::slice::from_raw_parts_mut(slot.add(data_off), frame_len) };
        frame[..ETH_HEADER_LEN].copy_from_slice(header);
        let mut at = ETH_HEADER_LEN;
        for p in parts {
            frame[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        self.commit_tx(slot, frame_len);
        Ok(true)
    }

    /// The next transmit slot and where its frame starts, if the kernel is done with it.
    fn free_tx_slot(&mut self) -> io::Result<Option<(*mut u8, usize)>> {
        let tx_base = self.config.slot_bytes * self.config.rx_slots;
        // SAFETY: tx_next < tx_slots, so the slot lies inside the transmit ring.
        let slot = unsafe { self.ring.add(tx_base + self.tx_next * self.config.slot_bytes) };
        let (status_off, data_off) = match self.config.version {
            RingVersion::V2 => (hdr::V2_STATUS, hdr::V2_TX_DATA),
            RingVersion::V3 => (hdr::V3_STATUS, hdr::V3_TX_DATA),
        };
        match status_at(slot, status_off).load(Ordering::Acquire) {
            TP_STATUS_AVAILABLE => Ok(Some((slot, data_off))),
            TP_STATUS_WRONG_FORMAT => {
                Err(io::Error::other("the kernel refused a queued frame (TP_STATUS_WRONG_FORMAT)"))
            }
            _ => Ok(None),
        }
    }

    /// Hand a filled slot of `frame_len` bytes to the kernel (sent at the next flush).
    fn commit_tx(&mut self, slot: *mut u8, frame_len: usize) {
        let status_off = match self.config.version {
            RingVersion::V2 => {
                write_u32(slot, hdr::V2_LEN, frame_len as u32);
                hdr::V2_STATUS
            }
            RingVersion::V3 => {
                write_u32(slot, hdr::V3_NEXT, 0);
                write_u32(slot, hdr::V3_LEN, frame_len as u32);
                write_u32(slot, hdr::V3_SNAPLEN, frame_len as u32);
                hdr::V3_STATUS
            }
        };
        status_at(slot, status_off).store(TP_STATUS_SEND_REQUEST, Ordering::Release);
        self.tx_next = (self.tx_next + 1) % self.config.tx_slots;
        self.tx_queued += 1;
        self.stats.tx_frames += 1;
    }

    /// Deliver only the frames `program` accepts: a classic BPF filter (`SO_ATTACH_FILTER`)
    /// that the kernel runs on each frame, Ethernet header at offset 0, before the frame takes
    /// a ring slot. Frames that arrived before the filter are discarded.
    pub fn attach_filter(&mut self, program: &[Bpf]) -> io::Result<()> {
        let mut code: Vec<libc::sock_filter> =
            program.iter().map(|b| libc::sock_filter { code: b.0, jt: b.1, jf: b.2, k: b.3 }).collect();
        let prog = libc::sock_fprog { len: code.len() as u16, filter: code.as_mut_ptr() };
        // SAFETY: `prog` points at `code`, alive for the call; the kernel copies the program.
        let r = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ATTACH_FILTER,
                (&prog as *const libc::sock_fprog).cast(),
                std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        self.receive_frames(|_| {});
        Ok(())
    }

    /// Frames wait in the transmit ring that a `sendto` has not handed to the kernel yet (it
    /// said the device was busy): call [`flush`](Self::flush) even with nothing new queued.
    pub fn pending(&self) -> bool {
        self.tx_queued > 0
    }

    /// Send every queued frame: one `sendto`, which does not wait for the frames to leave.
    pub fn flush(&mut self) -> io::Result<()> {
        if self.tx_queued == 0 {
            return Ok(());
        }
        loop {
            // SAFETY: sendto with no buffer and no address: "send what the TX ring holds".
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
            if r >= 0 {
                break;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                // The device queue is full: the frames stay queued, the next flush sends them.
                io::ErrorKind::WouldBlock => break,
                _ => return Err(e),
            }
        }
        self.tx_queued = 0;
        self.stats.tx_kicks += 1;
        Ok(())
    }

    /// Take the socket's pending error (`SO_ERROR`, which clears it): the kernel sets one when
    /// the interface goes down, and until it is taken the descriptor polls as ready.
    pub fn take_error(&self) -> io::Result<Option<io::Error>> {
        // SAFETY: SO_ERROR fills a c_int.
        let err = unsafe { getsockopt(&self.fd, libc::SOL_SOCKET, libc::SO_ERROR, 0 as libc::c_int)? };
        Ok((err != 0).then(|| io::Error::from_raw_os_error(err)))
    }

    /// Frames the kernel dropped for want of a free receive slot since the last call
    /// (`PACKET_STATISTICS`, which resets on reading); added to [`PacketStats::rx_ring_drops`].
    pub fn kernel_drops(&mut self) -> io::Result<u64> {
        let zero = libc::tpacket_stats_v3 { tp_packets: 0, tp_drops: 0, tp_freeze_q_cnt: 0 };
        // SAFETY: PACKET_STATISTICS fills plain counters (the V3 layout is the larger one).
        let st = unsafe { getsockopt(&self.fd, libc::SOL_PACKET, libc::PACKET_STATISTICS, zero)? };
        self.stats.rx_ring_drops += u64::from(st.tp_drops);
        Ok(u64::from(st.tp_drops))
    }
}

impl AsRawFd for PacketSocket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Drop for PacketSocket {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `open`; nothing refers to it after this.
        unsafe { libc::munmap(self.ring.cast(), self.ring_len) };
    }
}

fn status_at(base: *mut u8, off: usize) -> &'static AtomicU32 {
    // SAFETY: every status word lies 4-byte aligned inside the mapping (slots and blocks are
    // page aligned, the offsets multiples of 4); the kernel and this process share it, hence
    // the atomic. The reference does not outlive the mapping: callers use it at once.
    unsafe { &*(base.add(off) as *const AtomicU32) }
}

fn read_u32(base: *mut u8, off: usize) -> u32 {
    // SAFETY: inside the mapping (callers check), aligned as the status words are.
    unsafe { std::ptr::read_volatile(base.add(off) as *const u32) }
}

fn read_u16(base: *mut u8, off: usize) -> u16 {
    // SAFETY: inside the mapping (callers check), 2-byte aligned.
    unsafe { std::ptr::read_volatile(base.add(off) as *const u16) }
}

fn write_u32(base: *mut u8, off: usize, v: u32) {
    // SAFETY: inside a transmit slot this process owns (status AVAILABLE), 4-byte aligned.
    unsafe { std::ptr::write_volatile(base.add(off) as *mut u32, v) }
}

/// The room a ring slot keeps before a frame: the largest of the receive header with its
/// alignment (`tpacket_rcv` puts a V3 frame's network header at 96) and the transmit data
/// offsets, with a margin.
const SLOT_HEADROOM: usize = 128;
const _: () =
    assert!(SLOT_HEADROOM >= 96 && SLOT_HEADROOM >= hdr::V3_TX_DATA && SLOT_HEADROOM >= hdr::V2_TX_DATA);

/// The fewest bytes, in whole pages of `page` bytes, of a ring slot that holds a frame of
/// `mtu` bytes with its Ethernet and ring headers.
pub const fn slot_bytes_for(mtu: usize, page: usize) -> usize {
    (SLOT_HEADROOM + ETH_HEADER_LEN + mtu).next_multiple_of(page)
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// Read socket option `opt` of `level` into `value` (its starting contents are what the kernel
/// leaves of it: a shorter answer fills only its head).
///
/// # Safety
/// `T` must be the plain-data type the option fills, valid for any bytes the kernel writes.
pub(crate) unsafe fn getsockopt<T>(
    fd: &OwnedFd,
    level: libc::c_int,
    opt: libc::c_int,
    mut value: T,
) -> io::Result<T> {
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: `value` is writable for `len` bytes; the caller vouches for what may be written.
    let r = unsafe { libc::getsockopt(fd.as_raw_fd(), level, opt, (&mut value as *mut T).cast(), &mut len) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(value)
}

/// Set socket option `opt` of `level` to `value`, which must be the type the option takes.
pub(crate) fn setsockopt<T>(fd: &OwnedFd, level: libc::c_int, opt: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: `value` is a valid T of the size given, as the option expects.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("setsockopt({level}, {opt}): {e}")));
    }
    Ok(())
}

/// Write an Ethernet header from `src` to `dst` for `ethertype` at the start of `frame`.
pub(crate) fn write_eth_header(frame: &mut [u8], dst: Mac, src: Mac, ethertype: u16) {
    frame[0..6].copy_from_slice(&dst);
    frame[6..12].copy_from_slice(&src);
    frame[12..14].copy_from_slice(&ethertype.to_be_bytes());
}

/// A socket to ask the kernel about interfaces with (any socket answers the interface
/// ioctls), in the calling thread's network namespace.
pub(crate) fn query_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2), owned below.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Interface `ifname`'s index, MTU and MAC, asked through `fd`.
pub(crate) fn interface_on(fd: &OwnedFd, ifname: &str) -> io::Result<(i32, usize, Mac)> {
    let ifindex = ifreq_int(fd, ifname, libc::SIOCGIFINDEX)?;
    let mtu = ifreq_int(fd, ifname, libc::SIOCGIFMTU)? as usize;
    Ok((ifindex, mtu, ifreq_mac(fd, ifname)?))
}

/// How many receive queues interface `ifname` has (`ETHTOOL_GCHANNELS`: its receive-only and
/// combined channels), asked through `fd`.
pub(crate) fn rx_queues(fd: &OwnedFd, ifname: &str) -> io::Result<u32> {
    const ETHTOOL_GCHANNELS: u32 = 0x3c;
    /// `struct ethtool_channels`: cmd, then the maxima and the counts of rx, tx, other and
    /// combined channels.
    #[repr(C)]
    #[derive(Default)]
    struct Channels {
        cmd: u32,
        max: [u32; 4],
        rx: u32,
        tx: u32,
        other: u32,
        combined: u32,
    }
    let mut channels = Channels { cmd: ETHTOOL_GCHANNELS, ..Channels::default() };
    let mut ifr = ifreq_for(ifname)?;
    ifr.ifr_ifru.ifru_data = (&mut channels as *mut Channels).cast();
    ioctl(fd, ifname, libc::SIOCETHTOOL, &mut ifr)?;
    Ok(channels.rx + channels.combined)
}

fn ifreq_for(ifname: &str) -> io::Result<libc::ifreq> {
    let name = ifname.as_bytes();
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(&0) {
        return Err(invalid(format!("{ifname:?} is not an interface name")));
    }
    // SAFETY: an ifreq of zeros is valid (a union of plain data).
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    Ok(req)
}

fn ioctl(fd: &OwnedFd, ifname: &str, req: libc::c_ulong, ifr: &mut libc::ifreq) -> io::Result<()> {
    // SAFETY: the interface ioctls read the name from and write the answer into `ifr`.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, ifr as *mut libc::ifreq) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("interface {ifname}: {e}")));
    }
    Ok(())
}

/// SIOCGIFINDEX or SIOCGIFMTU: an int answer.
fn ifreq_int(fd: &OwnedFd, ifname: &str, req: libc::c_ulong) -> io::Result<i32> {
    let mut ifr = ifreq_for(ifname)?;
    ioctl(fd, ifname, req, &mut ifr)?;
    // SAFETY: both ioctls answer in the int member of the union.
    Ok(unsafe {
        if req == libc::SIOCGIFMTU {
            ifr.ifr_ifru.ifru_mtu
        } else {
            ifr.ifr_ifru.ifru_ifindex
        }
    })
}

fn ifreq_mac(fd: &OwnedFd, ifname: &str) -> io::Result<Mac> {
    let mut ifr = ifreq_for(ifname)?;
    ioctl(fd, ifname, libc::SIOCGIFHWADDR, &mut ifr)?;
    // SAFETY: SIOCGIFHWADDR answers in the hwaddr member.
    let data = unsafe { ifr.ifr_ifru.ifru_hwaddr.sa_data };
    let mut mac = [0u8; 6];
    for (m, d) in mac.iter_mut().zip(data.iter()) {
        *m = *d as u8;
    }
    Ok(mac)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_fit_the_mtu_and_a_byte_cap_shrinks_the_rings() {
        let d = RingConfig { rx_slots: 128, tx_slots: 64, ..RingConfig::default() };
        let at = |mtu| d.for_mtu(mtu, 4096).unwrap();
        assert_eq!(at(1500).slot_bytes, 4096);
        assert_eq!(at(9000).slot_bytes, 12 << 10);
        assert_eq!(at(65535).slot_bytes, 68 << 10);
        assert_eq!((at(65535).rx_slots, at(65535).tx_slots), (128, 64), "no cap, no change");

        // A cap of what jumbo rings take: jumbo and smaller keep their slots, 65,535 gets
        // the least.
        let capped = RingConfig { bytes_max: 192 * (12 << 10), ..d };
        let at = |mtu| capped.for_mtu(mtu, 4096).unwrap();
        assert_eq!((at(1500).rx_slots, at(1500).tx_slots), (128, 64));
        assert_eq!((at(9000).rx_slots, at(9000).tx_slots), (128, 64));
        assert_eq!((at(65535).rx_slots, at(65535).tx_slots), (RING_SLOTS_MIN, RING_SLOTS_MIN / 2));
        let mid = at(32768);
        assert_eq!(mid.slot_bytes, 36 << 10);
        assert!(mid.rx_slots < 128 && mid.rx_slots >= RING_SLOTS_MIN, "{mid:?}");
        assert!((mid.rx_slots + mid.tx_slots) * mid.slot_bytes <= capped.bytes_max, "{mid:?}");

        // A slot size given must hold a frame; a cap never raises a count.
        let small = RingConfig { slot_bytes: 16 << 10, ..d };
        assert!(small.for_mtu(9000, 4096).is_ok());
        let e = small.for_mtu(65535, 4096).unwrap_err();
        assert!(e.contains("MTU 65535") && e.contains("69632"), "{e}");
        let few = RingConfig { rx_slots: 8, tx_slots: 2, bytes_max: 1, ..d };
        assert_eq!(
            (few.for_mtu(65535, 4096).unwrap().rx_slots, few.for_mtu(65535, 4096).unwrap().tx_slots),
            (8, 2)
        );
    }
}
