//! Page-aligned memory: shared [`Region`]s that behave like device memory, and owned
//! [`AlignedBuf`]s for `O_DIRECT` bounce copies.
//!
//! A [`Region`] is anonymous `mmap` memory shared by every worker thread. Workers copy in and
//! out through `&self` with raw pointer copies and no lock, the way DMA engines copy to and from
//! a disk's cache. The consequence is the same as on a block device: two in-flight requests
//! that overlap, at least one of them a write, leave unspecified bytes in the overlap (or read
//! unspecified bytes). NBD and every other block protocol give no ordering between overlapping
//! in-flight requests, so a client that issues them has already accepted that outcome. Requests
//! that do not overlap never interfere.
//!
//! Bounds are validated by callers (the engine checks every request against the volume size);
//! an out-of-range access reaching this module is a bug, so it panics with a clear message
//! rather than touching memory it does not own.
//!
//! This module does not track which pages were touched (for NBD `base:allocation`); that comes
//! later. It owns no policy: sizes and lifetimes are the caller's.

use std::alloc::{self, Layout};
use std::io;
use std::ops::{Deref, DerefMut};
use std::ptr::{self, NonNull};
use std::slice;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

/// Alignment, in bytes, that every [`Region`] and [`AlignedBuf`] guarantees. 4096 satisfies
/// `O_DIRECT` on every file system and block device skiff targets (logical block sizes of 512
/// or 4096).
pub const ALIGN_BYTES: usize = 4096;

/// Regions at least this large ask for transparent huge pages, which cut TLB misses when
/// workers stream through a multi-gigabyte RAM volume.
const HUGEPAGE_MIN_BYTES: usize = 2 * 1024 * 1024;

/// A zero-sized type whose alignment gives empty allocations a well-aligned dangling pointer.
#[repr(C, align(4096))]
struct Page([u8; ALIGN_BYTES]);

fn dangling_aligned() -> NonNull<u8> {
    NonNull::<Page>::dangling().cast::<u8>()
}

/// Page-aligned anonymous memory, zero-filled at creation, unmapped on drop.
///
/// Shared between threads through `&self`; see the module documentation for what concurrent
/// overlapping accesses mean. The mapping uses `MAP_NORESERVE`, so pages are committed only
/// when first written: a RAM volume larger than free memory maps fine and fails (the kernel's
/// OOM handling) only when filled.
pub struct Region {
    ptr: NonNull<u8>,
    len_bytes: usize,
}

// SAFETY: `Region` owns its mapping outright (nothing else holds the pointer), so moving it to
// another thread is sound.
unsafe impl Send for Region {}

// SAFETY: every access through `&self` goes through raw pointers (`read_at`, `write_at`,
// `fill_zero`), never through a Rust reference to the shared bytes, and is bounds-checked.
// Threads touching disjoint ranges never interfere. Overlapping concurrent accesses race on the
// bytes themselves and produce unspecified contents, which is the documented contract of a
// block device and of this type (see the module docs); the region's own state (pointer and
// length) is immutable after creation.
unsafe impl Sync for Region {}

impl Region {
    /// Map `len_bytes` of zero-filled, page-aligned memory. A length of zero maps nothing and
    /// gives an empty region with an aligned dangling pointer.
    pub fn new(len_bytes: usize) -> io::Result<Region> {
        if len_bytes == 0 {
            return Ok(Region { ptr: dangling_aligned(), len_bytes: 0 });
        }
        // SAFETY: a fresh anonymous private mapping with no address hint and no file: it cannot
        // alias any existing Rust object. The result is checked against MAP_FAILED below.
        let raw = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr =
            NonNull::new(raw.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        let region = Region { ptr, len_bytes };
        if len_bytes >= HUGEPAGE_MIN_BYTES {
            region.advise_hugepages();
        }
        Ok(region)
    }

    /// Ask for transparent huge pages. Failure (THP disabled, old kernel) only costs speed.
    fn advise_hugepages(&self) {
        // SAFETY: the range is exactly our own live mapping; MADV_HUGEPAGE changes no contents.
        let rc = unsafe {
            libc::madvise(self.ptr.as_ptr().cast::<libc::c_void>(), self.len_bytes, libc::MADV_HUGEPAGE)
        };
        if rc != 0 {
            tracing::debug!(
                len_bytes = self.len_bytes,
                error = %io::Error::last_os_error(),
                "madvise(MADV_HUGEPAGE) refused; using normal pages"
            );
        }
    }

    /// Length in bytes, as requested at creation.
    pub fn len(&self) -> usize {
        self.len_bytes
    }

    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.len_bytes == 0
    }

