//! `skiff serve --config FILE`: the settings of `skiff serve` in a TOML file.
//!
//! Every flag of `skiff serve` is a key, spelled as the flag without its dashes (`io-max`,
//! `nbd-unix`); repeatable flags (`export`, `nbd`) are arrays. The file also holds the
//! target's deeper bounds, which have no flags ([`Tuning`]). A flag given on the command line
//! wins over the file, and the file over the built-in defaults; a repeated flag given on the
//! command line replaces the file's whole array. `contrib/skiff.toml` is the annotated example.
//!
//! Every value is parsed and checked while the file is read, so an error names the file, the
//! line and column, and the key; unknown keys are errors, not ignored, so a misspelt bound is
//! never silently the default. This module only reads and merges; turning the result into a
//! `server::TargetConfig` stays in `serve.rs`.

use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::parser::ValueSource;
use clap::ArgMatches;
use initiator::Endpoint;
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use server::{Bounds, ExportConfig};

use super::ServeArgs;
use crate::units;

/// Why a configuration file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config {}:{line}:{column}: {}{message}", path.display(), key.as_ref().map(|k| format!("{k}: ")).unwrap_or_default())]
    Entry { path: PathBuf, line: usize, column: usize, key: Option<String>, message: String },
    #[error("config {}: {message}", path.display())]
    File { path: PathBuf, message: String },
    #[error("{0}")]
    Bounds(String),
}

/// The file as written: every key optional, every value already checked.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(super) struct ServeFile {
    #[serde(default, deserialize_with = "endpoint")]
    listen: Option<String>,
    unix: Option<PathBuf>,
    no_tcp: Option<bool>,
    #[serde(default, deserialize_with = "endpoints")]
    nbd: Option<Vec<String>>,
    nbd_unix: Option<PathBuf>,
    eth: Option<Vec<String>>,
    #[serde(default, deserialize_with = "eth_options")]
    eth_options: Option<transport::EthOptions>,
    #[serde(default, rename = "export", deserialize_with = "exports")]
    exports: Option<Vec<ExportConfig>>,
    read_only: Option<bool>,
    #[serde(rename = "key-file")]
    key_files: Option<Vec<PathBuf>>,
    #[serde(default, deserialize_with = "tls_mode")]
    tls: Option<transport::tls::TlsMode>,
    tls_certificates: Option<PathBuf>,
    tls_verify_peer: Option<bool>,
    workers: Option<usize>,
    #[serde(default, deserialize_with = "count")]
    queue_depth: Option<u32>,
    #[serde(default, deserialize_with = "poll")]
    poll: Option<rt::poll::PollMode>,
    #[serde(default, deserialize_with = "size")]
    io_max: Option<u64>,
    metrics: Option<String>,
    #[serde(default, deserialize_with = "count")]
    connections_max: Option<usize>,
    #[serde(default, deserialize_with = "count")]
    handshakes_max: Option<usize>,
    #[serde(default, deserialize_with = "count")]
    connections_per_address_max: Option<usize>,
    #[serde(default, deserialize_with = "duration")]
    handshake_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "timeout")]
    idle_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "timeout")]
    nbd_idle_timeout: Option<Duration>,
    pool: Option<String>,
    coordinator: Option<String>,
    #[serde(default, deserialize_with = "size")]
    chunk: Option<u64>,
    advertise: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    lease: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    rebuild_after: Option<Duration>,
    #[serde(default, deserialize_with = "size")]
    rebuild_rate: Option<u64>,
    repair_verify: Option<bool>,
    #[serde(default, deserialize_with = "paths")]
    flash: Option<Vec<PathBuf>>,
    #[serde(default, deserialize_with = "size")]
    flash_cache: Option<u64>,
    #[serde(default, deserialize_with = "size")]
    flash_map_budget: Option<u64>,
    /// 0 is a setting here (reads on the worker's thread), so not a `count`.
    flash_read_depth: Option<u32>,
    flash_references: Option<PathBuf>,
    // The bounds only the file sets ([`Tuning`]). Not a flattened struct: serde cannot refuse
    // unknown keys through one.
    #[serde(default, deserialize_with = "count")]
    caravan_requests_max: Option<u32>,
    #[serde(default, deserialize_with = "size")]
    caravan_bytes_max: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    open_handles_max: Option<usize>,
    #[serde(default, deserialize_with = "size")]
    tx_backlog_max: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    reads_per_pass: Option<usize>,
    #[serde(default, deserialize_with = "count")]
    events_per_poll: Option<usize>,
    #[serde(default, deserialize_with = "count")]
    nbd_extents_per_reply_max: Option<usize>,
    #[serde(default, deserialize_with = "count")]
    volume_exports_max: Option<usize>,
}

