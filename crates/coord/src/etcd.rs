//! A small blocking client for etcd v3's JSON gateway (`POST /v3/kv/range` and friends): the
//! few calls skiff's control plane needs, with failover across a cluster's members.
//!
//! The gateway maps etcd's gRPC messages to JSON: keys and values are base64, 64-bit integers
//! travel as strings (and are accepted either way), enum values by name, and fields left at
//! their default are omitted. Every call goes to the member that answered last and, when it
//! cannot be reached, to the next; a member that answers with an error is not retried
//! elsewhere (the error is etcd's answer, not the network's). Only a failure that shows the
//! request never reached a member (refused, reset, unreachable) moves it to the next member: a
//! timeout leaves a transaction's fate unknown, and sending it again could apply it twice, so
//! it is reported instead ([`EtcdError::Unknown`]).

use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde::{Deserialize, Deserializer};
use serde_json::{json, Value};

/// Why an etcd call failed.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("no etcd member answered ({tried}): {last}")]
    Unreachable { tried: String, last: String },
    #[error("etcd at {endpoint} refused {path}: HTTP {status}: {message}")]
    Refused { endpoint: String, path: String, status: u16, message: String },
    #[error("etcd at {endpoint} answered {path} with something unexpected: {why}")]
    Malformed { endpoint: String, path: String, why: String },
    /// The request may or may not have been applied (no answer in time).
    #[error("etcd at {endpoint} did not answer {path} in time: whether it was applied is unknown ({why})")]
    Unknown { endpoint: String, path: String, why: String },
}

/// Whether a failed request certainly never reached a member, so that another may take it.
fn never_arrived(e: &ureq::Error) -> bool {
    use std::io::ErrorKind::*;
    match e {
        ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => true,
        // A TLS handshake that failed (a certificate refused either way) sent no request.
        ureq::Error::Tls(_) | ureq::Error::Rustls(_) => true,
        ureq::Error::Io(io) if io.get_ref().is_some_and(|e| e.is::<rustls::Error>()) => true,
        ureq::Error::Io(io) => matches!(
            io.kind(),
            ConnectionRefused | ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected
        ),
        _ => false,
    }
}

/// One key and its value, with etcd's revisions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub lease: i64,
}

/// A condition of a transaction.
#[derive(Debug, Clone)]
pub enum Compare {
    /// The key does not exist (its create revision is 0).
    Absent(Vec<u8>),
    /// The key was last modified at this revision (0: it does not exist).
    ModRevision(Vec<u8>, i64),
}

/// An operation of a transaction.
#[derive(Debug, Clone)]
pub enum Op {
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        lease: i64,
    },
    Delete(Vec<u8>),
    /// Every key with this prefix.
    DeletePrefix(Vec<u8>),
}

/// Keys [`Etcd::get_many`] reads in one transaction.
const GET_MANY_BATCH: usize = 100;

/// Keys [`Etcd::prefix`] reads a round trip. A namespace's stripe group is up to ~13 KB, and
/// the 512 groups of a large namespace in one answer were 8.6 MB of JSON that a debug build on
/// a loaded machine did not read within the client's timeout (a CI run); 64 are about 1 MB.
const PREFIX_PAGE: i64 = 64;

/// A client of one etcd cluster.
pub struct Etcd {
    endpoints: Vec<String>,
    /// The member that answered last.
    current: std::sync::atomic::AtomicUsize,
    agent: ureq::Agent,
    timeout: Duration,
    tls: Option<Tls>,
}

/// How to reach etcd members over TLS (`https://` client URLs): the CA that signed their
/// certificates, and a client certificate and key for members that ask for one
/// (`--client-cert-auth`). PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tls {
    pub ca: std::path::PathBuf,
    pub cert: Option<std::path::PathBuf>,
    pub key: Option<std::path::PathBuf>,
}

