//! Where a target listens or an initiator connects: `HOST:PORT` or `unix:PATH`.

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
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `host:port`; a bare host gets [`DEFAULT_PORT`].
    Tcp(String),
    Unix(PathBuf),
}

impl Endpoint {
    pub fn parse(s: &str) -> Result<Endpoint, EndpointError> {
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

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(a) => f.write_str(a),
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
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
    }
}