/// Bounds that only the file sets: their defaults suit every deployment we know of, and they
/// are here so that none is out of an administrator's reach. Documented in `server::Bounds`.
#[derive(Debug, Default)]
pub struct Tuning {
    caravan_requests_max: Option<u32>,
    caravan_bytes_max: Option<u64>,
    open_handles_max: Option<usize>,
    tx_backlog_max: Option<u64>,
    reads_per_pass: Option<usize>,
    events_per_poll: Option<usize>,
    nbd_extents_per_reply_max: Option<usize>,
    volume_exports_max: Option<usize>,
}

impl Tuning {
    fn of(f: &ServeFile) -> Tuning {
        Tuning {
            caravan_requests_max: f.caravan_requests_max,
            caravan_bytes_max: f.caravan_bytes_max,
            open_handles_max: f.open_handles_max,
            tx_backlog_max: f.tx_backlog_max,
            reads_per_pass: f.reads_per_pass,
            events_per_poll: f.events_per_poll,
            nbd_extents_per_reply_max: f.nbd_extents_per_reply_max,
            volume_exports_max: f.volume_exports_max,
        }
    }

    /// `bounds` with the file's values in place of theirs.
    pub fn apply(&self, mut bounds: Bounds) -> Result<Bounds, ConfigError> {
        let l = &mut bounds.limits;
        if let Some(n) = self.caravan_requests_max {
            l.caravan_reqs_max = n.min(u32::from(u16::MAX));
        }
        if let Some(n) = self.caravan_bytes_max {
            l.caravan_bytes_max =
                u32::try_from(n).ok().filter(|&n| n >= l.io_bytes_max).ok_or_else(|| {
                    ConfigError::Bounds("caravan-bytes-max must be at least io-max and below 4 GiB".into())
                })?;
        }
        let b = &mut bounds;
        b.open_handles_max = self.open_handles_max.unwrap_or(b.open_handles_max);
        if let Some(n) = self.tx_backlog_max {
            b.tx_backlog_bytes_max =
                usize::try_from(n).map_err(|_| ConfigError::Bounds("tx-backlog-max is too large".into()))?;
        }
        b.reads_per_pass = self.reads_per_pass.unwrap_or(b.reads_per_pass);
        b.events_per_poll = self.events_per_poll.unwrap_or(b.events_per_poll);
        b.nbd_extents_per_reply_max = self.nbd_extents_per_reply_max.unwrap_or(b.nbd_extents_per_reply_max);
        b.volume_exports_max = self.volume_exports_max.unwrap_or(b.volume_exports_max);
        Ok(bounds)
    }
}

/// Read `args.config`, if given, and fill every setting the command line did not give from
/// it. Returns the file-only bounds (none without a file).
pub(super) fn apply(args: &mut ServeArgs, matches: &ArgMatches) -> Result<Tuning, ConfigError> {
    let Some(path) = args.config.clone() else { return Ok(Tuning::default()) };
    let file = read(&path)?;
    let tuning = Tuning::of(&file);
    let given = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    // Each field takes the file's value unless its flag was given; the flags that are options
    // themselves take it wrapped.
    macro_rules! set {
        ($($field:ident),* ; options: $($opt:ident),*) => {
            $(if let (false, Some(v)) = (given(stringify!($field)), file.$field) {
                args.$field = v;
            })*
            $(if let (false, Some(v)) = (given(stringify!($opt)), file.$opt) {
                args.$opt = Some(v);
            })*
        };
    }
    set!(
        listen, no_tcp, nbd, eth, exports, read_only, key_files, tls, tls_verify_peer, workers, queue_depth, poll,
        io_max, connections_max, handshakes_max, connections_per_address_max, chunk, lease, rebuild_after, rebuild_rate, repair_verify, flash, flash_cache,
        flash_map_budget, flash_read_depth;
        options: unix, nbd_unix, eth_options, metrics, handshake_timeout, idle_timeout, nbd_idle_timeout, tls_certificates,
            pool, coordinator, advertise, flash_references
    );
    Ok(tuning)
}

