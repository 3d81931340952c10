//! The volume control frames: `VOLUME` asks a target to create, resize, snapshot, clone,
//! delete, list or measure the volumes of its flash array, and `VOLUME_REPLY` answers
//! (docs/PROTOCOL.md, section 17).
//!
//! Like the other control bodies these are hand-encoded little-endian fields with
//! length-prefixed strings, and every decoder rejects trailing bytes, over-long strings,
//! non-UTF-8 text and non-zero reserved fields. A field the operation does not use must be
//! empty or zero, so every body has one meaning. What the fields *say* (whether a size is
//! possible, whether a name is free) is for the target to judge: it answers with a status and
//! a message, and the connection goes on.
//!
//! A listing is paged: it fits one control body, so a reply holds the volumes that fit after
//! the cursor the request names, says whether more follow, and the initiator asks again from
//! the last name it got. An entry carries a volume's origin and how many snapshots and clones
//! it has, not their names: an entry is then bounded (under 540 bytes) however many children a
//! volume has, and the names are those of the entries whose origin it is.

use crate::control::{
    put_str16, truncate_utf8, Reader, StatsReply, CONTROL_BODY_MAX, EXPORT_NAME_MAX, MESSAGE_MAX,
};
use crate::status::Status;
use crate::{Result, WireError};

/// What a `VOLUME` request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum VolumeOp {
    /// A new, empty volume `name` of `size_bytes`.
    Create = 1,
    /// Volume `name` grows or shrinks to `size_bytes` (never below the data written in it).
    Resize = 2,
    /// A read-only snapshot `name` of volume `origin`.
    Snapshot = 3,
    /// A writable clone `name` of volume (or snapshot) `origin`.
    Clone = 4,
    /// Volume `name` goes, with its data.
    Delete = 5,
    /// The volumes whose names sort after `name` (empty: from the first), as many as fit.
    List = 6,
    /// The array's counters.
    Stats = 7,
}

impl VolumeOp {
    pub const ALL: [VolumeOp; 7] = [
        VolumeOp::Create,
        VolumeOp::Resize,
        VolumeOp::Snapshot,
        VolumeOp::Clone,
        VolumeOp::Delete,
        VolumeOp::List,
        VolumeOp::Stats,
    ];

    pub fn from_u8(v: u8) -> Option<VolumeOp> {
        VolumeOp::ALL.into_iter().find(|op| *op as u8 == v)
    }

    /// Lower-case name, for logs and messages.
    pub fn name(self) -> &'static str {
        match self {
            VolumeOp::Create => "create",
            VolumeOp::Resize => "resize",
            VolumeOp::Snapshot => "snapshot",
            VolumeOp::Clone => "clone",
            VolumeOp::Delete => "delete",
            VolumeOp::List => "list",
            VolumeOp::Stats => "stats",
        }
    }

    /// Which fields the operation uses: `(size_bytes, origin)`; `name` is always allowed (for
    /// a listing it is the cursor, for stats it must be empty).
    fn uses(self) -> (bool, bool) {
        match self {
            VolumeOp::Create | VolumeOp::Resize => (true, false),
            VolumeOp::Snapshot | VolumeOp::Clone => (false, true),
            VolumeOp::Delete | VolumeOp::List | VolumeOp::Stats => (false, false),
        }
    }
}

/// `VOLUME` (16 + n + m bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRequest {
    pub op: VolumeOp,
    /// For create, resize and delete, the volume; for snapshot and clone, the new volume; for
    /// list, the cursor; empty for stats.
    pub name: String,
    /// For snapshot and clone, the volume copied; empty otherwise.
    pub origin: String,
    /// For create and resize; zero otherwise.
    pub size_bytes: u64,
}

impl VolumeRequest {
    /// A request with no name, origin or size (`List` from the start, `Stats`).
    pub fn bare(op: VolumeOp) -> VolumeRequest {
        VolumeRequest { op, name: String::new(), origin: String::new(), size_bytes: 0 }
    }

    pub fn encode(&self) -> Vec<u8> {
        let name = truncate_utf8(&self.name, EXPORT_NAME_MAX);
        let origin = truncate_utf8(&self.origin, EXPORT_NAME_MAX);
        let mut w = Vec::with_capacity(16 + name.len() + origin.len());
        w.extend_from_slice(&[self.op as u8, 0, 0, 0]);
        w.extend_from_slice(&self.size_bytes.to_le_bytes());
        put_str16(&mut w, name);
        put_str16(&mut w, origin);
        w
    }

    pub fn decode(body: &[u8]) -> Result<VolumeRequest> {
        let mut r = Reader::new(body, "VOLUME")?;
        let op = VolumeOp::from_u8(r.u8()?).ok_or(WireError::Body("VOLUME operation"))?;
        r.zero(3)?;
        let size_bytes = r.u64()?;
        let name = r.str16(EXPORT_NAME_MAX)?;
        let origin = r.str16(EXPORT_NAME_MAX)?;
        r.end()?;
        let (sized, copied) = op.uses();
        if (!sized && size_bytes != 0) || (!copied && !origin.is_empty()) {
            return Err(WireError::Body("VOLUME field the operation does not use"));
        }
        if op == VolumeOp::Stats && !name.is_empty() {
            return Err(WireError::Body("VOLUME field the operation does not use"));
        }
        Ok(VolumeRequest { op, name, origin, size_bytes })
    }
}

