//! What is checked before mounting, so that a user gets a sentence instead of an errno: that
//! FUSE is there, and that the mount point is a directory or a regular file with nothing
//! mounted on it already.
//!
//! The kernel would let root stack a second mount on a mount point, hiding the first; a
//! second `skiff attach` on the same place is almost always a mistake, so it is refused.

use std::ffi::OsString;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use crate::Error;

/// Where FUSE requests come from.
const FUSE_DEVICE: &str = "/dev/fuse";

/// How the export appears at the mount point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// The mount point is a directory; the export is the one file in it, named after the
    /// export.
    Directory { file_name: OsString },
    /// The mount point is a regular file, and the export is mounted over it (as nbdfuse does):
    /// the path itself is the export.
    File,
}

/// The mount point, checked.
#[derive(Debug, Clone)]
pub struct MountPoint {
    /// Canonical path.
    pub path: PathBuf,
    pub layout: Layout,
    /// Owner of the mount point, who also owns the export's file.
    pub uid: u32,
    pub gid: u32,
}

impl MountPoint {
    /// The path of the export's file.
    pub fn file(&self) -> PathBuf {
        match &self.layout {
            Layout::Directory { file_name } => self.path.join(file_name),
            Layout::File => self.path.clone(),
        }
    }
}

/// FUSE is usable: its device exists and is a character device.
pub fn check_fuse() -> Result<(), Error> {
    check_fuse_device(Path::new(FUSE_DEVICE))
}

fn check_fuse_device(device: &Path) -> Result<(), Error> {
    match std::fs::metadata(device) {
        Ok(m) if m.file_type().is_char_device() => Ok(()),
        Ok(_) => Err(Error::FuseMissing(format!("{} is not a character device", device.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::FuseMissing(format!(
            "{} does not exist: load the fuse module (modprobe fuse), or give the container the device \
             (docker run --device /dev/fuse)",
            device.display()
        ))),
        Err(e) => Err(Error::FuseMissing(format!("{}: {e}", device.display()))),
    }
}

/// Check `path` as a mount point for the export `export`.
pub fn inspect(path: &Path, export: &str) -> Result<MountPoint, Error> {
    inspect_with(path, export, Path::new("/proc/self/mountinfo"))
}

fn inspect_with(path: &Path, export: &str, mountinfo: &Path) -> Result<MountPoint, Error> {
    let refuse = |why: String| Error::MountPoint { path: path.to_owned(), why };
    let meta = std::fs::metadata(path).map_err(|e| refuse(e.to_string()))?;
    let layout = if meta.is_dir() {
        Layout::Directory { file_name: file_name_for(export) }
    } else if meta.is_file() {
        Layout::File
    } else {
        return Err(refuse("not a directory or a regular file".into()));
    };
    let canonical = path.canonicalize().map_err(|e| refuse(e.to_string()))?;
    let table =
        std::fs::read_to_string(mountinfo).map_err(|e| refuse(format!("{}: {e}", mountinfo.display())))?;
    if mount_points(&table).any(|m| m == canonical) {
        return Err(Error::AlreadyMounted(canonical));
    }
    use std::os::unix::fs::MetadataExt;
    Ok(MountPoint { path: canonical, layout, uid: meta.uid(), gid: meta.gid() })
}

/// The name of the export's file in a directory mount: the export's name, with `/` (which a
/// file name cannot hold) as `_`; `export` when the name is empty or a directory's own entry.
pub fn file_name_for(export: &str) -> OsString {
    match export {
        "" | "." | ".." => "export".into(),
        name => name.replace('/', "_").into(),
    }
}

/// Every mount point in a `/proc/self/mountinfo` table (the fifth field, octal escapes undone).
fn mount_points(table: &str) -> impl Iterator<Item = PathBuf> + '_ {
    table.lines().filter_map(|line| line.split(' ').nth(4)).map(|field| PathBuf::from(unescape(field)))
}

/// Undo the kernel's `\ooo` escapes of space, tab, newline and backslash.
fn unescape(field: &str) -> OsString {
    use std::os::unix::ffi::OsStringExt;
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            let d = std::str::from_utf8(d).ok()?;
            u8::from_str_radix(d, 8).ok()
        });
        match (bytes[i], octal) {
            (b'\\', Some(b)) => {
                out.push(b);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    OsString::from_vec(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:35 / /mnt/with\\040space rw,nosuid,nodev shared:20 - fuse.skiff skiff:vol rw,user_id=0,group_id=0
41 22 0:36 / /mnt/plain rw - tmpfs tmpfs rw
";

    #[test]
    fn mount_points_are_read_with_their_escapes_undone() {
        let points: Vec<PathBuf> = mount_points(TABLE).collect();
        assert_eq!(points, [PathBuf::from("/"), "/mnt/with space".into(), "/mnt/plain".into()]);
    }

    #[test]
    fn a_directory_that_is_already_a_mount_point_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let canonical = dir.path().canonicalize().unwrap();
        let table = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(
            table.path(),
            format!("{TABLE}50 22 0:40 / {} rw - tmpfs t rw\n", canonical.display()),
        )
        .unwrap();
        match inspect_with(dir.path(), "vol", table.path()) {
            Err(Error::AlreadyMounted(p)) => assert_eq!(p, canonical),
            other => panic!("{other:?}"),
        }
        let err = inspect_with(dir.path(), "vol", table.path()).unwrap_err().to_string();
        assert!(err.contains("already a mount point"), "{err}");
    }

    #[test]
    fn directories_and_regular_files_are_taken_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let table = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(table.path(), TABLE).unwrap();
        let m = inspect_with(dir.path(), "a/b", table.path()).unwrap();
        assert_eq!(m.layout, Layout::Directory { file_name: "a_b".into() });
        assert_eq!(m.file(), dir.path().canonicalize().unwrap().join("a_b"));

        let file = dir.path().join("disk");
        std::fs::write(&file, b"").unwrap();
        let m = inspect_with(&file, "vol", table.path()).unwrap();
        assert_eq!((m.layout.clone(), m.file()), (Layout::File, file.canonicalize().unwrap()));

        let missing = inspect_with(&dir.path().join("nope"), "vol", table.path()).unwrap_err().to_string();
        assert!(missing.contains("No such file"), "{missing}");
        let fifo = inspect_with(Path::new("/dev/null"), "vol", table.path()).unwrap_err().to_string();
        assert!(fifo.contains("not a directory or a regular file"), "{fifo}");
    }

    #[test]
    fn a_missing_fuse_device_says_what_to_do() {
        let err = check_fuse_device(Path::new("/nonexistent/fuse")).unwrap_err().to_string();
        assert!(err.contains("modprobe fuse"), "{err}");
        let err = check_fuse_device(Path::new("/")).unwrap_err().to_string();
        assert!(err.contains("not a character device"), "{err}");
    }

    #[test]
    fn export_names_become_file_names() {
        assert_eq!(file_name_for("vol"), "vol");
        assert_eq!(file_name_for(""), "export");
        assert_eq!(file_name_for(".."), "export");
        assert_eq!(file_name_for("a/b"), "a_b");
    }
}
