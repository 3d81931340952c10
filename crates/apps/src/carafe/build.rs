//! Graphs into Carafe's layout: an edge list read from SNAP's text format or generated as an
//! R-MAT graph (Graph500's), turned into vertices sorted by external id and adjacency lists
//! (compressed sparse rows), with every bad line named by its number.

use std::io::BufRead;

/// A directed edge between external ids, with its weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Edge {
    pub src: u64,
    pub dst: u64,
    pub weight: f32,
}

/// Why an edge list was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadInput {
    /// Line `line` is not `src dst [weight]`.
    Malformed { line: u64, text: String, why: &'static str },
    /// A vertex id on line `line` is not an integer in 0..2^64.
    IdOutOfRange { line: u64, text: String },
    /// A weight on line `line` is not a finite number ≥ 0.
    BadWeight { line: u64, text: String },
    /// No edge at all.
    Empty,
    /// More distinct vertices than internal ids (`u32`) can name.
    TooManyVertices(u64),
    /// Reading the file failed.
    Io(String),
}

impl std::fmt::Display for BadInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadInput::Malformed { line, text, why } => write!(f, "line {line}: {why}: {text:?}"),
            BadInput::IdOutOfRange { line, text } => {
                write!(f, "line {line}: vertex id out of range (an integer from 0 to 2^64 - 1): {text:?}")
            }
            BadInput::BadWeight { line, text } => {
                write!(f, "line {line}: weight must be a finite number >= 0: {text:?}")
            }
            BadInput::Empty => f.write_str("the graph has no edge"),
            BadInput::TooManyVertices(n) => write!(f, "{n} vertices: Carafe names at most 2^32 - 1"),
            BadInput::Io(e) => write!(f, "reading the edge list: {e}"),
        }
    }
}

impl std::error::Error for BadInput {}

/// Parse one line of an edge list: `None` for a comment or a blank line.
pub fn parse_line(n: u64, line: &str) -> Result<Option<Edge>, BadInput> {
    let t = line.trim();
    if t.is_empty() || t.starts_with('#') || t.starts_with('%') {
        return Ok(None);
    }
    let mut fields = t.split_ascii_whitespace();
    let malformed = |why| BadInput::Malformed { line: n, text: t.to_owned(), why };
    let (Some(a), Some(b)) = (fields.next(), fields.next()) else {
        return Err(malformed("expected `src dst [weight]`"));
    };
    let weight = fields.next();
    if fields.next().is_some() {
        return Err(malformed("more than three fields"));
    }
    let id = |s: &str| -> Result<u64, BadInput> {
        let digits = s.strip_prefix(['-', '+']).unwrap_or(s);
        match s.parse::<u64>() {
            Ok(v) => Ok(v),
            // Digits that do not fit (or a sign that makes them negative) are out of range;
            // anything else is no number at all.
            Err(_) if !digits.is_empty() && digits.bytes().all(|c| c.is_ascii_digit()) => {
                Err(BadInput::IdOutOfRange { line: n, text: s.to_owned() })
            }
            Err(_) => Err(malformed("a vertex id is not a number")),
        }
    };
    let (src, dst) = (id(a)?, id(b)?);
    let weight = match weight {
        None => 1.0,
        Some(w) => match w.parse::<f32>() {
            Ok(v) if v.is_finite() && v >= 0.0 => v,
            _ => return Err(BadInput::BadWeight { line: n, text: w.to_owned() }),
        },
    };
    Ok(Some(Edge { src, dst, weight }))
}

/// Every edge of an edge list in SNAP's text format: `src dst [weight]` per line, `#` (and
/// `%`, Matrix Market's) comments, blank lines.
pub fn read_edges(input: impl BufRead) -> Result<Vec<Edge>, BadInput> {
    let mut edges = Vec::new();
    for (i, line) in input.lines().enumerate() {
        let line = line.map_err(|e| BadInput::Io(e.to_string()))?;
        if let Some(e) = parse_line(i as u64 + 1, &line)? {
            edges.push(e);
        }
    }
    if edges.is_empty() {
        return Err(BadInput::Empty);
    }
    Ok(edges)
}

