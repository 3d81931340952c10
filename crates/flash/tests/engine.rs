//! The flash engine over devices in memory: data through write-back, cleaning and
//! checkpoints, reopening, volumes, and the refusals.

use std::sync::Arc;

use skiff_flash::ctl::Config;
use skiff_flash::device::{Device, MemDevice};
use skiff_flash::engine::{format, Array};
use skiff_flash::layout::PAGE;
use skiff_flash::FlashError;

const SEGMENT_PAGES: u32 = 64;

fn devices(n: usize, pages: u64) -> Vec<Box<dyn Device>> {
    (0..n).map(|_| Box::new(MemDevice::new(pages)) as Box<dyn Device>).collect()
}

fn cfg(pool_pages: u32) -> Config {
    Config { pool_pages, ..Config::default() }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Devices kept by the test so that their images survive the array.
struct Shared(Vec<Arc<MemDevice>>);

impl Shared {
    fn new(n: usize, pages: u64) -> Shared {
        Shared((0..n).map(|_| Arc::new(MemDevice::new(pages))).collect())
    }
    fn boxed(&self) -> Vec<Box<dyn Device>> {
        self.0.iter().map(|d| Box::new(d.clone()) as Box<dyn Device>).collect()
    }
}

#[test]
fn data_survives_cleaning_checkpoints_and_reopening() {
    let devs = Shared::new(2, 256 + 64 * 12);
    format(&devs.boxed(), SEGMENT_PAGES, false).unwrap();
    let a = Array::open(devs.boxed(), cfg(64)).unwrap();
    let vol = a.create("v", 400 * PAGE as u64).unwrap();
    let mut model = vec![0u8; 400 * PAGE];
    // Overwrite a third of the volume many times over: far more than the array holds, so
    // cleaning must run (the background work is driven by hand here).
    for round in 0..100u64 {
        for i in 0..40u64 {
            let page = (i * 7 + round * 13) % 130;
            let off = page * PAGE as u64 + (i % 3) * 1000;
            let data = pattern(round * 1000 + i, 3000);
            a.write(vol, off, &data, i % 11 == 0).unwrap();
            model[off as usize..off as usize + data.len()].copy_from_slice(&data);
        }
        while a.background_step().unwrap() {}
        a.audit().unwrap();
    }
    let stats = a.stats();
    assert!(stats.counters.gc_segments_cleaned > 0, "cleaning ran: {stats:?}");
    assert!(stats.counters.checkpoints > 0, "checkpoints ran: {stats:?}");
    let mut back = vec![0u8; model.len()];
    a.read(vol, 0, &mut back).unwrap();
    assert!(back == model, "data differs before reopening");
    a.flush().unwrap();
    drop(a);
    let a = Array::open(devs.boxed(), cfg(64)).unwrap();
    a.audit().unwrap();
    let vol = a.id_of("v").unwrap();
    let mut back = vec![0u8; model.len()];
    a.read(vol, 0, &mut back).unwrap();
    assert!(back == model, "data differs after reopening");
}

#[test]
fn snapshots_and_clones_keep_their_contents_across_reopening() {
    let devs = Shared::new(1, 256 + 64 * 32);
    format(&devs.boxed(), SEGMENT_PAGES, false).unwrap();
    let a = Array::open(devs.boxed(), cfg(32)).unwrap();
    let vol = a.create("base", 64 * PAGE as u64).unwrap();
    a.write(vol, 0, &pattern(1, 64 * PAGE), false).unwrap();
    let snap = a.snapshot("base", "base@1", false).unwrap();
    a.write(vol, 5 * PAGE as u64, &pattern(2, PAGE), false).unwrap();
    let clone = a.snapshot("base@1", "clone", true).unwrap();
    a.write(clone, 9 * PAGE as u64 + 17, &pattern(3, 100), false).unwrap();
    assert_eq!(a.write(snap, 0, &[1], false), Err(FlashError::ReadOnly));
    assert!(matches!(a.delete("base", false), Err(FlashError::HasChildren { .. })));
    a.flush().unwrap();
    a.checkpoint().unwrap();
    let check = |a: &Array| {
        let read = |name: &str, off: u64, len: usize| {
            let mut b = vec![0u8; len];
            a.read(a.id_of(name).unwrap(), off, &mut b).unwrap();
            b
        };
        let original = pattern(1, 64 * PAGE);
        assert_eq!(read("base@1", 0, 64 * PAGE), original);
        assert_eq!(read("base", 5 * PAGE as u64, PAGE), pattern(2, PAGE));
        assert_eq!(read("base", 6 * PAGE as u64, PAGE), original[6 * PAGE..7 * PAGE]);
        let mut want = original[9 * PAGE..10 * PAGE].to_vec();
        want[17..117].copy_from_slice(&pattern(3, 100));
        assert_eq!(read("clone", 9 * PAGE as u64, PAGE), want);
        let names: Vec<String> = a.list().into_iter().map(|v| v.name).collect();
        assert_eq!(names, ["base", "base@1", "clone"]);
    };
    check(&a);
    drop(a);
    let a = Array::open(devs.boxed(), cfg(32)).unwrap();
    check(&a);
    a.delete("clone", false).unwrap();
    a.delete("base@1", false).unwrap();
    a.delete("base", false).unwrap();
    assert_eq!(a.stats().valid_bytes, 0);
    a.audit().unwrap();
}

#[test]
fn a_full_array_says_no_space_and_keeps_what_it_holds() {
    let devs = Shared::new(1, 256 + 64 * 20);
    format(&devs.boxed(), SEGMENT_PAGES, false).unwrap();
    let a = Array::open(devs.boxed(), cfg(16)).unwrap();
    let vol = a.create("big", 4000 * PAGE as u64).unwrap();
    let mut written = 0u64;
    let err = loop {
        match a.write(vol, written * PAGE as u64, &pattern(written, PAGE), false) {
            Ok(()) => written += 1,
            Err(e) => break e,
        }
        if written.is_multiple_of(64) {
            while a.background_step().unwrap() {}
        }
        assert!(written < 4000, "the array never filled");
    };
    assert_eq!(err, FlashError::NoSpace);
    a.audit().unwrap();
    a.flush().unwrap();
    for p in (0..written.saturating_sub(16)).step_by(7) {
        let mut b = vec![0u8; PAGE];
        a.read(vol, p * PAGE as u64, &mut b).unwrap();
        assert_eq!(b, pattern(p, PAGE), "page {p}");
    }
    // Trimming frees space again.
    a.zero(vol, 0, written * PAGE as u64 / 2, false).unwrap();
    while a.background_step().unwrap() {}
    a.write(vol, 0, &pattern(99, PAGE), false).unwrap();
}

#[test]
fn devices_that_do_not_belong_together_are_refused() {
    let one = Shared::new(2, 256 + 64 * 16);
    format(&one.boxed(), SEGMENT_PAGES, false).unwrap();
    let other = Shared::new(1, 256 + 64 * 16);
    format(&other.boxed(), SEGMENT_PAGES, false).unwrap();
    let err = |devs: Vec<Box<dyn Device>>| Array::open(devs, cfg(8)).err().expect("refused").to_string();
    let mut boxed = one.boxed();
    boxed.pop();
    assert!(err(boxed).contains("missing device index 1"));
    let mut boxed = one.boxed();
    boxed.pop();
    boxed.extend(other.boxed());
    assert!(err(boxed).contains("another flash array"));
    let mut swapped = one.boxed();
    swapped.reverse();
    assert!(Array::open(swapped, cfg(8)).is_ok(), "order does not matter");
    assert!(err(devices(1, 512)).contains("no skiff flash array"));
    let again = format(&one.boxed(), SEGMENT_PAGES, false).unwrap_err().to_string();
    assert!(again.contains("holds a skiff flash array"), "{again}");
    format(&one.boxed(), SEGMENT_PAGES, true).unwrap();
    assert!(format(&devices(1, 256 + 64 * 4), SEGMENT_PAGES, false).is_err(), "too small");
}

#[test]
fn a_volume_refuses_what_it_must() {
    let devs = Shared::new(1, 256 + 64 * 16);
    format(&devs.boxed(), SEGMENT_PAGES, false).unwrap();
    let a = Array::open(devs.boxed(), cfg(8)).unwrap();
    a.create("v", 10 * PAGE as u64).unwrap();
    assert_eq!(a.create("v", PAGE as u64), Err(FlashError::NameTaken("v".into())));
    let v = a.id_of("v").unwrap();
    a.write(v, 9 * PAGE as u64, &[1; 10], false).unwrap();
    assert!(matches!(a.resize("v", 5 * PAGE as u64), Err(FlashError::BadSize(_))));
    a.resize("v", 20 * PAGE as u64).unwrap();
    assert_eq!(a.list()[0].size_bytes, 20 * PAGE as u64);
    assert!(matches!(a.delete("v", true), Err(FlashError::Busy(_))));
    assert_eq!(a.id_of("nope"), Err(FlashError::NoSuchVolume));
    assert!(matches!(a.snapshot("v", "v", false), Err(FlashError::NameTaken(_))));
}

/// Erase counts, least and most, after a cold volume is written once and a hot one
/// overwritten for many rounds; and segments moved to level wear. Checks the data too.
fn wear_after_hot_and_cold(wear_spread_max: u32) -> (u32, u32, u64) {
    let devs = Shared::new(1, 256 + 64 * 32);
    format(&devs.boxed(), SEGMENT_PAGES, false).unwrap();
    let a =
        Array::open(devs.boxed(), Config { pool_pages: 32, wear_spread_max, ..Config::default() }).unwrap();
    let cold = a.create("cold", 300 * PAGE as u64).unwrap();
    let hot = a.create("hot", 60 * PAGE as u64).unwrap();
    let cold_data = pattern(1, 300 * PAGE);
    a.write(cold, 0, &cold_data, false).unwrap();
    let mut model = vec![0u8; 60 * PAGE];
    for round in 0..400u64 {
        let data = pattern(round + 10, 60 * PAGE);
        a.write(hot, 0, &data, false).unwrap();
        model.copy_from_slice(&data);
        while a.background_step().unwrap() {}
    }
    a.audit().unwrap();
    let mut back = vec![0u8; 300 * PAGE];
    a.read(cold, 0, &mut back).unwrap();
    assert!(back == cold_data, "cold data differs (spread {wear_spread_max})");
    let mut back = vec![0u8; 60 * PAGE];
    a.read(hot, 0, &mut back).unwrap();
    assert!(back == model, "hot data differs (spread {wear_spread_max})");
    let s = a.stats();
    (s.erase_min, s.erase_max, s.counters.wear_segments_moved)
}

#[test]
fn static_wear_levelling_moves_cold_data_off_unworn_segments() {
    let (min, max, moved) = wear_after_hot_and_cold(u32::MAX);
    assert_eq!(moved, 0);
    assert!(max - min > 8, "without levelling, cold segments stay unworn: {min}..{max}");
    let (lmin, lmax, lmoved) = wear_after_hot_and_cold(4);
    assert!(lmoved > 0, "levelling moved segments");
    assert!(lmax - lmin < max - min, "levelled {lmin}..{lmax}, not {min}..{max}");
    eprintln!("erase counts: {min}..{max} without levelling, {lmin}..{lmax} with ({lmoved} segments moved)");
}

#[test]
fn volume_sizes_past_the_largest_and_resizing_a_snapshot_are_refused() {
    let devs = Shared::new(1, 256 + 64 * 16);
    format(&devs.boxed(), SEGMENT_PAGES, false).unwrap();
    let a = Array::open(devs.boxed(), cfg(8)).unwrap();
    let largest = skiff_flash::ctl::VOLUME_PAGES_MAX * PAGE as u64;
    assert!(matches!(a.create("huge", largest + PAGE as u64), Err(FlashError::BadSize(_))));
    assert!(matches!(a.create("huge", u64::MAX - 1), Err(FlashError::BadSize(_))), "no unbounded allocation");
    a.create("v", 10 * PAGE as u64).unwrap();
    assert!(matches!(a.resize("v", largest + PAGE as u64), Err(FlashError::BadSize(_))));
    a.snapshot("v", "s", false).unwrap();
    assert_eq!(a.resize("s", 20 * PAGE as u64), Err(FlashError::ReadOnly));
    assert_eq!(a.list().len(), 2, "nothing was made");
    a.audit().unwrap();
}

/// A device whose syncs fail once `failing` is set.
struct FailingSync(Arc<MemDevice>, Arc<std::sync::atomic::AtomicBool>);
impl Device for FailingSync {
    fn pages(&self) -> u64 {
        self.0.pages()
    }
    fn read(&self, page: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.0.read(page, buf)
    }
    fn write(&self, page: u64, buf: &[u8]) -> std::io::Result<()> {
        self.0.write(page, buf)
    }
    fn sync(&self) -> std::io::Result<()> {
        if self.1.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(std::io::Error::other("an injected sync failure"));
        }
        self.0.sync()
    }
    fn name(&self) -> String {
        self.0.name()
    }
}