    /// Panic unless `[offset, offset + len)` lies inside the region: callers validate ranges, so
    /// a violation here is a bug and must not touch foreign memory.
    fn assert_in_bounds(&self, offset: usize, len: usize) {
        let end = offset.checked_add(len);
        assert!(
            end.is_some_and(|end| end <= self.len_bytes),
            "region access out of bounds: offset {offset} + len {len} > region len {}",
            self.len_bytes
        );
    }

    /// Copy `dst.len()` bytes starting at `offset` into `dst`.
    ///
    /// # Panics
    /// If the range is not inside the region.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) {
        self.assert_in_bounds(offset, dst.len());
        if let [byte] = dst {
            *byte = self.atomic_byte(offset).load(Ordering::Acquire);
            return;
        }
        // SAFETY: the source range is inside our live mapping (checked above) and `dst` is a
        // distinct exclusive borrow, so the ranges cannot overlap. A concurrent writer to the
        // same bytes yields unspecified bytes, as documented on the module.
        unsafe {
            ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len());
        }
    }

    /// Copy `src` into the region starting at `offset`. A write of one byte is one atomic
    /// store (and a read of one byte one atomic load): concurrent one-byte writers and readers
    /// of the same byte see the old value or the new one, never a torn or invented one. This
    /// is what RStore's one-byte flags rely on (docs/RSTORE.md).
    ///
    /// # Panics
    /// If the range is not inside the region.
    pub fn write_at(&self, offset: usize, src: &[u8]) {
        self.assert_in_bounds(offset, src.len());
        if let [byte] = src {
            self.atomic_byte(offset).store(*byte, Ordering::Release);
            return;
        }
        // SAFETY: the destination range is inside our live mapping (checked above). `src` may
        // itself point into the region (a [`RegionBytes`] slice), so this is a `memmove`, which
        // allows overlap. Concurrent overlapping requests give unspecified bytes, as documented
        // on the module.
        unsafe {
            ptr::copy(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len());
        }
    }

    /// The address of byte `offset`, for the kernel to write `len` bytes at (a read that
    /// lands in the region: [`crate::uring::RegionDest`]).
    ///
    /// # Panics
    /// If the range is not inside the region.
    pub(crate) fn ptr_at(&self, offset: usize, len: usize) -> *mut u8 {
        self.assert_in_bounds(offset, len);
        // SAFETY: `offset` is inside our live mapping (checked above).
        unsafe { self.ptr.as_ptr().add(offset) }
    }

    /// The byte at `offset`, as an atomic. The caller checked the bounds.
    fn atomic_byte(&self, offset: usize) -> &AtomicU8 {
        // SAFETY: `offset` is inside our live mapping (the caller checked), a `u8` has the
        // alignment and size of an `AtomicU8`, and the mapping lives as long as `&self`.
        unsafe { AtomicU8::from_ptr(self.ptr.as_ptr().add(offset)) }
    }

    /// Set `len` bytes starting at `offset` to zero.
    ///
    /// # Panics
    /// If the range is not inside the region.
    pub fn fill_zero(&self, offset: usize, len: usize) {
        self.assert_in_bounds(offset, len);
        // SAFETY: the range is inside our live mapping (checked above); same concurrency
        // contract as `write_at`.
        unsafe {
            ptr::write_bytes(self.ptr.as_ptr().add(offset), 0, len);
        }
    }

    /// `len` bytes starting at `offset`, held with a reference to the region so that they
    /// stay mapped for as long as the [`RegionBytes`] lives: for handing them to the kernel (one
    /// element of a send's gather list) without copying them out first.
    ///
    /// # Panics
    /// If the range is not inside the region.
    pub fn bytes(self: &Arc<Self>, offset: usize, len: usize) -> RegionBytes {
        self.assert_in_bounds(offset, len);
        RegionBytes { region: Arc::clone(self), offset, len, keep: None }
    }

    /// View the whole region. Takes `&mut self` because a `&[u8]` promises the bytes do not
    /// change, which only an exclusive owner (a bounce buffer, a test) can guarantee while
    /// other holders could call `write_at` through `&self`.
    pub fn as_slice(&mut self) -> &[u8] {
        // SAFETY: the pointer is valid for `len_bytes` initialised bytes (anonymous mappings
        // are zero-filled; an empty region has an aligned dangling pointer and length 0), and
        // `&mut self` excludes every other access for the borrow's lifetime.
        unsafe { slice::from_raw_parts(self.ptr.as_ptr(), self.len_bytes) }
    }

    /// View the whole region mutably; exclusive by construction.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only access.
        unsafe { slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len_bytes) }
    }
}