/// SplitMix64: the seeded generator of R-MAT graphs and of Carafe's random choices.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

/// An R-MAT graph as Graph500 makes one: `2^scale` vertex ids, `edge_factor * 2^scale` directed
/// edges, each placed by descending `scale` levels of the adjacency matrix with the quadrant
/// probabilities A = 0.57, B = 0.19, C = 0.19, D = 0.05, then the ids scrambled by a seeded
/// bijection. Self loops and repeated edges stay, as Graph500's generator leaves them.
/// Weights are 1, or uniform integers in `1..=max_weight`.
pub fn rmat(scale: u32, edge_factor: u64, seed: u64, max_weight: u32) -> Vec<Edge> {
    const A: f64 = 0.57;
    const B: f64 = 0.19;
    const C: f64 = 0.19;
    let mut rng = Rng::new(seed);
    // A seeded scramble of the ids, so that degree does not follow the id: a bijection of
    // `scale`-bit numbers built from odd multiplications, a right xorshift and an xor (each a
    // bijection), computed rather than looked up in a table of 2^scale ids.
    let mask = (1u64 << scale) - 1;
    let (k1, k2, k3) = (rng.next_u64() | 1, rng.next_u64() | 1, rng.next_u64());
    let shift = scale.div_ceil(2);
    let scramble = |x: u64| {
        let mut y = x.wrapping_mul(k1) & mask;
        y ^= y >> shift;
        y = y.wrapping_mul(k2) & mask;
        y ^ (k3 & mask)
    };
    // The quadrant thresholds on 32-bit draws, two draws per 64 random bits; the quadrant's
    // bits are computed without a branch (which one is taken is random).
    let scaled = |p: f64| (p * f64::from(u32::MAX)) as u32;
    let (ab, abc, a) = (scaled(A + B), scaled(A + B + C), scaled(A));
    let mut edges = Vec::with_capacity((edge_factor << scale) as usize);
    for _ in 0..edge_factor << scale {
        let (mut src, mut dst) = (0u64, 0u64);
        let mut bits = 0u64;
        for level in 0..scale {
            if level % 2 == 0 {
                bits = rng.next_u64();
            }
            let r = (bits >> (32 * (level % 2))) as u32;
            let (in_lower, in_d) = (r >= ab, r >= abc);
            let in_b = r >= a && !in_lower;
            src |= u64::from(in_lower) << level;
            dst |= u64::from(in_b || in_d) << level;
        }
        let weight = if max_weight > 1 { 1 + rng.below(u64::from(max_weight)) as u32 } else { 1 } as f32;
        edges.push(Edge { src: scramble(src), dst: scramble(dst), weight });
    }
    edges
}

/// An R-MAT graph to generate: [`rmat`]'s parameters, and what to make of its edges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenSpec {
    pub scale: u32,
    pub edge_factor: u64,
    pub seed: u64,
    pub max_weight: u32,
    /// Drop self loops and repeated edges (the first of each kept), as Graph500's kernel 1 may
    /// and as libraries that hold simple graphs (networkit) do anyway.
    pub simple: bool,
    /// Number the vertices 0 to V - 1 in the order of their ids, so that tools that take ids
    /// as array indices (networkit's and igraph's readers) read the file as it is.
    pub compact: bool,
}

impl GenSpec {
    pub fn edges(&self) -> Vec<Edge> {
        let mut edges = rmat(self.scale, self.edge_factor, self.seed, self.max_weight);
        if self.simple {
            edges = simplify(edges);
        }
        if self.compact {
            let (_, id) = Ids::of(&edges);
            for e in &mut edges {
                e.src = u64::from(id.get(e.src));
                e.dst = u64::from(id.get(e.dst));
            }
        }
        edges
    }
}

