//! Carafe, graph processing on RStore (Trivedi's thesis, 6.5.2; docs/RSTORE.md, Carafe):
//! graphs stored in namespaces, explored online a vertex at a time, and computed on by a
//! Pregel engine whose partition workers, processes on any machine, pass messages through a
//! shared mailbox in RStore and meet at every superstep on a coordination board.
//!
//! Namespaces (their names start with the graph's name):
//!
//! | namespace | what |
//! |---|---|
//! | `<name>-meta` | the graph's header (sector 0), the last run's (sector 1), the partition bounds, the mailbox's capacity matrix, the coordination board |
//! | `<name>-vertices` | every vertex as a [`VERTEX_BYTES`]-byte record, in internal-id order: external id, first edge, internal id, out-degree (little-endian `u64`, `u64`, `u32`, `u32`) |
//! | `<name>-edges` | the adjacency lists back to back, an [`EDGE_BYTES`]-byte record per directed edge: target's internal id (`u32`), weight (`f32`) |
//! | `<name>-values` | the property map: one `f64` per vertex, the value the last program gave it (a rank, a distance), written back by its worker after every superstep |
//! | `<name>-mail` | the mailbox of the last run (`pregel`) |
//!
//! A vertex's internal id is its place among the external ids in ascending order, so an
//! external id is found by binary search over the vertex records and needs no index. Edges are
//! directed; an undirected import stores each edge both ways, as the thesis does.
//!
//! - [`build`]: edge lists (SNAP's text format, or R-MAT generated) into sorted vertices and
//!   adjacency lists.
//! - [`Graph`]: online exploration: a vertex by id, an iterator over its edges, reading only
//!   what it needs from the namespaces (a block at a time, kept in a bounded cache: a graph's
//!   vertices and edges do not change once stored), and Dijkstra's shortest path on it
//!   ([`Graph::path`]).
//! - [`pregel`]: the Pregel engine and its programs, PageRank and single-source shortest paths.

pub mod build;
pub mod pregel;

use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::time::Instant;

use coord::Scope;
use rstore::{Board, Coordinator, Segment};

use crate::store::{fresh, map, read_region, sector_u64s, u64s, write_region, SECTOR};
pub use crate::Report;
use crate::Result;
use build::Csr;

/// Bytes of a vertex record.
pub const VERTEX_BYTES: usize = 24;
/// Bytes of an edge record.
pub const EDGE_BYTES: usize = 8;
const MAGIC: u64 = 0x0063_6172_6166_6531; // "carafe1"
/// Partition workers at most.
pub const WORKERS_MAX: usize = rstore::coordination::WORKERS_MAX;
/// `<name>-meta`: the graph's header, the last run's, the partition bounds (`WORKERS_MAX + 1`
/// `u64`s), the mailbox's capacity matrix (`WORKERS_MAX²` `u64`s), then the board.
const HEADER_AT: u64 = 0;
const RUN_AT: u64 = SECTOR as u64;
const BOUNDS_AT: u64 = 2 * SECTOR as u64;
const MATRIX_AT: u64 = BOUNDS_AT + round_up(8 * (WORKERS_MAX as u64 + 1));
const BOARD_AT: u64 = MATRIX_AT + (8 * WORKERS_MAX * WORKERS_MAX) as u64;
const META_BYTES: u64 = BOARD_AT + Board::bytes(WORKERS_MAX);
/// Header flags.
const WEIGHTED: u64 = 1;
const UNDIRECTED: u64 = 2;

// The parts of `<name>-meta` lie apart, and the board on a sector.
const _: () =
    assert!(BOUNDS_AT + 8 * (WORKERS_MAX as u64 + 1) <= MATRIX_AT && BOARD_AT.is_multiple_of(SECTOR as u64));

const fn round_up(n: u64) -> u64 {
    n.div_ceil(SECTOR as u64) * SECTOR as u64
}

/// A graph's header: what `gen` or `import` stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub vertices: u64,
    pub edges: u64,
    pub weighted: bool,
    pub undirected: bool,
}