/// A range of a [`Region`], holding the region alive: what [`Region::bytes`] returns. The
/// bytes stay mapped for as long as this value lives, so its slice borrows only from it.
/// A lender that must also keep the bytes where they are (a page pool's loan) hangs its
/// guard on the range ([`keeping`](Self::keeping)): it is dropped with the last clone.
#[derive(Clone)]
pub struct RegionBytes {
    region: Arc<Region>,
    offset: usize,
    len: usize,
    keep: Option<Arc<dyn Send + Sync>>,
}

impl std::fmt::Debug for RegionBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionBytes")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("kept", &self.keep.is_some())
            .finish()
    }
}

impl RegionBytes {
    /// The same bytes, holding `keep` alive as long as they (or a clone) live.
    pub fn keeping(mut self, keep: Arc<dyn Send + Sync>) -> RegionBytes {
        self.keep = Some(keep);
        self
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, for a gather list the kernel copies from.
    ///
    /// Other threads may write these bytes meanwhile (a region is shared device memory): the
    /// slice then holds unspecified bytes, as [`Region::read_at`] would copy them. Pass it to
    /// the kernel (or copy it out at once); do not keep it as a stable view of the volume.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the range was checked to lie inside the mapping when this value was made
        // (`Region::bytes`), and `self.region` keeps the mapping alive for the borrow.
        unsafe { slice::from_raw_parts(self.region.ptr.as_ptr().add(self.offset), self.len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.len_bytes == 0 {
            return;
        }
        // SAFETY: we own this mapping and nothing can borrow from it past `drop`.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast::<libc::c_void>(), self.len_bytes) };
        if rc != 0 {
            // Nothing to recover: the address range leaks, which is harmless but worth knowing.
            tracing::warn!(
                len_bytes = self.len_bytes,
                error = %io::Error::last_os_error(),
                "munmap failed"
            );
        }
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("ptr", &self.ptr).field("len_bytes", &self.len_bytes).finish()
    }
}

/// An owned, zero-initialised buffer aligned to [`ALIGN_BYTES`], used exclusively by one owner
/// (e.g. a per-thread `O_DIRECT` bounce buffer). Dereferences to `[u8]`.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len_bytes: usize,
}

// SAFETY: `AlignedBuf` uniquely owns its allocation, exactly like `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only yields `&[u8]` (via `Deref`); mutation needs `&mut self`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocate `len_bytes` zeroed bytes aligned to [`ALIGN_BYTES`]. Fails with `OutOfMemory`
    /// when the allocator refuses and `InvalidInput` when the size cannot be laid out.
    pub fn new(len_bytes: usize) -> io::Result<AlignedBuf> {
        if len_bytes == 0 {
            return Ok(AlignedBuf { ptr: dangling_aligned(), len_bytes: 0 });
        }
        let layout = Self::layout(len_bytes)?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("cannot allocate a {len_bytes}-byte aligned buffer"),
            )
        })?;
        Ok(AlignedBuf { ptr, len_bytes })
    }

    fn layout(len_bytes: usize) -> io::Result<Layout> {
        Layout::from_size_align(len_bytes, ALIGN_BYTES).map_err(|e| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("bad aligned buffer size {len_bytes}: {e}"))
        })
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the pointer is valid for `len_bytes` initialised (zeroed) bytes that we own;
        // an empty buffer has an aligned dangling pointer and length 0.
        unsafe { slice::from_raw_parts(self.ptr.as_ptr(), self.len_bytes) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this the only access.
        unsafe { slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len_bytes) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len_bytes == 0 {
            return;
        }
        // The layout was valid at allocation time, so recomputing it cannot fail; stay
        // panic-free in drop regardless and leak rather than abort if it somehow did.
        if let Ok(layout) = Self::layout(self.len_bytes) {
            // SAFETY: allocated by `alloc_zeroed` with this exact layout and not freed before.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf").field("ptr", &self.ptr).field("len_bytes", &self.len_bytes).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    #[test]
    fn region_starts_zeroed_and_round_trips() {
        let region = Region::new(3 * ALIGN_BYTES + 100).unwrap();
        assert_eq!(region.ptr.as_ptr() as usize % ALIGN_BYTES, 0);
        let mut buf = vec![0xffu8; 64];
        region.read_at(region.len() - 64, &mut buf);
        assert!(buf.iter().all(|&b| b == 0));

        let data: Vec<u8> = (0..200u8).collect();
        region.write_at(ALIGN_BYTES - 7, &data);
        let mut back = vec![0u8; 200];
        region.read_at(ALIGN_BYTES - 7, &mut back);
        assert_eq!(back, data);

        region.fill_zero(ALIGN_BYTES, 10);
        region.read_at(ALIGN_BYTES - 7, &mut back);
        assert_eq!(&back[..7], &data[..7]);
        assert!(back[7..17].iter().all(|&b| b == 0));
        assert_eq!(&back[17..], &data[17..]);
    }

    #[test]
    fn region_last_byte_is_reachable() {
        let region = Region::new(ALIGN_BYTES).unwrap();
        region.write_at(ALIGN_BYTES - 1, &[9]);
        let mut one = [0u8];
        region.read_at(ALIGN_BYTES - 1, &mut one);
        assert_eq!(one, [9]);
        // A zero-length access at the very end is in bounds.
        region.read_at(ALIGN_BYTES, &mut []);
    }

    #[test]
    fn empty_region_is_aligned_and_usable() {
        let mut region = Region::new(0).unwrap();
        assert!(region.is_empty());
        assert_eq!(region.as_slice().as_ptr() as usize % ALIGN_BYTES, 0);
        assert!(region.as_mut_slice().is_empty());
        region.read_at(0, &mut []);
        region.write_at(0, &[]);
        region.fill_zero(0, 0);
    }

    #[test]
    fn large_region_takes_the_hugepage_path() {
        let mut region = Region::new(4 * HUGEPAGE_MIN_BYTES).unwrap();
        region.write_at(HUGEPAGE_MIN_BYTES + 1, b"skiff");
        assert_eq!(&region.as_slice()[HUGEPAGE_MIN_BYTES + 1..][..5], b"skiff");
        region.as_mut_slice()[0] = 1;
        let mut one = [0u8];
        region.read_at(0, &mut one);
        assert_eq!(one, [1]);
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn read_past_end_panics() {
        let region = Region::new(ALIGN_BYTES).unwrap();
        let mut buf = [0u8; 2];
        region.read_at(ALIGN_BYTES - 1, &mut buf);
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn offset_overflow_panics() {
        let region = Region::new(ALIGN_BYTES).unwrap();
        region.fill_zero(usize::MAX, 2);
    }

    #[test]
    fn disjoint_concurrent_writers_do_not_interfere() {
        const THREADS: usize = 4;
        const CHUNK_BYTES: usize = 64 * 1024;
        let region = Arc::new(Region::new(THREADS * CHUNK_BYTES).unwrap());
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let region = Arc::clone(&region);
                thread::spawn(move || {
                    let pattern = vec![t as u8 + 1; 512];
                    for block in 0..CHUNK_BYTES / 512 {
                        region.write_at(t * CHUNK_BYTES + block * 512, &pattern);
                    }
                })
            })
            .collect();
        for handle in handles {
            handle.join().unwrap();
        }
        let mut region = Arc::try_unwrap(region).unwrap();
        for (t, chunk) in region.as_slice().chunks(CHUNK_BYTES).enumerate() {
            assert!(chunk.iter().all(|&b| b == t as u8 + 1), "chunk {t}");
        }
    }

    #[test]
    fn aligned_buf_is_aligned_zeroed_and_writable() {
        for len in [1, 511, 4096, 100_000] {
            let mut buf = AlignedBuf::new(len).unwrap();
            assert_eq!(buf.len(), len);
            assert_eq!(buf.as_ptr() as usize % ALIGN_BYTES, 0);
            assert!(buf.iter().all(|&b| b == 0));
            buf.fill(0xa5);
            assert!(buf.iter().all(|&b| b == 0xa5));
        }
        let empty = AlignedBuf::new(0).unwrap();
        assert!(empty.is_empty());
        assert_eq!(empty.as_ptr() as usize % ALIGN_BYTES, 0);
    }

    #[test]
    fn aligned_buf_rejects_impossible_sizes() {
        let err = AlignedBuf::new(usize::MAX).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }
}
