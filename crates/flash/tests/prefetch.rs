//! Pool misses read asynchronously (`Array::prefetch` over io_uring), on files: a batch wakes
//! its driver once every page it started is in the pool, the request then finds its pages
//! there, a batch that meets pages another batch is reading waits for those reads, and
//! prefetching beside writers and write-back never returns stale bytes.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backend::{Batch, Wake};
use skiff_flash::ctl::{Config, VolId};
use skiff_flash::device::{Device, FileDevice};
use skiff_flash::engine::{format, Array};
use skiff_flash::layout::PAGE;

const SEGMENT_PAGES: u32 = 64;
/// Long enough that only a lost wake reaches it: a guard against hanging, not a measure.
const WAKE_GUARD: Duration = Duration::from_secs(60);

struct Wakes(Mutex<Sender<u64>>);

impl Wake for Wakes {
    fn wake(&self, token: u64) {
        let _ = self.0.lock().unwrap().send(token);
    }
}

fn batch(token: u64) -> (Arc<Batch>, Receiver<u64>) {
    let (tx, rx) = channel();
    (Arc::new(Batch::new(Arc::new(Wakes(Mutex::new(tx))), token)), rx)
}

/// Open `batch`, let `start` add to it, seal it and wait for its wake if it must.
fn prepared(batch: &Arc<Batch>, woken: &Receiver<u64>, start: impl FnOnce(&Arc<Batch>)) -> usize {
    batch.open();
    start(batch);
    let started = batch.started();
    if batch.seal() {
        woken.recv_timeout(WAKE_GUARD).expect("the batch's wake never came");
    }
    started
}

fn page_of(seed: u64) -> Vec<u8> {
    (0..PAGE).map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) >> 2) as u8).collect()
}

fn file_array(dir: &tempfile::TempDir, pool_pages: u32) -> Arc<Array> {
    file_array_with(dir, Config { pool_pages, ..Config::default() })
}

fn file_array_with(dir: &tempfile::TempDir, cfg: Config) -> Arc<Array> {
    let devs = || -> Vec<Box<dyn Device>> {
        (0..2)
            .map(|i| {
                let path = dir.path().join(format!("dev{i}"));
                if !path.exists() {
                    std::fs::File::create(&path).unwrap().set_len((256 + 64 * 16) * PAGE as u64).unwrap();
                }
                Box::new(FileDevice::open(&path).unwrap()) as Box<dyn Device>
            })
            .collect()
    };
    if !dir.path().join("formatted").exists() {
        format(&devs(), SEGMENT_PAGES, false).unwrap();
        std::fs::write(dir.path().join("formatted"), b"").unwrap();
    }
    Array::open(devs(), cfg).unwrap()
}

/// An array on files in `dir` whose volume `v` (512 pages) holds pages `0..written`, each
/// [`page_of`] its number, on flash only: written, then the array reopened with an empty pool
/// of `pool_pages` and `depth` asynchronous reads.
fn cold_array(dir: &tempfile::TempDir, pool_pages: u32, depth: u32, written: u64) -> (Arc<Array>, VolId) {
    let a = file_array(dir, pool_pages);
    assert!(
        a.start_reads(depth).unwrap(),
        "io_uring must work here (a kernel of 5.6 or later, no seccomp ban)"
    );
    let vol = a.create("v", 512 * PAGE as u64).unwrap();
    for p in 0..written {
        a.write(vol, p * PAGE as u64, &page_of(p), false).unwrap();
    }
    a.flush().unwrap();
    a.shutdown().unwrap();
    drop(a);
    let a = file_array(dir, pool_pages);
    assert!(a.start_reads(depth).unwrap());
    let vol = a.id_of("v").unwrap();
    (a, vol)
}

