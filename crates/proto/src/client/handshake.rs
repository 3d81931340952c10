//! The initiator's side of the handshake.

use wire::control::{Hello, HelloReply, Limits, OpenReply, FEATURE_AUTH};
use wire::control::{HelloAuth, NONCE_LEN};
use wire::{FrameKind, Header, Status, VERSION};

use crate::auth::{proofs_equal, Key};
use crate::ProtoError;

/// Builds the HELLO (and, with a key, the AUTH) and checks the target's replies.
#[derive(Debug, Clone)]
pub struct ClientHandshake {
    proposed: Limits,
    features: u64,
    /// The key to prove, this side's nonce, and the target's once HELLO_REPLY gave it.
    auth: Option<(Key, [u8; NONCE_LEN], [u8; NONCE_LEN])>,
}

impl ClientHandshake {
    pub fn new(proposed: Limits) -> ClientHandshake {
        ClientHandshake { proposed, features: 0, auth: None }
    }

    /// Ask for these HELLO feature bits too (`wire::control::FEATURE_*`; authentication is
    /// [`with_key`](Self::with_key)'s).
    pub fn with_features(self, features: u64) -> ClientHandshake {
        let auth = self.features & FEATURE_AUTH;
        ClientHandshake { features: (features & !FEATURE_AUTH) | auth, ..self }
    }

    /// Authenticate with `key`, contributing `nonce` (random, from the driver).
    pub fn with_key(self, key: Key, nonce: [u8; NONCE_LEN]) -> ClientHandshake {
        ClientHandshake {
            features: self.features | FEATURE_AUTH,
            auth: Some((key, nonce, [0; NONCE_LEN])),
            ..self
        }
    }

    /// The HELLO frame to send first.
    pub fn hello_frame(&self) -> Vec<u8> {
        let hello = Hello {
            version_min: VERSION,
            version_max: VERSION,
            features: self.features,
            limits: self.proposed,
            auth: self
                .auth
                .as_ref()
                .map(|(key, nonce, _)| HelloAuth { key_name: key.name.clone(), nonce: *nonce }),
        };
        wire::control::frame(FrameKind::Hello, &hello.encode())
    }

    /// With a key, the AUTH frame to send after HELLO_REPLY: this side's proof.
    pub fn auth_frame(&self) -> Option<Vec<u8>> {
        let (key, client_nonce, target_nonce) = self.auth.as_ref()?;
        let auth = wire::Auth { proof: key.client_proof(client_nonce, target_nonce) };
        Some(wire::control::frame(FrameKind::Auth, &auth.encode()))
    }

    /// Check AUTH_REPLY: the target accepted the proof, and proved the key back.
    pub fn handle_auth_reply(&self, header: &Header, body: &[u8]) -> Result<(), ProtoError> {
        let reply = expect(header, body, FrameKind::AuthReply, wire::AuthReply::decode)?;
        if reply.status != Status::Ok {
            return Err(ProtoError::Refused(reply.status));
        }
        let Some((key, client_nonce, target_nonce)) = &self.auth else {
            return Err(ProtoError::Unexpected(FrameKind::AuthReply, "without an AUTH"));
        };
        if !proofs_equal(&key.target_proof(client_nonce, target_nonce), &reply.proof) {
            return Err(ProtoError::TargetNotAuthenticated);
        }
        Ok(())
    }

    /// Check HELLO_REPLY; returns the limits both sides now live by.
    pub fn handle_reply(&mut self, header: &Header, body: &[u8]) -> Result<Limits, ProtoError> {
        self.handle_reply_features(header, body).map(|(limits, _)| limits)
    }

    /// Check HELLO_REPLY; returns the limits both sides now live by and the features agreed
    /// (only bits this side asked for: a target that grants more is broken).
    pub fn handle_reply_features(
        &mut self,
        header: &Header,
        body: &[u8],
    ) -> Result<(Limits, u64), ProtoError> {
        let reply = expect(header, body, FrameKind::HelloReply, HelloReply::decode)?;
        if reply.status != Status::Ok {
            return Err(ProtoError::Refused(reply.status));
        }
        if reply.version != VERSION {
            return Err(wire::WireError::BadVersion(reply.version).into());
        }
        // A target that raises a limit we proposed is broken; trusting it could overrun us.
        let l = reply.limits;
        let p = self.proposed;
        let within = |got: u32, asked: u32| asked == 0 || got <= asked;
        if !(within(l.queue_depth, p.queue_depth)
            && within(l.caravan_reqs_max, p.caravan_reqs_max)
            && within(l.io_bytes_max, p.io_bytes_max)
            && l.queue_depth >= 1
            && l.caravan_reqs_max >= 1
            && l.caravan_bytes_max >= l.io_bytes_max)
        {
            return Err(wire::WireError::Body("HELLO_REPLY limits").into());
        }
        if reply.features & !self.features != 0 {
            return Err(wire::WireError::Body("HELLO_REPLY features not asked for").into());
        }
        if let Some((_, _, target_nonce)) = self.auth.as_mut() {
            match reply.auth_nonce {
                Some(nonce) if reply.features & FEATURE_AUTH != 0 => *target_nonce = nonce,
                _ => return Err(ProtoError::TargetNotAuthenticated),
            }
        }
        Ok((l, reply.features))
    }
}

