//! The devices under a flash array: a small trait, a file or block device behind it, and a
//! device in memory for tests and in-process experiments.
//!
//! Every transfer is whole pages at page offsets, from and into page-aligned buffers, so a
//! file device can use `O_DIRECT` (where the file system takes it) and keep the kernel's page
//! cache out: the array's own page pool is the only DRAM copy. `sync` makes every completed
//! write durable (`fdatasync`).

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::layout::PAGE;

/// One device of an array.
pub trait Device: Send + Sync {
    /// Pages it holds.
    fn pages(&self) -> u64;
    /// Read whole pages from page `page` into `buf` (a multiple of a page, page-aligned).
    fn read(&self, page: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Write whole pages at page `page` from `buf`.
    fn write(&self, page: u64, buf: &[u8]) -> io::Result<()>;
    /// Make every completed write durable.
    fn sync(&self) -> io::Result<()>;
    /// A name for messages.
    fn name(&self) -> String;
    /// Pages written through this handle (the engine's own count of device writes).
    fn pages_written(&self) -> u64 {
        0
    }
    /// The file descriptor to read it through asynchronously (io_uring), byte offset = page
    /// × 4 KiB; `None` for a device only this trait reaches (the array then reads it on the
    /// calling thread).
    fn fd(&self) -> Option<RawFd> {
        None
    }
}

/// A device its owner keeps a handle to while the array holds it: a test or a simulator that
/// crashes it, an experiment that counts what reached it.
impl<D: Device + ?Sized> Device for Arc<D> {
    fn pages(&self) -> u64 {
        (**self).pages()
    }
    fn read(&self, page: u64, buf: &mut [u8]) -> io::Result<()> {
        (**self).read(page, buf)
    }
    fn write(&self, page: u64, buf: &[u8]) -> io::Result<()> {
        (**self).write(page, buf)
    }
    fn sync(&self) -> io::Result<()> {
        (**self).sync()
    }
    fn name(&self) -> String {
        (**self).name()
    }
    fn pages_written(&self) -> u64 {
        (**self).pages_written()
    }
    fn fd(&self) -> Option<RawFd> {
        (**self).fd()
    }
}

/// A regular file or a block device.
pub struct FileDevice {
    file: File,
    path: PathBuf,
    pages: u64,
    direct: bool,
    written: AtomicU64,
}

impl FileDevice {
    /// Open `path` for reading and writing, with `O_DIRECT` if its file system takes it.
    pub fn open(path: &Path) -> io::Result<FileDevice> {
        let with = |flags| OpenOptions::new().read(true).write(true).custom_flags(flags).open(path);
        let (file, direct) = match with(libc::O_DIRECT) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::info!(path = %path.display(), "O_DIRECT refused by the file system; the flash array goes through the page cache");
                (with(0)?, false)
            }
            Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
        };
        let kind = file.metadata()?.file_type();
        if !kind.is_file() && !kind.is_block_device() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: not a regular file or block device", path.display()),
            ));
        }
        let bytes = (&file).seek(SeekFrom::End(0))?;
        Ok(FileDevice {
            file,
            path: path.to_owned(),
            pages: bytes / PAGE as u64,
            direct,
            written: AtomicU64::new(0),
        })
    }

    /// Whether `O_DIRECT` is in use.
    pub fn is_direct(&self) -> bool {
        self.direct
    }
}

fn check(pages: u64, page: u64, len: usize) -> io::Result<()> {
    let n = (len / PAGE) as u64;
    if !len.is_multiple_of(PAGE) || page.checked_add(n).is_none_or(|end| end > pages) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "device transfer out of range or not whole pages",
        ));
    }
    Ok(())
}

impl Device for FileDevice {
    fn pages(&self) -> u64 {
        self.pages
    }

    fn read(&self, page: u64, buf: &mut [u8]) -> io::Result<()> {
        check(self.pages, page, buf.len())?;
        self.file.read_exact_at(buf, page * PAGE as u64)
    }

    fn write(&self, page: u64, buf: &[u8]) -> io::Result<()> {
        check(self.pages, page, buf.len())?;
        self.file.write_all_at(buf, page * PAGE as u64)?;
        self.written.fetch_add((buf.len() / PAGE) as u64, Ordering::Relaxed);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn name(&self) -> String {
        self.path.display().to_string()
    }

    fn pages_written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    fn fd(&self) -> Option<RawFd> {
        Some(self.file.as_raw_fd())
    }
}

/// A device in memory: for tests, and for experiments that measure the controller alone.
pub struct MemDevice {
    bytes: Mutex<Vec<u8>>,
    pages: u64,
    written: AtomicU64,
}

impl MemDevice {
    pub fn new(pages: u64) -> MemDevice {
        MemDevice { bytes: Mutex::new(vec![0; pages as usize * PAGE]), pages, written: AtomicU64::new(0) }
    }

    /// A copy of everything it holds (to start another array from, as after a clean stop).
    pub fn image(&self) -> Vec<u8> {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A device holding `image`.
    pub fn from_image(image: Vec<u8>) -> MemDevice {
        let pages = (image.len() / PAGE) as u64;
        MemDevice { bytes: Mutex::new(image), pages, written: AtomicU64::new(0) }
    }
}

impl Device for MemDevice {
    fn pages(&self) -> u64 {
        self.pages
    }

    fn read(&self, page: u64, buf: &mut [u8]) -> io::Result<()> {
        check(self.pages, page, buf.len())?;
        let b = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        let at = page as usize * PAGE;
        buf.copy_from_slice(&b[at..at + buf.len()]);
        Ok(())
    }

    fn write(&self, page: u64, buf: &[u8]) -> io::Result<()> {
        check(self.pages, page, buf.len())?;
        let mut b = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        let at = page as usize * PAGE;
        b[at..at + buf.len()].copy_from_slice(buf);
        self.written.fetch_add((buf.len() / PAGE) as u64, Ordering::Relaxed);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        Ok(())
    }

    fn name(&self) -> String {
        format!("memory ({} pages)", self.pages)
    }

    fn pages_written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }
}

/// What a device held before formatting, if it looks like something worth keeping: a skiff
/// flash array or a file system's signature. `None`: nothing recognised.
pub fn recognise(dev: &dyn Device) -> io::Result<Option<&'static str>> {
    if dev.pages() < 17 {
        return Ok(None);
    }
    let mut head = rt::mem::AlignedBuf::new(17 * PAGE)?;
    dev.read(0, &mut head)?;
    let at = |off: usize, magic: &[u8]| head[off..off + magic.len()] == *magic;
    Ok(if at(0, b"SKFLSUP1") || at(PAGE, b"SKFLSUP1") {
        Some("a skiff flash array")
    } else if at(1080, &[0x53, 0xEF]) {
        Some("an ext2/3/4 file system")
    } else if at(0, b"XFSB") {
        Some("an XFS file system")
    } else if at(65600, b"_BHRfS_M") {
        Some("a Btrfs file system")
    } else if at(4086, b"SWAPSPACE2") {
        Some("a swap area")
    } else if at(0x52, b"FAT32   ") || at(0x36, b"FAT16   ") {
        Some("a FAT file system")
    } else if at(3, b"NTFS    ") {
        Some("an NTFS file system")
    } else {
        None
    })
}