/// Two connections' look-aheads want the same cold pages: the first starts the reads, the
/// second finds them on their way in and counts them on its own batch (instead of leaving its
/// request to wait for them on the worker). Each batch wakes its driver once, after the pages
/// landed, and both requests then find every page in the pool.
#[test]
fn a_batch_that_meets_pages_on_their_way_in_waits_for_them() {
    let dir = tempfile::tempdir().unwrap();
    let (a, vol) = cold_array(&dir, 256, 64, 320);
    let (first, first_woken) = batch(1);
    let (second, second_woken) = batch(2);
    let mut joined_total = 0;
    // Ten ranges of 16 cold pages: the second look comes microseconds after the first, the
    // device reads take far longer, so nearly every page is met on its way in.
    for r in 0..10u64 {
        let (at, len) = (r * 32 * PAGE as u64, 16 * PAGE as u64);
        let read_before = a.stats().pages_read_async;
        first.open();
        a.prefetch(vol, at, len, false, &first);
        second.open();
        a.prefetch(vol, at, len, false, &second);
        let (started, joined) = (a.stats().pages_read_async - read_before, second.started());
        assert_eq!(started, 16, "range {r}: the first look starts every cold page");
        assert!(joined <= 16, "range {r}: {joined} joined");
        joined_total += joined;
        for (b, woken) in [(&first, &first_woken), (&second, &second_woken)] {
            if b.seal() {
                woken.recv_timeout(WAKE_GUARD).expect("a batch's wake never came");
            }
            assert!(woken.try_recv().is_err(), "range {r}: one wake per batch");
        }
        let before = a.stats().counters;
        let mut back = vec![0u8; len as usize];
        a.read(vol, at, &mut back).unwrap();
        assert_eq!(a.stats().counters.pool_hits - before.pool_hits, 16, "range {r}: every page landed");
        for i in 0..16 {
            assert!(back[i * PAGE..(i + 1) * PAGE] == page_of(r * 32 + i as u64), "range {r} page {i}");
        }
    }
    assert!(joined_total > 0, "no look-ahead ever met a page on its way in");
    assert_eq!(a.stats().pages_joined, joined_total as u64);
}

#[test]
fn a_prefetched_read_finds_every_page_in_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    // The pool starts empty, every written page is on flash only.
    let (a, vol) = cold_array(&dir, 64, 32, 300);
    let (b, woken) = batch(9);

    // 16 pages from page 100, written one after another: a device read or a few (a group's
    // or a segment's header may lie between them) start for all 16.
    let started = prepared(&b, &woken, |b| a.prefetch(vol, 100 * PAGE as u64, 16 * PAGE as u64, false, b));
    assert!((1..=3).contains(&started), "{started} reads for 16 neighbouring pages");
    assert_eq!((a.stats().pages_read_async, a.stats().device_reads_async), (16, started as u64));
    let before = a.stats().counters;
    let mut back = vec![0u8; 16 * PAGE];
    a.read(vol, 100 * PAGE as u64, &mut back).unwrap();
    let after = a.stats().counters;
    for i in 0..16 {
        assert!(back[i * PAGE..(i + 1) * PAGE] == page_of(100 + i as u64), "page {}", 100 + i);
    }
    assert_eq!(after.pool_hits - before.pool_hits, 16, "every page came from the pool");
    assert_eq!(after.pool_misses, before.pool_misses, "no miss after the prefetch");
    assert_eq!(a.stats().pages_read_async, 16);

    // Nothing to start: in the pool already, or never written. No wait, no wake.
    let started = prepared(&b, &woken, |b| {
        a.prefetch(vol, 100 * PAGE as u64, 16 * PAGE as u64, false, b);
        a.prefetch(vol, 400 * PAGE as u64, 8 * PAGE as u64, false, b);
    });
    assert_eq!(started, 0);
    assert!(woken.try_recv().is_err());

    // A write fetches only its partial first and last pages (not neighbours: two reads).
    let started =
        prepared(&b, &woken, |b| a.prefetch(vol, 200 * PAGE as u64 + 100, 3 * PAGE as u64, true, b));
    assert_eq!(started, 2, "pages 200 and 203, not 201 and 202");
    // More pages than the pool holds: it starts what the pool has room for, and the rest
    // is read the ordinary way.
    let started = prepared(&b, &woken, |b| a.prefetch(vol, 0, 300 * PAGE as u64, false, b));
    assert!(started > 0 && started < 300, "started {started}");
    let mut all = vec![0u8; 300 * PAGE];
    a.read(vol, 0, &mut all).unwrap();
    for p in 0..300 {
        assert!(all[p * PAGE..(p + 1) * PAGE] == page_of(p as u64), "page {p}");
    }
    a.audit().unwrap();
}

