//! The target's view of one connection.
//!
//! [`ServerSession`] checks that the peer follows the protocol and keeps the table of export
//! handles this connection opened. It does not execute anything: [`admit`] judges each frame
//! from its header alone, as soon as the header has arrived and before any byte of the body is
//! waited for, and [`handle_frame`] classifies the whole frame into an [`Inbound`] for the
//! driver to act on.
//!
//! The order of checks on a frame (docs/PROTOCOL.md, section 10.2): the header itself
//! ([`wire::Header::parse`]); then state and direction (HELLO first and once, only kinds an
//! initiator sends); then the limits the header can be held to (descriptors and payload bytes
//! of a caravan against the negotiated limits, a control body against 64 KiB); then the body.
//!
//! [`admit`]: ServerSession::admit
//! [`handle_frame`]: ServerSession::handle_frame

use wire::control::{Hello, HelloReply, Limits, Open, CONTROL_BODY_MAX};
use wire::{caravan::RequestCaravan, FrameKind, Header, Status, WireError, VERSION};

use crate::ProtoError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    AwaitHello,
    Ready,
}

/// A frame from the initiator, classified and checked.
#[derive(Debug)]
pub enum Inbound<'a> {
    /// HELLO accepted: send this HELLO_REPLY body. `refused` means close after sending.
    Hello {
        reply: HelloReply,
    },
    Open(Open),
    List,
    Stats,
    Requests(RequestCaravan<'a>),
    Revoke(wire::Revoke),
    /// The initiator is closing the connection (status `Ok` for a clean close).
    GoAway(wire::GoAway),
}

/// One connection's protocol state on the target.
#[derive(Debug)]
pub struct ServerSession {
    state: State,
    /// What this target offers before negotiation.
    offered: Limits,
    /// What was agreed; equal to `offered` until HELLO.
    limits: Limits,
    /// Export indices (into the target's export table) by handle.
    handles: Vec<u32>,
    open_handles_max: usize,
    /// Direct reads were negotiated (HELLO feature bit 1).
    direct_reads: bool,
}

impl ServerSession {
    /// A connection offering `offered` in the handshake and allowing `open_handles_max`
    /// exports open at once.
    pub fn new(offered: Limits, open_handles_max: usize) -> ServerSession {
        ServerSession {
            state: State::AwaitHello,
            offered,
            limits: offered,
            handles: Vec::with_capacity(open_handles_max),
            open_handles_max,
            direct_reads: false,
        }
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Whether the handshake is done (a `HELLO` was answered): from then on the connection
    /// counts as established, no longer as a handshake the target may evict or time out.
    pub fn is_established(&self) -> bool {
        self.state == State::Ready
    }

    /// Judge a frame from its header alone, before its body is read: is this kind allowed now
    /// from an initiator, and is it within the limits? An error means the connection must
    /// close (with the GOAWAY status [`ProtoError::goaway_status`] gives).
    pub fn admit(&self, header: &Header) -> Result<(), ProtoError> {
        use FrameKind::*;
        match (self.state, header.kind) {
            (State::AwaitHello, Hello) => {}
            (State::AwaitHello, kind) => return Err(ProtoError::Unexpected(kind, "before HELLO")),
            (State::Ready, Hello) => return Err(ProtoError::Unexpected(Hello, "twice")),
            (State::Ready, Open | List | Stats | GoAway | Requests | Revoke) => {}
            (State::Ready, kind) => return Err(ProtoError::Unexpected(kind, "from an initiator")),
        }
        if header.kind.is_caravan() {
            let l = &self.limits;
            ProtoError::check_limit(
                "descriptors per caravan",
                header.desc_count.into(),
                l.caravan_reqs_max.into(),
            )?;
            ProtoError::check_limit(
                "caravan payload bytes",
                header.payload_len.into(),
                l.caravan_bytes_max.into(),
            )
        } else {
            ProtoError::check_limit("control body bytes", header.payload_len.into(), CONTROL_BODY_MAX as u64)
        }
    }

    /// Classify one complete frame that [`admit`](Self::admit) let through. An error means the
    /// connection must close.
    pub fn handle_frame<'a>(&mut self, header: &Header, body: &'a [u8]) -> Result<Inbound<'a>, ProtoError> {
        self.admit(header)?;
        match header.kind {
            FrameKind::Hello => self.handle_hello(body),
            FrameKind::Open => Ok(Inbound::Open(Open::decode(body)?)),
            FrameKind::List => empty(body, "LIST").map(|_| Inbound::List),
            FrameKind::Stats => empty(body, "STATS").map(|_| Inbound::Stats),
            FrameKind::Revoke => Ok(Inbound::Revoke(wire::Revoke::decode(body)?)),
            FrameKind::GoAway => Ok(Inbound::GoAway(wire::GoAway::decode(body)?)),
            FrameKind::Requests => Ok(Inbound::Requests(RequestCaravan::parse(header, body)?)),
            kind => Err(ProtoError::Unexpected(kind, "from an initiator")),
        }
    }

    fn handle_hello<'a>(&mut self, body: &[u8]) -> Result<Inbound<'a>, ProtoError> {
        let hello = Hello::decode(body)?;
        let speaks_v1 = hello.version_min <= VERSION && VERSION <= hello.version_max;
        if !speaks_v1 {
            let reply = HelloReply {
                status: Status::VersionMismatch,
                version: VERSION,
                features: 0,
                limits: self.offered,
            };
            return Ok(Inbound::Hello { reply });
        }
        self.limits = self.offered.negotiate(&hello.limits);
        self.state = State::Ready;
        // The agreed features are those asked for that this target speaks.
        let features = hello.features & wire::control::FEATURE_DIRECT_READS;
        self.direct_reads = features & wire::control::FEATURE_DIRECT_READS != 0;
        let reply = HelloReply { status: Status::Ok, version: VERSION, features, limits: self.limits };
        Ok(Inbound::Hello { reply })
    }

    /// Record that this connection opened export `export_index`; returns its handle, or
    /// `TooManyOpen`. Opening the same export twice returns the same handle.
    pub fn open_handle(&mut self, export_index: u32) -> Result<u32, Status> {
        if let Some(h) = self.handles.iter().position(|&e| e == export_index) {
            return Ok(h as u32);
        }
        if self.handles.len() >= self.open_handles_max {
            return Err(Status::TooManyOpen);
        }
        self.handles.push(export_index);
        Ok(self.handles.len() as u32 - 1)
    }

    /// Whether the initiator asked for direct reads in its HELLO (and so understands
    /// `CAPABILITIES` frames).
    pub fn direct_reads(&self) -> bool {
        self.direct_reads
    }

    /// The export index behind `handle`, if this connection opened it.
    pub fn resolve(&self, handle: u32) -> Option<u32> {
        self.handles.get(handle as usize).copied()
    }
}