impl Tls {
    /// From `$SKIFF_COORDINATOR_CA`, `$SKIFF_COORDINATOR_CERT` and `$SKIFF_COORDINATOR_KEY`
    /// (the C API's and child processes' way), if the CA is set.
    pub fn from_env() -> Option<Tls> {
        let var = |n: &str| std::env::var_os(n).filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
        Some(Tls {
            ca: var("SKIFF_COORDINATOR_CA")?,
            cert: var("SKIFF_COORDINATOR_CERT"),
            key: var("SKIFF_COORDINATOR_KEY"),
        })
    }

    /// The agent's TLS configuration: these roots only, this client certificate, rustls on
    /// ring (skiff's provider everywhere).
    fn config(&self) -> Result<ureq::tls::TlsConfig, String> {
        use ureq::tls::{Certificate, ClientCert, PemItem, PrivateKey, RootCerts, TlsConfig};
        let read = |p: &std::path::Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        let certs = |p: &std::path::Path| -> Result<Vec<Certificate<'static>>, String> {
            let pem = read(p)?;
            let certs: Vec<Certificate<'static>> = ureq::tls::parse_pem(&pem)
                .filter_map(|item| match item {
                    Ok(PemItem::Certificate(c)) => Some(c),
                    _ => None,
                })
                .collect();
            if certs.is_empty() {
                return Err(format!("{}: no PEM certificate in it", p.display()));
            }
            Ok(certs)
        };
        let roots = RootCerts::new_with_certs(&certs(&self.ca)?);
        let client = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let k = PrivateKey::from_pem(&read(key)?).map_err(|e| format!("{}: {e}", key.display()))?;
                Some(ClientCert::new_with_certs(&certs(cert)?, k))
            }
            (None, None) => None,
            _ => return Err("a client certificate needs its key, and a key its certificate".into()),
        };
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        Ok(TlsConfig::builder()
            .root_certs(roots)
            .client_cert(client)
            .unversioned_rustls_crypto_provider(provider)
            .build())
    }
}

fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

/// The first key after every key that starts with `prefix` (etcd's `range_end` for a prefix).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

fn int64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        S(String),
        N(i64),
    }
    match Either::deserialize(d)? {
        Either::N(n) => Ok(n),
        Either::S(s) => s.parse().map_err(serde::de::Error::custom),
    }
}

#[derive(Deserialize)]
struct RawKv {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
    #[serde(default, deserialize_with = "int64")]
    create_revision: i64,
    #[serde(default, deserialize_with = "int64")]
    mod_revision: i64,
    #[serde(default, deserialize_with = "int64")]
    lease: i64,
}

#[derive(Deserialize, Default)]
struct Header {
    #[serde(default, deserialize_with = "int64")]
    revision: i64,
}

#[derive(Deserialize)]
struct RangeResponse {
    #[serde(default)]
    header: Header,
    #[serde(default)]
    kvs: Vec<RawKv>,
    /// More keys lie in the range past `limit`.
    #[serde(default)]
    more: bool,
}

#[derive(Deserialize)]
struct TxnResponse {
    #[serde(default)]
    succeeded: bool,
    #[serde(default)]
    responses: Vec<TxnOpResponse>,
}

#[derive(Deserialize)]
struct TxnOpResponse {
    response_range: Option<RangeResponse>,
}

#[derive(Deserialize)]
struct LeaseGrant {
    #[serde(rename = "ID", deserialize_with = "int64")]
    id: i64,
}

#[derive(Deserialize)]
struct KeepAliveResult {
    #[serde(rename = "TTL", default, deserialize_with = "int64")]
    ttl: i64,
}

#[derive(Deserialize)]
struct KeepAlive {
    result: Option<KeepAliveResult>,
}

impl Etcd {
    /// A client of the cluster whose members' client URLs are `endpoints`
    /// (`http://127.0.0.1:2379`, comma-separated in one string or given apart).
    pub fn new(endpoints: &[String], timeout: Duration) -> Etcd {
        Etcd::with_tls(endpoints, timeout, None).expect("no TLS to set up")
    }

