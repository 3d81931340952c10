//! How a backend is named on the command line, and the geometry rules all backends share.
//!
//! A spec string is `kind:argument`: `ram:1G`, `null:512M`, `file:/dev/nvme0n1`. Parsing turns
//! it into a validated [`BackendSpec`] (sizes non-zero and whole blocks) once, at start-up;
//! [`Display`](std::fmt::Display) prints a spec back in a form that parses to the same value.
//! This module also holds the block size and the range check that every backend applies to
//! requests, so the three implementations cannot disagree. It opens nothing: see
//! [`crate::open`].

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::str::FromStr;

use crate::{BackendError, Result};

/// Block size of every backend, in bytes: the unit of offsets and lengths, and the granularity
/// of RAM and null volume sizes.
pub const BLOCK_BYTES: u32 = 512;

/// Size suffixes, largest first so `Display` picks the shortest exact form. All are binary:
/// `K`, `KB` and `KiB` all mean 1024, as storage tools conventionally read them.
const UNITS: [(&str, u32); 4] = [("T", 40), ("G", 30), ("M", 20), ("K", 10)];

/// A parsed, validated backend description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendSpec {
    /// Anonymous memory of `size_bytes` (a non-zero multiple of [`BLOCK_BYTES`]).
    Ram { size_bytes: u64 },
    /// A volume of `size_bytes` that reads zeroes and discards writes.
    Null { size_bytes: u64 },
    /// A regular file or block device; its size is found when opened.
    File { path: PathBuf },
}

/// Why a spec string or size was refused. Every message names the offending input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("backend spec \"{0}\" has no kind: expected ram:SIZE, null:SIZE or file:PATH")]
    MissingKind(String),
    #[error("unknown backend kind \"{kind}\" in \"{input}\": expected ram, null or file")]
    UnknownKind { kind: String, input: String },
    #[error("empty size: expected a number of bytes such as 4096, 64K, 512M or 1G")]
    EmptySize,
    #[error("invalid size \"{0}\": expected digits with an optional K, M, G or T suffix")]
    BadSize(String),
    #[error("size \"{0}\" does not fit in 64 bits")]
    SizeOverflow(String),
    #[error("size \"{0}\" is zero: a volume needs at least one block")]
    ZeroSize(String),
    #[error("size \"{input}\" ({size_bytes} bytes) is not a multiple of the {BLOCK_BYTES}-byte block")]
    NotWholeBlocks { input: String, size_bytes: u64 },
    #[error("backend spec \"{0}\" has an empty path")]
    EmptyPath(String),
}

impl BackendSpec {
    /// Parse `ram:SIZE`, `null:SIZE` or `file:PATH`. Everything after the first `:` is the
    /// argument, so paths may themselves contain colons.
    pub fn parse(input: &str) -> std::result::Result<BackendSpec, SpecError> {
        let (kind, arg) = input.split_once(':').ok_or_else(|| SpecError::MissingKind(input.to_owned()))?;
        match kind {
            "ram" => Ok(BackendSpec::Ram { size_bytes: parse_volume_size(arg)? }),
            "null" => Ok(BackendSpec::Null { size_bytes: parse_volume_size(arg)? }),
            "file" if arg.is_empty() => Err(SpecError::EmptyPath(input.to_owned())),
            "file" => Ok(BackendSpec::File { path: PathBuf::from(arg) }),
            _ => Err(SpecError::UnknownKind { kind: kind.to_owned(), input: input.to_owned() }),
        }
    }
}

impl FromStr for BackendSpec {
    type Err = SpecError;

    fn from_str(input: &str) -> std::result::Result<BackendSpec, SpecError> {
        BackendSpec::parse(input)
    }
}

impl fmt::Display for BackendSpec {
    /// Prints the parseable form. A path that is not UTF-8 is printed lossily and so cannot
    /// round-trip; `parse` only ever produces UTF-8 paths.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendSpec::Ram { size_bytes } => write!(f, "ram:{}", format_size(*size_bytes)),
            BackendSpec::Null { size_bytes } => write!(f, "null:{}", format_size(*size_bytes)),
            BackendSpec::File { path } => write!(f, "file:{}", path.display()),
        }
    }
}