/// `edges` without self loops and with each (src, dst) once (its first weight), in the order of
/// their first appearance.
pub fn simplify(edges: Vec<Edge>) -> Vec<Edge> {
    let mut order: Vec<(u64, u64, usize)> =
        edges.iter().enumerate().filter(|(_, e)| e.src != e.dst).map(|(i, e)| (e.src, e.dst, i)).collect();
    order.sort_unstable();
    order.dedup_by_key(|&mut (s, d, _)| (s, d));
    let mut keep: Vec<usize> = order.into_iter().map(|(_, _, i)| i).collect();
    keep.sort_unstable();
    keep.into_iter().map(|i| edges[i]).collect()
}

/// An edge list as Carafe stores it: vertices sorted by external id (a vertex's internal id is
/// its place in that order), and every vertex's out-edges together (compressed sparse rows).
#[derive(Debug, Clone, PartialEq)]
pub struct Csr {
    /// External id of each vertex, ascending.
    pub external: Vec<u64>,
    /// Where each vertex's out-edges start in `targets`; one more entry than vertices.
    pub first: Vec<u64>,
    /// Each edge's target (internal id) and weight.
    pub targets: Vec<(u32, f32)>,
}

impl Csr {
    /// The vertices an edge list names, and its edges as adjacency lists, each list in the
    /// order of the input (`undirected`: each edge stored both ways, as the thesis stores
    /// bidirectional edges).
    pub fn build(edges: &[Edge], undirected: bool) -> Result<Csr, BadInput> {
        if edges.is_empty() {
            return Err(BadInput::Empty);
        }
        let (external, id) = Ids::of(edges);
        if external.len() as u64 > u64::from(u32::MAX) {
            return Err(BadInput::TooManyVertices(external.len() as u64));
        }
        let mut arcs: Vec<(u32, u32, f32)> = Vec::with_capacity(edges.len() * if undirected { 2 } else { 1 });
        for e in edges {
            let (s, d) = (id.get(e.src), id.get(e.dst));
            arcs.push((s, d, e.weight));
            if undirected && s != d {
                arcs.push((d, s, e.weight));
            }
        }
        // Counting sort by source: stable, so each list keeps the input's order.
        let v = external.len();
        let mut first = vec![0u64; v + 1];
        for &(s, _, _) in &arcs {
            first[s as usize + 1] += 1;
        }
        for i in 0..v {
            first[i + 1] += first[i];
        }
        let mut next = first.clone();
        let mut targets = vec![(0u32, 0f32); arcs.len()];
        for &(s, d, w) in &arcs {
            targets[next[s as usize] as usize] = (d, w);
            next[s as usize] += 1;
        }
        Ok(Csr { external, first, targets })
    }

    pub fn vertices(&self) -> usize {
        self.external.len()
    }

    pub fn edges(&self) -> usize {
        self.targets.len()
    }

    pub fn weighted(&self) -> bool {
        self.targets.iter().any(|&(_, w)| w != 1.0)
    }
}

/// External ids to internal ones: a table indexed by external id when the ids are dense enough
/// (SNAP's and R-MAT's are: at most 8 ids of room per vertex), else a hash map.
enum Ids {
    Dense(Vec<u32>),
    Sparse(std::collections::HashMap<u64, u32>),
}

impl Ids {
    /// The distinct external ids of `edges`, ascending, and their internal ids.
    fn of(edges: &[Edge]) -> (Vec<u64>, Ids) {
        let max = edges.iter().map(|e| e.src.max(e.dst)).max().unwrap_or(0);
        if max < 8 * edges.len() as u64 + 1024 {
            // Mark each id present, then number them in order: no sort.
            let mut present = vec![false; max as usize + 1];
            for e in edges {
                present[e.src as usize] = true;
                present[e.dst as usize] = true;
            }
            let mut table = vec![u32::MAX; max as usize + 1];
            let mut external = Vec::new();
            for (x, _) in present.iter().enumerate().filter(|(_, &p)| p) {
                table[x] = external.len() as u32;
                external.push(x as u64);
            }
            (external, Ids::Dense(table))
        } else {
            let mut external: Vec<u64> = edges.iter().flat_map(|e| [e.src, e.dst]).collect();
            external.sort_unstable();
            external.dedup();
            let map = external.iter().enumerate().map(|(i, &x)| (x, i as u32)).collect();
            (external, Ids::Sparse(map))
        }
    }

