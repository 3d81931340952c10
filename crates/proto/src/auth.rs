//! Authentication: keys, key files, and the challenge-response proofs of the handshake
//! (docs/PROTOCOL.md, section 15).
//!
//! A key is a name and a secret of at least [`SECRET_MIN_BYTES`] bytes, shared by the target and
//! the initiators allowed to use it. Key files use nbdkit's PSK file format, `name:hexsecret`
//! per line, so one file serves both. The handshake proves knowledge of the secret both ways
//! without sending it: each side contributes a 32-byte nonce, the initiator proves itself with
//! HMAC-SHA256 over both nonces and the key name under a client label, and the target answers
//! with the same under a target label. Nonces are inputs (the drivers draw them from the OS);
//! nothing here reads a clock or a random generator.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a nonce and of a proof.
pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;
/// Shortest secret accepted: 128 bits.
pub const SECRET_MIN_BYTES: usize = 16;
/// Longest secret accepted.
pub const SECRET_MAX_BYTES: usize = 256;
/// Longest key name, in bytes of UTF-8.
pub const KEY_NAME_MAX: usize = 64;

const CLIENT_LABEL: &[u8] = b"skiff-v1 client proof";
const TARGET_LABEL: &[u8] = b"skiff-v1 target proof";

/// A named secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Key {
    pub name: String,
    secret: Vec<u8>,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print a secret.
        f.debug_struct("Key").field("name", &self.name).finish_non_exhaustive()
    }
}

/// Why a key or key file is refused. Messages never contain a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("line {line}: expected NAME:HEXSECRET")]
    Syntax { line: usize },
    #[error(
        "line {line}: key name must be 1 to {KEY_NAME_MAX} bytes of letters, digits, '.', '_', '-' or '@'"
    )]
    Name { line: usize },
    #[error("line {line}: the secret of key {name:?} is not hexadecimal")]
    Hex { line: usize, name: String },
    #[error(
        "line {line}: the secret of key {name:?} is {bytes} bytes; at least {SECRET_MIN_BYTES} are needed"
    )]
    Short { line: usize, name: String, bytes: usize },
    #[error("line {line}: the secret of key {name:?} is over {SECRET_MAX_BYTES} bytes")]
    Long { line: usize, name: String },
    #[error("line {line}: key {name:?} is given twice")]
    Duplicate { line: usize, name: String },
    #[error("no keys in the file")]
    Empty,
}

/// Whether `name` is a valid key name (also what access lists may name).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= KEY_NAME_MAX
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@'))
}

impl Key {
    /// A key from its parts; the secret must be [`SECRET_MIN_BYTES`] to [`SECRET_MAX_BYTES`].
    pub fn new(name: &str, secret: &[u8]) -> Result<Key, KeyError> {
        Key::checked(name, secret, 0)
    }

    fn checked(name: &str, secret: &[u8], line: usize) -> Result<Key, KeyError> {
        if !valid_name(name) {
            return Err(KeyError::Name { line });
        }
        if secret.len() < SECRET_MIN_BYTES {
            return Err(KeyError::Short { line, name: name.to_owned(), bytes: secret.len() });
        }
        if secret.len() > SECRET_MAX_BYTES {
            return Err(KeyError::Long { line, name: name.to_owned() });
        }
        Ok(Key { name: name.to_owned(), secret: secret.to_vec() })
    }

    /// Parse a key file: `name:hexsecret` per line; blank lines and lines starting with `#`
    /// are skipped. Every key is checked; a name may appear once.
    pub fn parse_file(text: &str) -> Result<Vec<Key>, KeyError> {
        let mut keys: Vec<Key> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let l = raw.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let (name, hex) = l.split_once(':').ok_or(KeyError::Syntax { line })?;
            if !valid_name(name) {
                return Err(KeyError::Name { line });
            }
            let secret = decode_hex(hex).ok_or_else(|| KeyError::Hex { line, name: name.to_owned() })?;
            let key = Key::checked(name, &secret, line)?;
            if keys.iter().any(|k| k.name == key.name) {
                return Err(KeyError::Duplicate { line, name: key.name });
            }
            keys.push(key);
        }
        if keys.is_empty() {
            return Err(KeyError::Empty);
        }
        Ok(keys)
    }

    fn proof(
        &self,
        label: &[u8],
        client_nonce: &[u8; NONCE_LEN],
        target_nonce: &[u8; NONCE_LEN],
    ) -> [u8; PROOF_LEN] {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.secret).expect("HMAC takes any key length");
        mac.update(label);
        mac.update(client_nonce);
        mac.update(target_nonce);
        mac.update(&[self.name.len() as u8]);
        mac.update(self.name.as_bytes());
        mac.finalize().into_bytes().into()
    }

    /// The initiator's proof of knowing this key's secret.
    pub fn client_proof(
        &self,
        client_nonce: &[u8; NONCE_LEN],
        target_nonce: &[u8; NONCE_LEN],
    ) -> [u8; PROOF_LEN] {
        self.proof(CLIENT_LABEL, client_nonce, target_nonce)
    }

    /// The target's proof of knowing it.
    pub fn target_proof(
        &self,
        client_nonce: &[u8; NONCE_LEN],
        target_nonce: &[u8; NONCE_LEN],
    ) -> [u8; PROOF_LEN] {
        self.proof(TARGET_LABEL, client_nonce, target_nonce)
    }
}

/// Compare two proofs in time independent of where they differ.
pub fn proofs_equal(a: &[u8; PROOF_LEN], b: &[u8; PROOF_LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The bytes of a string of hex digit pairs (either case); `None` for anything else.
pub fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|pair| u8::from_str_radix(pair, 16).ok()))
        .collect()
}

