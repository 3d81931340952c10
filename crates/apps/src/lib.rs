//! Applications on RStore (docs/RSTORE.md), each a library the `skiff` binary calls into:
//!
//! - [`rsort`]: RSort, the two-phase distributed bucket sort of TeraSort records over
//!   namespaces, with worker processes meeting at one-byte flags.
//!
//! They use RStore through its API alone (`rstore`'s coordinator and segments) and own no
//! argument parsing or output: the CLI parses, calls in, and prints what they report.

pub mod rsort;