/// Pages that lie next to each other on a device are read with one device read, each landing
/// in its own slot: a run breaks where a page was rewritten elsewhere, where one is in the
/// pool already, and at a segment's end.
#[test]
fn neighbouring_pages_are_read_as_one_and_each_lands_in_its_slot() {
    let dir = tempfile::tempdir().unwrap();
    let a = file_array(&dir, 256);
    let vol = a.create("v", 512 * PAGE as u64).unwrap();
    for p in 0..192 {
        a.write(vol, p * PAGE as u64, &page_of(p), false).unwrap();
    }
    a.flush().unwrap();
    // Every seventh page rewritten: it lies elsewhere now, between runs of its neighbours.
    for p in (0..192).step_by(7) {
        a.write(vol, p * PAGE as u64, &page_of(1000 + p), false).unwrap();
    }
    a.flush().unwrap();
    a.shutdown().unwrap();
    drop(a);
    let a = file_array(&dir, 256);
    assert!(a.start_reads(64).unwrap());
    let vol = a.id_of("v").unwrap();
    let want = |p: u64| if p.is_multiple_of(7) { page_of(1000 + p) } else { page_of(p) };
    // Four pages in the pool already: the look-ahead leaves them alone.
    let mut four = vec![0u8; 4 * PAGE];
    a.read(vol, 60 * PAGE as u64, &mut four).unwrap();

    let (b, woken) = batch(3);
    let reads = prepared(&b, &woken, |b| a.prefetch(vol, 0, 192 * PAGE as u64, false, b));
    let s = a.stats();
    assert_eq!(s.pages_read_async, 188, "every page not in the pool");
    assert_eq!(s.device_reads_async, reads as u64);
    // 27 rewritten pages read (the 28th, page 63, is in the pool), one read each, and 28 runs
    // between them of six pages at most, cut once more where a group's or a segment's
    // header lies between neighbours.
    assert!((27 + 28..=27 + 28 + 12).contains(&reads), "{reads} device reads for 188 pages");
    let before = a.stats().counters;
    let mut back = vec![0u8; 192 * PAGE];
    a.read(vol, 0, &mut back).unwrap();
    assert_eq!(a.stats().counters.pool_misses, before.pool_misses, "every page came from the pool");
    for p in 0..192u64 {
        assert!(back[p as usize * PAGE..(p as usize + 1) * PAGE] == want(p), "page {p}");
    }
    a.audit().unwrap();
}

#[test]
fn prefetching_beside_writers_and_write_back_never_serves_stale_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let a = file_array(&dir, 48);
    assert!(a.start_reads(16).unwrap());
    a.start_background();
    let vol = a.create("v", 256 * PAGE as u64).unwrap();
    for p in 0..256u64 {
        a.write(vol, p * PAGE as u64, &page_of(p), false).unwrap();
    }
    // Four threads, each the only writer of its quarter, prefetch and read across the whole
    // volume and check their own quarter against what they last wrote.
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let (b, woken) = batch(t);
                // What each page of its quarter holds now.
                let mut mine: Vec<Vec<u8>> = (0..64).map(|i| page_of(t * 64 + i)).collect();
                let mut x = t + 1;
                for round in 0..300u64 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let start = x % 250;
                    let n = 1 + (x >> 20) % 6;
                    prepared(&b, &woken, |b| a.prefetch(vol, start * PAGE as u64, n * PAGE as u64, false, b));
                    let mut back = vec![0u8; n as usize * PAGE];
                    a.read(vol, start * PAGE as u64, &mut back).unwrap();
                    for i in 0..n {
                        let p = start + i;
                        if p / 64 == t {
                            let want = &mine[(p % 64) as usize];
                            assert!(
                                back[i as usize * PAGE..(i as usize + 1) * PAGE] == want[..],
                                "page {p}, round {round}"
                            );
                        }
                    }
                    // Overwrite one page of its own quarter (whole or in part).
                    let p = t * 64 + (x >> 8) % 64;
                    let seed = 1000 + round * 4 + t;
                    if round % 3 == 0 {
                        // A partial write: prefetch its page, then write half of it.
                        let off = p * PAGE as u64 + 1024;
                        prepared(&b, &woken, |b| a.prefetch(vol, off, 2048, true, b));
                        let fresh = page_of(seed);
                        a.write(vol, off, &fresh[1024..3072], false).unwrap();
                        mine[(p % 64) as usize][1024..3072].copy_from_slice(&fresh[1024..3072]);
                    } else {
                        a.write(vol, p * PAGE as u64, &page_of(seed), round % 7 == 0).unwrap();
                        mine[(p % 64) as usize] = page_of(seed);
                    }
                }
                mine
            })
        })
        .collect();
    let finals: Vec<Vec<Vec<u8>>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let mut back = vec![0u8; 256 * PAGE];
    a.read(vol, 0, &mut back).unwrap();
    for (t, pages) in finals.iter().enumerate() {
        for (i, want) in pages.iter().enumerate() {
            let p = t * 64 + i;
            assert!(back[p * PAGE..(p + 1) * PAGE] == want[..], "page {p} at the end");
        }
    }
    assert!(a.stats().pages_read_async > 0);
    a.audit().unwrap();
    a.shutdown().unwrap();
}

