//! Where a target listens or an initiator connects: `HOST:PORT`, `unix:PATH`, or raw Ethernet
//! `eth:IFACE[/MAC]` (docs/ETHERNET.md).

use std::fmt;
use std::path::PathBuf;

/// Native protocol's default TCP port.
pub const DEFAULT_PORT: u16 = 7070;

/// Why a string is not an endpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("unix: needs a socket path")]
    EmptyUnixPath,
    #[error("empty address")]
    Empty,
    #[error("eth: needs an interface name (eth:IFACE or eth:IFACE/MAC)")]
    EmptyInterface,
    #[error("{0:?} is not a MAC address (six hex bytes, such as 02:00:00:00:00:01)")]
    BadMac(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `host:port`; a bare host gets [`DEFAULT_PORT`].
    Tcp(String),
    Unix(PathBuf),
    /// Raw Ethernet on interface `iface`; to connect, the target's `mac` (a target listens on
    /// the interface and needs none).
    Eth {
        iface: String,
        mac: Option<[u8; 6]>,
    },
}

impl Endpoint {
    pub fn parse(s: &str) -> Result<Endpoint, EndpointError> {
        if let Some(rest) = s.strip_prefix("eth:") {
            let (iface, mac) = match rest.split_once('/') {
                Some((i, m)) => (i, Some(parse_mac(m)?)),
                None => (rest, None),
            };
            if iface.is_empty() {
                return Err(EndpointError::EmptyInterface);
            }
            return Ok(Endpoint::Eth { iface: iface.to_owned(), mac });
        }
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(EndpointError::EmptyUnixPath);
            }
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        if s.is_empty() {
            return Err(EndpointError::Empty);
        }
        // A bracketed IPv6 literal or a host with a port keeps its port.
        let has_port = match s.rfind(':') {
            Some(i) => !s[..i].contains(':') || s.starts_with('[') && s[..i].ends_with(']'),
            None => false,
        };
        Ok(Endpoint::Tcp(if has_port { s.to_owned() } else { format!("{s}:{DEFAULT_PORT}") }))
    }
}

/// `aa:bb:cc:dd:ee:ff` (or with dashes).
pub fn parse_mac(s: &str) -> Result<[u8; 6], EndpointError> {
    let bad = || EndpointError::BadMac(s.to_owned());
    let parts: Vec<&str> = s.split([':', '-']).collect();
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(parts) {
        if p.len() != 2 {
            return Err(bad());
        }
        *m = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    Ok(mac)
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(a) => f.write_str(a),
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
            Endpoint::Eth { iface, mac: None } => write!(f, "eth:{iface}"),
            Endpoint::Eth { iface, mac: Some(mac) } => write!(f, "eth:{iface}/{}", format_mac(mac)),
        }
    }
}

impl std::str::FromStr for Endpoint {
    type Err = EndpointError;
    fn from_str(s: &str) -> Result<Endpoint, EndpointError> {
        Endpoint::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_users_type() {
        assert_eq!(Endpoint::parse("127.0.0.1:7070").unwrap(), Endpoint::Tcp("127.0.0.1:7070".into()));
        assert_eq!(Endpoint::parse("localhost").unwrap(), Endpoint::Tcp("localhost:7070".into()));
        assert_eq!(Endpoint::parse("[::1]:9").unwrap(), Endpoint::Tcp("[::1]:9".into()));
        assert_eq!(Endpoint::parse("unix:/run/s.sock").unwrap(), Endpoint::Unix("/run/s.sock".into()));
        assert_eq!(Endpoint::parse("unix:"), Err(EndpointError::EmptyUnixPath));
        assert_eq!(Endpoint::parse(""), Err(EndpointError::Empty));
        assert_eq!(Endpoint::parse("unix:/a").unwrap().to_string(), "unix:/a");
        assert_eq!(Endpoint::parse("eth:veth0").unwrap(), Endpoint::Eth { iface: "veth0".into(), mac: None });
        let with_mac = Endpoint::parse("eth:veth0/02:00:0A:ff:00:01").unwrap();
        assert_eq!(with_mac, Endpoint::Eth { iface: "veth0".into(), mac: Some([2, 0, 10, 255, 0, 1]) });
        assert_eq!(with_mac.to_string(), "eth:veth0/02:00:0a:ff:00:01");
        assert_eq!(Endpoint::parse("eth:"), Err(EndpointError::EmptyInterface));
        assert_eq!(Endpoint::parse("eth:/02:00:00:00:00:01"), Err(EndpointError::EmptyInterface));
        assert!(matches!(Endpoint::parse("eth:v/02:00:00:00:00"), Err(EndpointError::BadMac(_))));
        assert!(matches!(Endpoint::parse("eth:v/02:00:00:00:00:zz"), Err(EndpointError::BadMac(_))));
    }
}
