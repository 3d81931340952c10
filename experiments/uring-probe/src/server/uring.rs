//! The io_uring server loop, in the variants the modes name.
//!
//! Per pass it queues what is due (a receive if none is armed, a send of the flight batch if
//! none is in progress) and makes one `io_uring_enter` that both submits and waits. The wait asks
//! for two completions when a receive and an all-or-nothing send (`MSG_WAITALL`) are both armed
//! (three with a zero-copy notification): the send finishes without help, and every response is
//! then with the client, so the next request will come. A send that may complete short
//! (`WRITEV_FIXED`) is waited for alone, else the server could sleep on a receive while the
//! client still waits for the rest of a response.
//!
//! All variants share the ring set-up (single issuer, deferred task work, registered ring fd),
//! the region layout and the response code; only the receive or send opcode changes.

use std::net::TcpStream;
use std::os::fd::AsRawFd;

use io_uring::{cqueue, opcode, squeue, types, IoUring, Probe};

use super::bufring::BufRing;
use super::{data_area_len, ServerStats, RX_BYTES};
use crate::error::ProbeError;
use crate::region::Region;
use crate::respond::Responder;
use crate::rx::RxBuffer;
use crate::tx::{Limits, TxPair};
use rt::usage;

const RING_ENTRIES: u32 = 64;
const UD_RECV: u64 = 1;
const UD_SEND: u64 = 2;
/// Provided buffers for multishot receive: requests are small, so a few 16 KiB buffers go far.
const BUF_GROUP: u16 = 7;
const BUF_COUNT: u16 = 64;
const BUF_BYTES: usize = 16 << 10;
/// `IORING_RECVSEND_FIXED_BUF` (sqe->ioprio): the send's iovecs lie in a registered buffer. The
/// io-uring crate's bindings are private, so the uapi value is repeated here.
const RECVSEND_FIXED_BUF: u16 = 1 << 2;
/// Index of the one registered buffer (the whole region).
const REGION_BUF_INDEX: u16 = 0;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvKind {
    Single,
    Multishot,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendKind {
    SendMsg,
    WritevFixed,
    SendZcFixed,
}

impl SendKind {
    fn registered(self) -> bool {
        self != SendKind::SendMsg
    }

    /// True when the completion means every byte was queued (`MSG_WAITALL` retries short sends).
    fn all_or_nothing(self) -> bool {
        self != SendKind::WritevFixed
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub recv: RecvKind,
    pub send: SendKind,
}

impl Plan {
    pub const SINGLE_SENDMSG: Plan = Plan { recv: RecvKind::Single, send: SendKind::SendMsg };
    pub const MULTISHOT_SENDMSG: Plan = Plan { recv: RecvKind::Multishot, send: SendKind::SendMsg };
    pub const SINGLE_WRITEV_FIXED: Plan = Plan { recv: RecvKind::Single, send: SendKind::WritevFixed };
    pub const SINGLE_SEND_ZC: Plan = Plan { recv: RecvKind::Single, send: SendKind::SendZcFixed };
}

/// Can this process set up an io_uring at all? The error names the cause.
pub fn check_available() -> Result<(), ProbeError> {
    match IoUring::new(8) {
        Ok(_) => Ok(()),
        Err(e) => Err(ProbeError::Unavailable(match e.raw_os_error() {
            Some(libc::ENOSYS) => "io_uring_setup: ENOSYS, this kernel is built without io_uring".to_string(),
            Some(libc::EPERM) => "io_uring_setup: EPERM, io_uring is disabled for this process \
                 (sysctl kernel.io_uring_disabled, a seccomp filter or a container policy)"
                .to_string(),
            _ => format!("io_uring_setup failed: {e}"),
        })),
    }
}

fn build_ring() -> Result<IoUring, ProbeError> {
    // Single issuer and deferred task work cut the kernel's own locking and wake-ups for a
    // ring one thread drives; fall back quietly to a plain ring on kernels before 6.1.
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(RING_ENTRIES)
        .or_else(|_| IoUring::new(RING_ENTRIES))
        .map_err(ProbeError::io("io_uring_setup"))
}

fn check_opcodes(ring: &IoUring, plan: Plan) -> Result<(), ProbeError> {
    let mut probe = Probe::new();
    ring.submitter().register_probe(&mut probe).map_err(ProbeError::io("register_probe"))?;
    let needed: &[(u8, &str)] = match plan.send {
        SendKind::SendMsg => &[(opcode::SendMsg::CODE, "SENDMSG")],
        SendKind::WritevFixed => &[(opcode::WritevFixed::CODE, "WRITEV_FIXED (Linux 6.15)")],
        SendKind::SendZcFixed => &[(opcode::SendMsgZc::CODE, "SENDMSG_ZC (Linux 6.1)")],
    };
    for &(code, name) in needed.iter().chain(&[(opcode::Recv::CODE, "RECV")]) {
        if !probe.is_supported(code) {
            return Err(ProbeError::Unavailable(format!("the kernel lacks IORING_OP_{name}")));
        }
    }
    Ok(())
}

/// What the loop keeps between passes.
#[derive(Default)]
struct Armed {
    recv: bool,
    send: bool,
    /// A zero-copy send completed but the kernel may still read its pages.
    notif: bool,
    eof: bool,
    /// Bytes the armed send asked for, to tell a short completion from a full one.
    send_bytes: usize,
}

pub fn serve(
    plan: Plan,
    sock: TcpStream,
    limits: Limits,
    ready: &dyn Fn(),
) -> Result<ServerStats, ProbeError> {
    let fd = types::Fd(sock.as_raw_fd());
    let data_len = data_area_len(limits.bs_max);
    let mut region = Region::new(data_len, limits.slots_len()).map_err(ProbeError::io("mmap"))?;
    let region_iov = region.as_iovec();
    let mut ring = build_ring()?;
    check_opcodes(&ring, plan)?;
    if plan.send.registered() {
        // SAFETY: the region outlives the ring (the ring is dropped first, below) and is never
        // unmapped while registered.
        unsafe { ring.submitter().register_buffers(&[region_iov]) }
            .map_err(ProbeError::io("register_buffers"))?;
    }
    let mut bufs = match plan.recv {
        RecvKind::Single => None,
        RecvKind::Multishot => Some(
            BufRing::new(&ring.submitter(), BUF_GROUP, BUF_COUNT, BUF_BYTES)
                .map_err(ProbeError::io("register_buf_ring"))?,
        ),
    };
    let (data, slots) = region.split();
    let mut tx = TxPair::new(slots, &limits);
    let mut rx = RxBuffer::new(RX_BYTES);
    let mut responder = Responder::new(limits, data_len);
    // Only ever read by the kernel while a SENDMSG is armed; rewritten between sends.
    // SAFETY: msghdr is plain data for which all-zero is a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    let mut armed = Armed::default();
    let mut enters = 0u64;

    let (mut submitter, mut sq, mut cq) = ring.split();
    // Saves a file-table lookup per enter; optional, so a refusal changes nothing else.
    let _ = submitter.register_ring_fd();

    ready();
    let before = usage::this_thread();
    loop {
        if !armed.recv && !armed.eof {
            rx.compact();
            let entry = match plan.recv {
                RecvKind::Single => {
                    let (ptr, len) = rx.spare_raw();
                    opcode::Recv::new(fd, ptr, len as u32).build()
                }
                RecvKind::Multishot => opcode::RecvMulti::new(fd, BUF_GROUP).build(),
            };
            // SAFETY: a single receive writes only into rx's spare tail, which is neither
            // touched nor moved until its completion; a multishot one writes only into the
            // registered buffer ring, which outlives the ring.
            unsafe { push(&mut sq, &entry.user_data(UD_RECV))? };
            armed.recv = true;
        }
        if !armed.send && !armed.notif {
            if let Some(flight) = tx.poll_flight() {
                let pending = flight.pending();
                armed.send_bytes = pending.iter().map(|iov| iov.iov_len).sum();
                let entry = send_entry(plan.send, fd, pending, &mut msg);
                // SAFETY: the iovecs and `msg` point into the region and into this frame; the
                // flight batch is neither rewritten nor swapped out until the send (and for
                // zero-copy, its notification) has completed.
                unsafe { push(&mut sq, &entry.user_data(UD_SEND))? };
                armed.send = true;
            }
        }
        if armed.eof && !armed.recv && !armed.send && !armed.notif && tx.is_idle() {
            break;
        }
        let want = wait_for(plan.send, &armed);
        sq.sync();
        enters += 1;
        match submitter.submit_and_wait(want) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) => return Err(ProbeError::Io { op: "io_uring_enter", source: e }),
        }
        cq.sync();
        let mut received = false;
        for cqe in &mut cq {
            match cqe.user_data() {
                UD_RECV => received |= handle_recv(&cqe, &mut armed, &mut rx, bufs.as_mut())?,
                UD_SEND => handle_send(&cqe, plan.send, &mut armed, &mut tx)?,
                other => unreachable!("unknown user_data {other}"),
            }
        }
        // Publish the new head now: the kernel counts unreleased CQEs towards `want`, and
        // would return at once on entries we have already handled.
        cq.sync();
        // Only after a receive: with a single receive armed, rx must not be consumed (that
        // can rewind its end under the kernel), and nothing new can be complete anyway.
        if received {
            responder.handle_requests(&mut rx, data, tx.staged())?;
        }
    }
    let usage = usage::this_thread().since(&before);
    // The ring goes first: until it is closed the kernel may still write into the buffer ring.
    drop(cq);
    drop(sq);
    drop(ring);
    drop(bufs);
    Ok(ServerStats { caravans: responder.caravans, payloads: responder.payloads, syscalls: enters, usage })
}

