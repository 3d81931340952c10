//! What a server offers in the handshake: its exports, their sizes, block-size constraints
//! and capabilities.
//!
//! The target fills in one [`ExportDesc`] per export from its config and its backend's
//! capability queries; [`HandshakeConfig::new`] checks them once against the spec's rules
//! (string limits, block-size constraints, unique names) so the handshake never has to.
//! This module decides which transmission flags an export advertises; it does not enforce
//! them on requests (see [`crate::transmission::check_request`]).

use crate::{tflags, NbdError, EXPORTS_MAX, STRING_MAX};

/// The spec's default block-size constraints, assumed by clients that do not ask.
const DEFAULT_BLOCK_MIN: u32 = 1;
const DEFAULT_BLOCK_PREFERRED: u32 = 4096;
const DEFAULT_BLOCK_MAX: u32 = u32::MAX;
/// Largest minimum block size the spec allows.
const BLOCK_MIN_MAX: u32 = 64 * 1024;

/// One export as NBD clients see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportDesc {
    /// Non-empty; the empty name is the client's way of asking for the default export.
    pub name: String,
    /// Free text shown to humans by LIST and `NBD_INFO_DESCRIPTION`; may be empty.
    pub description: String,
    pub size_bytes: u64,
    /// Alignment and smallest length of a request: a power of two, at most 64 KiB.
    pub block_min: u32,
    /// Smallest efficient request: a power of two, at least `block_min` and 512.
    pub block_preferred: u32,
    /// Largest request payload: a multiple of `block_min`, or `u32::MAX` for no limit.
    pub block_max: u32,
    pub read_only: bool,
    pub can_flush: bool,
    pub can_fua: bool,
    pub can_trim: bool,
    pub can_write_zeroes: bool,
    /// Only advertised together with `can_write_zeroes`.
    pub can_fast_zero: bool,
    pub can_cache: bool,
    /// Flush and FUA are visible across every connection to this export.
    pub can_multi_conn: bool,
    /// Not offered to this handshake's clients at all (an export they have no access to): LIST
    /// leaves it out, and asking for it is answered as for a name that does not exist.
    pub hidden: bool,
}

impl ExportDesc {
    /// A writable export with the spec's default block sizes and no optional capabilities.
    pub fn new(name: impl Into<String>, size_bytes: u64) -> ExportDesc {
        ExportDesc {
            name: name.into(),
            description: String::new(),
            size_bytes,
            block_min: DEFAULT_BLOCK_MIN,
            block_preferred: DEFAULT_BLOCK_PREFERRED,
            block_max: DEFAULT_BLOCK_MAX,
            read_only: false,
            can_flush: false,
            can_fua: false,
            can_trim: false,
            can_write_zeroes: false,
            can_fast_zero: false,
            hidden: false,
            can_cache: false,
            can_multi_conn: false,
        }
    }

    /// The transmission flags for this export, given whether structured replies were
    /// negotiated.
    ///
    /// A read-only export does not advertise TRIM, WRITE_ZEROES or FAST_ZERO: the spec forbids
    /// advertising what the server will not do, and every one of them would get `EPERM`.
    /// SEND_DF is advertised whenever structured replies are on, because a skiff READ is
    /// always answered with a single data chunk, which is exactly what DF asks for.
    pub fn transmission_flags(&self, structured_replies: bool) -> u16 {
        let writable = !self.read_only;
        let write_zeroes = writable && self.can_write_zeroes;
        [
            (true, tflags::HAS_FLAGS),
            (self.read_only, tflags::READ_ONLY),
            (self.can_flush, tflags::SEND_FLUSH),
            (self.can_fua, tflags::SEND_FUA),
            (writable && self.can_trim, tflags::SEND_TRIM),
            (write_zeroes, tflags::SEND_WRITE_ZEROES),
            (structured_replies, tflags::SEND_DF),
            (self.can_multi_conn, tflags::CAN_MULTI_CONN),
            (self.can_cache, tflags::SEND_CACHE),
            (write_zeroes && self.can_fast_zero, tflags::SEND_FAST_ZERO),
        ]
        .into_iter()
        .filter(|&(on, _)| on)
        .fold(0, |acc, (_, flag)| acc | flag)
    }