/// One volume of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeEntry {
    pub name: String,
    pub size_bytes: u64,
    /// Bytes of it that hold data (written and not trimmed), its own or shared with its origin.
    pub allocated_bytes: u64,
    /// A volume or a clone; false for a read-only snapshot.
    pub writable: bool,
    /// The volume it is a snapshot or clone of; empty for one created empty (or whose origin
    /// has gone).
    pub origin: String,
    /// Snapshots and clones made of it (the entries whose origin it is).
    pub children: u32,
}

impl VolumeEntry {
    const FIXED_LEN: usize = 2 + 8 + 8 + 1 + 1 + 2 + 4;
    const WRITABLE: u8 = 1 << 0;

    fn encoded_len(&self) -> usize {
        Self::FIXED_LEN
            + truncate_utf8(&self.name, EXPORT_NAME_MAX).len()
            + truncate_utf8(&self.origin, EXPORT_NAME_MAX).len()
    }

    fn put(&self, w: &mut Vec<u8>) {
        put_str16(w, truncate_utf8(&self.name, EXPORT_NAME_MAX));
        w.extend_from_slice(&self.size_bytes.to_le_bytes());
        w.extend_from_slice(&self.allocated_bytes.to_le_bytes());
        w.extend_from_slice(&[if self.writable { Self::WRITABLE } else { 0 }, 0]);
        put_str16(w, truncate_utf8(&self.origin, EXPORT_NAME_MAX));
        w.extend_from_slice(&self.children.to_le_bytes());
    }

    fn get(r: &mut Reader<'_>) -> Result<VolumeEntry> {
        let name = r.str16(EXPORT_NAME_MAX)?;
        let size_bytes = r.u64()?;
        let allocated_bytes = r.u64()?;
        let flags = r.u8()?;
        if flags & !Self::WRITABLE != 0 {
            return Err(WireError::Reserved("VOLUME_REPLY entry flags"));
        }
        r.zero(1)?;
        let origin = r.str16(EXPORT_NAME_MAX)?;
        let children = r.u32()?;
        Ok(VolumeEntry { name, size_bytes, allocated_bytes, writable: flags != 0, origin, children })
    }
}

/// What a successful `VOLUME_REPLY` carries beyond its message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum VolumeBody {
    /// Create, resize, snapshot, clone and delete; and every refusal.
    #[default]
    None,
    /// A page of the listing, and whether more volumes follow its last.
    List { volumes: Vec<VolumeEntry>, more: bool },
    /// The array's counters, named as in `STATS_REPLY`.
    Stats(StatsReply),
}

/// `VOLUME_REPLY` (6 + m bytes and the body): sent once the change is durable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeReply {
    pub status: Status,
    /// The request's operation, echoed: it says how to read the body.
    pub op: VolumeOp,
    /// What was done, or why not, for a person.
    pub message: String,
    /// Present only with status `Ok` and operation `List` or `Stats`.
    pub body: VolumeBody,
}

/// Flag of a listing: volumes follow the last entry of this page.
const LIST_MORE: u8 = 1 << 0;

impl VolumeReply {
    pub fn refused(op: VolumeOp, status: Status, message: impl Into<String>) -> VolumeReply {
        VolumeReply { status, op, message: message.into(), body: VolumeBody::None }
    }

    pub fn done(op: VolumeOp, message: impl Into<String>) -> VolumeReply {
        VolumeReply::refused(op, Status::Ok, message)
    }

    /// The body. A listing holds the entries that fit one control body; when some were left
    /// out, it says more follow (whatever `more` said), and the initiator asks again from
    /// the last entry it got.
    pub fn encode(&self) -> Vec<u8> {
        let message = truncate_utf8(&self.message, MESSAGE_MAX);
        let mut w = Vec::with_capacity(6 + message.len());
        w.extend_from_slice(&self.status.to_u16().to_le_bytes());
        w.extend_from_slice(&[self.op as u8, 0]);
        put_str16(&mut w, message);
        if !self.status.is_ok() {
            return w;
        }
        match (&self.body, self.op) {
            (VolumeBody::List { volumes, more }, VolumeOp::List) => {
                let head = w.len();
                w.extend_from_slice(&[0; 4]);
                let mut count: u16 = 0;
                for v in volumes {
                    if w.len() + v.encoded_len() > CONTROL_BODY_MAX || count == u16::MAX {
                        break;
                    }
                    v.put(&mut w);
                    count += 1;
                }
                let cut = usize::from(count) < volumes.len();
                w[head..head + 2].copy_from_slice(&count.to_le_bytes());
                w[head + 2] = if *more || cut { LIST_MORE } else { 0 };
            }
            (VolumeBody::Stats(stats), VolumeOp::Stats) => stats.put(&mut w),
            // A listing or counters are what these operations answer; without them the
            // body is empty, which the decoder reads as an empty answer.
            (_, VolumeOp::List) => w.extend_from_slice(&[0; 4]),
            (_, VolumeOp::Stats) => w.extend_from_slice(&[0; 2]),
            _ => {}
        }
        w
    }