#[test]
fn a_failed_sync_fails_the_array_and_what_was_flushed_stays_readable() {
    let dev = Arc::new(MemDevice::new(256 + 64 * 16));
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    format(&[Box::new(dev.clone()) as Box<dyn Device>], SEGMENT_PAGES, false).unwrap();
    let a = Array::open(vec![Box::new(FailingSync(dev.clone(), failing.clone()))], cfg(16)).unwrap();
    let v = a.create("v", 10 * PAGE as u64).unwrap();
    a.write(v, 0, &pattern(1, PAGE), true).unwrap();
    failing.store(true, std::sync::atomic::Ordering::Relaxed);
    a.write(v, PAGE as u64, &pattern(2, PAGE), false).unwrap();
    assert!(a.flush().is_err(), "the sync failed");
    // The kernel may have dropped what it could not store: no later sync may vouch for it.
    failing.store(false, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(a.write(v, 2 * PAGE as u64, &pattern(3, PAGE), true), Err(FlashError::Failed));
    assert_eq!(a.flush(), Err(FlashError::Failed));
    let mut back = vec![0u8; PAGE];
    a.read(v, 0, &mut back).unwrap();
    assert!(back == pattern(1, PAGE), "the FUA write before the failure reads back");
}

/// A map budget of a few leaves while writers on three threads rewrite a volume of 16
/// leaves and checkpoints are taken under them: the leaves a checkpoint stores are the ones
/// it took, leaves changed while it was written stay in memory, and every byte reads back,
/// before and after reopening with the same budget.
#[test]
fn a_small_map_budget_holds_under_writers_and_checkpoints() {
    const LEAVES: u64 = 16;
    const VOLUME_PAGES: u64 = LEAVES * 512;
    let devs = Shared::new(2, 256 + 64 * 200);
    format(&devs.boxed(), SEGMENT_PAGES, false).unwrap();
    let budget = Config { map_budget: 3 * skiff_flash::ctl::LEAF_BYTES, ..cfg(64) };
    let a = Array::open(devs.boxed(), budget).unwrap();
    a.start_background();
    let vol = a.create("v", VOLUME_PAGES * PAGE as u64).unwrap();
    // Each thread owns the pages congruent to its number, so the model needs no lock.
    let writers: Vec<_> = (0..3u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let mut last = std::collections::HashMap::new();
                for i in 0..1500u64 {
                    let page = (i * 2_654_435_761 % (VOLUME_PAGES / 3)) * 3 + t;
                    let seed = t << 32 | i;
                    a.write(vol, page * PAGE as u64, &pattern(seed, PAGE), i % 50 == 0).unwrap();
                    last.insert(page, seed);
                }
                last
            })
        })
        .collect();
    let mut checkpoints = 0;
    while !writers.iter().all(|w| w.is_finished()) {
        a.checkpoint().unwrap();
        checkpoints += 1;
        a.audit().unwrap();
    }
    let mut model = std::collections::HashMap::new();
    for w in writers {
        model.extend(w.join().unwrap());
    }
    let check = |a: &Array, vol| {
        let mut page = vec![0u8; PAGE];
        for p in 0..VOLUME_PAGES {
            a.read(vol, p * PAGE as u64, &mut page).unwrap();
            let want = model.get(&p).map_or_else(|| vec![0u8; PAGE], |&seed| pattern(seed, PAGE));
            assert!(page == want, "page {p} reads back other bytes");
        }
    };
    check(&a, vol);
    let s = a.stats();
    assert!(checkpoints > 1 && s.map_evictions > 0 && s.map_loads > 0, "the budget never bound: {s:?}");
    assert_eq!(s.map_leaves, LEAVES);
    a.audit().unwrap();
    a.shutdown().unwrap();
    drop(a);
    let a = Array::open(devs.boxed(), budget).unwrap();
    a.audit().unwrap();
    check(&a, a.id_of("v").unwrap());
    let s = a.stats();
    assert!(s.map_leaves_resident < LEAVES && s.map_loads > 0, "{s:?}");
}