    /// As [`new`](Etcd::new), reaching `https://` members with `tls`. Fails when the PEM
    /// files cannot be read or hold nothing of use.
    pub fn with_tls(endpoints: &[String], timeout: Duration, tls: Option<Tls>) -> Result<Etcd, String> {
        let endpoints: Vec<String> = endpoints
            .iter()
            .flat_map(|e| e.split(','))
            .map(|e| e.trim().trim_end_matches('/').to_owned())
            .filter(|e| !e.is_empty())
            .collect();
        let mut config =
            ureq::Agent::config_builder().timeout_global(Some(timeout)).http_status_as_error(false);
        config = config.tls_config(match &tls {
            Some(t) => t.config().map_err(|e| format!("etcd TLS: {e}"))?,
            // No CA given: an https:// member's certificate is trusted by nothing, and the
            // call fails saying so (rather than on a missing provider).
            None => ureq::tls::TlsConfig::builder()
                .root_certs(ureq::tls::RootCerts::new_with_certs(&[]))
                .unversioned_rustls_crypto_provider(std::sync::Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .build(),
        });
        let agent = ureq::Agent::new_with_config(config.build());
        Ok(Etcd { endpoints, current: 0.into(), agent, timeout, tls })
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Another client of the same members, the same way (for a thread of its own).
    pub fn again(&self) -> Etcd {
        Etcd {
            endpoints: self.endpoints.clone(),
            current: 0.into(),
            agent: self.agent.clone(),
            timeout: self.timeout,
            tls: self.tls.clone(),
        }
    }

    /// POST `body` to `path` on a member that answers.
    fn call(&self, path: &str, body: &Value) -> Result<Value, EtcdError> {
        use std::sync::atomic::Ordering;
        let n = self.endpoints.len();
        let start = self.current.load(Ordering::Relaxed);
        let mut last = String::from("no endpoints");
        for k in 0..n {
            let i = (start + k) % n;
            let endpoint = &self.endpoints[i];
            let mut response = match self.agent.post(format!("{endpoint}{path}")).send_json(body) {
                Ok(r) => r,
                Err(e) if never_arrived(&e) => {
                    last = format!("{endpoint}: {e}");
                    continue;
                }
                Err(e) => {
                    return Err(EtcdError::Unknown {
                        endpoint: endpoint.clone(),
                        path: path.to_owned(),
                        why: e.to_string(),
                    })
                }
            };
            self.current.store(i, Ordering::Relaxed);
            let status = response.status().as_u16();
            let value: Value = response.body_mut().read_json().map_err(|e| EtcdError::Malformed {
                endpoint: endpoint.clone(),
                path: path.to_owned(),
                why: e.to_string(),
            })?;
            if status != 200 {
                let message = value
                    .get("message")
                    .or_else(|| value.get("error"))
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned();
                return Err(EtcdError::Refused {
                    endpoint: endpoint.clone(),
                    path: path.to_owned(),
                    status,
                    message,
                });
            }
            return Ok(value);
        }
        Err(EtcdError::Unreachable { tried: self.endpoints.join(", "), last })
    }

    fn parse<T: serde::de::DeserializeOwned>(&self, path: &str, v: Value) -> Result<T, EtcdError> {
        serde_json::from_value(v).map_err(|e| EtcdError::Malformed {
            endpoint: self.endpoints[self.current.load(std::sync::atomic::Ordering::Relaxed)].clone(),
            path: path.to_owned(),
            why: e.to_string(),
        })
    }

    fn kvs(&self, path: &str, raw: Vec<RawKv>) -> Result<Vec<Kv>, EtcdError> {
        raw.into_iter()
            .map(|r| {
                let decode = |s: &str| {
                    B64.decode(s).map_err(|e| EtcdError::Malformed {
                        endpoint: self.endpoints[self.current.load(std::sync::atomic::Ordering::Relaxed)]
                            .clone(),
                        path: path.to_owned(),
                        why: format!("base64: {e}"),
                    })
                };
                Ok(Kv {
                    key: decode(&r.key)?,
                    value: decode(&r.value)?,
                    create_revision: r.create_revision,
                    mod_revision: r.mod_revision,
                    lease: r.lease,
                })
            })
            .collect()
    }

    /// The key, if it exists.
    pub fn get(&self, key: &[u8]) -> Result<Option<Kv>, EtcdError> {
        let v = self.call("/v3/kv/range", &json!({ "key": b64(key) }))?;
        let r: RangeResponse = self.parse("/v3/kv/range", v)?;
        Ok(self.kvs("/v3/kv/range", r.kvs)?.into_iter().next())
    }

    /// Every key with `prefix`, in key order, as of one revision: read [`PREFIX_PAGE`] keys a
    /// round trip, every page after the first at the first one's revision.
    pub fn prefix(&self, prefix: &[u8]) -> Result<Vec<Kv>, EtcdError> {
        let end = prefix_end(prefix);
        let (mut out, mut from, mut revision) = (Vec::new(), prefix.to_vec(), 0);
        loop {
            let mut body =
                json!({ "key": b64(&from), "range_end": b64(&end), "limit": PREFIX_PAGE.to_string() });
            if revision != 0 {
                body["revision"] = json!(revision.to_string());
            }
            let v = self.call("/v3/kv/range", &body)?;
            let r: RangeResponse = self.parse("/v3/kv/range", v)?;
            if revision == 0 {
                revision = r.header.revision;
            }
            let page = self.kvs("/v3/kv/range", r.kvs)?;
            let next = page.last().filter(|_| r.more).map(|kv| [kv.key.as_slice(), &[0]].concat());
            out.extend(page);
            match next {
                Some(key) => from = key,
                None => return Ok(out),
            }
        }
    }

    /// Keys in `start..end`, at most `limit` of them (0: all), in key order or, `last`, from
    /// the last one down.
    pub fn range(&self, start: &[u8], end: &[u8], limit: i64, last: bool) -> Result<Vec<Kv>, EtcdError> {
        let mut body = json!({ "key": b64(start), "range_end": b64(end), "limit": limit.to_string() });
        if last {
            body["sort_order"] = json!("DESCEND");
            body["sort_target"] = json!("KEY");
        }
        let v = self.call("/v3/kv/range", &body)?;
        let r: RangeResponse = self.parse("/v3/kv/range", v)?;
        self.kvs("/v3/kv/range", r.kvs)
    }

    /// The keys in `start..end` with their mod revisions, values left out (etcd's `keys_only`):
    /// whether records changed, for the cost of their keys.
    pub fn revisions(&self, start: &[u8], end: &[u8]) -> Result<Vec<(Vec<u8>, i64)>, EtcdError> {
        let body = json!({ "key": b64(start), "range_end": b64(end), "keys_only": true });
        let v = self.call("/v3/kv/range", &body)?;
        let r: RangeResponse = self.parse("/v3/kv/range", v)?;
        Ok(self.kvs("/v3/kv/range", r.kvs)?.into_iter().map(|kv| (kv.key, kv.mod_revision)).collect())
    }

    /// Each of `keys`, if it exists, read a hundred to a round trip (each hundred one
    /// transaction of reads, so at one revision; etcd takes 128 operations a transaction).
    pub fn get_many(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<Kv>>, EtcdError> {
        let mut out = Vec::with_capacity(keys.len());
        for batch in keys.chunks(GET_MANY_BATCH) {
            let reads: Vec<Value> =
                batch.iter().map(|k| json!({ "request_range": { "key": b64(k) } })).collect();
            let v = self.call("/v3/kv/txn", &json!({ "success": reads }))?;
            let r: TxnResponse = self.parse("/v3/kv/txn", v)?;
            if r.responses.len() != batch.len() {
                return Err(EtcdError::Malformed {
                    endpoint: self.endpoints[self.current.load(std::sync::atomic::Ordering::Relaxed)].clone(),
                    path: "/v3/kv/txn".into(),
                    why: format!("{} answers to {} reads", r.responses.len(), batch.len()),
                });
            }
            for o in r.responses {
                let kvs = o.response_range.map(|r| r.kvs).unwrap_or_default();
                out.push(self.kvs("/v3/kv/txn", kvs)?.into_iter().next());
            }
        }
        Ok(out)
    }

    pub fn put(&self, key: &[u8], value: &[u8], lease: i64) -> Result<(), EtcdError> {
        self.call(
            "/v3/kv/put",
            &json!({ "key": b64(key), "value": b64(value), "lease": lease.to_string() }),
        )?;
        Ok(())
    }

    /// Run `success` if every comparison holds, `failure` otherwise, atomically; says which.
    pub fn txn(&self, compare: &[Compare], success: &[Op], failure: &[Op]) -> Result<bool, EtcdError> {
        let compare: Vec<Value> = compare
            .iter()
            .map(|c| match c {
                Compare::Absent(key) => json!({
                    "target": "CREATE", "result": "EQUAL", "key": b64(key), "create_revision": "0"
                }),
                Compare::ModRevision(key, rev) => json!({
                    "target": "MOD", "result": "EQUAL", "key": b64(key), "mod_revision": rev.to_string()
                }),
            })
            .collect();
        let ops = |ops: &[Op]| -> Vec<Value> {
            ops.iter()
                .map(|op| match op {
                    Op::Put { key, value, lease } => json!({ "request_put": {
                        "key": b64(key), "value": b64(value), "lease": lease.to_string()
                    }}),
                    Op::Delete(key) => json!({ "request_delete_range": { "key": b64(key) } }),
                    Op::DeletePrefix(prefix) => json!({ "request_delete_range": {
                        "key": b64(prefix), "range_end": b64(&prefix_end(prefix))
                    }}),
                })
                .collect()
        };
        let (compares, operations) = (compare.len(), success.len().max(failure.len()));
        let v = self
            .call(
                "/v3/kv/txn",
                &json!({ "compare": compare, "success": ops(success), "failure": ops(failure) }),
            )
            .map_err(|e| match e {
                // Say how large the refused transaction was: its size is ours to bound.
                EtcdError::Refused { endpoint, path, status, message } => EtcdError::Refused {
                    endpoint,
                    path,
                    status,
                    message: format!("{message} ({compares} comparisons, {operations} operations)"),
                },
                e => e,
            })?;
        Ok(self.parse::<TxnResponse>("/v3/kv/txn", v)?.succeeded)
    }

    /// A lease that expires `ttl` seconds after its last keepalive.
    pub fn grant(&self, ttl: Duration) -> Result<i64, EtcdError> {
        let v = self.call("/v3/lease/grant", &json!({ "TTL": ttl.as_secs().max(1) }))?;
        Ok(self.parse::<LeaseGrant>("/v3/lease/grant", v)?.id)
    }

    /// Renew `lease`; `false` when it has already expired (its keys are gone).
    pub fn keep_alive(&self, lease: i64) -> Result<bool, EtcdError> {
        let v = self.call("/v3/lease/keepalive", &json!({ "ID": lease.to_string() }))?;
        let k: KeepAlive = self.parse("/v3/lease/keepalive", v)?;
        Ok(k.result.is_some_and(|r| r.ttl > 0))
    }

    /// End `lease` now: its keys go at once.
    pub fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        self.call("/v3/lease/revoke", &json!({ "ID": lease.to_string() }))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends_are_the_next_key_after_the_prefix() {
        assert_eq!(prefix_end(b"/skiff/ns/"), b"/skiff/ns0".to_vec());
        assert_eq!(prefix_end(&[b'a', 0xff]), b"b".to_vec());
        assert_eq!(prefix_end(&[0xff, 0xff]), vec![0]);
    }

    #[test]
    fn int64_fields_come_as_strings_or_numbers_and_may_be_missing() {
        let kv: RawKv =
            serde_json::from_str(r#"{"key":"Zm9v","mod_revision":"7","create_revision":3}"#).unwrap();
        assert_eq!((kv.mod_revision, kv.create_revision, kv.lease), (7, 3, 0));
        assert_eq!(kv.value, "");
    }
}
