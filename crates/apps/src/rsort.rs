//! RSort, the two-phase distributed bucket sort of Trivedi's thesis (6.5.3), on RStore
//! namespaces (docs/RSTORE.md; `skiff rsort` is its command line).
//!
//! Records are TeraSort's in Indy mode as `gensort -a` writes them: 100 bytes, a 10-byte key of
//! printable ASCII drawn at random (seeded), then the record's number and filler, ending in
//! `\r\n`, so that the same records sort with GNU `sort` too (`gen --file`).
//!
//! Namespaces (their names start with `--name`, `rsort` by default):
//!
//! | namespace | what |
//! |---|---|
//! | `<name>-in` | the input records, back to back |
//! | `<name>-meta` | the input's header and the sort's (a sector each), a sector per worker's phase 1 (its bucket counts) and phase 2 (its run), then the coordination board |
//! | `<name>-buckets` | a slot per (bucket, worker): what phase 1 classified |
//! | `<name>-out` | the sorted runs, bucket after bucket, each starting on a 512-byte boundary |
//!
//! `sort --workers W` is the coordinator: it starts W worker processes (the caller says how:
//! `skiff rsort` starts itself again) and moves them through two phases on a coordination
//! board (`rstore::coordination`: one-byte status fields, heartbeats, a worker's error or death
//! ends the run naming it). Phase 0: worker `i` reads its share of the input, classifies each
//! record into one of W key ranges, writes bucket `b`'s records to slot `(b, i)` and its counts
//! to its sector of `<name>-meta`, then reports. Once every worker has, the coordinator starts
//! phase 1: worker `b` reads slot `(b, i)` of every worker, sorts the records, writes its run
//! at the offset the counts of the buckets before it give and its count to its sector, then
//! reports. The coordinator then marks the sort finished in its sector. A report is written
//! only after the sectors it announces were acknowledged, so whoever sees it reads them whole.
//! `check` reads the runs back: every key in order, exactly as many records as
//! the input, and the same checksum: the sum of every record's CRC-32 (zlib's), which is
//! `valsort`'s checksum.

use std::process::Command;
use std::time::{Duration, Instant};

use coord::Scope;
use rstore::{Board, Coordinator, Party, Segment};

use crate::store::{fresh, map, read_region, sector_u64s, u64s, write_region, IO_BYTES, SECTOR};
use crate::workers::{serve, Workers};

const RECORD: usize = 100;
const KEY: usize = 10;
/// Workers at most: a worker's phase-1 sector holds one count per bucket.
const WORKERS_MAX: usize = 32;

/// Record `n` of the input of `seed`.
fn record(seed: u64, n: u64, out: &mut [u8]) {
    let mut state = seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    for b in &mut out[..KEY] {
        *b = b' ' + (next() % 95) as u8;
    }
    let body = format!("  {n:032X}  ");
    out[KEY..KEY + body.len()].copy_from_slice(body.as_bytes());
    let fill = b'A' + (n % 26) as u8;
    for b in &mut out[KEY + body.len()..RECORD - 2] {
        *b = fill;
    }
    out[RECORD - 2..].copy_from_slice(b"\r\n");
}

/// The sum of every record's CRC-32 (`valsort`'s checksum).
fn checksum(records: &[u8]) -> u128 {
    records.chunks_exact(RECORD).map(|r| u128::from(crc32(r))).sum()
}

