//! Data messages on the sending side: [`Splitter`] writes a target's outgoing byte stream into
//! a [`DatagramStream`], sending the read data of completion caravans as Place datagrams
//! (docs/PROTOCOL.md, 16.9) instead of stream bytes, once the connection has agreed to them.
//!
//! The target's front end builds its replies exactly as for TCP (header, descriptors, read
//! data); the splitter follows the frames as their bytes go by, so it knows at every byte
//! whether it belongs to a frame header, a completion descriptor (whose tag and data length
//! it keeps) or a completion's data, which it cuts into segments at multiples of 4 KiB and
//! hands to [`DatagramStream::write_place`]. Everything else is stream bytes. It takes bytes
//! only as far as the stream takes them, so a caller that sends the rest later resumes
//! exactly where it stopped, as with any partial write.

use std::io::IoSlice;

use wire::caravan::COMPLETION_DESC_LEN;
use wire::header::{FrameKind, Header, HEADER_LEN};

use super::DatagramStream;

/// Data segments are cut at multiples of this, so a page of the volume lands whole.
const PAGE: usize = 4096;

/// Where the next outgoing byte falls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// In a frame header, of which `have` bytes went by.
    Header { have: usize },
    /// In the descriptors of a completion caravan going apart: `left` of them to come, `have`
    /// bytes of the current one went by.
    Descriptors { left: usize, have: usize },
    /// In the read data of descriptor `index` of the current caravan, `offset` bytes of it
    /// sent.
    Data { index: usize, offset: u32 },
    /// In the body of a frame that goes whole on the stream: `left` bytes to come.
    Body { left: usize },
    /// The bytes are not skiff frames (an NBD client): all stream bytes, for good.
    Opaque,
}

/// The sending half of data messages over one [`DatagramStream`] (see the module docs).
#[derive(Debug)]
pub struct Splitter {
    phase: Phase,
    /// Completion caravans go apart (the connection agreed to data messages).
    apart: bool,
    /// Two data segments may share a datagram (Tyche's data-message batching).
    batch: bool,
    /// The current frame header's bytes, and the current descriptor's.
    header: [u8; HEADER_LEN],
    desc: [u8; COMPLETION_DESC_LEN],
    /// The current caravan's completions with data: (tag, data length).
    data: Vec<(u32, u32)>,
}

impl Splitter {
    pub fn new(batch: bool) -> Splitter {
        Splitter {
            phase: Phase::Header { have: 0 },
            apart: false,
            batch,
            header: [0; HEADER_LEN],
            desc: [0; COMPLETION_DESC_LEN],
            data: Vec::new(),
        }
    }

    /// Send the read data of completion caravans as data messages from the next frame on.
    /// Returns false (and changes nothing) when the stream is not skiff frames.
    pub fn set_apart(&mut self) -> bool {
        self.apart = self.phase != Phase::Opaque;
        self.apart
    }

    pub fn is_apart(&self) -> bool {
        self.apart
    }

