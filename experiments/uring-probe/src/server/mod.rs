//! The server side of the echo, one loop per mode. Only the server changes between modes; the
//! client stays on plain syscalls throughout.

mod bufring;
mod syscalls;
mod uring;

use std::net::TcpStream;

use crate::error::ProbeError;
use crate::tx::Limits;
use rt::usage::Usage;

pub use uring::check_available;

/// Bytes of the RAM area reads are served from (rounded down to a whole number of blocks).
pub const DATA_AREA_BYTES: usize = 64 << 20;

/// Bytes of the server's receive buffer, as in skiff's target.
pub const RX_BYTES: usize = 256 << 10;

/// The data area for blocks of `bs` bytes.
pub fn data_area_len(bs: usize) -> usize {
    DATA_AREA_BYTES / bs * bs
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// epoll_wait, recv, writev: what skiff's target does today.
    Syscalls,
    /// One recv and one sendmsg SQE per pass, one io_uring_enter to submit and wait.
    Uring,
    /// Multishot recv into a provided buffer ring; sendmsg as in `uring`.
    UringMultishot,
    /// recv as in `uring`; the response sent by WRITEV_FIXED from one registered buffer.
    UringFixed,
    /// recv as in `uring`; zero-copy SENDMSG_ZC from one registered buffer.
    UringZc,
}

impl Mode {
    pub const ALL: [Mode; 5] =
        [Mode::Syscalls, Mode::Uring, Mode::UringMultishot, Mode::UringFixed, Mode::UringZc];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Syscalls => "syscalls",
            Mode::Uring => "uring",
            Mode::UringMultishot => "uring-multishot",
            Mode::UringFixed => "uring-fixed",
            Mode::UringZc => "uring-zc",
        }
    }
}

/// What the server did and spent, counted from its first wait to the client's end of stream.
#[derive(Debug, Default, Clone, Copy)]
pub struct ServerStats {
    pub caravans: u64,
    pub payloads: u64,
    /// Syscalls on the data path: epoll_wait, epoll_ctl, recv, writev; or io_uring_enter.
    pub syscalls: u64,
    pub usage: Usage,
}

/// Serve one connection in `mode` until the client closes its sending side. `ready` is called
/// once set-up (mapping, ring, registrations) is done, so that the client's clock and the
/// server's counters both start after it.
pub fn serve(
    mode: Mode,
    sock: TcpStream,
    limits: Limits,
    ready: &dyn Fn(),
) -> Result<ServerStats, ProbeError> {
    let plan = match mode {
        Mode::Syscalls => return syscalls::serve(sock, limits, ready),
        Mode::Uring => uring::Plan::SINGLE_SENDMSG,
        Mode::UringMultishot => uring::Plan::MULTISHOT_SENDMSG,
        Mode::UringFixed => uring::Plan::SINGLE_WRITEV_FIXED,
        Mode::UringZc => uring::Plan::SINGLE_SEND_ZC,
    };
    uring::serve(plan, sock, limits, ready)
}