/// Rights on an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rights {
    ReadOnly,
    ReadWrite,
}

/// Who may open an export, and with which rights. `*` stands for initiators without a key.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AccessList {
    pub anonymous: Option<Rights>,
    pub keys: Vec<(String, Rights)>,
}

impl AccessList {
    /// Parse `NAME:rw+NAME:ro+*:ro` (`*` is anyone without a key).
    pub fn parse(s: &str) -> Result<AccessList, String> {
        let mut list = AccessList::default();
        for entry in s.split('+') {
            let (who, rights) =
                entry.split_once(':').ok_or_else(|| format!("{entry:?}: expected NAME:ro or NAME:rw"))?;
            let rights = match rights {
                "ro" => Rights::ReadOnly,
                "rw" => Rights::ReadWrite,
                other => return Err(format!("{entry:?}: rights {other:?} are neither ro nor rw")),
            };
            if who == "*" {
                list.anonymous = Some(rights);
            } else if valid_name(who) {
                if list.keys.iter().any(|(n, _)| n == who) {
                    return Err(format!("{who:?} is listed twice"));
                }
                list.keys.push((who.to_owned(), rights));
            } else {
                return Err(format!("{who:?} is not a key name"));
            }
        }
        Ok(list)
    }

    /// The rights of `principal` (a key name, or `None` for an initiator without a key).
    pub fn rights_of(&self, principal: Option<&str>) -> Option<Rights> {
        match principal {
            None => self.anonymous,
            Some(name) => self.keys.iter().find(|(n, _)| n == name).map(|&(_, r)| r).or(self.anonymous),
        }
    }
}

impl std::fmt::Display for AccessList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = |r: Rights| if r == Rights::ReadOnly { "ro" } else { "rw" };
        let mut parts: Vec<String> = self.keys.iter().map(|(n, r)| format!("{n}:{}", name(*r))).collect();
        if let Some(r) = self.anonymous {
            parts.push(format!("*:{}", name(r)));
        }
        f.write_str(&parts.join("+"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_files_parse_and_every_fault_names_its_line() {
        let keys = Key::parse_file(
            "# ops\nalice:000102030405060708090a0b0c0d0e0f\n\nbob:ffeeddccbbaa99887766554433221100aa\n",
        )
        .unwrap();
        assert_eq!(keys.iter().map(|k| k.name.as_str()).collect::<Vec<_>>(), ["alice", "bob"]);
        assert!(!format!("{keys:?}").contains("0001"), "a secret never prints");
        let bad = |t: &str| Key::parse_file(t).unwrap_err();
        assert_eq!(bad("alice"), KeyError::Syntax { line: 1 });
        assert_eq!(bad("\nal ice:00"), KeyError::Name { line: 2 });
        assert!(matches!(bad("a:zz000102030405060708090a0b0c0d0e"), KeyError::Hex { line: 1, .. }));
        assert!(matches!(bad("a:0001"), KeyError::Short { bytes: 2, .. }));
        assert!(matches!(
            bad("a:00010203040506070809000102030405\na:00010203040506070809000102030405"),
            KeyError::Duplicate { line: 2, .. }
        ));
        assert_eq!(bad("# nothing\n"), KeyError::Empty);
        assert!(bad("a:00010203040506070809000102030405x").to_string().contains("line 1"));
    }

    /// Fixed vectors for docs/PROTOCOL.md, section 15, so a second implementation can check
    /// its proofs.
    #[test]
    fn proofs_are_fixed_and_domain_separated() {
        let key = Key::new("alice", &(0u8..16).collect::<Vec<_>>()).unwrap();
        let cn = [0x11; NONCE_LEN];
        let tn = [0x22; NONCE_LEN];
        let hex = |p: [u8; 32]| p.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let client = key.client_proof(&cn, &tn);
        let target = key.target_proof(&cn, &tn);
        assert_ne!(client, target);
        assert_eq!(hex(client), "8acdb5d4eee028d2f77adc3870d6b0346b93e3eb444bc4ef799fb90af6ba9611");
        assert_eq!(hex(target), "8df4461f33f44e95a4a9a5c9b637331dc2449812358094b91780aa8c9bb741d3");
        let other = Key::new("alice", &(1u8..17).collect::<Vec<_>>()).unwrap();
        assert!(!proofs_equal(&other.client_proof(&cn, &tn), &client));
        assert!(proofs_equal(&key.client_proof(&cn, &tn), &client));
        assert_ne!(key.client_proof(&tn, &cn), client, "nonces are not interchangeable");
    }

    #[test]
    fn access_lists_parse_and_grant() {
        let l = AccessList::parse("alice:rw+bob:ro+*:ro").unwrap();
        assert_eq!(l.rights_of(Some("alice")), Some(Rights::ReadWrite));
        assert_eq!(l.rights_of(Some("bob")), Some(Rights::ReadOnly));
        assert_eq!(l.rights_of(Some("carol")), Some(Rights::ReadOnly), "anyone may read");
        assert_eq!(l.rights_of(None), Some(Rights::ReadOnly));
        assert_eq!(l.to_string(), "alice:rw+bob:ro+*:ro");
        let keyed = AccessList::parse("alice:rw").unwrap();
        assert_eq!(keyed.rights_of(None), None);
        assert_eq!(keyed.rights_of(Some("bob")), None);
        assert!(AccessList::parse("alice").is_err());
        assert!(AccessList::parse("alice:rx").is_err());
        assert!(AccessList::parse("alice:rw+alice:ro").is_err());
        assert!(AccessList::parse("al ice:rw").is_err());
    }
}