    pub fn decode(body: &[u8]) -> Result<VolumeReply> {
        let mut r = Reader::new(body, "VOLUME_REPLY")?;
        let status = Status::from_u16(r.u16()?);
        let op = VolumeOp::from_u8(r.u8()?).ok_or(WireError::Body("VOLUME_REPLY operation"))?;
        r.zero(1)?;
        let message = r.str16(MESSAGE_MAX)?;
        let body = match (status.is_ok(), op) {
            (true, VolumeOp::List) => {
                let count = r.u16()?;
                let flags = r.u8()?;
                if flags & !LIST_MORE != 0 {
                    return Err(WireError::Reserved("VOLUME_REPLY listing flags"));
                }
                r.zero(1)?;
                let mut volumes = Vec::with_capacity(usize::from(count).min(1024));
                for _ in 0..count {
                    volumes.push(VolumeEntry::get(&mut r)?);
                }
                VolumeBody::List { volumes, more: flags & LIST_MORE != 0 }
            }
            (true, VolumeOp::Stats) => VolumeBody::Stats(StatsReply::read_from(&mut r)?),
            _ => VolumeBody::None,
        };
        r.end()?;
        Ok(VolumeReply { status, op, message, body })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, origin: &str) -> VolumeEntry {
        VolumeEntry {
            name: name.into(),
            size_bytes: 1 << 30,
            allocated_bytes: 4096,
            writable: origin.is_empty(),
            origin: origin.into(),
            children: 0,
        }
    }

    #[test]
    fn requests_round_trip_and_unused_fields_must_be_empty() {
        let reqs = [
            VolumeRequest {
                op: VolumeOp::Create,
                name: "a".into(),
                origin: String::new(),
                size_bytes: 1 << 20,
            },
            VolumeRequest { op: VolumeOp::Snapshot, name: "s".into(), origin: "a".into(), size_bytes: 0 },
            VolumeRequest { op: VolumeOp::List, name: "cursor".into(), origin: String::new(), size_bytes: 0 },
            VolumeRequest::bare(VolumeOp::Stats),
        ];
        for req in reqs {
            assert_eq!(VolumeRequest::decode(&req.encode()).unwrap(), req);
        }
        for bad in [
            VolumeRequest { op: VolumeOp::Delete, name: "a".into(), origin: String::new(), size_bytes: 1 },
            VolumeRequest { op: VolumeOp::Create, name: "a".into(), origin: "b".into(), size_bytes: 1 },
            VolumeRequest { op: VolumeOp::Clone, name: "a".into(), origin: "b".into(), size_bytes: 1 },
            VolumeRequest { op: VolumeOp::Stats, name: "a".into(), origin: String::new(), size_bytes: 0 },
        ] {
            assert!(VolumeRequest::decode(&bad.encode()).is_err(), "{bad:?}");
        }
        let mut unknown = VolumeRequest::bare(VolumeOp::List).encode();
        unknown[0] = 8;
        assert_eq!(VolumeRequest::decode(&unknown), Err(WireError::Body("VOLUME operation")));
        let mut reserved = VolumeRequest::bare(VolumeOp::List).encode();
        reserved[2] = 1;
        assert!(matches!(VolumeRequest::decode(&reserved), Err(WireError::Reserved(_))));
    }

    #[test]
    fn a_listing_longer_than_a_body_is_cut_and_says_more_follow() {
        let many: Vec<VolumeEntry> = (0..400).map(|i| entry(&format!("{i:0>200}"), "")).collect();
        let reply = VolumeReply {
            status: Status::Ok,
            op: VolumeOp::List,
            message: String::new(),
            body: VolumeBody::List { volumes: many, more: false },
        };
        let body = reply.encode();
        assert!(body.len() <= CONTROL_BODY_MAX);
        let VolumeBody::List { volumes, more } = VolumeReply::decode(&body).unwrap().body else { panic!() };
        assert!(more && volumes.len() > 200 && volumes.len() < 400, "{}", volumes.len());
        assert_eq!(volumes[0].name, format!("{:0>200}", 0));
    }

    #[test]
    fn a_refusal_has_no_body() {
        let r = VolumeReply::refused(VolumeOp::List, Status::Unsupported, "no flash array");
        let body = r.encode();
        assert_eq!(body.len(), 6 + 14);
        assert_eq!(VolumeReply::decode(&body).unwrap(), r);
        let mut extra = body.clone();
        extra.extend_from_slice(&[0; 4]);
        assert!(VolumeReply::decode(&extra).is_err(), "a listing after a refusal");
    }
}