/// How many completions one enter may wait for without risking a wait on a request the client
/// cannot send yet (see the module comment).
fn wait_for(kind: SendKind, armed: &Armed) -> usize {
    if !(armed.send && armed.recv && kind.all_or_nothing()) {
        return 1;
    }
    // A zero-copy send also posts a notification once the kernel lets go of the pages.
    if kind == SendKind::SendZcFixed {
        3
    } else {
        2
    }
}

/// Queue one SQE.
///
/// # Safety
///
/// Every buffer the entry names must stay valid, and unmoved, until its completion arrives.
unsafe fn push(sq: &mut squeue::SubmissionQueue<'_>, entry: &squeue::Entry) -> Result<(), ProbeError> {
    // SAFETY: forwarded to the caller.
    unsafe { sq.push(entry) }
        .map_err(|_| ProbeError::Corrupt("submission queue full; at most two SQEs per pass".into()))
}

/// The SQE sending `iovs` the way `kind` says.
fn send_entry(kind: SendKind, fd: types::Fd, iovs: &[libc::iovec], msg: &mut libc::msghdr) -> squeue::Entry {
    let flags = libc::MSG_WAITALL | libc::MSG_NOSIGNAL;
    match kind {
        SendKind::SendMsg => {
            msg.msg_iov = iovs.as_ptr() as *mut libc::iovec;
            msg.msg_iovlen = iovs.len();
            opcode::SendMsg::new(fd, msg).flags(flags as u32).build()
        }
        // Sockets are non-seekable: the offset is ignored, 0 as for a pipe.
        SendKind::WritevFixed => {
            opcode::WritevFixed::new(fd, iovs.as_ptr(), iovs.len() as u32, REGION_BUF_INDEX).build()
        }
        // Vectored registered buffers for SENDMSG_ZC (Linux 6.15). The builder has no
        // buf_index field; it leaves the SQE's zeroed, which is REGION_BUF_INDEX. (SEND_ZC with
        // IORING_SEND_VECTORIZED and a fixed buffer is refused with EINVAL on 6.18.)
        SendKind::SendZcFixed => {
            const _: () = assert!(REGION_BUF_INDEX == 0);
            msg.msg_iov = iovs.as_ptr() as *mut libc::iovec;
            msg.msg_iovlen = iovs.len();
            opcode::SendMsgZc::new(fd, msg).ioprio(RECVSEND_FIXED_BUF).flags(flags as u32).build()
        }
    }
}

