//! The initiator's side of the protocol: the handshake, the session that carries one lane's
//! requests and completions ([`ClientSession`]), and the connection that carries the session
//! across transports and reconnections ([`Connection`]).

mod connection;
mod directory;
mod handshake;
mod outbox;
mod placement;
pub mod reconnect;
mod session;

pub use connection::{is_goodbye, is_refusal, Closed, Connection, ConnectionConfig, Event, Opened, Opening};
pub use handshake::{admit_control, expect, handle_open_reply, ClientHandshake};
pub use outbox::Outbox;
pub use reconnect::{Reconnect, ReconnectConfig};
pub use session::Mutation;
pub use session::{
    Batching, ClientSession, Completion, IoBuf, Refused, RxProgress, SessionConfig, SessionStats, Submission,
    SubmitError, DIRECT_OFF, LEVEL_LOG_MAX,
};