/// Carafe over one coordinator: graph `name`'s namespaces, made of `scope` in chunks of
/// `chunk_bytes` when a step creates them.
pub struct Carafe {
    pub coord: Coordinator,
    pub name: String,
    pub scope: Scope,
    pub chunk_bytes: u64,
}

impl Carafe {
    fn ns(&self, what: &str) -> String {
        format!("{}-{what}", self.name)
    }

    fn fresh(&self, name: &str, bytes: u64) -> Result<()> {
        fresh(&self.coord, name, self.scope, self.chunk_bytes, bytes.max(SECTOR as u64))
    }

    /// Import the edge list at `path` (SNAP's text format: `src dst [weight]`, `#` comments)
    /// as this graph; `undirected` stores each edge both ways.
    pub fn import(&self, path: &std::path::Path, undirected: bool) -> Result<Report> {
        let start = Instant::now();
        let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let edges = build::read_edges(std::io::BufReader::with_capacity(1 << 20, file))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let read_s = start.elapsed().as_secs_f64();
        self.build_and_store(&edges, undirected, ("read_s", read_s), start)
    }

    /// Generate an R-MAT graph as `spec` says as this graph, and write its edge list to `file`
    /// too, for the peers that read files.
    pub fn gen(
        &self,
        spec: &build::GenSpec,
        file: Option<&std::path::Path>,
        undirected: bool,
    ) -> Result<Report> {
        if !(1..=30).contains(&spec.scale) || spec.edge_factor == 0 {
            return Err("--scale 1 to 30 and --edge-factor at least 1".into());
        }
        let start = Instant::now();
        let edges = spec.edges();
        if let Some(path) = file {
            let mut out = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path)?);
            use std::io::Write;
            let weighted = spec.max_weight > 1;
            writeln!(
                out,
                "# R-MAT scale {} edge factor {} seed {}{}{}: src dst{}",
                spec.scale,
                spec.edge_factor,
                spec.seed,
                if spec.simple { ", simple" } else { "" },
                if spec.compact { ", compact ids" } else { "" },
                if weighted { " weight" } else { "" }
            )?;
            for e in &edges {
                if weighted {
                    writeln!(out, "{}\t{}\t{}", e.src, e.dst, e.weight)?;
                } else {
                    writeln!(out, "{}\t{}", e.src, e.dst)?;
                }
            }
            out.flush()?;
        }
        let gen_s = start.elapsed().as_secs_f64();
        self.build_and_store(&edges, undirected, ("gen_s", gen_s), start)
    }

    fn build_and_store(
        &self,
        edges: &[build::Edge],
        undirected: bool,
        first: (&'static str, f64),
        start: Instant,
    ) -> Result<Report> {
        let t = Instant::now();
        let csr = Csr::build(edges, undirected)?;
        let build_s = t.elapsed().as_secs_f64();
        let mut report = self.store(&csr, undirected)?;
        report.what = "import";
        report.fields.push(first);
        report.fields.push(("build_s", build_s));
        report.fields.push(("seconds", start.elapsed().as_secs_f64()));
        Ok(report)
    }

    pub fn store(&self, csr: &Csr, undirected: bool) -> Result<Report> {
        let c = &self.coord;
        let start = Instant::now();
        let (v, e) = (csr.vertices(), csr.edges());
        self.fresh(&self.ns("meta"), META_BYTES)?;
        self.fresh(&self.ns("vertices"), (v * VERTEX_BYTES) as u64)?;
        self.fresh(&self.ns("edges"), (e * EDGE_BYTES) as u64)?;
        self.fresh(&self.ns("values"), 8 * v as u64)?;
        let mut records = vec![0u8; v * VERTEX_BYTES];
        for (i, r) in records.chunks_exact_mut(VERTEX_BYTES).enumerate() {
            let degree = (csr.first[i + 1] - csr.first[i]) as u32;
            r[0..8].copy_from_slice(&csr.external[i].to_le_bytes());
            r[8..16].copy_from_slice(&csr.first[i].to_le_bytes());
            r[16..20].copy_from_slice(&(i as u32).to_le_bytes());
            r[20..24].copy_from_slice(&degree.to_le_bytes());
        }
        write_region(&mut map(c, &self.ns("vertices"))?, 0, &records)?;
        drop(records);
        let mut edges = vec![0u8; e * EDGE_BYTES];
        for (r, &(dst, w)) in edges.chunks_exact_mut(EDGE_BYTES).zip(&csr.targets) {
            r[0..4].copy_from_slice(&dst.to_le_bytes());
            r[4..8].copy_from_slice(&w.to_le_bytes());
        }
        write_region(&mut map(c, &self.ns("edges"))?, 0, &edges)?;
        let flags = if csr.weighted() { WEIGHTED } else { 0 } | if undirected { UNDIRECTED } else { 0 };
        // The header last: a graph whose header is written is whole.
        map(c, &self.ns("meta"))?.write(HEADER_AT, &sector_u64s(&[MAGIC, v as u64, e as u64, flags]))?;
        Ok(Report {
            what: "stored",
            fields: vec![
                ("vertices", v as f64),
                ("edges", e as f64),
                ("weighted", f64::from(u8::from(csr.weighted()))),
                ("store_s", start.elapsed().as_secs_f64()),
            ],
            detail: Vec::new(),
        })
    }

    /// This graph's `<name>-meta`, mapped.
    fn meta(&self) -> Result<Segment> {
        map(&self.coord, &self.ns("meta")).map_err(|e| {
            format!("graph {}: {e} (run `skiff carafe gen` or `import` first)", self.name).into()
        })
    }

    /// This graph's header.
    pub fn header(&self) -> Result<Header> {
        header(&mut self.meta()?, &self.name)
    }

    /// Open this graph for online exploration.
    pub fn open(&self) -> Result<Graph> {
        self.open_with_cache(CACHE_BYTES)
    }

    /// [`Carafe::open`] with a cache of `cache_bytes` (at least a block for vertices and one
    /// for edges).
    pub fn open_with_cache(&self, cache_bytes: usize) -> Result<Graph> {
        let header = self.header()?;
        let cache = cache_bytes / BLOCK_BYTES / 2;
        Ok(Graph {
            vertices: Blocks::new(
                map(&self.coord, &self.ns("vertices"))?,
                header.vertices * VERTEX_BYTES as u64,
                cache,
            ),
            edges: Blocks::new(map(&self.coord, &self.ns("edges"))?, header.edges * EDGE_BYTES as u64, cache),
            header,
            explored: Explored::default(),
        })
    }

    /// Each vertex's external id and value (what the last run left in `<name>-values`), in
    /// internal-id order.
    pub fn values(&self) -> Result<Vec<(u64, f64)>> {
        let h = self.header()?;
        let v = h.vertices as usize;
        let records = read_region(&mut map(&self.coord, &self.ns("vertices"))?, 0, v * VERTEX_BYTES)?;
        let values = read_region(&mut map(&self.coord, &self.ns("values"))?, 0, 8 * v)?;
        Ok(records
            .chunks_exact(VERTEX_BYTES)
            .zip(values.chunks_exact(8))
            .map(|(r, x)| {
                (
                    u64::from_le_bytes(r[0..8].try_into().expect("8")),
                    f64::from_le_bytes(x.try_into().expect("8")),
                )
            })
            .collect())
    }

    /// Shortest paths between `pairs` vertex pairs drawn at random (seeded) with Dijkstra on
    /// the online graph (thesis Figure 6.12a): per pair, its length and how much of the graph
    /// it explored.
    pub fn paths(&self, pairs: usize, seed: u64, walk: Walk) -> Result<Report> {
        let mut g = self.open_with_cache(walk.cache_bytes)?;
        let mut rng = build::Rng::new(seed);
        let n = g.header.vertices;
        let chosen: Vec<(u32, u32)> =
            (0..pairs).map(|_| (rng.below(n) as u32, rng.below(n) as u32)).collect();
        self.paths_between(&mut g, &chosen, walk.cold)
    }

    /// Shortest paths between the given pairs of external ids.
    pub fn paths_of(&self, pairs: &[(u64, u64)], walk: Walk) -> Result<Report> {
        let mut g = self.open_with_cache(walk.cache_bytes)?;
        let mut chosen = Vec::with_capacity(pairs.len());
        for &(a, b) in pairs {
            let find = |g: &mut Graph, x: u64| -> Result<u32> {
                g.find(x)?
                    .map(|v| v.internal)
                    .ok_or_else(|| format!("graph {} has no vertex {x}", self.name).into())
            };
            chosen.push((find(&mut g, a)?, find(&mut g, b)?));
        }
        self.paths_between(&mut g, &chosen, walk.cold)
    }

    fn paths_between(&self, g: &mut Graph, pairs: &[(u32, u32)], cold: bool) -> Result<Report> {
        let start = Instant::now();
        let mut rows = Vec::with_capacity(pairs.len());
        let (mut settled, mut scanned) = (0u64, 0u64);
        for &(a, b) in pairs {
            if cold {
                g.forget();
            }
            let reads = g.explored.reads;
            let p = g.path(a, b)?;
            settled += p.settled;
            scanned += p.scanned;
            rows.push(serde_json::json!({
                "from": p.from, "to": p.to,
                "distance": p.distance, "hops": p.hops,
                "vertices_explored": p.settled, "edges_explored": p.scanned,
                "reads": g.explored.reads - reads, "seconds": p.seconds,
            }));
        }
        let seconds = start.elapsed().as_secs_f64();
        Ok(Report {
            what: "path",
            fields: vec![
                ("pairs", pairs.len() as f64),
                ("vertices_explored", settled as f64),
                ("edges_explored", scanned as f64),
                ("reads", g.explored.reads as f64),
                ("seconds", seconds),
                ("edges_per_s", scanned as f64 / seconds.max(1e-9)),
            ],
            detail: vec![("paths", serde_json::Value::Array(rows))],
        })
    }
}