/// Read and check a configuration file.
pub(super) fn read(path: &Path) -> Result<ServeFile, ConfigError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
    parse(&text).map_err(|e| located(path, &text, &e))
}

fn parse(text: &str) -> Result<ServeFile, toml::de::Error> {
    toml::from_str(text)
}

/// A TOML error as the file's line, column and key.
fn located(path: &Path, text: &str, e: &toml::de::Error) -> ConfigError {
    let message = e.message().trim_end().to_owned();
    let Some(span) = e.span() else { return ConfigError::File { path: path.into(), message } };
    let at = span.start.min(text.len());
    let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let line = text[..at].matches('\n').count() + 1;
    let column = text[line_start..at].chars().count() + 1;
    ConfigError::Entry { path: path.into(), line, column, key: key_at(text, at), message }
}

/// The key whose entry holds byte `at`: the nearest line at or above it that starts with a
/// bare key and `=` (an array's later lines belong to the key that opened it), or a table
/// header (none is allowed, but a key written as one gets its name in the error).
fn key_at(text: &str, at: usize) -> Option<String> {
    let line_end = text[at..].find('\n').map_or(text.len(), |i| at + i);
    text[..line_end].lines().rev().find_map(|line| {
        let line = line.trim_start();
        let header = line.strip_prefix('[').and_then(|l| l.trim_start_matches('[').split_once(']'));
        let (key, _) = header.or_else(|| line.split_once('='))?;
        let key = key.trim();
        let bare = !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        bare.then(|| key.to_owned())
    })
}

// Deserializers for `#[serde(deserialize_with)]`: each parses the value as the flag would and
// turns a refusal into an error at the value's position.

/// A string, parsed by `parse`; `expecting` says what was wanted when it is not a string.
fn text_with<'de, D: Deserializer<'de>, T, E: Display>(
    d: D,
    expecting: &'static str,
    parse: impl Fn(&str) -> Result<T, E>,
) -> Result<Option<T>, D::Error> {
    struct Text<F>(&'static str, F);
    impl<T, E: Display, F: Fn(&str) -> Result<T, E>> Visitor<'_> for Text<F> {
        type Value = T;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str(self.0)
        }
        fn visit_str<X: de::Error>(self, v: &str) -> Result<T, X> {
            (self.1)(v).map_err(X::custom)
        }
    }
    d.deserialize_str(Text(expecting, parse)).map(Some)
}

/// A list of strings, each parsed by `parse`; a single string is a list of one.
fn list_with<'de, D: Deserializer<'de>, T, E: Display>(
    d: D,
    parse: impl Fn(&str) -> Result<T, E>,
) -> Result<Option<Vec<T>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged, expecting = "a string or an array of strings")]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    let all = match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    };
    all.iter().map(|s| parse(s).map_err(de::Error::custom)).collect::<Result<_, _>>().map(Some)
}

fn endpoint<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    text_with(d, "an address such as \"127.0.0.1:7070\"", |s| Endpoint::parse(s).map(|_| s.to_owned()))
}

fn eth_options<'de, D: Deserializer<'de>>(d: D) -> Result<Option<transport::EthOptions>, D::Error> {
    text_with(d, "raw-Ethernet options such as \"driver=xdp,frame=4000\"", transport::EthOptions::parse)
}

fn endpoints<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    list_with(d, |s| Endpoint::parse(s).map(|_| s.to_owned()).map_err(|e| format!("{s:?}: {e}")))
}

fn exports<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<ExportConfig>>, D::Error> {
    list_with(d, str::parse::<ExportConfig>)
}

/// Device paths: an array, or one string of comma-separated paths as `--flash` takes them.
fn paths<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<PathBuf>>, D::Error> {
    let lists = list_with(d, |s: &str| {
        let parts: Vec<PathBuf> = s.split(',').filter(|p| !p.is_empty()).map(PathBuf::from).collect();
        if parts.is_empty() {
            return Err("an empty path");
        }
        Ok(parts)
    })?;
    Ok(lists.map(|l| l.into_iter().flatten().collect()))
}

const DURATION: &str = "a duration such as \"10s\" or \"500ms\"";

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    text_with(d, DURATION, units::parse_duration)
}

fn timeout<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    text_with(d, "a duration such as \"5m\", or \"off\"", units::parse_timeout)
}