fn handle_recv(
    cqe: &cqueue::Entry,
    armed: &mut Armed,
    rx: &mut RxBuffer,
    bufs: Option<&mut BufRing>,
) -> Result<bool, ProbeError> {
    let res = cqe.result();
    let more = bufs.is_some() && cqueue::more(cqe.flags());
    if !more {
        armed.recv = false;
    }
    match res {
        0 => armed.eof = true,
        // Multishot ran out of buffers (re-armed next pass), or a signal interrupted us.
        r if r == -libc::ENOBUFS || r == -libc::EINTR || r == -libc::EAGAIN => {}
        r if r < 0 => return Err(ProbeError::errno("recv", r)),
        n => match bufs {
            None => rx.commit(n as usize),
            Some(bufs) => {
                let bid = cqueue::buffer_select(cqe.flags())
                    .ok_or_else(|| ProbeError::Corrupt("multishot recv without a buffer".into()))?;
                let copied = rx.append(bufs.buffer(bid, n as usize));
                bufs.recycle(bid);
                if !copied {
                    return Err(ProbeError::Corrupt("receive buffer overflow".into()));
                }
            }
        },
    }
    Ok(res > 0)
}

fn handle_send(
    cqe: &cqueue::Entry,
    kind: SendKind,
    armed: &mut Armed,
    tx: &mut TxPair<'_>,
) -> Result<(), ProbeError> {
    let flags = cqe.flags();
    if cqueue::notif(flags) {
        armed.notif = false;
        return Ok(());
    }
    armed.send = false;
    armed.notif = cqueue::more(flags);
    let res = cqe.result();
    if res < 0 {
        if res == -libc::EINVAL && kind.registered() {
            return Err(ProbeError::Unavailable(format!(
                "the kernel refused {kind:?} with EINVAL (vectored sends from registered \
                 buffers need Linux 6.15)"
            )));
        }
        return Err(ProbeError::errno("send", res));
    }
    let sent = res as usize;
    if sent > armed.send_bytes {
        return Err(ProbeError::Corrupt(format!("sent {sent} of {} bytes", armed.send_bytes)));
    }
    tx.handle_sent(sent);
    Ok(())
}
