//! skiff's datagram stack, free of I/O: what turns raw Ethernet's lossy datagrams into the
//! reliable byte streams that skiff's frames run over (docs/PROTOCOL.md, section 16).
//!
//! Inputs are datagrams (parsed by `wire::datagram`) and a `now` in microseconds passed by the
//! caller; outputs are datagrams to send and a time to be woken at. Sockets, clocks and threads
//! belong to the driver (`skiff-eth`), and the simulator (`skiff-sim`) drives the same code over
//! a seeded lossy link.
//!
//! - [`reliable::DatagramStream`]: one side of a session: sequence numbers, selective acks,
//!   credits, retransmission and its timer, data messages placed by tag and offset.
//! - [`reliable::split::Splitter`]: cutting a completion caravan's read data out of the byte
//!   stream into data messages.
//! - [`bundle::Bundle`]: the paths of a session bundled over several interfaces: which path a
//!   send takes, probes, leaving out a path that stops working and taking it back.
#![forbid(unsafe_code)]

pub mod bundle;
#[doc(hidden)]
pub mod fuzz_api;
pub mod reliable;
