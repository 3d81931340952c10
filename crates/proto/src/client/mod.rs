//! The initiator's side of the protocol: the handshake, and the session that carries one lane's
//! requests and completions ([`ClientSession`]).

mod directory;
mod handshake;
mod outbox;
mod placement;
pub mod reconnect;
mod session;

pub use handshake::{admit_control, expect, handle_open_reply, ClientHandshake};
pub use outbox::Outbox;
pub use reconnect::{Reconnect, ReconnectConfig};
pub use session::Mutation;
pub use session::{
    Batching, ClientSession, Completion, IoBuf, Refused, RxProgress, SessionConfig, SessionStats, Submission,
    SubmitError, DIRECT_OFF, LEVEL_LOG_MAX,
};
