//! Turning request caravans into response caravans: the part every server mode shares.
//!
//! It parses complete request caravans from the front of an [`RxBuffer`] and appends their
//! responses to a [`TxBatch`]. It never touches a socket or a ring, so the modes differ only in
//! how bytes move, not in what work is done per request.

use crate::error::ProbeError;
use crate::rx::RxBuffer;
use crate::shape::{self, Header, ReadRequest, HEADER_LEN, REQUEST_DESC_LEN};
use crate::tx::{Limits, TxBatch};

pub struct Responder {
    limits: Limits,
    data_len: usize,
    /// Reused per caravan: the parsed reads of the caravan being answered.
    reads: Vec<ReadRequest>,
    pub caravans: u64,
    pub payloads: u64,
}

impl Responder {
    pub fn new(limits: Limits, data_len: usize) -> Responder {
        Responder {
            limits,
            data_len,
            reads: Vec::with_capacity(limits.caravan_max),
            caravans: 0,
            payloads: 0,
        }
    }

    /// Answer every complete caravan at the front of `rx` into `batch`.
    pub fn handle_requests<'r>(
        &mut self,
        rx: &mut RxBuffer,
        data: &'r [u8],
        batch: &mut TxBatch<'r>,
    ) -> Result<(), ProbeError> {
        while let Some(header_bytes) = rx.filled().first_chunk::<HEADER_LEN>() {
            let header = Header::parse(header_bytes, self.limits.caravan_max)?;
            let count = header.count as usize;
            let expected = count * REQUEST_DESC_LEN;
            if header.responses || header.body_len as usize != expected {
                return Err(
                    shape::ShapeError::BadBodyLen { body_len: header.body_len as usize, expected }.into()
                );
            }
            let frame_len = HEADER_LEN + expected;
            let Some(frame) = rx.filled().get(..frame_len) else {
                return Ok(());
            };
            self.reads.clear();
            for desc in frame[HEADER_LEN..].chunks_exact(REQUEST_DESC_LEN) {
                let bs_max = self.limits.bs_max as u32;
                self.reads.push(ReadRequest::parse(desc, self.data_len, bs_max)?);
            }
            if !batch.push_response(header.seq, &self.reads, data) {
                // A batch holds `outstanding_max` caravans, and every caravan in it is one the
                // client is still waiting for: a full batch means the client broke its bound.
                return Err(ProbeError::Corrupt(format!(
                    "caravan {} exceeds the bound of {} outstanding",
                    header.seq, self.limits.outstanding_max
                )));
            }
            rx.consume(frame_len);
            self.caravans += 1;
            self.payloads += count as u64;
        }
        Ok(())
    }
}
