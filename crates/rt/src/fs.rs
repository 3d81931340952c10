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
