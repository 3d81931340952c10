//! Where a target listens or an initiator connects: `HOST:PORT`, `unix:PATH`, or raw Ethernet
//! `eth:IFACE[+IFACE…][/MAC][,OPTION=VALUE…]` (docs/ETHERNET.md), whose options
//! ([`EthOptions`]) are the settings of its sessions.

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
    #[error("eth: option {0:?}: {1}")]
    BadOption(String, &'static str),
}

/// The largest datagram payload an `eth:` endpoint's `frame=` may ask for: a frame of the
/// largest MTU Linux gives an interface (65,535 bytes, veth's and loopback's most) less the
/// datagram header. A session takes the least of this, `frame=` and what its interfaces' MTU
/// carries, so a real NIC's jumbo MTU of 9,000 gives 8,972 bytes.
pub const ETH_FRAME_MAX: u16 = u16::MAX - wire::datagram::DATAGRAM_HEADER_LEN as u16;
/// The smallest.
pub const ETH_FRAME_MIN: u16 = 64;

/// What carries a raw-Ethernet session's frames (`driver=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EthDriver {
    /// AF_PACKET's memory-mapped rings: the default, everywhere (`packet`).
    #[default]
    Packet,
    /// AF_XDP, where the interface allows it (`xdp`); a session that cannot have it falls
    /// back to AF_PACKET.
    Xdp,
}

impl EthDriver {
    /// The name reports use: `af_packet` or `af_xdp`.
    pub fn name(self) -> &'static str {
        match self {
            EthDriver::Packet => "af_packet",
            EthDriver::Xdp => "af_xdp",
        }
    }
}

/// The settings a raw-Ethernet endpoint names after its interfaces and MAC, each `None` when it
/// does not: then the environment's `SKIFF_ETH_*` variable, if set, and otherwise the built-in
/// default decides (`skiff-eth`'s `EthConfig`; docs/ETHERNET.md, "Settings").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EthOptions {
    /// `driver=packet|xdp` (default packet).
    pub driver: Option<EthDriver>,
    /// `qdisc=on|off`: through the interface's queueing discipline, for links shaped with
    /// `tc` (default off: past it, PACKET_QDISC_BYPASS).
    pub qdisc: Option<bool>,
    /// `frame=BYTES`: the largest datagram payload, from [`ETH_FRAME_MIN`] to
    /// [`ETH_FRAME_MAX`] (default the most, lowered to what the interface's MTU carries).
    pub frame: Option<u16>,
    /// `data-messages=on|off`: read data in data messages (default on).
    pub data_messages: Option<bool>,
    /// `data-batching=on|off`: data segments share a datagram while it has room, two 4 KiB
    /// ones to a jumbo frame (default on).
    pub data_batching: Option<bool>,
    /// `crc=full|header`: each datagram's checksum covers its payload too (the default), or
    /// its header alone, for a link known to go from memory to memory (a veth pair).
    pub payload_crc: Option<bool>,
}

impl EthOptions {
    /// Each setting from `self`, or from `fallback` where `self` leaves it out.
    pub fn or(self, fallback: EthOptions) -> EthOptions {
        EthOptions {
            driver: self.driver.or(fallback.driver),
            qdisc: self.qdisc.or(fallback.qdisc),
            frame: self.frame.or(fallback.frame),
            data_messages: self.data_messages.or(fallback.data_messages),
            data_batching: self.data_batching.or(fallback.data_batching),
            payload_crc: self.payload_crc.or(fallback.payload_crc),
        }
    }