/// A write whose look-ahead finds the pool seven eighths dirty parks while the sync thread
/// writes back, instead of writing back on its worker; after the wake it finds room, and its
/// bytes and every earlier one read back. (No background thread here: nothing else writes
/// back, so the pool fills for sure.)
#[test]
fn a_write_into_a_full_pool_parks_while_the_sync_thread_makes_room() {
    let dir = tempfile::tempdir().unwrap();
    let a = file_array(&dir, 64);
    assert!(a.start_reads(16).unwrap());
    a.start_syncer();
    let vol = a.create("v", 512 * PAGE as u64).unwrap();
    for p in 0..60u64 {
        a.write(vol, p * PAGE as u64, &page_of(p), false).unwrap();
    }
    assert_eq!(a.stats().pool_dirty, 60);
    let (b, woken) = batch(5);
    // Four whole pages: nothing to read, but 60 + 4 dirty pages pass the mark of 56.
    let started = prepared(&b, &woken, |b| a.prefetch(vol, 60 * PAGE as u64, 4 * PAGE as u64, true, b));
    assert_eq!(started, 1, "the write waited for room");
    assert!(a.stats().pool_dirty + 4 <= 56, "the sync thread wrote back: {} dirty", a.stats().pool_dirty);
    let data: Vec<u8> = (60..64).flat_map(page_of).collect();
    a.write(vol, 60 * PAGE as u64, &data, false).unwrap();
    let s = a.stats();
    assert_eq!((s.rooms_later, s.pool_full_writes), (1, 0));
    // Below the mark, a write starts nothing.
    let started = prepared(&b, &woken, |b| a.prefetch(vol, 64 * PAGE as u64, PAGE as u64, true, b));
    assert_eq!(started, 0);
    let mut back = vec![0u8; 64 * PAGE];
    a.read(vol, 0, &mut back).unwrap();
    for p in 0..64usize {
        assert!(back[p * PAGE..(p + 1) * PAGE] == page_of(p as u64), "page {p}");
    }
    a.shutdown().unwrap();
}

/// An array on files in `dir` whose volume `v` holds one page under each of `leaves` map
/// leaves (page `l * 512 + 7`, [`page_of`] `l`), reopened with a map budget of two leaves, so
/// the others come back from the checkpoint when wanted; reads not set up yet.
fn paged_array(dir: &tempfile::TempDir, leaves: u64) -> (Arc<Array>, VolId) {
    let a = file_array(dir, 64);
    let vol = a.create("v", leaves * 512 * PAGE as u64).unwrap();
    for l in 0..leaves {
        a.write(vol, (l * 512 + 7) * PAGE as u64, &page_of(l), false).unwrap();
    }
    a.shutdown().unwrap();
    drop(a);
    let budget = Config { pool_pages: 64, map_budget: 2 * skiff_flash::ctl::LEAF_BYTES, ..Config::default() };
    let a = file_array_with(dir, budget);
    let vol = a.id_of("v").unwrap();
    (a, vol)
}

