//! FlashNet's flash controller (thesis chapter 5), as a skiff storage engine.
//!
//! A **flash array** is one or more files or block devices formatted together. It exports a
//! 64-bit space of 4 KiB logical pages through a virtualised FTL: every write goes out of
//! place, appended log-structured in **write groups** (a header page naming each data page,
//! then the pages) to open segments spread over the devices, and the map points each logical
//! page at its newest physical copy. Volumes (ContigFS's contiguous files) are ranges of that
//! space; snapshots and clones share their pages through the map until either side writes.
//!
//! The logic is sans-I/O ([`ctl::Controller`] over [`map`], [`space`] and [`pool`]): plain data
//! driven by calls, so the simulator runs it over a faulty device. [`engine`] drives it over
//! real devices for the target, one lock around the controller and device I/O outside it.
//!
//! What is on the devices is in [`layout`]; how the map is rebuilt after a crash in
//! [`recover`]; the checkpoint that bounds that work in [`ckpt`]. docs/FLASH.md has the design
//! and its figures.
#![forbid(unsafe_code)]

pub mod ckpt;
pub mod ctl;
pub mod device;
pub mod engine;
pub mod layout;
pub mod map;
pub mod pool;
pub mod recover;
pub mod space;
pub mod volume;

/// Why a flash operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlashError {
    #[error("no such volume")]
    NoSuchVolume,
    #[error("volume name {0:?} is already taken")]
    NameTaken(String),
    #[error("volume name {0:?}: expected 1 to 64 bytes, no '/' or control characters")]
    BadName(String),
    #[error("bad size: {0}")]
    BadSize(String),
    #[error("the volume is a read-only snapshot")]
    ReadOnly,
    #[error("past the end of the volume")]
    OutOfRange,
    #[error("the array is full")]
    NoSpace,
    #[error("volume {name:?} has snapshots or clones ({children}): delete them first")]
    HasChildren { name: String, children: String },
    #[error("busy: {0}")]
    Busy(&'static str),
    #[error("on-device data is damaged: {0}")]
    Corrupt(&'static str),
    #[error("a device write failed earlier: the array takes no more writes")]
    Failed,
    #[error("{0}")]
    Device(String),
}

impl From<std::io::Error> for FlashError {
    fn from(e: std::io::Error) -> FlashError {
        FlashError::Device(e.to_string())
    }
}
