//! Persistent references (FlashNet's persistent credentials, thesis 5.3.4): the secret that
//! seals a flash array's extents and each volume's key epoch, kept in a file, so that a
//! reference stays valid across a target restart while its volume and the volume's epoch are
//! unchanged, and a reference revoked before a restart stays revoked after it.
//!
//! The file is text, written whole to a temporary file, synced and renamed over the old one
//! (then the directory synced), created readable by its owner alone:
//!
//! ```text
//! # skiff flash references: ...
//! version 1
//! secret 000102…1f                  (64 hex digits)
//! epoch 7 3                         (volume id 7 is at key epoch 3; one line per volume rotated)
//! ```
//!
//! A volume without a line is at epoch 1. An epoch is saved before the rotation answers
//! (`REVOKE`, a shrink), so a revocation the initiator was told about survives a crash.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use proto::capability::KEY_LEN;

/// What the file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    pub secret: [u8; KEY_LEN],
    /// Volume id → key epoch, for the volumes whose epoch moved past 1.
    pub epochs: BTreeMap<u32, u32>,
}

/// The secret and epochs of one flash array's references, and the file they live in.
pub struct ReferenceStore {
    path: PathBuf,
    saved: Mutex<Saved>,
}

impl std::fmt::Debug for ReferenceStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.debug_struct("ReferenceStore").field("path", &self.path).finish_non_exhaustive()
    }
}

const HEADER: &str =
    "# skiff flash references: the secret that seals the array's extents and the volumes' key \
                      epochs. Anyone who reads it can forge references: keep it private.";

impl Saved {
    /// The file's text.
    pub fn encode(&self) -> String {
        let mut out = format!("{HEADER}\nversion 1\nsecret ");
        for b in self.secret {
            out.push_str(&format!("{b:02x}"));
        }
        out.push('\n');
        for (vol, epoch) in &self.epochs {
            out.push_str(&format!("epoch {vol} {epoch}\n"));
        }
        out
    }

    /// Parse the file's text; the error names the line and what is wrong with it.
    pub fn decode(text: &str) -> Result<Saved, String> {
        let mut version = false;
        let mut secret = None;
        let mut epochs = BTreeMap::new();
        for (i, line) in text.lines().enumerate() {
            let n = i + 1;
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let words: Vec<&str> = line.split_ascii_whitespace().collect();
            match words.as_slice() {
                ["version", "1"] if !version => version = true,
                ["version", v] => {
                    return Err(format!("line {n}: version {v:?}: this build reads version 1, once"))
                }
                _ if !version => return Err(format!("line {n}: expected \"version 1\" first")),
                ["secret", hex] if secret.is_none() => {
                    secret = Some(parse_secret(hex).map_err(|e| format!("line {n}: {e}"))?)
                }
                ["epoch", vol, epoch] => {
                    let vol: u32 =
                        vol.parse().map_err(|_| format!("line {n}: volume id {vol:?} is not a u32"))?;
                    let epoch: u32 =
                        epoch.parse().map_err(|_| format!("line {n}: epoch {epoch:?} is not a u32"))?;
                    if epoch == 0 {
                        return Err(format!("line {n}: epoch 0: epochs start at 1"));
                    }
                    if epochs.insert(vol, epoch).is_some() {
                        return Err(format!("line {n}: volume {vol} twice"));
                    }
                }
                _ => {
                    return Err(format!("line {n}: expected \"secret HEX\" once, or \"epoch VOLUME EPOCH\""))
                }
            }
        }
        let secret = secret.ok_or("no \"secret\" line")?;
        Ok(Saved { secret, epochs })
    }
}

fn parse_secret(hex: &str) -> Result<[u8; KEY_LEN], String> {
    if hex.len() != 2 * KEY_LEN || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("the secret must be {} hex digits", 2 * KEY_LEN));
    }
    let mut out = [0u8; KEY_LEN];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("checked hex digits");
    }
    Ok(out)
}