    /// `KEY=VALUE[,KEY=VALUE…]`, each key at most once.
    pub fn parse(s: &str) -> Result<EthOptions, EndpointError> {
        let mut o = EthOptions::default();
        for item in s.split(',') {
            let bad = |why| EndpointError::BadOption(item.to_owned(), why);
            let (key, value) = item.split_once('=').ok_or_else(|| bad("not KEY=VALUE"))?;
            let on_off = || match value {
                "on" => Ok(true),
                "off" => Ok(false),
                _ => Err(bad("the value is on or off")),
            };
            let set = match key {
                "driver" => o
                    .driver
                    .replace(match value {
                        "packet" => EthDriver::Packet,
                        "xdp" => EthDriver::Xdp,
                        _ => return Err(bad("the driver is packet or xdp")),
                    })
                    .is_some(),
                "qdisc" => o.qdisc.replace(on_off()?).is_some(),
                "frame" => {
                    let n = value.parse::<u16>().ok().filter(|n| (ETH_FRAME_MIN..=ETH_FRAME_MAX).contains(n));
                    o.frame
                        .replace(n.ok_or_else(|| bad("the frame is a payload size from 64 to 65507 bytes"))?)
                        .is_some()
                }
                "data-messages" => o.data_messages.replace(on_off()?).is_some(),
                "data-batching" => o.data_batching.replace(on_off()?).is_some(),
                "crc" => o
                    .payload_crc
                    .replace(match value {
                        "full" => true,
                        "header" => false,
                        _ => return Err(bad("the crc is full or header")),
                    })
                    .is_some(),
                _ => {
                    return Err(bad("options are driver, qdisc, frame, data-messages, data-batching and crc"))
                }
            };
            if set {
                return Err(bad("given twice"));
            }
        }
        Ok(o)
    }
}

impl fmt::Display for EthOptions {
    /// `,KEY=VALUE` for each option set, in a fixed order; empty when none is.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on_off = |b: bool| if b { "on" } else { "off" };
        if let Some(d) = self.driver {
            write!(f, ",driver={}", if d == EthDriver::Xdp { "xdp" } else { "packet" })?;
        }
        if let Some(q) = self.qdisc {
            write!(f, ",qdisc={}", on_off(q))?;
        }
        if let Some(n) = self.frame {
            write!(f, ",frame={n}")?;
        }
        if let Some(d) = self.data_messages {
            write!(f, ",data-messages={}", on_off(d))?;
        }
        if let Some(b) = self.data_batching {
            write!(f, ",data-batching={}", on_off(b))?;
        }
        if let Some(c) = self.payload_crc {
            write!(f, ",crc={}", if c { "full" } else { "header" })?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `host:port`; a bare host gets [`DEFAULT_PORT`].
    Tcp(String),
    Unix(PathBuf),
    /// Raw Ethernet on interface `ifaces[0]`, bundled with the others if there are more; to
    /// connect, the target's `mac` on the first interface (found by discovery when absent; a
    /// target listens on the interfaces and needs none); the sessions' settings.
    Eth {
        ifaces: Vec<String>,
        mac: Option<[u8; 6]>,
        options: EthOptions,
    },
}

impl Endpoint {
    /// Raw Ethernet on the one interface `iface`.
    pub fn eth(iface: impl Into<String>, mac: Option<[u8; 6]>) -> Endpoint {
        Endpoint::Eth { ifaces: vec![iface.into()], mac, options: EthOptions::default() }
    }

