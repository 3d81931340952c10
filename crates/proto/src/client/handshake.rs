//! The initiator's side of the handshake.

use wire::control::{Hello, HelloReply, Limits, OpenReply};
use wire::{FrameKind, Header, Status, VERSION};

use crate::ProtoError;

/// Builds the HELLO and checks the target's reply.
#[derive(Debug, Clone, Copy)]
pub struct ClientHandshake {
    proposed: Limits,
    features: u64,
}

impl ClientHandshake {
    pub fn new(proposed: Limits) -> ClientHandshake {
        ClientHandshake { proposed, features: 0 }
    }

    /// Ask for these HELLO feature bits too (`wire::control::FEATURE_*`).
    pub fn with_features(self, features: u64) -> ClientHandshake {
        ClientHandshake { features, ..self }
    }

    /// The HELLO frame to send first.
    pub fn hello_frame(&self) -> Vec<u8> {
        let hello = Hello {
            version_min: VERSION,
            version_max: VERSION,
            features: self.features,
            limits: self.proposed,
        };
        wire::control::frame(FrameKind::Hello, &hello.encode())
    }

    /// Check HELLO_REPLY; returns the limits both sides now live by.
    pub fn handle_reply(&self, header: &Header, body: &[u8]) -> Result<Limits, ProtoError> {
        self.handle_reply_features(header, body).map(|(limits, _)| limits)
    }

    /// Check HELLO_REPLY; returns the limits both sides now live by and the features agreed
    /// (only bits this side asked for: a target that grants more is broken).
    pub fn handle_reply_features(&self, header: &Header, body: &[u8]) -> Result<(Limits, u64), ProtoError> {
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
        let client = ClientHandshake::new(Limits {
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

    #[test]
    fn a_target_raising_our_limits_is_refused() {
        let client = ClientHandshake::new(Limits {
            queue_depth: 4,
            caravan_reqs_max: 4,
            caravan_bytes_max: 0,
            io_bytes_max: 0,
        });
        let bad = HelloReply { status: Status::Ok, version: VERSION, features: 0, limits: Limits::default() };
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
