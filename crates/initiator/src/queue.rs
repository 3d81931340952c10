//! What a lane of one's own and a handle on a shared lane have in common.

use wire::{Opcode, ReqFlags};

use crate::lane::{Completion, IoBuf, Rejected};
use crate::Result;

/// Requests in, completions out: a [`Lane`](crate::Lane) or a
/// [`SharedHandle`](crate::SharedHandle). The typed `submit_*` methods are built on `submit`.
pub trait Queue<B: IoBuf> {
    /// Queue any request; the target judges range, alignment and permissions. A request that is
    /// accepted completes exactly once, through `poll` or `wait`.
    fn submit(
        &mut self,
        opcode: Opcode,
        flags: ReqFlags,
        offset: u64,
        length: usize,
        buf: Option<B>,
        user_data: u64,
    ) -> std::result::Result<(), Rejected<B>>;

    /// Wait until at least `min` completions (bounded by what is in flight) are in `out`.
    fn wait(&mut self, min: usize, out: &mut Vec<Completion<B>>) -> Result<usize>;

    /// Collect the completions that have arrived, without waiting.
    fn poll(&mut self, out: &mut Vec<Completion<B>>) -> Result<usize>;

    /// Requests submitted and not yet returned by `poll` or `wait`.
    fn in_flight(&self) -> usize;

    /// Read `buf.len()` bytes at `offset` into `buf`.
    fn submit_read(&mut self, offset: u64, buf: B, user_data: u64) -> std::result::Result<(), Rejected<B>> {
        let length = buf.as_ref().len();
        self.submit(Opcode::Read, ReqFlags::empty(), offset, length, Some(buf), user_data)
    }

    /// Write `buf` at `offset`.
    fn submit_write(
        &mut self,
        offset: u64,
        buf: B,
        flags: ReqFlags,
        user_data: u64,
    ) -> std::result::Result<(), Rejected<B>> {
        let length = buf.as_ref().len();
        self.submit(Opcode::Write, flags, offset, length, Some(buf), user_data)
    }

    /// Make every completed write durable.
    fn submit_flush(&mut self, user_data: u64) -> std::result::Result<(), Rejected<B>> {
        self.submit(Opcode::Flush, ReqFlags::empty(), 0, 0, None, user_data)
    }

    fn submit_trim(
        &mut self,
        offset: u64,
        length: u32,
        user_data: u64,
    ) -> std::result::Result<(), Rejected<B>> {
        self.submit(Opcode::Trim, ReqFlags::empty(), offset, length as usize, None, user_data)
    }

    fn submit_write_zeroes(
        &mut self,
        offset: u64,
        length: u32,
        flags: ReqFlags,
        user_data: u64,
    ) -> std::result::Result<(), Rejected<B>> {
        self.submit(Opcode::WriteZeroes, flags, offset, length as usize, None, user_data)
    }
}
