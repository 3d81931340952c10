//! Telling a service manager how the daemon is doing: systemd's `sd_notify` protocol, written
//! here without libsystemd.
//!
//! A unit with `Type=notify` starts the process with `$NOTIFY_SOCKET` naming a Unix datagram
//! socket, and waits for a datagram saying `READY=1` before it calls the service started (and
//! starts what is ordered after it). The datagram is newline-separated `KEY=VALUE` lines. A
//! name starting with `/` is a socket file; one starting with `@` lives in Linux's abstract
//! namespace (the `@` stands for the leading NUL byte). Without the variable there is nobody
//! to tell, and every call here does nothing.

use std::ffi::OsString;
use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The environment variable naming the service manager's socket.
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

/// The service is up: its listeners accept connections. `status` is a line for
/// `systemctl status`.
pub fn ready(status: &str) -> io::Result<bool> {
    notify(&format!("READY=1\nSTATUS={}", one_line(status)))
}

/// The service is shutting down.
pub fn stopping() -> io::Result<bool> {
    notify("STOPPING=1")
}

/// Send `state` to the socket `$NOTIFY_SOCKET` names. Returns whether there was one.
pub fn notify(state: &str) -> io::Result<bool> {
    match std::env::var_os(NOTIFY_SOCKET) {
        Some(socket) if !socket.is_empty() => notify_to(&socket, state).map(|()| true),
        _ => Ok(false),
    }
}

/// Send `state` to the notification socket `socket` (a path, or `@` and an abstract name).
pub fn notify_to(socket: &OsString, state: &str) -> io::Result<()> {
    let bytes = socket.as_bytes();
    let addr = match bytes.first() {
        Some(b'/') => SocketAddr::from_pathname(socket)?,
        Some(b'@') => SocketAddr::from_abstract_name(&bytes[1..])?,
        _ => {
            let what = format!("{}={socket:?}: expected a path or an @abstract name", NOTIFY_SOCKET);
            return Err(io::Error::new(io::ErrorKind::InvalidInput, what));
        }
    };
    let sent = UnixDatagram::unbound()?.send_to_addr(state.as_bytes(), &addr)?;
    if sent != state.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "notification datagram cut short"));
    }
    Ok(())
}

/// A value fit for one `KEY=VALUE` line.
fn one_line(s: &str) -> String {
    s.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn receive(socket: &UnixDatagram) -> String {
        socket.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 512];
        let n = socket.recv(&mut buf).expect("a notification");
        String::from_utf8(buf[..n].to_vec()).unwrap()
    }

    #[test]
    fn notifications_reach_a_socket_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let manager = UnixDatagram::bind(&path).unwrap();
        notify_to(&path.into_os_string(), "READY=1\nSTATUS=up").unwrap();
        assert_eq!(receive(&manager), "READY=1\nSTATUS=up");
    }

    #[test]
    fn notifications_reach_an_abstract_socket() {
        let name = format!("skiff-notify-test-{}", std::process::id());
        let manager =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
        notify_to(&format!("@{name}").into(), "STOPPING=1").unwrap();
        assert_eq!(receive(&manager), "STOPPING=1");
    }

    #[test]
    fn other_socket_names_are_refused() {
        let e = notify_to(&"vsock:2:1234".into(), "READY=1").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(one_line("a\nb"), "a b");
    }
}