fn header(m: &mut Segment, name: &str) -> Result<Header> {
    let h = u64s(&read_region(m, HEADER_AT, SECTOR)?);
    if h[0] != MAGIC {
        return Err(format!("graph {name} holds no graph: run `skiff carafe gen` or `import` first").into());
    }
    Ok(Header {
        vertices: h[1],
        edges: h[2],
        weighted: h[3] & WEIGHTED != 0,
        undirected: h[3] & UNDIRECTED != 0,
    })
}

/// A vertex as its record holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vertex {
    pub internal: u32,
    pub external: u64,
    pub first_edge: u64,
    pub out_degree: u32,
}

impl Vertex {
    fn parse(r: &[u8]) -> Vertex {
        Vertex {
            external: u64::from_le_bytes(r[0..8].try_into().expect("8")),
            first_edge: u64::from_le_bytes(r[8..16].try_into().expect("8")),
            internal: u32::from_le_bytes(r[16..20].try_into().expect("4")),
            out_degree: u32::from_le_bytes(r[20..24].try_into().expect("4")),
        }
    }
}

/// How [`Carafe::paths`] walks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walk {
    /// What the graph keeps cached ([`Carafe::open_with_cache`]).
    pub cache_bytes: usize,
    /// Each path starts with an empty cache, as a first query would.
    pub cold: bool,
}

