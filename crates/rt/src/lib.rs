//! The runtime layer: everything that touches the OS below the protocol.
//!
//! `rt` owns the unsafe edges of skiff other than sockets: page-aligned memory regions
//! ([`mem`]), hole queries on files and unmounting ([`fs`]), the I/O-flusher state of a thread
//! ([`task`]), per-thread CPU and context-switch accounting ([`usage`]), signal handling
//! ([`signals`]), how a thread waits for events under hybrid polling ([`poll`]), kernel randomness for secrets ([`random`]), readiness notifications to a service manager ([`notify`]), reads that do not block
//! their starter, over io_uring ([`uring`]) and a counting
//! allocator for tests that prove a path allocates nothing
//! ([`alloc`]). It has no protocol knowledge.

pub mod alloc;
pub mod fs;
pub mod mem;
pub mod netns;
pub mod notify;
pub mod poll;
pub mod random;
pub mod signals;
pub mod task;
pub mod uring;
pub mod usage;
