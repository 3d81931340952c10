//! skiff's deterministic simulation: the initiator's connection and the target's connection
//! handling, the real code of both, stepped on one thread over an in-memory pipe and a RAM
//! volume, with seeded network and disk faults and a virtual clock, every read checked against
//! a model of the volume.
//!
//! In the manner of TigerBeetle's simulator, a run is a function of its seed: a failing seed is
//! printed with the command that replays it, and replays exactly. The pieces are usable alone:
//! [`pipe`] (an in-memory [`transport::FrameIo`]), [`faults::FaultyIo`] (network faults for any
//! `FrameIo`), [`datagram`] (a faulty datagram link, the reliable streams of the raw-Ethernet
//! transport over it as a `FrameIo`, and their own seeded simulation), [`link::ConnIo`] (the
//! run's choice between the two), [`disk::FaultyBackend`] (disk faults for any backend),
//! [`clock::Clock`].
//!
//! Nothing here is linked into the product. The planted bugs of `proto`, `engine`, `eth` and `server`
//! ([`Planted`]), which prove that the simulation catches what it claims to, need this crate's
//! feature `mutations` (`cargo test -p skiff-sim --features mutations`); it is off by default,
//! so that no workspace build links them into the product's binaries.

pub mod clock;
pub mod datagram;
pub mod direct;
pub mod disk;
pub mod faults;
pub mod flash;
pub mod heal;
pub mod link;
pub mod pipe;
pub mod rng;
pub mod run;
pub mod shadow;

/// Whether this build can plant the bugs of `proto` and `engine` (feature `mutations`).
pub const PLANTED_BUGS: bool = cfg!(feature = "mutations");

/// What a run that asks for a planted bug gets from a build without them.
pub const NO_PLANTED_BUGS: &str =
    "this skiff-sim was built without planted bugs: build it with --features mutations";

pub use link::LinkKind;
pub use run::{run, Failure, Options, Planted, Report};
