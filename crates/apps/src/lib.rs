//! Applications on RStore (docs/RSTORE.md), each a library the `skiff` binary calls into:
//!
//! - [`rsort`]: RSort, the two-phase distributed bucket sort of TeraSort records over
//!   namespaces, with worker processes moved through its phases on a coordination board.
//! - [`carafe`]: Carafe, graph processing on namespaces: graphs imported or generated into
//!   vertex and edge namespaces, explored online (Dijkstra), and run through a Pregel engine
//!   whose partition workers pass messages through a shared mailbox (PageRank, SSSP).
//! - [`store`]: namespaces made afresh, mapped, and moved through in whole regions.
//! - [`workers`]: worker processes and their turns on a board (`rstore::coordination`),
//!   shared by both.
//!
//! They use RStore through its API alone (`rstore`'s coordinator and segments) and own no
//! argument parsing or output: the CLI parses, calls in, and prints what they report.

pub mod carafe;
pub mod rsort;
pub mod store;
pub mod workers;

/// Why a step failed: the coordinator's, a segment's, a worker's or a local file's error.
pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// What a step measured: its figures in order (counts and seconds), and any further JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub what: &'static str,
    pub fields: Vec<(&'static str, f64)>,
    /// Further JSON: a run's supersteps, `path`'s pairs.
    pub detail: Vec<(&'static str, serde_json::Value)>,
}

impl Report {
    pub fn json(&self) -> serde_json::Value {
        let mut map: serde_json::Map<String, serde_json::Value> =
            self.fields.iter().map(|(k, v)| ((*k).to_owned(), serde_json::json!(v))).collect();
        for (k, v) in &self.detail {
            map.insert((*k).to_owned(), v.clone());
        }
        serde_json::Value::Object(map)
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.fields.iter().map(|(k, v)| format!("{k} {v}")).collect();
        write!(f, "{}: {}", self.what, parts.join(", "))
    }
}