/// With the map paged, a read whose leaf was evicted parks while the look-ahead reads the leaf
/// back on the ring and then the page under it: the request finds its page in the pool.
#[test]
fn a_prefetch_reads_an_evicted_leaf_back_and_then_the_page() {
    const LEAVES: u64 = 16;
    let dir = tempfile::tempdir().unwrap();
    let (a, vol) = paged_array(&dir, LEAVES);
    assert!(a.start_reads(32).unwrap());
    assert_eq!((a.stats().map_leaves, a.stats().map_leaves_resident), (LEAVES, 2));
    let (b, woken) = batch(5);
    let mut reads = 0;
    for l in 0..LEAVES {
        let at = (l * 512 + 7) * PAGE as u64;
        prepared(&b, &woken, |b| a.prefetch(vol, at, PAGE as u64, false, b));
        // Counted after the wake: an evicted leaf's read, once it lands, starts the page's
        // read in the same batch, and how soon is up to the ring (counting before the wake
        // saw 1 or 2 by timing).
        let started = b.started();
        assert!(started == 1 || started == 2, "leaf {l}: the page, or its leaf and then the page: {started}");
        reads += started as u64;
        let before = a.stats().counters;
        let mut back = vec![0u8; PAGE];
        a.read(vol, at, &mut back).unwrap();
        assert!(back == page_of(l), "leaf {l}: the page reads back other bytes");
        let after = a.stats().counters;
        assert_eq!(after.pool_hits - before.pool_hits, 1, "leaf {l}: the page was in the pool");
    }
    let s = a.stats();
    assert!(s.map_loads_async >= LEAVES - 2, "{s:?}");
    assert_eq!(reads, LEAVES + s.map_loads_async, "a read per page and one per leaf read back: {s:?}");
    assert!(s.map_leaves_resident <= 2, "the budget still holds: {s:?}");
    a.audit().unwrap();
}

/// Two look-aheads meet the same evicted leaf, and each reads it (leaf reads in flight are not
/// joined). The first to land puts the leaf back and starts the page's read; the second, landing
/// after, finds the leaf back already and must join that page's read rather than end its batch
/// at once, which would wake its driver to run a request whose page is still on its way in
/// (and so block the worker). Landed in that order on held reads.
#[test]
fn a_leaf_read_back_by_another_look_ahead_still_waits_for_its_pages() {
    const LEAVES: u64 = 8;
    let dir = tempfile::tempdir().unwrap();
    let (a, vol) = paged_array(&dir, LEAVES);
    assert!(a.hold_reads(32));
    let (first, first_woken) = batch(1);
    let (second, second_woken) = batch(2);
    let mut met = 0;
    for l in 0..LEAVES {
        let at = (l * 512 + 7) * PAGE as u64;
        first.open();
        a.prefetch(vol, at, PAGE as u64, false, &first);
        second.open();
        a.prefetch(vol, at, PAGE as u64, false, &second);
        let (first_waits, second_waits) = (first.seal(), second.seal());
        assert!(first_waits && second_waits, "leaf {l}: the page is cold");
        if a.held_reads() == 2 {
            // Two reads of the leaf: the second look did not join the first's (a page read
            // would have been joined). The first lands, puts the leaf back, starts the page.
            met += 1;
            assert!(a.land_held(0, false));
            assert_eq!(a.held_reads(), 2, "leaf {l}: the second leaf read, and the page's");
            assert!(a.land_held(0, false));
            assert!(
                second_woken.try_recv().is_err(),
                "leaf {l}: the second batch woke before its page landed"
            );
            assert_eq!(a.held_reads(), 1, "leaf {l}: the page's read, once");
        }
        while a.held_reads() > 0 {
            assert!(a.land_held(0, false));
        }
        for woken in [&first_woken, &second_woken] {
            assert!(woken.recv_timeout(WAKE_GUARD).is_ok(), "leaf {l}: a batch never woke");
            assert!(woken.try_recv().is_err(), "leaf {l}: one wake per batch");
        }
        let before = a.stats().counters;
        let mut back = vec![0u8; PAGE];
        a.read(vol, at, &mut back).unwrap();
        assert!(back == page_of(l), "leaf {l}: the page reads back other bytes");
        assert_eq!(a.stats().counters.pool_hits - before.pool_hits, 1, "leaf {l}: the page was in the pool");
    }
    assert!(met > 0, "no leaf was evicted: the budget did not bind");
    a.audit().unwrap();
}