impl Default for Walk {
    fn default() -> Self {
        Walk { cache_bytes: CACHE_BYTES, cold: false }
    }
}

/// How much online exploration read from RStore.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Explored {
    pub reads: u64,
    pub bytes: u64,
}

/// A graph opened for online exploration (the thesis's `CarafeGraph`): its vertex and edge
/// namespaces mapped, read a block at a time into a bounded cache, so that a walk that comes
/// back near where it has been costs no round trip.
pub struct Graph {
    pub header: Header,
    vertices: Blocks,
    edges: Blocks,
    pub explored: Explored,
}

/// Edges an [`EdgeIter`] takes from the cache at a time.
const EDGES_PER_READ: usize = 512;

/// What online exploration reads from RStore at a time. A miss costs one request, and a
/// request of 32 KiB costs little more than one of 24 bytes (its round trip dominates), so a
/// walk through much of the graph makes a few thousand requests instead of two per vertex.
pub const BLOCK_BYTES: usize = 32 << 10;

/// The bytes a [`Graph`] keeps cached, half for vertex records and half for edges.
pub const CACHE_BYTES: usize = 512 << 20;

/// A read-through cache of one namespace's bytes in [`BLOCK_BYTES`] blocks, evicting the
/// oldest block first. Only for bytes that do not change while it lives.
struct Blocks {
    segment: Segment,
    len: u64,
    blocks: HashMap<u64, Box<[u8]>, IdHash>,
    order: VecDeque<u64>,
    capacity: usize,
}