    fn get(&self, x: u64) -> u32 {
        match self {
            Ids::Dense(t) => t[x as usize],
            Ids::Sparse(m) => m[&x],
        }
    }
}

/// The edge-list parser and the graph built from what it accepts, under any input: the
/// `edge_list` fuzz target's and `tests/fuzz_smoke.rs`'s entry point.
pub mod fuzz_api {
    use super::*;

    /// Parse `data` as an edge list, line by line, and check: no panic; an error names the line
    /// it is on (counted from 1) and only lines that are neither blank nor comments fail; an
    /// edge printed back parses to the same edge; and the graph built from the edges parsed is
    /// well formed (ids ascending and distinct, rows increasing to the edge count, every target
    /// a vertex, the same edges).
    pub fn edge_list(data: &[u8]) {
        let text = String::from_utf8_lossy(data);
        let mut edges = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let n = i as u64 + 1;
            match parse_line(n, line) {
                Ok(None) => {
                    let t = line.trim();
                    assert!(t.is_empty() || t.starts_with('#') || t.starts_with('%'), "{line:?} skipped");
                }
                Ok(Some(e)) => {
                    let again =
                        parse_line(n, &format!("{}\t{}\t{}", e.src, e.dst, e.weight)).unwrap().unwrap();
                    assert_eq!(again, e);
                    assert!(e.weight.is_finite() && e.weight >= 0.0);
                    edges.push(e);
                }
                Err(err) => assert!(err.to_string().starts_with(&format!("line {n}: ")), "{err}"),
            }
        }
        if edges.len() > 4096 {
            edges.truncate(4096);
        }
        for undirected in [false, true] {
            let Ok(g) = Csr::build(&edges, undirected) else {
                assert!(edges.is_empty());
                continue;
            };
            assert!(g.external.windows(2).all(|w| w[0] < w[1]));
            assert_eq!(g.first.len(), g.vertices() + 1);
            assert!(g.first.windows(2).all(|w| w[0] <= w[1]));
            assert_eq!(*g.first.last().unwrap() as usize, g.edges());
            assert!(g.targets.iter().all(|&(d, _)| (d as usize) < g.vertices()));
            let loops = edges.iter().filter(|e| e.src == e.dst).count();
            let want = if undirected { 2 * edges.len() - loops } else { edges.len() };
            assert_eq!(g.edges(), want);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snap_lines_parse_and_bad_ones_are_named_by_line() {
        assert_eq!(parse_line(1, "# FromNodeId ToNodeId").unwrap(), None);
        assert_eq!(parse_line(2, "   ").unwrap(), None);
        assert_eq!(parse_line(3, "0\t1").unwrap(), Some(Edge { src: 0, dst: 1, weight: 1.0 }));
        assert_eq!(parse_line(4, " 7 3 2.5 ").unwrap(), Some(Edge { src: 7, dst: 3, weight: 2.5 }));
        assert_eq!(parse_line(5, "18446744073709551615 0").unwrap().unwrap().src, u64::MAX);
        for (line, want) in [
            ("1", "expected `src dst [weight]`"),
            ("1 2 3 4", "more than three fields"),
            ("a b", "not a number"),
            ("1 0x2", "not a number"),
        ] {
            let e = parse_line(9, line).unwrap_err().to_string();
            assert!(e.starts_with("line 9: ") && e.contains(want), "{line}: {e}");
        }
        for line in ["18446744073709551616 1", "-1 2", "1 -20"] {
            assert!(matches!(parse_line(9, line), Err(BadInput::IdOutOfRange { line: 9, .. })), "{line}");
        }
        for line in ["1 2 -1", "1 2 inf", "1 2 NaN", "1 2 x"] {
            assert!(matches!(parse_line(9, line), Err(BadInput::BadWeight { line: 9, .. })), "{line}");
        }
        let err = read_edges("# only comments\n\n".as_bytes()).unwrap_err();
        assert_eq!(err, BadInput::Empty);
        let err = read_edges("0 1\n1 2\n2 x\n".as_bytes()).unwrap_err().to_string();
        assert!(err.starts_with("line 3:"), "{err}");
    }

    #[test]
    fn csr_orders_vertices_by_external_id_and_keeps_each_list_in_input_order() {
        let e = |src, dst| Edge { src, dst, weight: 1.0 };
        let edges = [e(30, 10), e(10, 20), e(30, 20), e(10, 20), e(20, 20)];
        let g = Csr::build(&edges, false).unwrap();
        assert_eq!(g.external, vec![10, 20, 30]);
        assert_eq!(g.first, vec![0, 2, 3, 5]);
        assert_eq!(g.targets.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 1, 1, 0, 1]);
        let u = Csr::build(&[e(1, 2), e(3, 3)], true).unwrap();
        // Both ways, and a self loop once.
        assert_eq!(u.first, vec![0, 1, 2, 3]);
        assert_eq!(u.targets.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 0, 2]);
        assert_eq!(Csr::build(&[], false).unwrap_err(), BadInput::Empty);
        // Ids far apart take the hash map; the result is the same shape.
        let sparse = Csr::build(&[e(1 << 60, 5), e(5, u64::MAX)], false).unwrap();
        assert_eq!(sparse.external, vec![5, 1 << 60, u64::MAX]);
        assert_eq!(sparse.first, vec![0, 1, 2, 2]);
        assert_eq!(sparse.targets.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 0]);
    }

    #[test]
    fn rmat_is_seeded_skewed_and_within_its_ids() {
        let a = rmat(10, 16, 7, 1);
        assert_eq!(a.len(), 16 << 10);
        assert_eq!(a, rmat(10, 16, 7, 1), "seeded");
        assert_ne!(a, rmat(10, 16, 8, 1));
        assert!(a.iter().all(|e| e.src < 1024 && e.dst < 1024 && e.weight == 1.0));
        let g = Csr::build(&a, false).unwrap();
        let max = (0..g.vertices()).map(|v| g.first[v + 1] - g.first[v]).max().unwrap();
        // A power law: the busiest vertex has far more than the mean of 16 out-edges.
        assert!(max > 16 * 8, "max out-degree {max}");
        // The scramble is a bijection: every one of the 2^10 ids can occur, none twice over.
        let hit: std::collections::HashSet<u64> =
            rmat(10, 64, 7, 1).iter().flat_map(|e| [e.src, e.dst]).collect();
        assert!(hit.len() > 900 && hit.iter().all(|&x| x < 1024), "{}", hit.len());
        let spec =
            GenSpec { scale: 10, edge_factor: 16, seed: 7, max_weight: 1, simple: true, compact: true };
        let simple = spec.edges();
        let mut pairs: Vec<(u64, u64)> = simple.iter().map(|e| (e.src, e.dst)).collect();
        assert!(simple.iter().all(|e| e.src != e.dst) && simple.len() < a.len());
        pairs.sort_unstable();
        pairs.dedup();
        assert_eq!(pairs.len(), simple.len(), "no edge twice");
        let g = Csr::build(&simple, false).unwrap();
        assert_eq!(g.external, (0..g.vertices() as u64).collect::<Vec<_>>(), "compact ids");
        let w = rmat(8, 4, 1, 100);
        assert!(w.iter().all(|e| (1.0..=100.0).contains(&e.weight) && e.weight.fract() == 0.0));
        assert!(w.iter().any(|e| e.weight > 50.0));
    }
}