/// A volume size: a valid size that is non-zero and made of whole blocks.
fn parse_volume_size(input: &str) -> std::result::Result<u64, SpecError> {
    let size_bytes = parse_size(input)?;
    if size_bytes == 0 {
        return Err(SpecError::ZeroSize(input.to_owned()));
    }
    if !size_bytes.is_multiple_of(u64::from(BLOCK_BYTES)) {
        return Err(SpecError::NotWholeBlocks { input: input.to_owned(), size_bytes });
    }
    Ok(size_bytes)
}

/// Parse a byte count: decimal digits, optionally followed by a binary suffix `K`, `M`, `G` or
/// `T` (case-insensitive, optionally followed by `B` or `iB`: `4k`, `64KB`, `1GiB`). Zero is a
/// valid size here; volume specs reject it separately.
pub fn parse_size(input: &str) -> std::result::Result<u64, SpecError> {
    if input.is_empty() {
        return Err(SpecError::EmptySize);
    }
    let digits_len = input.bytes().position(|b| !b.is_ascii_digit()).unwrap_or(input.len());
    let (digits, suffix) = input.split_at(digits_len);
    if digits.is_empty() {
        return Err(SpecError::BadSize(input.to_owned()));
    }
    let shift = suffix_shift(suffix).ok_or_else(|| SpecError::BadSize(input.to_owned()))?;
    // Only ASCII digits remain, so the sole way `parse` can fail is by overflowing.
    let count: u64 = digits.parse().map_err(|_| SpecError::SizeOverflow(input.to_owned()))?;
    count.checked_mul(1u64 << shift).ok_or_else(|| SpecError::SizeOverflow(input.to_owned()))
}

/// The power of two a suffix stands for, or `None` for junk. The empty suffix and a bare `B`
/// mean bytes.
fn suffix_shift(suffix: &str) -> Option<u32> {
    if suffix.is_empty() || suffix.eq_ignore_ascii_case("b") {
        return Some(0);
    }
    let (letter, rest) = suffix.split_at_checked(1)?;
    let (_, shift) = UNITS.iter().find(|(unit, _)| unit.eq_ignore_ascii_case(letter))?;
    let tail_ok = rest.is_empty() || rest.eq_ignore_ascii_case("b") || rest.eq_ignore_ascii_case("ib");
    tail_ok.then_some(*shift)
}

/// The shortest exact spelling of a size: `1G` for 2^30, `1536K` for 1.5 MiB, plain bytes
/// when no suffix divides it.
fn format_size(size_bytes: u64) -> String {
    if size_bytes != 0 {
        for (unit, shift) in UNITS {
            if size_bytes.is_multiple_of(1u64 << shift) {
                return format!("{}{unit}", size_bytes >> shift);
            }
        }
    }
    size_bytes.to_string()
}

/// Check that `[offset, offset + len_bytes)` lies inside a volume of `size_bytes`. The engine
/// validates every request first; this keeps a bug there from reaching memory or growing a
/// file. Out of range maps to `EINVAL`, as the kernel reports for a bad offset.
pub(crate) fn check_range(size_bytes: u64, offset: u64, len_bytes: u64) -> Result<()> {
    match offset.checked_add(len_bytes) {
        Some(end) if end <= size_bytes => Ok(()),
        _ => Err(BackendError::Io(io::Error::from_raw_os_error(libc::EINVAL))),
    }
}

