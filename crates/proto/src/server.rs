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

use wire::control::{
    Hello, HelloReply, Limits, Open, CONTROL_BODY_MAX, FEATURE_AUTH, FEATURE_DATA_MESSAGES,
    FEATURE_DIRECT_READS, NONCE_LEN, PROOF_LEN,
};
use wire::{caravan::RequestCaravan, FrameKind, Header, Status, WireError, VERSION};

use std::collections::HashMap;

use crate::auth::{proofs_equal, Key};
use crate::grant::Bound;
use crate::ProtoError;

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    AwaitHello,
    /// HELLO asked to authenticate with key `name` (`None` in `key` when the target knows no
    /// such key); waiting for AUTH.
    AwaitAuth {
        name: String,
        key: Option<Key>,
        client_nonce: [u8; NONCE_LEN],
    },
    Ready,
}

/// What a target authenticates with: the keys it knows, and this connection's nonce (drawn by
/// the driver from the OS).
#[derive(Debug, Clone)]
pub struct AuthConfig {
    pub keys: std::sync::Arc<Vec<Key>>,
    pub nonce: [u8; NONCE_LEN],
}

/// A frame from the initiator, classified and checked.
#[derive(Debug)]
pub enum Inbound<'a> {
    /// HELLO accepted: send this HELLO_REPLY body. `refused` means close after sending.
    Hello {
        reply: HelloReply,
    },
    /// AUTH judged: send this AUTH_REPLY; on a status other than `Ok` close after sending.
    /// `key` names the key tried, and `reason` says what failed, for the log (never sent).
    Auth {
        reply: wire::AuthReply,
        key: String,
        reason: Option<&'static str>,
    },
    Open(Open),
    List,
    Stats,
    Requests(RequestCaravan<'a>),
    Revoke(wire::Revoke),
    /// Chunk grants presented for a handle: the driver judges them against the export's
    /// [`crate::grant::PoolGrants`] and [`bind`](ServerSession::bind)s those it admits.
    Grant(wire::Grant),
    /// A reference asked for a range of an export (FlashNet's lazy registration): the driver
    /// seals one, or refuses, and sends the `REGISTER_REPLY`.
    Register(wire::Register),
    /// The initiator is closing the connection (status `Ok` for a clean close).
    GoAway(wire::GoAway),
    /// A volume request from a connection allowed to make it
    /// ([`may_manage_volumes`](ServerSession::may_manage_volumes)): the driver executes it and
    /// sends the `VOLUME_REPLY`.
    Volume(wire::VolumeRequest),
    /// A volume request from a connection that may not make one: send a `VOLUME_REPLY` with
    /// this status; the connection goes on.
    VolumeRefused {
        op: wire::VolumeOp,
        status: Status,
    },
}