/// Judge a frame on a connection that carries no lane yet, from its header alone: only
/// control replies come, each within the control body limit.
pub fn admit_control(h: &Header) -> Result<(), ProtoError> {
    if h.kind.is_caravan() {
        return Err(ProtoError::Unexpected(h.kind, "as a reply to a control frame"));
    }
    ProtoError::check_limit(
        "control body bytes",
        h.payload_len.into(),
        wire::control::CONTROL_BODY_MAX as u64,
    )
}

/// Decode a control reply of the expected kind; a GOAWAY becomes a refusal with its status.
pub fn expect<T>(
    header: &Header,
    body: &[u8],
    kind: FrameKind,
    decode: fn(&[u8]) -> wire::Result<T>,
) -> Result<T, ProtoError> {
    if header.kind == FrameKind::GoAway {
        let goaway = wire::GoAway::decode(body)?;
        return Err(ProtoError::Refused(goaway.status));
    }
    if header.kind != kind {
        return Err(ProtoError::Unexpected(header.kind, "as a reply"));
    }
    Ok(decode(body)?)
}

/// Check an OPEN_REPLY.
pub fn handle_open_reply(header: &Header, body: &[u8]) -> Result<OpenReply, ProtoError> {
    let reply = expect(header, body, FrameKind::OpenReply, OpenReply::decode)?;
    if reply.status != Status::Ok {
        return Err(ProtoError::Refused(reply.status));
    }
    if reply.block_size == 0 || !reply.block_size.is_power_of_two() {
        return Err(wire::WireError::Body("OPEN_REPLY block size").into());
    }
    Ok(reply)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::{Inbound, ServerSession};

    /// Run the handshake through both state machines in memory.
    #[test]
    fn both_sides_agree_on_limits() {
        let mut client = ClientHandshake::new(Limits {
            queue_depth: 32,
            caravan_reqs_max: 16,
            caravan_bytes_max: 0,
            io_bytes_max: 128 << 10,
        });
        let mut server = ServerSession::new(Limits::default(), 16);
        let hello = client.hello_frame();
        let h = Header::parse(&hello).unwrap();
        let Inbound::Hello { reply } = server.handle_frame(&h, &hello[wire::HEADER_LEN..]).unwrap() else {
            panic!("not a hello");
        };
        let reply_frame = wire::control::frame(FrameKind::HelloReply, &reply.encode());
        let rh = Header::parse(&reply_frame).unwrap();
        let limits = client.handle_reply(&rh, &reply_frame[wire::HEADER_LEN..]).unwrap();
        assert_eq!(limits, *server.limits());
        assert_eq!(limits.queue_depth, 32);
        assert_eq!(limits.caravan_reqs_max, 16);
        assert_eq!(limits.io_bytes_max, 128 << 10);
        assert_eq!(limits.caravan_bytes_max, Limits::default().caravan_bytes_max);
    }

    /// The authenticated handshake in memory: `client_key` against a target knowing
    /// `target_keys`. Returns the AUTH_REPLY status and the client's verdict on it.
    fn authenticate(
        client_key: Key,
        target_keys: Vec<Key>,
    ) -> (Status, Result<(), ProtoError>, Option<String>) {
        let mut client = ClientHandshake::new(Limits::default()).with_key(client_key, [7; NONCE_LEN]);
        let auth =
            crate::server::AuthConfig { keys: std::sync::Arc::new(target_keys), nonce: [9; NONCE_LEN] };
        let mut server = ServerSession::new(Limits::default(), 16).with_auth(auth);
        let hello = client.hello_frame();
        let h = Header::parse(&hello).unwrap();
        let Inbound::Hello { reply } = server.handle_frame(&h, &hello[wire::HEADER_LEN..]).unwrap() else {
            panic!("not a hello");
        };
        assert!(server.is_authenticating() && !server.is_established());
        let reply_frame = wire::control::frame(FrameKind::HelloReply, &reply.encode());
        client.handle_reply(&Header::parse(&reply_frame).unwrap(), &reply_frame[wire::HEADER_LEN..]).unwrap();
        // Nothing but AUTH (or GOAWAY) is accepted before it.
        let open = wire::control::frame(FrameKind::Open, &wire::Open { name: "x".into() }.encode());
        assert!(server.admit(&Header::parse(&open).unwrap()).is_err());
        let auth = client.auth_frame().unwrap();
        let Inbound::Auth { reply, .. } =
            server.handle_frame(&Header::parse(&auth).unwrap(), &auth[wire::HEADER_LEN..]).unwrap()
        else {
            panic!("not an auth reply");
        };
        let frame = wire::control::frame(FrameKind::AuthReply, &reply.encode());
        let verdict = client.handle_auth_reply(&Header::parse(&frame).unwrap(), &frame[wire::HEADER_LEN..]);
        (reply.status, verdict, server.principal().map(str::to_owned))
    }

    #[test]
    fn keys_prove_themselves_both_ways_and_every_wrong_key_fails() {
        let alice = Key::new("alice", &[1; 16]).unwrap();
        let (status, verdict, principal) = authenticate(alice.clone(), vec![alice.clone()]);
        assert_eq!((status, verdict, principal.as_deref()), (Status::Ok, Ok(()), Some("alice")));
        // A wrong secret and an unknown name look the same to the initiator.
        let wrong = Key::new("alice", &[2; 16]).unwrap();
        let (status, verdict, principal) = authenticate(wrong, vec![alice.clone()]);
        assert_eq!(
            (status, verdict, principal),
            (Status::AuthFailed, Err(ProtoError::Refused(Status::AuthFailed)), None)
        );
        let unknown = Key::new("mallory", &[1; 16]).unwrap();
        assert_eq!(authenticate(unknown, vec![alice.clone()]).0, Status::AuthFailed);
        assert_eq!(authenticate(alice.clone(), vec![]).0, Status::AuthFailed, "a target without keys");
    }

    #[test]
    fn an_impostor_target_is_caught() {
        let alice = Key::new("alice", &[1; 16]).unwrap();
        let mut client = ClientHandshake::new(Limits::default()).with_key(alice.clone(), [7; NONCE_LEN]);
        // A target that does not authenticate at all: refused at HELLO_REPLY.
        let plain = HelloReply {
            status: Status::Ok,
            version: VERSION,
            features: 0,
            limits: Limits::default(),
            auth_nonce: None,
        };
        let frame = wire::control::frame(FrameKind::HelloReply, &plain.encode());
        let h = Header::parse(&frame).unwrap();
        assert_eq!(
            client.handle_reply(&h, &frame[wire::HEADER_LEN..]),
            Err(ProtoError::TargetNotAuthenticated)
        );
        // One that says Ok to AUTH without knowing the key: its proof is wrong.
        let reply = HelloReply { features: FEATURE_AUTH, auth_nonce: Some([3; NONCE_LEN]), ..plain };
        let frame = wire::control::frame(FrameKind::HelloReply, &reply.encode());
        client.handle_reply(&Header::parse(&frame).unwrap(), &frame[wire::HEADER_LEN..]).unwrap();
        let forged = wire::AuthReply { status: Status::Ok, proof: [0xAB; 32] };
        let frame = wire::control::frame(FrameKind::AuthReply, &forged.encode());
        let h = Header::parse(&frame).unwrap();
        assert_eq!(
            client.handle_auth_reply(&h, &frame[wire::HEADER_LEN..]),
            Err(ProtoError::TargetNotAuthenticated)
        );
    }

    #[test]
    fn a_target_raising_our_limits_is_refused() {
        let mut client = ClientHandshake::new(Limits {
            queue_depth: 4,
            caravan_reqs_max: 4,
            caravan_bytes_max: 0,
            io_bytes_max: 0,
        });
        let bad = HelloReply {
            status: Status::Ok,
            version: VERSION,
            features: 0,
            limits: Limits::default(),
            auth_nonce: None,
        };
        let frame = wire::control::frame(FrameKind::HelloReply, &bad.encode());
        let h = Header::parse(&frame).unwrap();
        assert!(client.handle_reply(&h, &frame[wire::HEADER_LEN..]).is_err());
    }

    #[test]
    fn goaway_and_refusals_surface_their_status() {
        let goaway = wire::GoAway { status: Status::NotFound, message: "no".into() };
        let frame = wire::control::frame(FrameKind::GoAway, &goaway.encode());
        let h = Header::parse(&frame).unwrap();
        assert_eq!(
            handle_open_reply(&h, &frame[wire::HEADER_LEN..]).unwrap_err(),
            ProtoError::Refused(Status::NotFound)
        );
        let refused = OpenReply::refused(Status::NotFound);
        let frame = wire::control::frame(FrameKind::OpenReply, &refused.encode());
        let h = Header::parse(&frame).unwrap();
        assert_eq!(
            handle_open_reply(&h, &frame[wire::HEADER_LEN..]).unwrap_err(),
            ProtoError::Refused(Status::NotFound)
        );
    }
}