    /// Write `bufs` into `stream`: as [`DatagramStream::write`], with completion caravans'
    /// read data as data messages when [`set_apart`](Self::set_apart). Returns the bytes taken.
    pub fn write(&mut self, stream: &mut DatagramStream, bufs: &[IoSlice<'_>]) -> usize {
        if self.phase == Phase::Opaque {
            return stream.write(bufs);
        }
        let mut taken = 0;
        for buf in bufs {
            let mut rest: &[u8] = buf;
            while !rest.is_empty() {
                let n = self.step(stream, rest);
                if n == 0 {
                    return taken;
                }
                taken += n;
                rest = &rest[n..];
            }
        }
        taken
    }

    /// Take a prefix of `bytes` within the current phase; returns how much (0: the stream is
    /// full).
    fn step(&mut self, stream: &mut DatagramStream, bytes: &[u8]) -> usize {
        match self.phase {
            Phase::Opaque => stream.write(&[IoSlice::new(bytes)]),
            Phase::Body { left } => {
                let n = stream.write(&[IoSlice::new(&bytes[..left.min(bytes.len())])]);
                self.phase =
                    if n == left { Phase::Header { have: 0 } } else { Phase::Body { left: left - n } };
                n
            }
            Phase::Header { have } => {
                let want = (HEADER_LEN - have).min(bytes.len());
                let n = stream.write(&[IoSlice::new(&bytes[..want])]);
                self.header[have..have + n].copy_from_slice(&bytes[..n]);
                self.phase = Phase::Header { have: have + n };
                if have + n == HEADER_LEN {
                    self.phase = self.after_header();
                }
                n
            }
            Phase::Descriptors { left, have } => {
                let want = (COMPLETION_DESC_LEN - have).min(bytes.len());
                let n = stream.write(&[IoSlice::new(&bytes[..want])]);
                self.desc[have..have + n].copy_from_slice(&bytes[..n]);
                self.phase = Phase::Descriptors { left, have: have + n };
                if have + n == COMPLETION_DESC_LEN {
                    let word = |at: usize| u32::from_le_bytes(self.desc[at..at + 4].try_into().unwrap());
                    let (tag, data_len) = (word(0), word(8));
                    if data_len > 0 {
                        self.data.push((tag, data_len));
                    }
                    self.phase = if left > 1 {
                        Phase::Descriptors { left: left - 1, have: 0 }
                    } else {
                        self.first_data()
                    };
                }
                n
            }
            Phase::Data { index, offset } => {
                let (tag, len) = self.data[index];
                let max = stream.place_segment_max();
                let cap = if max >= PAGE { max / PAGE * PAGE } else { max };
                let n = ((len - offset) as usize).min(cap).min(bytes.len());
                if !stream.write_place(tag, offset, &bytes[..n], self.batch) {
                    return 0;
                }
                let offset = offset + n as u32;
                self.phase = if offset < len {
                    Phase::Data { index, offset }
                } else if index + 1 < self.data.len() {
                    Phase::Data { index: index + 1, offset: 0 }
                } else {
                    Phase::Header { have: 0 }
                };
                n
            }
        }
    }

    /// A whole frame header went by: what follows it.
    fn after_header(&mut self) -> Phase {
        let Ok(header) = Header::parse(&self.header) else {
            // Not skiff's frames (the first bytes of an NBD client): never split.
            self.apart = false;
            return Phase::Opaque;
        };
        if self.apart && header.kind == FrameKind::Completions && header.desc_count > 0 {
            self.data.clear();
            return Phase::Descriptors { left: usize::from(header.desc_count), have: 0 };
        }
        match header.body_len() {
            0 => Phase::Header { have: 0 },
            left => Phase::Body { left },
        }
    }

    fn first_data(&self) -> Phase {
        if self.data.is_empty() {
            Phase::Header { have: 0 }
        } else {
            Phase::Data { index: 0, offset: 0 }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::IoSliceMut;

    use wire::caravan::Completion;
    use wire::datagram::{DatagramHeader, DatagramKind, PlaceSegment};
    use wire::Status;

    use super::*;
    use crate::reliable::{ReadCursor, ReliableConfig};

    /// A completion caravan as the target's front end writes it: header, descriptors, data.
    fn caravan(reads: &[(u32, usize)]) -> Vec<u8> {
        let data: usize = reads.iter().map(|r| r.1).sum();
        let header =
            Header { kind: FrameKind::Completions, desc_count: reads.len() as u16, payload_len: data as u32 };
        let mut out = header.to_bytes().to_vec();
        for &(tag, len) in reads {
            let mut d = [0u8; COMPLETION_DESC_LEN];
            Completion { tag, status: Status::Ok, data_len: len as u32 }.emit(&mut d);
            out.extend_from_slice(&d);
        }
        for &(tag, len) in reads {
            out.extend((0..len).map(|i| (tag as usize * 7 + i / 4096) as u8));
        }
        out
    }

    /// Data segments sent: (tag, offset, length).
    type Segments = Vec<(u32, u32, usize)>;

    /// Everything `stream` has to send, by kind: the stream bytes, and the data segments.
    fn drain(stream: &mut DatagramStream) -> (Vec<DatagramKind>, Vec<u8>, Segments) {
        let mut out = vec![0u8; 9000];
        let (mut kinds, mut bytes, mut segs) = (Vec::new(), Vec::new(), Vec::new());
        let mut rx = DatagramStream::new(stream.config(), stream.session_id(), 0, 0);
        while let Some(n) = stream.poll_transmit(0, &mut out) {
            let (h, payload) = DatagramHeader::parse(&out[..n]).unwrap();
            kinds.push(h.kind);
            if h.kind == DatagramKind::Place {
                for s in PlaceSegment::parse_all(payload) {
                    let s = s.unwrap();
                    segs.push((s.tag, s.offset, s.bytes.len()));
                }
            }
            let mut buf = [0u8; 9000];
            let mut bufs = [IoSliceMut::new(&mut buf)];
            let mut ignore = |_: &[u8]| {};
            let got = rx.handle_datagram_into(0, &out[..n], &mut ReadCursor::placing(&mut bufs, &mut ignore));
            bytes.extend_from_slice(&buf[..got]);
        }
        (kinds, bytes, segs)
    }

    fn jumbo() -> ReliableConfig {
        ReliableConfig { payload_bytes_max: 8972, ..ReliableConfig::default() }
    }

    #[test]
    fn completion_data_goes_in_data_messages_two_pages_to_a_frame_and_the_rest_on_the_stream() {
        let mut stream = DatagramStream::new(&jumbo(), 1, 0, 0);
        let mut split = Splitter::new(true);
        let hello = Header { kind: FrameKind::HelloReply, desc_count: 0, payload_len: 5 };
        let mut before = hello.to_bytes().to_vec();
        before.extend_from_slice(b"hello");
        assert_eq!(split.write(&mut stream, &[IoSlice::new(&before)]), before.len());
        assert!(split.set_apart());
        let frame = caravan(&[(1, 4096), (2, 4096), (3, 16384), (4, 0), (5, 512)]);
        // Cut anywhere: the splitter keeps its place across writes.
        let (a, b) = frame.split_at(HEADER_LEN + 20);
        let n = split.write(&mut stream, &[IoSlice::new(a), IoSlice::new(&b[..5000])]);
        assert_eq!(n, a.len() + 5000);
        assert_eq!(split.write(&mut stream, &[IoSlice::new(&b[5000..])]), b.len() - 5000);
        let (kinds, bytes, segs) = drain(&mut stream);
        use DatagramKind::{Data, Place};
        assert_eq!(kinds, [Data, Place, Place, Place]);
        let head_len = HEADER_LEN + 5 * COMPLETION_DESC_LEN;
        assert_eq!(bytes, [&before[..], &frame[..head_len]].concat(), "the stream carries no read data");
        // Two 4 KiB reads share a frame; a 16 KiB read is two frames of two pages; the 512
        // bytes join the last of them, which has room.
        // The cut between the two writes cuts tag 2's data into two segments (in one frame).
        let want = [(1, 0, 4096), (2, 0, 844), (2, 844, 3252), (3, 0, 8192), (3, 8192, 8192), (5, 0, 512)];
        assert_eq!(segs, want);
    }

    #[test]
    fn a_full_stream_takes_part_and_the_rest_resumes_where_it_stopped() {
        let cfg = ReliableConfig { send_slots: 2, peer_window_initial: 64, ..jumbo() };
        let mut stream = DatagramStream::new(&cfg, 1, 0, 0);
        let mut split = Splitter::new(false);
        split.set_apart();
        let frame = caravan(&[(7, 4096), (8, 4096), (9, 4096)]);
        // Two slots: the head's datagram and one data message.
        let n = split.write(&mut stream, &[IoSlice::new(&frame)]);
        assert_eq!(n, HEADER_LEN + 3 * COMPLETION_DESC_LEN + 4096);
        let (_, _, segs) = drain(&mut stream);
        assert_eq!(segs, [(7, 0, 4096)]);
    }

    #[test]
    fn before_agreement_and_for_other_streams_everything_is_stream_bytes() {
        let mut stream = DatagramStream::new(&jumbo(), 1, 0, 0);
        let mut split = Splitter::new(true);
        let frame = caravan(&[(1, 4096)]);
        assert_eq!(split.write(&mut stream, &[IoSlice::new(&frame)]), frame.len());
        let (kinds, bytes, _) = drain(&mut stream);
        assert!(kinds.iter().all(|k| *k == DatagramKind::Data));
        assert_eq!(bytes, frame);
        // An NBD client's bytes are no skiff frame: the splitter never splits them.
        let mut split = Splitter::new(true);
        let nbd = b"NBDMAGICIHAVEOPT and then some more bytes".to_vec();
        assert_eq!(split.write(&mut stream, &[IoSlice::new(&nbd)]), nbd.len());
        assert!(!split.set_apart());
    }
}
