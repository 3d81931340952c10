//! File-system queries the standard library does not offer.

use std::io;
use std::os::fd::AsRawFd;

/// What to look for with [`seek`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seek {
    /// The next byte at or after the offset that holds data.
    Data,
    /// The next hole at or after the offset (the end of the file counts as a hole).
    Hole,
}

/// `lseek(SEEK_DATA / SEEK_HOLE)`: the position found, or `None` when there is no data at or
/// after `offset` (`ENXIO`). File systems without hole support report the whole file as data,
/// which is the truth as far as anyone can tell. Only the file position changes, which skiff
/// never relies on (all I/O is positional).
pub fn seek(file: &impl AsRawFd, offset: u64, what: Seek) -> io::Result<Option<u64>> {
    let whence = match what {
        Seek::Data => libc::SEEK_DATA,
        Seek::Hole => libc::SEEK_HOLE,
    };
    let offset = libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: lseek takes a descriptor the caller keeps open for the call and plain integers.
    let pos = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
    if pos >= 0 {
        return Ok(Some(pos as u64));
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ENXIO) {
        Ok(None)
    } else {
        Err(err)
    }
}

/// `umount(2)` of `path`, without forcing and without detaching lazily: it fails with
/// `EBUSY` while anything still uses the mount (an open file, a loop device over it), which is
/// what a daemon asked to stop wants to know rather than pull the data out from under a user.
pub fn unmount(path: &std::path::Path) -> io::Result<()> {
    let c_path = c_path(path)?;
    // SAFETY: the path is a NUL-terminated string that lives across the call; no flags.
    let rc = unsafe { libc::umount2(c_path.as_ptr(), 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `umount2(path, MNT_DETACH)`: take the mount out of the namespace now; the kernel ends it once
/// its last user lets go. For cleanup paths that must not leave a mount behind.
pub fn unmount_lazily(path: &std::path::Path) -> io::Result<()> {
    let c_path = c_path(path)?;
    // SAFETY: as in `unmount`; MNT_DETACH is a valid flag.
    let rc = unsafe { libc::umount2(c_path.as_ptr(), libc::MNT_DETACH) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn c_path(path: &std::path::Path) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// The extended attribute `name` of the open file, `None` when it has none of that name
/// (`ENODATA`). A file system without extended attributes fails with `ENOTSUP`.
pub fn xattr(file: &impl AsRawFd, name: &str) -> io::Result<Option<Vec<u8>>> {
    let name = std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut buf = vec![0u8; 256];
    // SAFETY: the descriptor stays open for the call, `name` is a NUL-terminated string that
    // outlives it, and `buf` is a live buffer of `buf.len()` bytes, the most fgetxattr writes.
    let n = unsafe {
        libc::fgetxattr(file.as_raw_fd(), name.as_ptr(), buf.as_mut_ptr().cast::<libc::c_void>(), buf.len())
    };
    if n >= 0 {
        buf.truncate(n as usize);
        return Ok(Some(buf));
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ENODATA) {
        Ok(None)
    } else {
        Err(err)
    }
}

/// Set the extended attribute `name` of the open file to `value`.
pub fn set_xattr(file: &impl AsRawFd, name: &str, value: &[u8]) -> io::Result<()> {
    let name = std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: as in `xattr`; `value` is read, `value.len()` bytes of it.
    let r = unsafe {
        libc::fsetxattr(
            file.as_raw_fd(),
            name.as_ptr(),
            value.as_ptr().cast::<libc::c_void>(),
            value.len(),
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Fill `buf` from descriptor `fd` at `offset` (`pread(2)` until full); a file that ends
/// first is `UnexpectedEof`. For a descriptor the caller borrows by number (a file export's,
/// open while its export is).
pub fn pread_exact(fd: std::os::fd::RawFd, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let at = libc::off_t::try_from(offset + done as u64)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let rest = &mut buf[done..];
        // SAFETY: `rest` is valid for writes of its length; a bad `fd` is an error, not UB.
        let n = unsafe { libc::pread(fd, rest.as_mut_ptr().cast(), rest.len(), at) };
        match n {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn finds_data_and_holes_in_a_sparse_file() {
        let f = tempfile_in_var_tmp();
        f.set_len(4 << 20).unwrap();
        f.write_all_at(&[1; 4096], 1 << 20).unwrap();
        f.sync_all().unwrap();
        let data = seek(&f, 0, Seek::Data).unwrap().unwrap();
        // File systems may round to their own allocation unit; the data lies within it.
        assert!(data <= 1 << 20, "{data}");
        let hole = seek(&f, data, Seek::Hole).unwrap().unwrap();
        assert!(((1 << 20) + 4096..=4 << 20).contains(&hole), "{hole}");
        assert_eq!(seek(&f, 4 << 20, Seek::Data).unwrap(), None);
    }

    #[test]
    fn unmounting_what_is_not_a_mount_point_fails_cleanly() {
        // A fresh directory: never a mount point (the temporary directory itself may be one).
        let dir = std::env::temp_dir().join(format!("skiff-rt-unmount-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = unmount(&dir).unwrap_err();
        std::fs::remove_dir(&dir).unwrap();
        // EINVAL as root (not a mount point), EPERM otherwise: never a crash, never a success.
        assert!(matches!(err.raw_os_error(), Some(libc::EINVAL) | Some(libc::EPERM)), "{err}");
        assert!(unmount(std::path::Path::new("a\0b")).is_err());
    }

    fn tempfile_in_var_tmp() -> std::fs::File {
        let path = format!("/var/tmp/skiff-rt-seek-{}", std::process::id());
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }
}