impl Blocks {
    fn new(segment: Segment, len: u64, capacity: usize) -> Self {
        Blocks { segment, len, blocks: HashMap::default(), order: VecDeque::new(), capacity: capacity.max(1) }
    }

    /// `out.len()` bytes from `offset`, which must lie within the namespace's `len`.
    fn read(&mut self, offset: u64, out: &mut [u8], explored: &mut Explored) -> Result<()> {
        let end = offset + out.len() as u64;
        if end > self.len {
            return Err(
                format!("read of {}..{end} past the end of the graph's {} bytes", offset, self.len).into()
            );
        }
        let mut at = offset;
        while at < end {
            let index = at / BLOCK_BYTES as u64;
            let start = index * BLOCK_BYTES as u64;
            if !self.blocks.contains_key(&index) {
                let mut block = vec![0u8; (self.len - start).min(BLOCK_BYTES as u64) as usize];
                self.segment.read(start, &mut block)?;
                explored.reads += 1;
                explored.bytes += block.len() as u64;
                if self.order.len() == self.capacity {
                    let old = self.order.pop_front().expect("capacity is at least 1");
                    self.blocks.remove(&old);
                }
                self.order.push_back(index);
                self.blocks.insert(index, block.into_boxed_slice());
            }
            let block = &self.blocks[&index];
            let from = (at - start) as usize;
            let n = (block.len() - from).min((end - at) as usize);
            let put = (at - offset) as usize;
            out[put..put + n].copy_from_slice(&block[from..from + n]);
            at += n as u64;
        }
        Ok(())
    }
}

/// One shortest path's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct PathFound {
    pub from: u64,
    pub to: u64,
    /// `None` when `to` cannot be reached from `from`.
    pub distance: Option<f64>,
    pub hops: Option<u64>,
    /// Vertices settled and edges looked at on the way.
    pub settled: u64,
    pub scanned: u64,
    pub seconds: f64,
}

impl Graph {
    /// Vertex `internal` (the thesis's `VertexHandle`): its record, one read.
    pub fn vertex(&mut self, internal: u32) -> Result<Vertex> {
        if u64::from(internal) >= self.header.vertices {
            return Err(format!("no vertex {internal}: the graph has {}", self.header.vertices).into());
        }
        let mut r = [0u8; VERTEX_BYTES];
        self.vertices.read(u64::from(internal) * VERTEX_BYTES as u64, &mut r, &mut self.explored)?;
        Ok(Vertex::parse(&r))
    }

    /// Drops every cached block: the next reads go to RStore.
    pub fn forget(&mut self) {
        for b in [&mut self.vertices, &mut self.edges] {
            b.blocks.clear();
            b.order.clear();
        }
    }

