//! Where a target listens or an initiator connects: `HOST:PORT`, `unix:PATH`, or raw Ethernet
//! `eth:IFACE[+IFACE…][/MAC]` (docs/ETHERNET.md).

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
    #[error("eth: needs an interface name (eth:IFACE, eth:IFACE/MAC or eth:IFACE+IFACE/MAC)")]
    EmptyInterface,
    #[error("interface {0:?} appears twice in one bundle")]
    RepeatedInterface(String),
    #[error("{0:?} is not a MAC address (six hex bytes, such as 02:00:00:00:00:01)")]
    BadMac(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `host:port`; a bare host gets [`DEFAULT_PORT`].
    Tcp(String),
    Unix(PathBuf),
    /// Raw Ethernet on interface `ifaces[0]`, bundled with the others if there are more; to
    /// connect, the target's `mac` on the first interface (found by discovery when absent; a
    /// target listens on the interfaces and needs none).
    Eth {
        ifaces: Vec<String>,
        mac: Option<[u8; 6]>,
    },
}

impl Endpoint {
    /// Raw Ethernet on the one interface `iface`.
    pub fn eth(iface: impl Into<String>, mac: Option<[u8; 6]>) -> Endpoint {
        Endpoint::Eth { ifaces: vec![iface.into()], mac }
    }

    pub fn parse(s: &str) -> Result<Endpoint, EndpointError> {
        if let Some(rest) = s.strip_prefix("eth:") {
            let (bundle, mac) = match rest.split_once('/') {
                Some((i, m)) => (i, Some(parse_mac(m)?)),
                None => (rest, None),
            };
            let mut ifaces: Vec<String> = Vec::new();
            for iface in bundle.split('+') {
                if iface.is_empty() {
                    return Err(EndpointError::EmptyInterface);
                }
                if ifaces.iter().any(|i| i == iface) {
                    return Err(EndpointError::RepeatedInterface(iface.to_owned()));
                }
                ifaces.push(iface.to_owned());
            }
            return Ok(Endpoint::Eth { ifaces, mac });
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
            Endpoint::Eth { ifaces, mac: None } => write!(f, "eth:{}", ifaces.join("+")),
            Endpoint::Eth { ifaces, mac: Some(mac) } => {
                write!(f, "eth:{}/{}", ifaces.join("+"), format_mac(mac))
            }
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
        let one = |i: &str| vec![i.to_owned()];
        assert_eq!(Endpoint::parse("eth:veth0").unwrap(), Endpoint::Eth { ifaces: one("veth0"), mac: None });
        let with_mac = Endpoint::parse("eth:veth0/02:00:0A:ff:00:01").unwrap();
        assert_eq!(with_mac, Endpoint::Eth { ifaces: one("veth0"), mac: Some([2, 0, 10, 255, 0, 1]) });
        assert_eq!(with_mac.to_string(), "eth:veth0/02:00:0a:ff:00:01");
        let bundle = Endpoint::parse("eth:veth0+veth2/02:00:00:00:00:01").unwrap();
        let both = vec!["veth0".to_owned(), "veth2".to_owned()];
        assert_eq!(bundle, Endpoint::Eth { ifaces: both, mac: Some([2, 0, 0, 0, 0, 1]) });
        assert_eq!(bundle.to_string(), "eth:veth0+veth2/02:00:00:00:00:01");
        assert_eq!(Endpoint::parse("eth:veth0+"), Err(EndpointError::EmptyInterface));
        assert_eq!(Endpoint::parse("eth:a+b+a"), Err(EndpointError::RepeatedInterface("a".into())));
        assert_eq!(Endpoint::parse("eth:"), Err(EndpointError::EmptyInterface));
        assert_eq!(Endpoint::parse("eth:/02:00:00:00:00:01"), Err(EndpointError::EmptyInterface));
        assert!(matches!(Endpoint::parse("eth:v/02:00:00:00:00"), Err(EndpointError::BadMac(_))));
        assert!(matches!(Endpoint::parse("eth:v/02:00:00:00:00:zz"), Err(EndpointError::BadMac(_))));
    }
}