/// CRC-32 as zlib's `crc32` computes it (reflected, polynomial 0x04C11DB7), which `valsort`
/// sums over records. Slicing by 8 (eight tables, eight bytes a step), as zlib does, for
/// several times the speed of a byte at a time; `gen` and `check` run it over every record.
fn crc32(bytes: &[u8]) -> u32 {
    const TABLES: [[u32; 256]; 8] = {
        let mut t = [[0u32; 256]; 8];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
                k += 1;
            }
            t[0][i] = c;
            i += 1;
        }
        let mut i = 0;
        while i < 256 {
            let mut s = 1;
            while s < 8 {
                let prev = t[s - 1][i];
                t[s][i] = (prev >> 8) ^ t[0][(prev & 0xFF) as usize];
                s += 1;
            }
            i += 1;
        }
        t
    };
    let mut c = !0u32;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let lo = c ^ u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        c = TABLES[7][(lo & 0xFF) as usize]
            ^ TABLES[6][((lo >> 8) & 0xFF) as usize]
            ^ TABLES[5][((lo >> 16) & 0xFF) as usize]
            ^ TABLES[4][(lo >> 24) as usize]
            ^ TABLES[3][w[4] as usize]
            ^ TABLES[2][w[5] as usize]
            ^ TABLES[1][w[6] as usize]
            ^ TABLES[0][w[7] as usize];
    }
    for &b in words.remainder() {
        c = TABLES[0][((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8);
    }
    !c
}

/// `records` sorted by key, records of equal keys by their whole bytes. The sort moves 16-byte
/// (key, index) pairs, not records, and compares integers, not slices: the 10-byte key is the
/// top of a `u128`, the record's index its bottom.
fn sort_records(records: &[u8]) -> Vec<u8> {
    let mut keys: Vec<u128> = records
        .chunks_exact(RECORD)
        .enumerate()
        .map(|(i, r)| {
            let mut k = [0u8; 16];
            k[..KEY].copy_from_slice(&r[..KEY]);
            u128::from_be_bytes(k) | i as u128
        })
        .collect();
    keys.sort_unstable();
    let record = |k: u128| &records[(k as u32) as usize * RECORD..][..RECORD];
    // Runs of equal keys (rare: 95^10 keys) are ordered by the whole record.
    let mut i = 0;
    while i < keys.len() {
        let key = keys[i] >> 48;
        let mut j = i + 1;
        while j < keys.len() && keys[j] >> 48 == key {
            j += 1;
        }
        if j - i > 1 {
            keys[i..j].sort_unstable_by(|&a, &b| record(a).cmp(record(b)));
        }
        i = j;
    }
    let mut out = Vec::with_capacity(records.len());
    for &k in &keys {
        out.extend_from_slice(record(k));
    }
    out
}

/// Which of `workers` key ranges `key` falls in (by its first two characters).
fn bucket(key: &[u8], workers: usize) -> usize {
    let v = usize::from(key[0].saturating_sub(b' ')) * 95 + usize::from(key[1].saturating_sub(b' '));
    (v * workers / (95 * 95)).min(workers - 1)
}

fn round_up(n: u64) -> u64 {
    n.div_ceil(SECTOR as u64) * SECTOR as u64
}

/// Metadata sectors: the input's header, the sort's, then each worker's phase 1 and phase 2,
/// then the board.
fn gen_sector() -> u64 {
    0
}
fn sort_sector() -> u64 {
    SECTOR as u64
}
fn phase1_sector(i: usize) -> u64 {
    (2 + i) as u64 * SECTOR as u64
}
fn phase2_sector(workers: usize, b: usize) -> u64 {
    (2 + workers + b) as u64 * SECTOR as u64
}
/// The coordination board, after every worker's sectors.
const BOARD_AT: u64 = ((2 + 2 * WORKERS_MAX) * SECTOR) as u64;
const META_BYTES: u64 = BOARD_AT + Board::bytes(WORKERS_MAX);
/// The sort sector's third word once the coordinator saw every run written.
const SORTED: u64 = 1;
/// How long the workers have to exit once the board said done.
const EXIT_PATIENCE: Duration = Duration::from_secs(30);
const MAGIC: u64 = 0x7273_6f72_7431; // "rsort1"

pub use crate::{Report, Result};

/// RSort over one coordinator: its namespaces are `<name>-in`, `-meta`, `-buckets` and
/// `-out`, made of `scope` in chunks of `chunk_bytes` when a step creates them.
pub struct Rsort {
    pub coord: Coordinator,
    pub name: String,
    pub scope: Scope,
    pub chunk_bytes: u64,
}

impl Rsort {
    fn ns(&self, what: &str) -> String {
        format!("{}-{what}", self.name)
    }

    fn fresh(&self, name: &str, bytes: u64) -> Result<()> {
        fresh(&self.coord, name, self.scope, self.chunk_bytes, bytes)
    }

    /// Generate `records` records of `seed` into `<name>-in` (and into the local `file`, for
    /// GNU sort), and the input's header into `<name>-meta`.
    pub fn gen(&self, records: u64, seed: u64, file: Option<&std::path::Path>) -> Result<Report> {
        let c = &self.coord;
        let (input, meta) = (self.ns("in"), self.ns("meta"));
        let start = Instant::now();
        let bytes = round_up(records * RECORD as u64).max(SECTOR as u64);
        self.fresh(&input, bytes)?;
        self.fresh(&meta, META_BYTES)?;
        let mut seg = map(c, &input)?;
        let mut local = match file {
            Some(path) => Some(std::io::BufWriter::new(std::fs::File::create(path)?)),
            None => None,
        };
        // Whole megabytes of the record stream at a time (records straddle sectors).
        let per = IO_BYTES / RECORD * RECORD;
        let mut sum = 0u128;
        let mut buf = vec![0u8; IO_BYTES];
        let mut pending: Vec<u8> = Vec::new();
        let mut written = 0u64;
        let mut n = 0;
        while n < records {
            let k = ((records - n) as usize).min(per / RECORD);
            let mut chunk = vec![0u8; k * RECORD];
            for (j, r) in chunk.chunks_exact_mut(RECORD).enumerate() {
                record(seed, n + j as u64, r);
            }
            sum = sum.wrapping_add(checksum(&chunk));
            if let Some(f) = local.as_mut() {
                std::io::Write::write_all(f, &chunk)?;
            }
            pending.extend_from_slice(&chunk);
            n += k as u64;
            while pending.len() >= IO_BYTES || (n == records && !pending.is_empty()) {
                let take = pending.len().min(IO_BYTES);
                let len = round_up(take as u64) as usize;
                buf[..take].copy_from_slice(&pending[..take]);
                buf[take..len].fill(0);
                seg.write(written, &buf[..len])?;
                written += take as u64;
                pending.drain(..take);
            }
        }
        if let Some(mut f) = local {
            std::io::Write::flush(&mut f)?;
        }
        let mut m = map(c, &meta)?;
        let header = sector_u64s(&[MAGIC, records, sum as u64, (sum >> 64) as u64, seed]);
        m.write(gen_sector(), &header)?;
        Ok(Report {
            what: "gen",
            fields: vec![("records", records as f64), ("seconds", start.elapsed().as_secs_f64())],
            detail: Vec::new(),
        })
    }

    /// Sort `<name>-in` into `<name>-out` with `workers` worker processes, started from the
    /// commands `worker(id, workers)` gives (each runs [`Rsort::worker`] and prints its
    /// report's JSON on stdout); the figures are the slowest worker's.
    pub fn sort(&self, workers: usize, mut worker: impl FnMut(usize, usize) -> Command) -> Result<Report> {
        let c = &self.coord;
        let (meta, buckets, output) = (self.ns("meta"), self.ns("buckets"), self.ns("out"));
        if workers == 0 || workers > WORKERS_MAX {
            return Err(format!("--workers: 1 to {WORKERS_MAX}").into());
        }
        let start = Instant::now();
        let mut m = map(c, &meta)?;
        let header = u64s(&read_region(&mut m, gen_sector(), SECTOR)?);
        if header[0] != MAGIC {
            return Err(format!("{meta} holds no input: run `skiff rsort gen` first").into());
        }
        let records = header[1];
        let cap = slot_records(records, workers);
        self.fresh(&buckets, (workers * workers) as u64 * round_up(cap * RECORD as u64))?;
        self.fresh(&output, round_up(records * RECORD as u64) + (workers * SECTOR) as u64)?;
        let board = Board::new(BOARD_AT, workers)?;
        // Nothing of an earlier sort may count.
        board.reset(&mut m)?;
        m.write(sort_sector(), &sector_u64s(&[MAGIC, workers as u64, 0]))?;
        let _beat = board.heartbeat(map(c, &meta)?, Party::Coordinator)?;
        let mut procs = Workers::spawn(workers, |i| worker(i, workers))?;
        for phase in 0..2 {
            board.start(&mut m, phase, &[])?;
            board.gather(&mut m, phase, || procs.watch())?;
        }
        board.finish(&mut m)?;
        m.write(sort_sector(), &sector_u64s(&[MAGIC, workers as u64, SORTED]))?;
        let mut phases = [0f64; 3];
        for r in procs.finish(EXIT_PATIENCE)? {
            for (k, key) in ["phase1_s", "wait_s", "phase2_s"].iter().enumerate() {
                phases[k] = phases[k].max(r[key].as_f64().unwrap_or(0.0));
            }
        }
        Ok(Report {
            what: "sort",
            fields: vec![
                ("records", records as f64),
                ("workers", workers as f64),
                ("phase1_s", phases[0]),
                ("wait_s", phases[1]),
                ("phase2_s", phases[2]),
                ("seconds", start.elapsed().as_secs_f64()),
            ],
            detail: Vec::new(),
        })
    }

    /// Worker `id` of `workers`: phase 0, then phase 1, as the coordinator starts them (the
    /// module's docs). Its report holds the time of each and of the wait between.
    pub fn worker(&self, id: usize, workers: usize) -> Result<Report> {
        let c = &self.coord;
        let meta = self.ns("meta");
        let mut m = map(c, &meta)?;
        let board = Board::new(BOARD_AT, workers)?;
        let _beat = board.heartbeat(map(c, &meta)?, Party::Worker(id))?;
        let header = u64s(&read_region(&mut m, gen_sector(), SECTOR)?);
        let records = header[1];
        let cap = slot_records(records, workers);
        let slot = round_up(cap * RECORD as u64);
        let mut b_seg = map(c, &self.ns("buckets"))?;
        let (mut phase1, mut waited, mut phase2) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let mut reported = Instant::now();
        serve(&board, &mut m, id, |m, phase, _| {
            let t = Instant::now();
            match phase {
                0 => {
                    self.classify(m, &mut b_seg, id, workers, records, cap, slot)?;
                    phase1 = t.elapsed();
                }
                1 => {
                    waited = t - reported;
                    self.sort_bucket(m, &mut b_seg, id, workers, slot)?;
                    phase2 = t.elapsed();
                }
                _ => return Err(format!("RSort has two phases, not {}", phase + 1).into()),
            }
            reported = Instant::now();
            Ok(Vec::new())
        })?;
        Ok(Report {
            what: "worker",
            fields: vec![
                ("phase1_s", phase1.as_secs_f64()),
                ("wait_s", waited.as_secs_f64()),
                ("phase2_s", phase2.as_secs_f64()),
            ],
            detail: Vec::new(),
        })
    }

    /// Phase 0 of worker `id`: classify its share of the input into the buckets' slots, and
    /// write its counts to its sector.
    #[allow(clippy::too_many_arguments)]
    fn classify(
        &self,
        m: &mut Segment,
        b_seg: &mut Segment,
        id: usize,
        workers: usize,
        records: u64,
        cap: u64,
        slot: u64,
    ) -> Result<()> {
        let (first, last) =
            (records * id as u64 / workers as u64, records * (id as u64 + 1) / workers as u64);
        let from = first * RECORD as u64 / SECTOR as u64 * SECTOR as u64;
        let to = round_up(last * RECORD as u64);
        let mut input = map(&self.coord, &self.ns("in"))?;
        let raw = read_region(&mut input, from, (to - from) as usize)?;
        let mine = &raw[(first * RECORD as u64 - from) as usize..(last * RECORD as u64 - from) as usize];
        let mut classified: Vec<Vec<u8>> = vec![Vec::new(); workers];
        for r in mine.chunks_exact(RECORD) {
            classified[bucket(&r[..KEY], workers)].extend_from_slice(r);
        }
        let mut counts = Vec::with_capacity(workers);
        for (b, data) in classified.iter_mut().enumerate() {
            let n = (data.len() / RECORD) as u64;
            if n > cap {
                return Err(format!(
                    "bucket {b} got {n} records from worker {id}, more than its slot's {cap}"
                )
                .into());
            }
            counts.push(n);
            data.resize(round_up(data.len() as u64) as usize, 0);
            write_region(b_seg, ((b * workers + id) as u64) * slot, data)?;
        }
        m.write(phase1_sector(id), &sector_u64s(&counts))?;
        Ok(())
    }

    /// Phase 1 of worker `b`: sort bucket `b` from every worker's slot and write its run where
    /// the buckets before it end, and its count to its sector.
    fn sort_bucket(
        &self,
        m: &mut Segment,
        b_seg: &mut Segment,
        b: usize,
        workers: usize,
        slot: u64,
    ) -> Result<()> {
        let sectors = read_region(m, phase1_sector(0), workers * SECTOR)?;
        let all: Vec<Vec<u64>> = sectors.chunks(SECTOR).map(u64s).collect();
        let totals: Vec<u64> = (0..workers).map(|bb| all.iter().map(|s| s[bb]).sum()).collect();
        let mut run: Vec<u8> = Vec::with_capacity(totals[b] as usize * RECORD);
        for (i, s) in all.iter().enumerate() {
            let n = s[b] as usize;
            if n > 0 {
                let data = read_region(
                    b_seg,
                    ((b * workers + i) as u64) * slot,
                    round_up((n * RECORD) as u64) as usize,
                )?;
                run.extend_from_slice(&data[..n * RECORD]);
            }
        }
        let mut sorted = sort_records(&run);
        sorted.resize(round_up(sorted.len() as u64) as usize, 0);
        let at: u64 = totals[..b].iter().map(|&t| round_up(t * RECORD as u64)).sum();
        let mut out = map(&self.coord, &self.ns("out"))?;
        write_region(&mut out, at, &sorted)?;
        m.write(phase2_sector(workers, b), &sector_u64s(&[totals[b]]))?;
        Ok(())
    }

    /// Check `<name>-out`: every key in order, and exactly the input's records (their count and
    /// checksum).
    pub fn check(&self) -> Result<Report> {
        let c = &self.coord;
        let (meta, output) = (self.ns("meta"), self.ns("out"));
        let start = Instant::now();
        let mut m = map(c, &meta)?;
        let header = u64s(&read_region(&mut m, gen_sector(), SECTOR)?);
        let sort = u64s(&read_region(&mut m, sort_sector(), SECTOR)?);
        if header[0] != MAGIC || sort[0] != MAGIC {
            return Err("nothing to check: run `skiff rsort gen` and `skiff rsort sort` first".into());
        }
        let (records, workers) = (header[1], sort[1] as usize);
        let want = u128::from(header[2]) | (u128::from(header[3]) << 64);
        let mut out = map(c, &output)?;
        let (mut n, mut sum, mut last): (u64, u128, Option<Vec<u8>>) = (0, 0, None);
        let mut at = 0u64;
        if sort[2] != SORTED {
            return Err("the last sort did not finish: its runs are not all written".into());
        }
        for b in 0..workers {
            let s = u64s(&read_region(&mut m, phase2_sector(workers, b), SECTOR)?);
            let count = s[0];
            let data = read_region(&mut out, at, round_up(count * RECORD as u64) as usize)?;
            for r in data[..count as usize * RECORD].chunks_exact(RECORD) {
                if last.as_deref().is_some_and(|l| l[..KEY] > r[..KEY]) {
                    return Err(format!("record {n} (bucket {b}) is out of order").into());
                }
                last = Some(r.to_vec());
                sum = sum.wrapping_add(u128::from(crc32(r)));
                n += 1;
            }
            at += round_up(count * RECORD as u64);
        }
        if n != records {
            return Err(format!("the output holds {n} records, the input {records}").into());
        }
        if sum != want {
            return Err(format!("the output's checksum {sum:#x} is not the input's {want:#x}").into());
        }
        Ok(Report {
            what: "check",
            fields: vec![("records", n as f64), ("seconds", start.elapsed().as_secs_f64())],
            detail: Vec::new(),
        })
    }
}

/// Sort `records` records of `seed` in this process's memory: the single-process peer.
pub fn local(records: u64, seed: u64) -> Report {
    let start = Instant::now();
    let mut data = vec![0u8; records as usize * RECORD];
    for (n, r) in data.chunks_exact_mut(RECORD).enumerate() {
        record(seed, n as u64, r);
    }
    let generated = start.elapsed();
    let t = Instant::now();
    let out = sort_records(&data);
    let sorted = t.elapsed();
    drop(out);
    Report {
        what: "local",
        fields: vec![
            ("records", records as f64),
            ("gen_s", generated.as_secs_f64()),
            ("sort_s", sorted.as_secs_f64()),
        ],
        detail: Vec::new(),
    }
}

/// Records one (bucket, worker) slot holds: the share expected with uniform keys, doubled,
/// plus room for small inputs' variance.
fn slot_records(records: u64, workers: usize) -> u64 {
    let w = workers as u64;
    records.div_ceil(w * w) * 2 + 256
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_sort_by_key_then_by_their_bytes() {
        let mut data = vec![0u8; 5 * RECORD];
        for (n, r) in data.chunks_exact_mut(RECORD).enumerate() {
            record(9, n as u64, r);
        }
        // Two records with the same key, the later one smaller past the key.
        let first: Vec<u8> = data[..RECORD].to_vec();
        data[4 * RECORD..4 * RECORD + KEY].copy_from_slice(&first[..KEY]);
        data[4 * RECORD + KEY] = b' ';
        let sorted = sort_records(&data);
        let mut want: Vec<&[u8]> = data.chunks_exact(RECORD).collect();
        want.sort_unstable_by(|x, y| x[..KEY].cmp(&y[..KEY]).then_with(|| x.cmp(y)));
        assert_eq!(sorted, want.concat());
    }

    #[test]
    fn records_are_gensort_shaped_and_buckets_cover_every_key() {
        let mut r = [0u8; RECORD];
        record(1, 7, &mut r);
        assert!(r[..KEY].iter().all(|b| (b' '..=b'~').contains(b)));
        assert_eq!(&r[RECORD - 2..], b"\r\n");
        let mut again = [0u8; RECORD];
        record(1, 7, &mut again);
        assert_eq!(r, again, "seeded");
        assert_eq!(bucket(b"          ", 4), 0);
        assert_eq!(bucket(b"~~~~~~~~~~", 4), 3);
        assert_eq!(bucket(b"N~        ", 2), 0);
        assert_eq!(bucket(b"P         ", 2), 1);
    }

    /// zlib's CRC-32 check value, and the checksum as a sum that wraps nowhere near 2^128.
    #[test]
    fn the_checksum_is_valsorts_sum_of_crc32s() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"The quick brown fox jumps over the lazy dog"), 0x414F_A339);
        // Every length around the eight-byte steps agrees with the bitwise definition.
        let bitwise = |bytes: &[u8]| {
            let mut c = !0u32;
            for &b in bytes {
                c ^= u32::from(b);
                for _ in 0..8 {
                    c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
                }
            }
            !c
        };
        let data: Vec<u8> = (0..100u32).map(|i| (i * 37 + 11) as u8).collect();
        for n in 0..data.len() {
            assert_eq!(crc32(&data[..n]), bitwise(&data[..n]), "{n} bytes");
        }
        let mut two = vec![0u8; 2 * RECORD];
        record(3, 0, &mut two[..RECORD]);
        record(3, 1, &mut two[RECORD..]);
        let want = u128::from(crc32(&two[..RECORD])) + u128::from(crc32(&two[RECORD..]));
        assert_eq!(checksum(&two), want);
    }
}