    /// Whether the constraints are the spec's defaults, which a client may assume unasked.
    pub fn has_default_block_sizes(&self) -> bool {
        (self.block_min, self.block_preferred, self.block_max)
            == (DEFAULT_BLOCK_MIN, DEFAULT_BLOCK_PREFERRED, DEFAULT_BLOCK_MAX)
    }

    fn validate(&self) -> Result<(), &'static str> {
        if self.name.is_empty() {
            return Err("empty name (the empty name selects the default export)");
        }
        if self.name.len() > STRING_MAX || self.description.len() > STRING_MAX {
            return Err("name or description longer than 4096 bytes");
        }
        if self.name.contains('\0') || self.description.contains('\0') {
            return Err("name or description contains NUL");
        }
        let (min, preferred, max) = (self.block_min, self.block_preferred, self.block_max);
        if !min.is_power_of_two() || min > BLOCK_MIN_MAX {
            return Err("block_min must be a power of two no larger than 64 KiB");
        }
        if !preferred.is_power_of_two() || preferred < min.max(512) {
            return Err("block_preferred must be a power of two, at least block_min and 512");
        }
        if max != u32::MAX && max % min != 0 {
            return Err("block_max must be a multiple of block_min, or u32::MAX");
        }
        if u64::from(max) < u64::from(preferred).min(self.size_bytes) {
            return Err("block_max must be at least block_preferred or the export size");
        }
        Ok(())
    }
}

/// The exports one listener offers, checked once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandshakeConfig {
    exports: Vec<ExportDesc>,
    /// Index of the export served for the empty name, if any.
    default_export: Option<usize>,
    tls: TlsPolicy,
}

/// Whether the server offers NBD_OPT_STARTTLS; the names are nbdkit's `--tls`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsPolicy {
    /// STARTTLS is answered `NBD_REP_ERR_UNSUP`.
    #[default]
    Off,
    /// STARTTLS is accepted; every option also works in plaintext.
    On,
    /// Before STARTTLS, every option but STARTTLS and ABORT is answered
    /// `NBD_REP_ERR_TLS_REQD` (EXPORT_NAME closes the connection).
    Require,
}

impl HandshakeConfig {
    pub fn new(exports: Vec<ExportDesc>, default_export: Option<usize>) -> Result<HandshakeConfig, NbdError> {
        if exports.len() > EXPORTS_MAX {
            return Err(NbdError::BadConfig("more than EXPORTS_MAX exports"));
        }
        if default_export.is_some_and(|i| i >= exports.len()) {
            return Err(NbdError::BadConfig("default export index out of range"));
        }
        for (index, export) in exports.iter().enumerate() {
            export.validate().map_err(|reason| NbdError::BadExport { index, reason })?;
            if exports[..index].iter().any(|e| e.name == export.name) {
                return Err(NbdError::BadExport { index, reason: "duplicate name" });
            }
        }
        Ok(HandshakeConfig { exports, default_export, tls: TlsPolicy::Off })
    }

    /// Offer STARTTLS as `tls` says (the driver must then be able to do the TLS handshake).
    pub fn with_tls(mut self, tls: TlsPolicy) -> HandshakeConfig {
        self.tls = tls;
        self
    }

    pub fn tls(&self) -> TlsPolicy {
        self.tls
    }

    pub fn exports(&self) -> &[ExportDesc] {
        &self.exports
    }

    pub fn default_export(&self) -> Option<usize> {
        self.default_export
    }

