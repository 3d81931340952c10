//! skiff-uring-probe: does io_uring lower the CPU per 4 KiB I/O of skiff's target loop?
//!
//! The probe runs a loopback TCP echo of skiff-shaped traffic (request caravans of read
//! descriptors in, completion caravans with the read data out) between a server thread and a
//! client thread of one process, once per server mode, and counts throughput, CPU per payload
//! (`getrusage(RUSAGE_THREAD)`), syscalls and context switches per caravan. The client checks
//! every byte it gets back, so a mode that loses or reorders data fails instead of scoring.
//!
//! This is a measuring tool outside the product crates: it talks to the kernel directly (mmap,
//! epoll, io_uring), so unlike `wire` or `proto` it needs `unsafe`. Every block says why it is
//! sound; the raw calls live in `sys`, `region`, `server::bufring` and `server::uring`.

pub mod client;
pub mod error;
pub mod region;
pub mod report;
pub mod respond;
pub mod run;
pub mod rx;
pub mod server;
pub mod shape;
pub mod sys;
pub mod tx;

pub use client::{Stop, Workload};
pub use error::ProbeError;
pub use run::{run_mode, Sample};
pub use server::{check_available, Mode};