/// The bytes of `lent` ranges, in order.
fn joined(lent: &[rt::mem::RegionBytes]) -> Vec<u8> {
    lent.iter().flat_map(|b| b.as_slice().to_vec()).collect()
}

/// Pool pages lent to a sender are the volume's bytes and keep their slots while held: other
/// traffic cannot evict them and a delete cannot free them, while writes, write-back and a
/// flush go on (nothing waits for a loan, so a worker holding one cannot wait on itself). A
/// read not wholly in the pool, or too large a share of it, is not lent.
#[test]
fn lent_pool_pages_keep_their_slots_until_let_go_and_hold_nothing_back() {
    let devs = Shared::new(2, 256 + 64 * 12);
    format(&devs.boxed(), SEGMENT_PAGES, false).unwrap();
    let a = Array::open(devs.boxed(), cfg(64)).unwrap();
    let vol = a.create("v", 300 * PAGE as u64).unwrap();
    let data = pattern(5, 8 * PAGE);
    a.write(vol, 0, &data, false).unwrap();

    // Unaligned, over three pages: every byte is the volume's.
    let mut lent = Vec::new();
    let (off, len) = (100usize, 2 * PAGE + 50);
    assert!(a.lend(vol, off as u64, len, &mut lent).unwrap());
    assert!(joined(&lent) == data[off..off + len], "other bytes lent");
    let lent_pages = a.stats().pages_lent;
    assert_eq!(lent_pages, 3);

    // Held: a flush writes the dirty pages back all the same, and a write to a lent page goes
    // through (the bytes lent follow it: an overlapping request's).
    a.flush().unwrap();
    let fresh = pattern(6, 10);
    a.write(vol, off as u64, &fresh, true).unwrap();
    assert_eq!(&joined(&lent)[..10], &fresh[..]);
    let mut model = data.clone();
    model[off..off + 10].copy_from_slice(&fresh);

    // Far more other pages than the pool holds pass through it: the lent slots stay.
    for round in 0..4u64 {
        let other = pattern(100 + round, 64 * PAGE);
        a.write(vol, (16 + 64 * round) * PAGE as u64, &other, false).unwrap();
    }
    a.flush().unwrap();
    assert!(a.stats().counters.evictions > 0, "the pool turned over");
    assert!(joined(&lent) == model[off..off + len], "a lent slot was evicted and reused");

    // A delete orphans the lent slots but cannot free them while held.
    a.create("w", 8 * PAGE as u64).unwrap();
    a.delete("v", false).unwrap();
    let w = a.id_of("w").unwrap();
    a.write(w, 0, &pattern(7, 8 * PAGE), false).unwrap();
    assert!(joined(&lent) == model[off..off + len], "a deleted volume's lent slot was reused");
    drop(lent);

    // Not lent: a page not in the pool, a hole, and a read of more than an eighth of the pool.
    let vol = a.create("x", 300 * PAGE as u64).unwrap();
    a.write(vol, 0, &pattern(8, 20 * PAGE), false).unwrap();
    a.flush().unwrap();
    let mut out = Vec::new();
    assert!(!a.lend(vol, 0, 9 * PAGE, &mut out).unwrap(), "9 pages of a pool of 64");
    assert!(!a.lend(vol, 100 * PAGE as u64, PAGE, &mut out).unwrap(), "a hole");
    assert!(out.is_empty());
    assert!(a.lend(vol, 12 * PAGE as u64, 8 * PAGE, &mut out).unwrap());
    assert!(joined(&out) == pattern(8, 20 * PAGE)[12 * PAGE..20 * PAGE], "other bytes lent");
    drop(out);
    a.audit().unwrap();
    drop(a);
    let a = Array::open(devs.boxed(), cfg(64)).unwrap();
    let vol = a.id_of("x").unwrap();
    let mut out = Vec::new();
    assert!(!a.lend(vol, 0, 2 * PAGE, &mut out).unwrap(), "pages on flash only");
    let mut back = vec![0u8; 2 * PAGE];
    a.read(vol, 0, &mut back).unwrap();
    assert!(a.lend(vol, 0, 2 * PAGE, &mut out).unwrap(), "the same once read into the pool");
    assert!(joined(&out) == back, "other bytes lent");
}
