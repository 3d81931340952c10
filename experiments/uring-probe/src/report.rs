//! Median and spread of repeated runs, as a Markdown table or JSON.

use serde_json::{json, Value};

use crate::client::Workload;
use crate::run::Sample;
use crate::server::Mode;

/// One column: a name, a unit and how to read it from a sample.
struct Metric {
    key: &'static str,
    title: &'static str,
    digits: usize,
    of: fn(&Sample) -> f64,
}

const METRICS: [Metric; 7] = [
    Metric { key: "kcaravans_per_s", title: "kcaravans/s", digits: 1, of: |s| s.caravans_per_s() / 1e3 },
    Metric { key: "kpayloads_per_s", title: "k4KiB/s", digits: 1, of: |s| s.payloads_per_s() / 1e3 },
    Metric {
        key: "server_cpu_us_per_payload",
        title: "server CPU µs/payload",
        digits: 3,
        of: Sample::server_cpu_us_per_payload,
    },
    Metric {
        key: "client_cpu_us_per_payload",
        title: "client CPU µs/payload",
        digits: 3,
        of: Sample::client_cpu_us_per_payload,
    },
    Metric {
        key: "server_syscalls_per_caravan",
        title: "server syscalls/caravan",
        digits: 2,
        of: Sample::server_syscalls_per_caravan,
    },
    Metric {
        key: "server_ctx_per_caravan",
        title: "server ctx sw/caravan",
        digits: 2,
        of: Sample::server_ctx_per_caravan,
    },
    Metric {
        key: "client_ctx_per_caravan",
        title: "client ctx sw/caravan",
        digits: 2,
        of: Sample::client_ctx_per_caravan,
    },
];

/// What happened to one mode over all repeats.
pub enum Outcome {
    Measured(Vec<Sample>),
    Unavailable(String),
}

pub struct ModeReport {
    pub mode: Mode,
    pub outcome: Outcome,
}

/// Median, minimum and maximum of `values` (not empty).
fn spread(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let median = if n % 2 == 1 { values[n / 2] } else { (values[n / 2 - 1] + values[n / 2]) / 2.0 };
    (median, values[0], values[n - 1])
}

pub fn markdown(w: &Workload, seconds: f64, repeat: usize, reports: &[ModeReport]) -> String {
    let mut out = format!(
        "caravan {} x {} B, {} caravans in flight, {seconds} s per run, {repeat} runs per mode \
         (interleaved). Cells: median (min-max). Only the server changes between modes; the \
         client uses plain syscalls (send, ppoll, recv) throughout.\n\n",
        w.caravan, w.bs, w.outstanding
    );
    out.push_str("| mode |");
    for m in &METRICS {
        out.push_str(&format!(" {} |", m.title));
    }
    out.push_str("\n|---|");
    out.push_str(&"---|".repeat(METRICS.len()));
    out.push('\n');
    for report in reports {
        out.push_str(&format!("| {} |", report.mode.name()));
        match &report.outcome {
            Outcome::Measured(samples) => {
                for m in &METRICS {
                    let (med, lo, hi) = spread(samples.iter().map(m.of).collect());
                    let d = m.digits;
                    out.push_str(&format!(" {med:.d$} ({lo:.d$}-{hi:.d$}) |"));
                }
            }
            Outcome::Unavailable(why) => {
                out.push_str(&format!(" not available: {why} |"));
                out.push_str(&" |".repeat(METRICS.len() - 1));
            }
        }
        out.push('\n');
    }
    out
}

pub fn json(w: &Workload, seconds: f64, repeat: usize, reports: &[ModeReport]) -> Value {
    let modes: Vec<Value> = reports
        .iter()
        .map(|report| match &report.outcome {
            Outcome::Measured(samples) => {
                let mut median = serde_json::Map::new();
                let mut min = serde_json::Map::new();
                let mut max = serde_json::Map::new();
                for m in &METRICS {
                    let (med, lo, hi) = spread(samples.iter().map(m.of).collect());
                    median.insert(m.key.into(), json!(med));
                    min.insert(m.key.into(), json!(lo));
                    max.insert(m.key.into(), json!(hi));
                }
                let runs: Vec<Value> = samples
                    .iter()
                    .map(|s| {
                        let fields = METRICS.iter().map(|m| (m.key.to_string(), json!((m.of)(s))));
                        Value::Object(fields.collect())
                    })
                    .collect();
                json!({ "mode": report.mode.name(), "status": "ok", "median": median,
                        "min": min, "max": max, "runs": runs })
            }
            Outcome::Unavailable(why) => {
                json!({ "mode": report.mode.name(), "status": "unavailable", "reason": why })
            }
        })
        .collect();
    json!({
        "workload": { "caravan": w.caravan, "outstanding": w.outstanding, "bs": w.bs,
                      "seconds": seconds, "repeat": repeat },
        "client": "plain syscalls (send, ppoll, recv) in every mode",
        "modes": modes,
    })
}