    /// The vertex of external id `external`, by binary search over the records.
    pub fn find(&mut self, external: u64) -> Result<Option<Vertex>> {
        let (mut lo, mut hi) = (0u64, self.header.vertices);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let v = self.vertex(mid as u32)?;
            match v.external.cmp(&external) {
                std::cmp::Ordering::Equal => return Ok(Some(v)),
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
            }
        }
        Ok(None)
    }

    /// `v`'s out-edges (the thesis's `EdgeIterator`), taken [`EDGES_PER_READ`] at a time.
    pub fn edges(&mut self, v: &Vertex) -> EdgeIter<'_> {
        EdgeIter {
            graph: self,
            next: v.first_edge,
            end: v.first_edge + u64::from(v.out_degree),
            buf: Vec::new(),
            at: 0,
        }
    }

    /// Dijkstra's shortest path from internal id `from` to `to`, exploring the graph online.
    pub fn path(&mut self, from: u32, to: u32) -> Result<PathFound> {
        let start = Instant::now();
        let (a, b) = (self.vertex(from)?, self.vertex(to)?);
        // Tentative distance and hop count of each vertex reached; the heap orders by distance.
        let mut best: HashMap<u32, (f64, u64), IdHash> = HashMap::default();
        let mut done: HashSet<u32, IdHash> = HashSet::default();
        let mut heap = BinaryHeap::new();
        best.insert(from, (0.0, 0));
        heap.push(Queued { distance: 0.0, vertex: from, hops: 0 });
        let (mut settled, mut scanned) = (0u64, 0u64);
        let mut found = None;
        while let Some(Queued { distance, vertex, hops }) = heap.pop() {
            if !done.insert(vertex) {
                continue;
            }
            settled += 1;
            if vertex == to {
                found = Some((distance, hops));
                break;
            }
            let v = if vertex == from { a } else { self.vertex(vertex)? };
            for edge in self.edges(&v) {
                let (dst, w) = edge?;
                scanned += 1;
                let d = distance + f64::from(w);
                let better = best.get(&dst).is_none_or(|&(old, _)| d < old);
                if better && !done.contains(&dst) {
                    best.insert(dst, (d, hops + 1));
                    heap.push(Queued { distance: d, vertex: dst, hops: hops + 1 });
                }
            }
        }
        Ok(PathFound {
            from: a.external,
            to: b.external,
            distance: found.map(|f| f.0),
            hops: found.map(|f| f.1),
            settled,
            scanned,
            seconds: start.elapsed().as_secs_f64(),
        })
    }
}

/// Hashing for internal ids and block numbers, which are dense and chosen by no adversary: one multiplication
/// (Fibonacci hashing), where the standard library's SipHash would cost Dijkstra a third of its
/// time on a warm cache.
type IdHash = std::hash::BuildHasherDefault<IdHasher>;

#[derive(Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, id: u32) {
        self.0 = u64::from(id).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A vertex waiting in Dijkstra's heap: the nearest first.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Queued {
    distance: f64,
    vertex: u32,
    hops: u64,
}

impl Eq for Queued {}

impl Ord for Queued {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.distance.total_cmp(&self.distance).then_with(|| other.vertex.cmp(&self.vertex))
    }
}

impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// A vertex's out-edges, read from the edge namespace a piece at a time.
pub struct EdgeIter<'g> {
    graph: &'g mut Graph,
    next: u64,
    end: u64,
    buf: Vec<u8>,
    at: usize,
}

impl Iterator for EdgeIter<'_> {
    type Item = Result<(u32, f32)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.at == self.buf.len() {
            if self.next == self.end {
                return None;
            }
            let n = (self.end - self.next).min(EDGES_PER_READ as u64) as usize;
            self.buf.resize(n * EDGE_BYTES, 0);
            let g = &mut *self.graph;
            if let Err(e) = g.edges.read(self.next * EDGE_BYTES as u64, &mut self.buf, &mut g.explored) {
                self.next = self.end;
                self.buf.clear();
                self.at = 0;
                return Some(Err(e));
            }
            self.next += n as u64;
            self.at = 0;
        }
        let r = &self.buf[self.at..self.at + EDGE_BYTES];
        self.at += EDGE_BYTES;
        Some(Ok((
            u32::from_le_bytes(r[0..4].try_into().expect("4")),
            f32::from_le_bytes(r[4..8].try_into().expect("4")),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heap_pops_the_nearest_first() {
        let mut h = BinaryHeap::new();
        for (d, v) in [(3.0, 1), (1.0, 2), (2.0, 3), (1.0, 0)] {
            h.push(Queued { distance: d, vertex: v, hops: 0 });
        }
        let order: Vec<u32> = std::iter::from_fn(|| h.pop().map(|q| q.vertex)).collect();
        assert_eq!(order, vec![0, 2, 3, 1]);
    }
}