impl ReferenceStore {
    /// Open the store at `path`, or make it with `fresh()`'s secret when there is no file yet.
    pub fn open(
        path: &Path,
        fresh: impl FnOnce() -> io::Result<[u8; KEY_LEN]>,
    ) -> io::Result<ReferenceStore> {
        let saved = match std::fs::read_to_string(path) {
            Ok(text) => Saved::decode(&text).map_err(|e| {
                io::Error::new(io::ErrorKind::InvalidData, format!("{}: {e}", path.display()))
            })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let saved = Saved { secret: fresh()?, epochs: BTreeMap::new() };
                write_atomically(path, &saved.encode())?;
                saved
            }
            Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
        };
        Ok(ReferenceStore { path: path.to_owned(), saved: Mutex::new(saved) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn secret(&self) -> [u8; KEY_LEN] {
        self.lock().secret
    }

    /// Volume `vol`'s key epoch as saved (1 when never rotated).
    pub fn epoch(&self, vol: u32) -> u32 {
        self.lock().epochs.get(&vol).copied().unwrap_or(1)
    }

    /// Save that volume `vol` is at `epoch` now (never moving an epoch back, whatever order
    /// two rotations save in), durably, before returning.
    pub fn save_epoch(&self, vol: u32, epoch: u32) -> io::Result<()> {
        let mut saved = self.lock();
        let at = saved.epochs.entry(vol).or_insert(1);
        *at = (*at).max(epoch);
        write_atomically(&self.path, &saved.encode())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Saved> {
        self.saved.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Replace `path` with `text`: a temporary file beside it, synced, renamed over it, the
/// directory synced. Readable by its owner alone.
fn write_atomically(path: &Path, text: &str) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let named = |e: io::Error, what: &Path| io::Error::new(e.kind(), format!("{}: {e}", what.display()));
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| named(e, &tmp))?;
    f.write_all(text.as_bytes()).and_then(|()| f.sync_all()).map_err(|e| named(e, &tmp))?;
    std::fs::rename(&tmp, path).map_err(|e| named(e, path))?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| named(e, dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_round_trips_survives_reopening_and_never_moves_an_epoch_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("refs");
        let store = ReferenceStore::open(&path, || Ok([7; KEY_LEN])).unwrap();
        assert_eq!((store.secret(), store.epoch(3)), ([7; KEY_LEN], 1));
        store.save_epoch(3, 4).unwrap();
        store.save_epoch(3, 2).unwrap();
        store.save_epoch(9, 2).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let again = ReferenceStore::open(&path, || panic!("the file exists: no new secret")).unwrap();
        assert_eq!((again.secret(), again.epoch(3), again.epoch(9), again.epoch(1)), ([7; KEY_LEN], 4, 2, 1));
        let saved = Saved::decode(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(Saved::decode(&saved.encode()).unwrap(), saved);
    }

    #[test]
    fn bad_files_are_refused_by_line() {
        let secret = "ab".repeat(KEY_LEN);
        for (text, says) in [
            ("", "no \"secret\""),
            ("secret 00", "line 1: expected \"version 1\" first"),
            ("version 2\n", "version \"2\""),
            ("version 1\nversion 1\n", "once"),
            ("version 1\nsecret abc\n", "64 hex digits"),
            (&format!("version 1\nsecret {secret}\nsecret {secret}\n"), "line 3"),
            (&format!("version 1\nsecret {secret}\nepoch x 2\n"), "volume id"),
            (&format!("version 1\nsecret {secret}\nepoch 1 0\n"), "epochs start at 1"),
            (&format!("version 1\nsecret {secret}\nepoch 1 2\nepoch 1 3\n"), "twice"),
            (&format!("version 1\nsecret {secret}\nwhat\n"), "line 3"),
        ] {
            let e = Saved::decode(text).unwrap_err();
            assert!(e.contains(says), "{text:?}: {e}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("refs");
        std::fs::write(&path, "version 1\n").unwrap();
        let e = ReferenceStore::open(&path, || Ok([0; KEY_LEN])).unwrap_err();
        assert!(e.to_string().contains("refs") && e.to_string().contains("secret"), "{e}");
    }

    /// Seeded garbage and mutations of a good file: the parser answers, never panics, and
    /// what it accepts encodes back to something it accepts the same.
    #[test]
    fn seeded_mutations_never_panic() {
        let good = Saved { secret: [0x5a; KEY_LEN], epochs: BTreeMap::from([(1, 2), (40, 9)]) }.encode();
        let mut rng = wire::fuzz_api::SplitMix64(29);
        for _ in 0..20_000 {
            let mut bytes = good.clone().into_bytes();
            for _ in 0..rng.below(6) + 1 {
                let at = rng.below(bytes.len() as u64 + 1) as usize;
                match rng.below(3) {
                    0 if at < bytes.len() => bytes[at] = rng.below(128) as u8,
                    1 if at < bytes.len() => {
                        bytes.remove(at);
                    }
                    _ => bytes.insert(at, b" \n0123456789abcdefepochsecretversion#"[rng.below(36) as usize]),
                }
            }
            let text = String::from_utf8_lossy(&bytes);
            if let Ok(saved) = Saved::decode(&text) {
                assert_eq!(Saved::decode(&saved.encode()).as_ref(), Ok(&saved));
            }
        }
    }
}