/// One connection's protocol state on the target.
#[derive(Debug)]
pub struct ServerSession {
    state: State,
    /// What this target offers before negotiation.
    offered: Limits,
    /// What was agreed; equal to `offered` until HELLO.
    limits: Limits,
    /// Export indices (into the target's export table) by handle, and whether the handle was
    /// granted read-only.
    handles: Vec<(u32, bool)>,
    /// The chunk grants bound to each handle, by chunk (at most one per chunk of the export's
    /// pool, so bounded by its size).
    grants: Vec<HashMap<u64, Bound>>,
    auth: Option<AuthConfig>,
    /// The key this initiator proved, once it has.
    principal: Option<String>,
    open_handles_max: usize,
    /// Direct reads were negotiated (HELLO feature bit 1).
    direct_reads: bool,
    /// The transport can send data messages, and they were negotiated (HELLO feature bit 2).
    data_messages_offered: bool,
    data_messages: bool,
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
            grants: Vec::new(),
            auth: None,
            principal: None,
            open_handles_max,
            direct_reads: false,
            data_messages_offered: false,
            data_messages: false,
        }
    }

    /// Agree to data messages when an initiator asks (its connection's transport can send
    /// them: raw Ethernet).
    pub fn with_data_messages(mut self) -> ServerSession {
        self.data_messages_offered = true;
        self
    }

    /// Whether completion caravans' read data goes in data messages on this connection
    /// (HELLO feature bit 2 agreed): the driver switches its transport over once HELLO_REPLY
    /// is queued.
    pub fn data_messages(&self) -> bool {
        self.data_messages
    }

    /// Authenticate initiators that ask with these keys and this connection's nonce. Without,
    /// an initiator asking to authenticate fails: this target knows no keys.
    pub fn with_auth(mut self, auth: AuthConfig) -> ServerSession {
        self.auth = Some(auth);
        self
    }

    /// The key the initiator proved (`None`: it gave none).
    pub fn principal(&self) -> Option<&str> {
        self.principal.as_deref()
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Whether the handshake is done (a `HELLO` was answered): from then on the connection
    /// counts as established, no longer as a handshake the target may evict or time out.
    pub fn is_established(&self) -> bool {
        self.state == State::Ready
    }

    /// Whether a HELLO asked to authenticate and AUTH has not come yet.
    pub fn is_authenticating(&self) -> bool {
        matches!(self.state, State::AwaitAuth { .. })
    }

    /// Judge a frame from its header alone, before its body is read: is this kind allowed now
    /// from an initiator, and is it within the limits? An error means the connection must
    /// close (with the GOAWAY status [`ProtoError::goaway_status`] gives).
    pub fn admit(&self, header: &Header) -> Result<(), ProtoError> {
        use FrameKind::*;
        match (&self.state, header.kind) {
            (State::AwaitHello, Hello) => {}
            (State::AwaitHello, kind) => return Err(ProtoError::Unexpected(kind, "before HELLO")),
            (State::AwaitAuth { .. }, Auth | GoAway) => {}
            (State::AwaitAuth { .. }, kind) => return Err(ProtoError::Unexpected(kind, "before AUTH")),
            (State::Ready, Hello) => return Err(ProtoError::Unexpected(Hello, "twice")),
            (State::Ready, Open | List | Stats | GoAway | Requests | Revoke | Grant | Register | Volume) => {}
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
            FrameKind::Auth => self.handle_auth(body),
            FrameKind::Open => Ok(Inbound::Open(Open::decode(body)?)),
            FrameKind::List => empty(body, "LIST").map(|_| Inbound::List),
            FrameKind::Stats => empty(body, "STATS").map(|_| Inbound::Stats),
            FrameKind::Revoke => Ok(Inbound::Revoke(wire::Revoke::decode(body)?)),
            FrameKind::Grant => Ok(Inbound::Grant(wire::Grant::decode(body)?)),
            FrameKind::Register => Ok(Inbound::Register(wire::Register::decode(body)?)),
            FrameKind::GoAway => Ok(Inbound::GoAway(wire::GoAway::decode(body)?)),
            FrameKind::Requests => Ok(Inbound::Requests(RequestCaravan::parse(header, body)?)),
            FrameKind::Volume => self.handle_volume(body),
            kind => Err(ProtoError::Unexpected(kind, "from an initiator")),
        }
    }

    fn handle_volume<'a>(&self, body: &[u8]) -> Result<Inbound<'a>, ProtoError> {
        let request = wire::VolumeRequest::decode(body)?;
        if !self.may_manage_volumes() {
            return Ok(Inbound::VolumeRefused { op: request.op, status: Status::AuthRequired });
        }
        Ok(Inbound::Volume(request))
    }

    /// Whether this connection may send volume requests (docs/PROTOCOL.md, section 17.3): on
    /// a target that knows keys, only once it has proved one (any key: volumes have no access
    /// lists of their own), since a volume request can delete data no export's list protects;
    /// on a target without keys, as any connection may open any export, any connection.
    pub fn may_manage_volumes(&self) -> bool {
        self.principal.is_some() || self.auth.as_ref().is_none_or(|a| a.keys.is_empty())
    }

    /// The handle this connection already holds on export `export_index`, if it opened it.
    pub fn handle_of(&self, export_index: u32) -> Option<u32> {
        self.handles.iter().position(|&(e, _)| e == export_index).map(|h| h as u32)
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
                auth_nonce: None,
            };
            return Ok(Inbound::Hello { reply });
        }
        self.limits = self.offered.negotiate(&hello.limits);
        // The agreed features are those asked for that this target speaks.
        let spoken = FEATURE_DIRECT_READS
            | FEATURE_AUTH
            | if self.data_messages_offered { FEATURE_DATA_MESSAGES } else { 0 };
        let features = hello.features & spoken;
        self.direct_reads = features & FEATURE_DIRECT_READS != 0;
        self.data_messages = features & FEATURE_DATA_MESSAGES != 0;
        let auth_nonce = match hello.auth {
            Some(a) => {
                // An unknown key goes on to AUTH like a known one, and fails there: whether a
                // key name exists is not for the initiator to learn.
                let key =
                    self.auth.as_ref().and_then(|c| c.keys.iter().find(|k| k.name == a.key_name).cloned());
                self.state = State::AwaitAuth { name: a.key_name, key, client_nonce: a.nonce };
                Some(self.auth.as_ref().map_or([0; NONCE_LEN], |c| c.nonce))
            }
            None => {
                self.state = State::Ready;
                None
            }
        };
        let reply =
            HelloReply { status: Status::Ok, version: VERSION, features, limits: self.limits, auth_nonce };
        Ok(Inbound::Hello { reply })
    }

    fn handle_auth<'a>(&mut self, body: &[u8]) -> Result<Inbound<'a>, ProtoError> {
        let auth = wire::Auth::decode(body)?;
        let State::AwaitAuth { name, key, client_nonce } =
            std::mem::replace(&mut self.state, State::AwaitHello)
        else {
            return Err(ProtoError::Unexpected(FrameKind::Auth, "without a HELLO asking for it"));
        };
        let target_nonce = self.auth.as_ref().map_or([0; NONCE_LEN], |c| c.nonce);
        let refuse = |reason| Inbound::Auth {
            reply: wire::AuthReply { status: Status::AuthFailed, proof: [0; PROOF_LEN] },
            key: name.clone(),
            reason: Some(reason),
        };
        let Some(key) = key else { return Ok(refuse("unknown key")) };
        if !proofs_equal(&key.client_proof(&client_nonce, &target_nonce), &auth.proof) {
            return Ok(refuse("wrong proof: not this key's secret"));
        }
        self.state = State::Ready;
        self.principal = Some(name.clone());
        let reply =
            wire::AuthReply { status: Status::Ok, proof: key.target_proof(&client_nonce, &target_nonce) };
        Ok(Inbound::Auth { reply, key: name, reason: None })
    }

    /// Record that this connection opened export `export_index`, read-only or not; returns its
    /// handle, or `TooManyOpen`. Opening the same export twice returns the same handle.
    pub fn open_handle(&mut self, export_index: u32, read_only: bool) -> Result<u32, Status> {
        if let Some(h) = self.handles.iter().position(|&(e, _)| e == export_index) {
            self.handles[h].1 = read_only;
            return Ok(h as u32);
        }
        if self.handles.len() >= self.open_handles_max {
            return Err(Status::TooManyOpen);
        }
        self.handles.push((export_index, read_only));
        self.grants.push(HashMap::new());
        Ok(self.handles.len() as u32 - 1)
    }

    /// Hold an admitted chunk grant on `handle` (replacing what it held for that chunk).
    /// Ignored for a handle never opened.
    pub fn bind(&mut self, handle: u32, bound: Bound) {
        if let Some(g) = self.grants.get_mut(handle as usize) {
            g.insert(bound.chunk, bound);
        }
    }

    /// The grant `handle` holds for `chunk`, if any.
    pub fn bound(&self, handle: u32, chunk: u64) -> Option<&Bound> {
        self.grants.get(handle as usize)?.get(&chunk)
    }

    /// Some grant `handle` holds, if it holds any.
    pub fn any_bound(&self, handle: u32) -> Option<&Bound> {
        self.grants.get(handle as usize)?.values().next()
    }

    /// Whether `handle` was granted read-only (true for a handle never opened).
    pub fn is_read_only(&self, handle: u32) -> bool {
        self.handles.get(handle as usize).is_none_or(|&(_, ro)| ro)
    }

    /// Whether the initiator asked for direct reads in its HELLO (and so understands
    /// `CAPABILITIES` frames).
    pub fn direct_reads(&self) -> bool {
        self.direct_reads
    }

    /// The export index behind `handle`, if this connection opened it.
    pub fn resolve(&self, handle: u32) -> Option<u32> {
        self.handles.get(handle as usize).map(|&(e, _)| e)
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
        Hello { version_min: 1, version_max: 1, features: 0, limits, auth: None }.encode()
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
        let body =
            Hello { version_min: 2, version_max: 3, features: 0, limits: Limits::default(), auth: None }
                .encode();
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

    /// VOLUME is for established sessions; on a target with keys, only for one that proved a
    /// key, and the others are answered, not disconnected.
    #[test]
    fn volume_requests_need_a_session_and_on_a_keyed_target_a_key() {
        let list = wire::VolumeRequest::bare(wire::VolumeOp::List).encode();
        let h = header(FrameKind::Volume, 0, list.len() as u32);
        let hello_body = hello(Limits::default());
        let hello_h = header(FrameKind::Hello, 0, hello_body.len() as u32);

        let mut open = ServerSession::new(Limits::default(), 16);
        assert!(matches!(open.handle_frame(&h, &list), Err(ProtoError::Unexpected(FrameKind::Volume, _))));
        open.handle_frame(&hello_h, &hello_body).unwrap();
        assert!(
            matches!(open.handle_frame(&h, &list), Ok(Inbound::Volume(r)) if r.op == wire::VolumeOp::List)
        );

        let keys = std::sync::Arc::new(vec![Key::new("alice", &[1; 16]).unwrap()]);
        let mut keyed =
            ServerSession::new(Limits::default(), 16).with_auth(AuthConfig { keys, nonce: [2; 32] });
        keyed.handle_frame(&hello_h, &hello_body).unwrap();
        assert!(!keyed.may_manage_volumes());
        assert!(matches!(
            keyed.handle_frame(&h, &list),
            Ok(Inbound::VolumeRefused { op: wire::VolumeOp::List, status: Status::AuthRequired })
        ));
        // A malformed body is a framing error wherever it comes from.
        assert!(keyed.handle_frame(&header(FrameKind::Volume, 0, 2), &[9, 0]).is_err());
    }

    #[test]
    fn handles_are_bounded_and_stable() {
        let mut s = ServerSession::new(Limits::default(), 16);
        for i in 0..16 {
            assert_eq!(s.open_handle(i * 10, false), Ok(i));
        }
        assert_eq!(s.open_handle(30, true), Ok(3), "reopening returns the same handle");
        assert!(s.is_read_only(3) && !s.is_read_only(2) && s.is_read_only(99));
        assert_eq!(s.open_handle(999, false), Err(Status::TooManyOpen));
        assert_eq!(s.resolve(2), Some(20));
        assert_eq!(s.resolve(16), None);
        assert_eq!((s.handle_of(30), s.handle_of(31)), (Some(3), None));
    }
}