fn empty(body: &[u8], what: &'static str) -> Result<(), ProtoError> {
    if body.is_empty() {
        Ok(())
    } else {
        Err(WireError::Body(what).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(limits: Limits) -> Vec<u8> {
        Hello { version_min: 1, version_max: 1, features: 0, limits }.encode()
    }

    fn header(kind: FrameKind, desc_count: u16, payload_len: u32) -> Header {
        Header { kind, desc_count, payload_len }
    }

    #[test]
    fn hello_first_then_anything() {
        let mut s = ServerSession::new(Limits::default(), 16);
        let err = s.handle_frame(&header(FrameKind::List, 0, 0), &[]).unwrap_err();
        assert!(matches!(err, ProtoError::Unexpected(FrameKind::List, _)));

        let body = hello(Limits { queue_depth: 8, ..Limits::default() });
        let h = header(FrameKind::Hello, 0, body.len() as u32);
        match s.handle_frame(&h, &body).unwrap() {
            Inbound::Hello { reply } => {
                assert_eq!(reply.status, Status::Ok);
                assert_eq!(reply.limits.queue_depth, 8);
                assert_eq!(reply.limits.caravan_reqs_max, 8, "a caravan never exceeds the queue");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(s.handle_frame(&h, &body), Err(ProtoError::Unexpected(FrameKind::Hello, _))));
        assert!(matches!(s.handle_frame(&header(FrameKind::List, 0, 0), &[]), Ok(Inbound::List)));
    }

    #[test]
    fn version_mismatch_is_answered_not_accepted() {
        let mut s = ServerSession::new(Limits::default(), 16);
        let body = Hello { version_min: 2, version_max: 3, features: 0, limits: Limits::default() }.encode();
        let h = header(FrameKind::Hello, 0, body.len() as u32);
        match s.handle_frame(&h, &body).unwrap() {
            Inbound::Hello { reply } => assert_eq!(reply.status, Status::VersionMismatch),
            other => panic!("unexpected {other:?}"),
        }
        // Still waiting for an acceptable HELLO: nothing else is allowed.
        assert!(s.handle_frame(&header(FrameKind::Stats, 0, 0), &[]).is_err());
    }

    #[test]
    fn caravans_over_the_limits_break_the_connection() {
        let mut s = ServerSession::new(Limits::default(), 16);
        let body = hello(Limits {
            caravan_reqs_max: 4,
            caravan_bytes_max: 8192,
            io_bytes_max: 4096,
            queue_depth: 0,
        });
        s.handle_frame(&header(FrameKind::Hello, 0, body.len() as u32), &body).unwrap();
        let too_many = header(FrameKind::Requests, 5, 0);
        let err = s.handle_frame(&too_many, &[0u8; 5 * 32]).unwrap_err();
        assert!(matches!(err, ProtoError::OverLimit { what: "descriptors per caravan", .. }));
        let too_big = header(FrameKind::Requests, 0, 8193);
        assert!(s.handle_frame(&too_big, &vec![0u8; 8193]).is_err());
        assert!(matches!(
            s.handle_frame(&header(FrameKind::Completions, 0, 0), &[]),
            Err(ProtoError::Unexpected(FrameKind::Completions, _))
        ));
    }

    #[test]
    fn handles_are_bounded_and_stable() {
        let mut s = ServerSession::new(Limits::default(), 16);
        for i in 0..16 {
            assert_eq!(s.open_handle(i * 10), Ok(i));
        }
        assert_eq!(s.open_handle(30), Ok(3), "reopening returns the same handle");
        assert_eq!(s.open_handle(999), Err(Status::TooManyOpen));
        assert_eq!(s.resolve(2), Some(20));
        assert_eq!(s.resolve(16), None);
    }
}