fn poll<'de, D: Deserializer<'de>>(d: D) -> Result<Option<rt::poll::PollMode>, D::Error> {
    text_with(d, "\"off\", \"hybrid[:MICROSECONDS]\" or \"adaptive[:MICROSECONDS]\"", units::parse_poll)
}

/// A size: a string with binary units (`"1M"`), or a whole number of bytes.
fn size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    struct Size;
    impl Visitor<'_> for Size {
        type Value = u64;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a size such as \"1M\" or \"64KiB\", or a number of bytes")
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::custom("a size cannot be negative"))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
            units::parse_size(v).map_err(E::custom)
        }
    }
    d.deserialize_any(Size).map(Some)
}

/// A count of at least one.
fn count<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<Option<T>, D::Error> {
    let n = u64::deserialize(d)?;
    if n == 0 {
        return Err(de::Error::custom("must be at least 1"));
    }
    T::try_from(n).map(Some).map_err(|_| de::Error::custom(format!("{n} is too large")))
}

/// `tls = "off" | "on" | "require"`.
fn tls_mode<'de, D: Deserializer<'de>>(d: D) -> Result<Option<transport::tls::TlsMode>, D::Error> {
    let s = String::deserialize(d)?;
    s.parse().map(Some).map_err(de::Error::custom)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(text: &str) -> String {
        let e = parse(text).expect_err("a bad file");
        located(Path::new("skiff.toml"), text, &e).to_string()
    }

    #[test]
    fn a_full_file_parses() {
        let one = parse("export = \"vol=ram:1M\"\nnbd = \"unix:/run/n.sock\"").unwrap();
        assert_eq!((one.exports.map(|e| e.len()), one.nbd.map(|n| n.len())), (Some(1), Some(1)));
        let f = parse(
            r#"
            listen = "0.0.0.0:7070"
            nbd = ["127.0.0.1:10809", "unix:/run/skiff-nbd.sock"]
            export = ["fast=ram:1G", "golden=file:/srv/golden.img,ro"]
            io-max = "1M"
            queue-depth = 128
            poll = "hybrid:20"
            idle-timeout = "off"
            handshake-timeout = "10s"
            tx-backlog-max = 8388608
            "#,
        )
        .unwrap();
        assert_eq!(f.listen.as_deref(), Some("0.0.0.0:7070"));
        assert_eq!(f.exports.as_ref().map(Vec::len), Some(2));
        assert_eq!((f.io_max, f.queue_depth), (Some(1 << 20), Some(128)));
        assert_eq!(f.poll, Some(rt::poll::PollMode::Fixed(Duration::from_micros(20))));
        assert_eq!(
            (f.idle_timeout, f.handshake_timeout),
            (Some(Duration::ZERO), Some(Duration::from_secs(10)))
        );
        let b = Tuning::of(&f).apply(Bounds::default()).unwrap();
        assert_eq!(b.tx_backlog_bytes_max, 8 << 20);
    }

    #[test]
    fn bad_entries_name_their_line_and_key() {
        let e = error("listen = \"127.0.0.1:7070\"\n\nio-max = \"1X\"\n");
        assert!(e.starts_with("config skiff.toml:3:10: io-max: "), "{e}");
        let e = error("workers = 2\nconnection-max = 10\n");
        assert!(
            e.starts_with("config skiff.toml:2:1: connection-max: unknown field `connection-max`"),
            "{e}"
        );
        let e = error("export = [\n  \"vol=ram:1M\",\n  \"disk=tape:9\",\n]\n");
        assert!(e.contains(": export: ") && e.contains("disk"), "{e}");
        let e = error("handshake-timeout = \"0s\"\n");
        assert!(e.contains("handshake-timeout: ") && e.contains("positive"), "{e}");
        let e = error("connections-max = 0\n");
        assert!(e.contains("connections-max: must be at least 1"), "{e}");
        let e = error("read-only = \"yes\"\n");
        assert!(e.starts_with("config skiff.toml:1:13: read-only: "), "{e}");
        let e = error("listen = \"\"\n");
        assert!(e.contains("listen: empty address"), "{e}");
        let e = error("listen = \"a\"\nlisten = \"b\"\n");
        assert!(e.contains(":2:"), "a key given twice: {e}");
        let e = error("handshake-timeout = 10\n");
        assert!(e.contains("handshake-timeout: invalid type: integer `10`, expected a duration"), "{e}");
        let e = error("[listen]\nport = 1\n");
        assert!(e.contains("listen: "), "{e}");
    }

    /// `skiff serve ARGS` with `file` as its config, after the file is applied.
    fn serve_with(file: &str, args: &[&str]) -> (ServeArgs, Tuning) {
        use clap::{CommandFactory, FromArgMatches};
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, file.as_bytes()).unwrap();
        let path = f.path().to_str().unwrap().to_owned();
        let argv = ["skiff", "serve", "--config", &path].into_iter().chain(args.iter().copied());
        let matches = crate::Cli::command().try_get_matches_from(argv).unwrap();
        let crate::Command::Serve(mut serve) = crate::Cli::from_arg_matches(&matches).unwrap().command else {
            unreachable!()
        };
        let tuning = apply(&mut serve, matches.subcommand_matches("serve").unwrap()).unwrap();
        (serve, tuning)
    }

    #[test]
    fn flags_on_the_command_line_override_the_file() {
        let file = "listen = \"127.0.0.1:7171\"\nworkers = 3\nexport = [\"a=ram:1M\", \"b=ram:1M\"]\n\
                    metrics = \"127.0.0.1:9470\"\nidle-timeout = \"off\"\nread-only = true\nreads-per-pass = 4\n";
        let (args, tuning) =
            serve_with(file, &["--workers", "5", "--export", "c=ram:2M", "--idle-timeout", "1m"]);
        assert_eq!((args.listen.as_str(), args.workers), ("127.0.0.1:7171", 5));
        let names: Vec<_> = args.exports.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["c"], "a repeated flag replaces the file's list");
        assert_eq!(args.metrics.as_deref(), Some("127.0.0.1:9470"));
        assert_eq!(args.idle_timeout, Some(Duration::from_secs(60)));
        assert!(args.read_only);
        assert_eq!(tuning.apply(Bounds::default()).unwrap().reads_per_pass, 4);

        // Flags left out keep the file's values, and keys left out keep the defaults.
        let (args, _) = serve_with(file, &[]);
        assert_eq!((args.workers, args.exports.len(), args.idle_timeout), (3, 2, Some(Duration::ZERO)));
        assert_eq!((args.io_max, args.connections_max), (1 << 20, Bounds::default().connections_max));
    }

    /// `--repair-verify` is on by default, comes from the file unless the flag is given, and a
    /// value that is not a boolean is refused, in the file and on the command line.
    #[test]
    fn repair_verify_comes_from_the_file_or_the_flag_and_a_bad_value_is_refused() {
        use clap::CommandFactory;
        assert!(serve_with("", &[]).0.repair_verify, "on by default");
        assert!(!serve_with("repair-verify = false\n", &[]).0.repair_verify);
        assert!(serve_with("repair-verify = false\n", &["--repair-verify", "true"]).0.repair_verify);
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, b"repair-verify = \"maybe\"\n").unwrap();
        let err = read(f.path()).expect_err("not a boolean");
        assert!(err.to_string().contains("repair-verify"), "{err}");
        let argv = ["skiff", "serve", "--repair-verify", "maybe"];
        assert!(crate::Cli::command().try_get_matches_from(argv).is_err());
    }

    /// Raw-Ethernet settings come from `eth-options` in the file unless `--eth-options` is
    /// given, and a bad option is refused in either place with its name.
    #[test]
    fn eth_options_come_from_the_file_or_the_flag_and_a_bad_one_is_refused() {
        use clap::CommandFactory;
        use transport::{EthDriver, EthOptions};
        let file = "eth = [\"veth0\"]\neth-options = \"driver=xdp,frame=4000\"\n";
        let (args, _) = serve_with(file, &[]);
        let want = EthOptions { driver: Some(EthDriver::Xdp), frame: Some(4000), ..EthOptions::default() };
        assert_eq!((args.eth.as_slice(), args.eth_options), (&["veth0".to_owned()][..], Some(want)));
        let (args, _) = serve_with(file, &["--eth-options", "data-messages=off"]);
        let want = EthOptions { data_messages: Some(false), ..EthOptions::default() };
        assert_eq!(args.eth_options, Some(want), "the flag replaces the file's options");
        assert_eq!(serve_with("", &[]).0.eth_options, None);

        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, b"eth-options = \"driver=dpdk\"\n").unwrap();
        let err = read(f.path()).expect_err("no such driver").to_string();
        assert!(err.contains("eth-options") && err.contains("driver=dpdk"), "{err}");
        let argv = ["skiff", "serve", "--eth", "v", "--eth-options", "frame=65508"];
        let err = crate::Cli::command().try_get_matches_from(argv).expect_err("too large").to_string();
        assert!(err.contains("frame=65508"), "{err}");
    }

    #[test]
    fn a_flash_array_comes_from_the_file_as_from_the_flags() {
        let (args, tuning) = serve_with(
            "flash = [\"/dev/nvme0n1\", \"/dev/nvme1n1\"]\nflash-cache = \"1G\"\nflash-map-budget = \"64M\"\nvolume-exports-max = 64\n",
            &[],
        );
        assert_eq!(args.flash, [PathBuf::from("/dev/nvme0n1"), PathBuf::from("/dev/nvme1n1")]);
        assert_eq!((args.flash_cache, args.flash_map_budget), (1 << 30, 64 << 20));
        assert_eq!(tuning.apply(Bounds::default()).unwrap().volume_exports_max, 64);
        let (args, _) = serve_with("flash = \"/a,/b\"\n", &["--flash", "/c", "--flash-cache", "64M"]);
        assert_eq!((args.flash, args.flash_cache), (vec![PathBuf::from("/c")], 64 << 20));
        let (args, _) = serve_with("flash = \"/a,/b\"\n", &[]);
        assert_eq!((args.flash.len(), args.flash_cache), (2, 256 << 20));
        assert_eq!(args.flash_read_depth, server::FLASH_READ_DEPTH_DEFAULT);
        // 0 is a setting (reads on the worker's thread), and the flag wins over the file.
        let (args, _) = serve_with("flash = \"/a\"\nflash-read-depth = 0\n", &[]);
        assert_eq!(args.flash_read_depth, 0);
        let (args, _) = serve_with("flash-read-depth = 0\n", &["--flash-read-depth", "32"]);
        assert_eq!(args.flash_read_depth, 32);
        assert!(error("flash = \"\"\n").contains("flash: "), "an empty path");
        assert_eq!(args.flash_references, None);
        let (args, _) = serve_with("flash = \"/a\"\nflash-references = \"/var/lib/skiff/refs\"\n", &[]);
        assert_eq!(args.flash_references, Some(PathBuf::from("/var/lib/skiff/refs")));
    }

    #[test]
    fn tuning_refuses_caravans_smaller_than_an_io() {
        let f = parse("caravan-bytes-max = \"4k\"\n").unwrap();
        assert!(Tuning::of(&f).apply(Bounds::default()).is_err());
    }

    #[test]
    fn the_shipped_example_parses_and_says_the_defaults() {
        let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../contrib/skiff.toml"));
        let f = read(path).unwrap_or_else(|e| panic!("{e}"));
        assert!(!f.exports.unwrap_or_default().is_empty(), "the example exports something");
        // Every commented-out key is a real one with a value that parses: uncomment them all.
        let text = std::fs::read_to_string(path).unwrap();
        let uncommented: String = text
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(rest) if rest.split_once(" = ").is_some_and(|(k, _)| !k.contains(' ')) => rest,
                _ => l,
            })
            .map(|l| format!("{l}\n"))
            .collect();
        let all = parse(&uncommented).unwrap_or_else(|e| panic!("{}", located(path, &uncommented, &e)));
        let b = Tuning::of(&all).apply(Bounds::default()).unwrap();
        assert_eq!(b, Bounds::default(), "the example's bounds are the defaults");
        let limits = wire::Limits::default();
        assert_eq!(
            (all.queue_depth, all.io_max),
            (Some(limits.queue_depth), Some(limits.io_bytes_max.into()))
        );
        assert_eq!(all.handshake_timeout, Some(Bounds::default().handshake_timeout));
        assert_eq!(all.idle_timeout, Some(Bounds::default().idle_timeout));
        assert_eq!(all.nbd_idle_timeout, Some(Bounds::default().nbd_idle_timeout));
        assert_eq!(all.connections_max, Some(Bounds::default().connections_max));
        assert_eq!(all.handshakes_max, Some(Bounds::default().handshakes_max));
        assert_eq!(all.connections_per_address_max, Some(Bounds::default().connections_per_address_max));
    }
}
