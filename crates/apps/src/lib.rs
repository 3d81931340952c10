//! Applications on RStore (docs/RSTORE.md), each a library the `skiff` binary calls into:
//!
//! - [`rsort`]: RSort, the two-phase distributed bucket sort of TeraSort records over
//!   namespaces, with worker processes moved through its phases on a coordination board.
//! - [`carafe`]: Carafe, graph processing on namespaces: graphs imported or generated into
//!   vertex and edge namespaces, explored online (Dijkstra), and run through a Pregel engine
//!   whose partition workers pass messages through a shared mailbox (PageRank, SSSP).
//! - [`store`]: namespaces made afresh, mapped, and moved through in whole regions.
//! - [`workers`]: worker processes and their turns on a board (`rstore::coordination`),
//!   shared by both.
//!
//! They use RStore through its API alone (`rstore`'s coordinator and segments) and own no
//! argument parsing or output: the CLI parses, calls in, and prints what they report.

pub mod carafe;
pub mod rsort;
pub mod store;
pub mod workers;

/// Why a step failed: the coordinator's, a segment's, a worker's or a local file's error.
pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;
