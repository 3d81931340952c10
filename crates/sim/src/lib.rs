//! skiff's deterministic simulation: an initiator session and a target front end, the real
//! protocol code of both, stepped on one thread over an in-memory pipe and a RAM volume, with
//! seeded network and disk faults and a virtual clock, every read checked against a model of
//! the volume.
//!
//! In the manner of TigerBeetle's simulator, a run is a function of its seed: a failing seed is
//! printed with the command that replays it, and replays exactly. The pieces are usable alone:
//! [`pipe`] (an in-memory [`transport::FrameIo`]), [`faults::FaultyIo`] (network faults for any
//! `FrameIo`), [`datagram`] (a faulty datagram link, the reliable streams of the raw-Ethernet
//! transport over it as a `FrameIo`, and their own seeded simulation), [`link::ConnIo`] (the
//! run's choice between the two), [`disk::FaultyBackend`] (disk faults for any backend),
//! [`clock::Clock`].
//!
//! Nothing here is linked into the product: the crate turns on the `mutations` features of
//! `proto` and `engine`, whose planted bugs ([`Planted`]) prove that the simulation catches
//! what it claims to.

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

pub use link::LinkKind;
pub use run::{run, Failure, Options, Planted, Report};