    pub fn parse(s: &str) -> Result<Endpoint, EndpointError> {
        if let Some(rest) = s.strip_prefix("eth:") {
            let (rest, options) = match rest.split_once(',') {
                Some((r, o)) => (r, EthOptions::parse(o)?),
                None => (rest, EthOptions::default()),
            };
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
            return Ok(Endpoint::Eth { ifaces, mac, options });
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
            Endpoint::Eth { ifaces, mac: None, options } => write!(f, "eth:{}{options}", ifaces.join("+")),
            Endpoint::Eth { ifaces, mac: Some(mac), options } => {
                write!(f, "eth:{}/{}{options}", ifaces.join("+"), format_mac(mac))
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
        assert_eq!(Endpoint::parse("eth:veth0").unwrap(), Endpoint::eth("veth0", None));
        let with_mac = Endpoint::parse("eth:veth0/02:00:0A:ff:00:01").unwrap();
        assert_eq!(with_mac, Endpoint::eth("veth0", Some([2, 0, 10, 255, 0, 1])));
        assert_eq!(with_mac.to_string(), "eth:veth0/02:00:0a:ff:00:01");
        let bundle = Endpoint::parse("eth:veth0+veth2/02:00:00:00:00:01").unwrap();
        let both = vec!["veth0".to_owned(), "veth2".to_owned()];
        assert_eq!(
            bundle,
            Endpoint::Eth { ifaces: both, mac: Some([2, 0, 0, 0, 0, 1]), options: EthOptions::default() }
        );
        assert_eq!(bundle.to_string(), "eth:veth0+veth2/02:00:00:00:00:01");
        assert_eq!(Endpoint::parse("eth:veth0+"), Err(EndpointError::EmptyInterface));
        assert_eq!(Endpoint::parse("eth:a+b+a"), Err(EndpointError::RepeatedInterface("a".into())));
        assert_eq!(Endpoint::parse("eth:"), Err(EndpointError::EmptyInterface));
        assert_eq!(Endpoint::parse("eth:/02:00:00:00:00:01"), Err(EndpointError::EmptyInterface));
        assert!(matches!(Endpoint::parse("eth:v/02:00:00:00:00"), Err(EndpointError::BadMac(_))));
        assert!(matches!(Endpoint::parse("eth:v/02:00:00:00:00:zz"), Err(EndpointError::BadMac(_))));
    }

    #[test]
    fn eth_options_parse_print_back_and_refuse_what_they_do_not_know() {
        let e = Endpoint::parse("eth:veth0+veth1/02:00:00:00:00:01,frame=4000,driver=xdp,data-messages=off")
            .unwrap();
        let Endpoint::Eth { ifaces, mac, options } = &e else { panic!("{e:?}") };
        assert_eq!((ifaces.len(), mac.is_some()), (2, true));
        let want = EthOptions {
            driver: Some(EthDriver::Xdp),
            frame: Some(4000),
            data_messages: Some(false),
            ..EthOptions::default()
        };
        assert_eq!(*options, want);
        assert_eq!(
            e.to_string(),
            "eth:veth0+veth1/02:00:00:00:00:01,driver=xdp,frame=4000,data-messages=off"
        );
        assert_eq!(Endpoint::parse(&e.to_string()).unwrap(), e);
        let no_mac = Endpoint::parse("eth:veth0,qdisc=on,data-batching=off,crc=header").unwrap();
        assert_eq!(no_mac.to_string(), "eth:veth0,qdisc=on,data-batching=off,crc=header");
        let Endpoint::Eth { options, .. } = Endpoint::parse("eth:v,crc=full").unwrap() else {
            unreachable!()
        };
        assert_eq!(options.payload_crc, Some(true));
        let refused = |s: &str| match Endpoint::parse(s) {
            Err(EndpointError::BadOption(item, _)) => item,
            other => panic!("{s}: {other:?}"),
        };
        assert_eq!(refused("eth:v,driver=dpdk"), "driver=dpdk");
        assert_eq!(refused("eth:v,frame=63"), "frame=63");
        assert_eq!(refused("eth:v,frame=65508"), "frame=65508");
        assert_eq!(refused("eth:v,frame=8972,frame=64"), "frame=64");
        assert_eq!(refused("eth:v,qdisc=yes"), "qdisc=yes");
        assert_eq!(refused("eth:v,crc=off"), "crc=off");
        assert_eq!(refused("eth:v,mtu=1500"), "mtu=1500");
        assert_eq!(refused("eth:v,"), "");
        assert_eq!(refused("eth:v/02:00:00:00:00:01,xdp"), "xdp");
        assert!(Endpoint::parse("eth:v,frame=64").is_ok() && Endpoint::parse("eth:v,frame=65507").is_ok());
    }
}