    /// The export a client means by `name` (raw bytes off the wire; the empty name is the
    /// default export).
    pub fn find(&self, name: &[u8]) -> Option<(usize, &ExportDesc)> {
        if name.is_empty() {
            let index = self.default_export?;
            return self.exports.get(index).filter(|e| !e.hidden).map(|e| (index, e));
        }
        self.exports.iter().enumerate().find(|(_, e)| !e.hidden && e.name.as_bytes() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejects(mut edit: impl FnMut(&mut ExportDesc)) -> bool {
        let mut e = ExportDesc::new("disk", 1 << 30);
        edit(&mut e);
        matches!(HandshakeConfig::new(vec![e], None), Err(NbdError::BadExport { index: 0, .. }))
    }

    #[test]
    fn block_size_rules_follow_the_spec() {
        assert!(!rejects(|_| {}), "defaults are valid");
        assert!(!rejects(|e| (e.block_min, e.block_preferred, e.block_max) = (512, 4096, 1 << 20)));
        assert!(!rejects(|e| (e.block_min, e.block_preferred, e.block_max) = (4096, 4096, 3 * 4096)));
        assert!(rejects(|e| e.block_min = 0));
        assert!(rejects(|e| e.block_min = 3));
        assert!(rejects(|e| (e.block_min, e.block_preferred) = (128 * 1024, 128 * 1024)));
        assert!(rejects(|e| e.block_preferred = 256), "preferred below 512");
        assert!(rejects(|e| (e.block_min, e.block_preferred) = (8192, 4096)), "preferred below min");
        assert!(rejects(|e| (e.block_min, e.block_max) = (512, 1000)), "max not a multiple");
        assert!(rejects(|e| e.block_max = 2048), "max below preferred");
        // A tiny export may have a maximum below the preferred size, but not below its size.
        assert!(!rejects(|e| (e.size_bytes, e.block_max) = (1024, 1024)));
    }

    #[test]
    fn names_are_checked() {
        assert!(rejects(|e| e.name.clear()));
        assert!(rejects(|e| e.name.push('\0')));
        assert!(rejects(|e| e.description = "x".repeat(STRING_MAX + 1)));
        let two = vec![ExportDesc::new("a", 1), ExportDesc::new("a", 2)];
        assert_eq!(
            HandshakeConfig::new(two, None),
            Err(NbdError::BadExport { index: 1, reason: "duplicate name" })
        );
        assert!(HandshakeConfig::new(vec![ExportDesc::new("a", 1)], Some(1)).is_err());
    }

    #[test]
    fn find_resolves_the_default_for_the_empty_name() {
        let exports = vec![ExportDesc::new("a", 1), ExportDesc::new("b", 2)];
        let config = HandshakeConfig::new(exports.clone(), Some(1)).unwrap();
        assert_eq!(config.find(b"").map(|(i, _)| i), Some(1));
        assert_eq!(config.find(b"a").map(|(i, _)| i), Some(0));
        assert_eq!(config.find(b"c"), None);
        let config = HandshakeConfig::new(exports, None).unwrap();
        assert_eq!(config.find(b""), None);
    }

    #[test]
    fn flags_follow_capabilities() {
        let mut e = ExportDesc::new("disk", 1 << 30);
        assert_eq!(e.transmission_flags(false), tflags::HAS_FLAGS);
        assert_eq!(e.transmission_flags(true), tflags::HAS_FLAGS | tflags::SEND_DF);
        e.can_fast_zero = true;
        assert_eq!(e.transmission_flags(false), tflags::HAS_FLAGS, "fast zero needs write zeroes");
        e.can_write_zeroes = true;
        e.can_trim = true;
        e.can_flush = true;
        e.can_cache = true;
        e.can_multi_conn = true;
        e.can_fua = true;
        assert_eq!(e.transmission_flags(false), 0x0d6d);
        e.read_only = true;
        let ro = e.transmission_flags(false);
        assert_eq!(ro, tflags::HAS_FLAGS | tflags::READ_ONLY | 0x050c, "no trim or zeroes when read-only");
    }
}
