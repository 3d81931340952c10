//! Key files on the command line: `--key-file` on `skiff serve` (every key it knows) and on the
//! clients (`--key-file` and `--key NAME` to pick one). The format is nbdkit's PSK file,
//! `name:hexsecret` per line (docs/PROTOCOL.md, section 15).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use proto::auth::Key;

/// Read every key of a key file. A file others may read is used, with a warning: its secrets
/// are no longer only yours.
pub fn load(path: &Path) -> Result<Vec<Key>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("key file {}: {e}", path.display()))?;
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(path = %path.display(), mode = format!("{:o}", meta.permissions().mode() & 0o777), "key file is readable by others; chmod 600 it");
        }
    }
    Key::parse_file(&text).map_err(|e| format!("key file {}: {e}", path.display()))
}

/// The key options of a client command.
#[derive(Args, Debug, Clone, Default)]
pub struct KeyArgs {
    /// Authenticate with a key from this file (nbdkit's PSK format, NAME:HEXSECRET per line;
    /// docs/PROTOCOL.md section 15).
    #[arg(long, value_name = "PATH")]
    key_file: Option<PathBuf>,
    /// Which key of --key-file to use (needed when it holds several).
    #[arg(long, value_name = "NAME", requires = "key_file")]
    key: Option<String>,
}

impl KeyArgs {
    /// The key to prove, if any.
    pub fn key(&self) -> Result<Option<Arc<Key>>, String> {
        let Some(path) = &self.key_file else { return Ok(None) };
        let keys = load(path)?;
        let key = match &self.key {
            Some(name) => keys
                .into_iter()
                .find(|k| &k.name == name)
                .ok_or_else(|| format!("key file {}: no key {name:?}", path.display()))?,
            None if keys.len() == 1 => keys.into_iter().next().expect("one key"),
            None => {
                let names: Vec<&str> = keys.iter().map(|k| k.name.as_str()).collect();
                return Err(format!(
                    "key file {} holds {} keys ({}): pick one with --key",
                    path.display(),
                    keys.len(),
                    names.join(", ")
                ));
            }
        };
        Ok(Some(Arc::new(key)))
    }
}