/// The error every backend gives for a change to a read-only volume.
pub(crate) fn read_only_error() -> BackendError {
    BackendError::Io(io::Error::from_raw_os_error(libc::EROFS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        let cases: [(&str, u64); 14] = [
            ("0", 0),
            ("4096", 4096),
            ("4k", 4096),
            ("4K", 4096),
            ("4KiB", 4096),
            ("64KB", 64 << 10),
            ("64kb", 64 << 10),
            ("512M", 512 << 20),
            ("512MiB", 512 << 20),
            ("1G", 1 << 30),
            ("1g", 1 << 30),
            ("1T", 1 << 40),
            ("100B", 100),
            ("16777215T", 16777215 << 40),
        ];
        for (input, want) in cases {
            assert_eq!(parse_size(input), Ok(want), "{input}");
        }
    }

    #[test]
    fn bad_sizes_are_refused_by_name() {
        assert_eq!(parse_size(""), Err(SpecError::EmptySize));
        for junk in ["K", "-1", "+4", " 4", "4 ", "1.5G", "4X", "4KK", "4Kb2", "4iB", "0x10", "G1"] {
            assert_eq!(parse_size(junk), Err(SpecError::BadSize(junk.to_owned())), "{junk}");
        }
        for huge in ["16777216T", "18446744073709551616", "99999999999999999999999"] {
            assert_eq!(parse_size(huge), Err(SpecError::SizeOverflow(huge.to_owned())));
        }
        let message = parse_size("12Q").unwrap_err().to_string();
        assert!(message.contains("\"12Q\""), "{message}");
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
    }

    #[test]
    fn specs_parse() {
        assert_eq!(BackendSpec::parse("ram:1G"), Ok(BackendSpec::Ram { size_bytes: 1 << 30 }));
        assert_eq!(BackendSpec::parse("null:512M"), Ok(BackendSpec::Null { size_bytes: 512 << 20 }));
        assert_eq!(
            BackendSpec::parse("file:/var/tmp/a:b"),
            Ok(BackendSpec::File { path: PathBuf::from("/var/tmp/a:b") })
        );
        assert_eq!("ram:512".parse(), Ok(BackendSpec::Ram { size_bytes: 512 }));
    }

    #[test]
    fn bad_specs_are_refused_by_name() {
        assert_eq!(BackendSpec::parse("ram1G"), Err(SpecError::MissingKind("ram1G".into())));
        assert_eq!(
            BackendSpec::parse("disk:1G"),
            Err(SpecError::UnknownKind { kind: "disk".into(), input: "disk:1G".into() })
        );
        assert_eq!(BackendSpec::parse("ram:"), Err(SpecError::EmptySize));
        assert_eq!(BackendSpec::parse("ram:0"), Err(SpecError::ZeroSize("0".into())));
        assert_eq!(BackendSpec::parse("null:0K"), Err(SpecError::ZeroSize("0K".into())));
        assert_eq!(
            BackendSpec::parse("ram:1000"),
            Err(SpecError::NotWholeBlocks { input: "1000".into(), size_bytes: 1000 })
        );
        assert_eq!(BackendSpec::parse("file:"), Err(SpecError::EmptyPath("file:".into())));
        assert_eq!(BackendSpec::parse("null:lots"), Err(SpecError::BadSize("lots".into())));
        let message = BackendSpec::parse("tape:/dev/st0").unwrap_err().to_string();
        assert!(message.contains("tape"), "{message}");
    }

    #[test]
    fn display_round_trips() {
        let specs = [
            BackendSpec::Ram { size_bytes: 1 << 30 },
            BackendSpec::Ram { size_bytes: 512 },
            BackendSpec::Ram { size_bytes: 1536 << 10 },
            BackendSpec::Null { size_bytes: 3 << 40 },
            BackendSpec::Null { size_bytes: (1 << 40) + 512 },
            BackendSpec::File { path: PathBuf::from("/dev/nvme0n1") },
            BackendSpec::File { path: PathBuf::from("rel/a:b") },
        ];
        for spec in specs {
            let text = spec.to_string();
            assert_eq!(BackendSpec::parse(&text), Ok(spec), "{text}");
        }
        assert_eq!(BackendSpec::Ram { size_bytes: 1 << 30 }.to_string(), "ram:1G");
        assert_eq!(BackendSpec::Null { size_bytes: 1536 << 10 }.to_string(), "null:1536K");
        assert_eq!(BackendSpec::Ram { size_bytes: 1000 }.to_string(), "ram:1000");
    }

    #[test]
    fn range_check() {
        assert!(check_range(4096, 0, 4096).is_ok());
        assert!(check_range(4096, 4096, 0).is_ok());
        assert_eq!(check_range(4096, 3584, 1024).unwrap_err().errno(), libc::EINVAL);
        assert_eq!(check_range(4096, u64::MAX, 2).unwrap_err().errno(), libc::EINVAL);
        assert_eq!(read_only_error().errno(), libc::EROFS);
    }
}
