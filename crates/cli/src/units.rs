//! Parsing and printing sizes and durations as people type and read them.

use std::time::Duration;

use rt::poll::PollMode;

/// Why a command-line value does not parse.
#[derive(Debug, thiserror::Error)]
pub enum ArgError {
    #[error(transparent)]
    Size(#[from] backend::SpecError),
    #[error("bad duration {0:?} (try 10s, 500ms, 2m)")]
    Duration(String),
    #[error("duration {0:?} must be positive")]
    DurationNotPositive(String),
    #[error("{0:?}: at most 4 GiB - 2, or off")]
    DirectMin(String),
    #[error("{0:?}: expected off, hybrid, hybrid:MICROSECONDS, adaptive or adaptive:MICROSECONDS")]
    Poll(String),
    #[error("{0:?}: expected off, static, static:N (N >= 1) or adaptive")]
    Batching(String),
}

/// `4k`, `64KiB`, `1G`, `4096`: binary units.
pub fn parse_size(s: &str) -> Result<u64, ArgError> {
    Ok(backend::parse_size(s)?)
}

/// `10s`, `500ms`, `2m`, `1.5s`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, ArgError> {
    let s = s.trim();
    let (num, scale) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| ArgError::Duration(s.to_owned()))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(ArgError::DurationNotPositive(s.to_owned()));
    }
    Ok(Duration::from_secs_f64(v * scale))
}

/// A timeout that may be off: `off` or `0` for never, else a duration as [`parse_duration`].
pub fn parse_timeout(s: &str) -> Result<Duration, ArgError> {
    match s.trim() {
        "off" | "0" => Ok(Duration::ZERO),
        _ => parse_duration(s),
    }
}

/// `--direct-min SIZE | off`: the average read size from which lanes place read data directly
/// in the callers' buffers (`off`: never).
pub fn parse_direct_min(s: &str) -> Result<u32, ArgError> {
    if s == "off" {
        return Ok(u32::MAX);
    }
    let n = parse_size(s).map_err(|_| ArgError::DirectMin(s.to_owned()))?;
    u32::try_from(n).ok().filter(|&n| n < u32::MAX).ok_or_else(|| ArgError::DirectMin(s.to_owned()))
}

/// Spin bound of hybrid polling when `--poll hybrid` or `adaptive` names none: long enough to
/// cover a loopback round trip at queue depth 1, and two wake-ups on a small VM.
pub const HYBRID_SPIN_DEFAULT_US: u64 = 50;

/// `--poll off | hybrid[:US] | adaptive[:US]`: sleep at once, spin US on every wait, or learn
/// when and how long to spin (at most US per wait).
pub fn parse_poll(s: &str) -> Result<PollMode, ArgError> {
    let bad = || ArgError::Poll(s.to_owned());
    let (name, bound) = match s.split_once(':') {
        None => (s, Duration::from_micros(HYBRID_SPIN_DEFAULT_US)),
        Some((name, us)) => match us.parse::<u64>() {
            Ok(us) if us > 0 && name != "off" => (name, Duration::from_micros(us)),
            _ => return Err(bad()),
        },
    };
    match name {
        "off" => Ok(PollMode::Off),
        "hybrid" => Ok(PollMode::Fixed(bound)),
        "adaptive" => Ok(PollMode::Adaptive(bound)),
        _ => Err(bad()),
    }
}

/// Bytes in binary units, e.g. `1.0 GiB`.
pub fn human_bytes(b: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i < units.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", units[i])
}

/// A count with thousands separators.
pub fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_numbers() {
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("3").unwrap(), Duration::from_secs(3));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("fast").is_err());
        assert_eq!(parse_timeout("off").unwrap(), Duration::ZERO);
        assert_eq!(parse_timeout("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_timeout("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(grouped(1234567), "1,234,567");
        assert_eq!(grouped(999), "999");
        assert_eq!(human_bytes(1536.0), "1.5 KiB");
        assert_eq!(parse_poll("off").unwrap(), PollMode::Off);
        assert_eq!(parse_direct_min("128k").unwrap(), 128 << 10);
        assert_eq!((parse_direct_min("0").unwrap(), parse_direct_min("off").unwrap()), (0, u32::MAX));
        assert!(parse_direct_min("8G").is_err() && parse_direct_min("some").is_err());
        assert_eq!(
            parse_poll("hybrid").unwrap(),
            PollMode::Fixed(Duration::from_micros(HYBRID_SPIN_DEFAULT_US))
        );
        assert_eq!(parse_poll("hybrid:20").unwrap(), PollMode::Fixed(Duration::from_micros(20)));
        assert_eq!(parse_poll("adaptive").unwrap(), PollMode::Adaptive(Duration::from_micros(50)));
        assert_eq!(parse_poll("adaptive:80").unwrap(), PollMode::Adaptive(Duration::from_micros(80)));
        for bad in ["hybrid:0", "busy", "off:5", "adaptive:", "adaptive:x", "hybrid:-1"] {
            assert!(parse_poll(bad).is_err(), "{bad}");
        }
    }
}
