//! The metrics endpoint's HTTP: a tiny blocking HTTP/1.1 responder on a thread of its own.
//!
//! It answers one client at a time, one request per connection (`Connection: close`), which
//! is all a Prometheus scraper needs. `GET /metrics` (or `HEAD`) gets the exposition, any other
//! path 404, any other method 405. Every client is bounded in what it may send (the request
//! head, [`ClientBounds::head_bytes_max`]; larger gets 431) and in how long the whole exchange
//! may take ([`ClientBounds::time_max`]), so a scraper that stalls or trickles bytes holds the
//! endpoint for at most that long and never reaches a worker.
//!
//! This is the one socket of the server crate that does not go through `transport`: a
//! side channel in plain blocking `std::net`, away from the data path and its event loops.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What one client may cost the endpoint.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientBounds {
    /// Bytes of request line and headers. A scraper sends a few hundred.
    pub head_bytes_max: usize,
    /// Time from accept to the last byte of the response.
    pub time_max: Duration,
}

impl Default for ClientBounds {
    fn default() -> ClientBounds {
        ClientBounds { head_bytes_max: 8 << 10, time_max: Duration::from_secs(5) }
    }
}

/// Serve until `stop` is set; [`wake`] unblocks the accept so the flag is seen. `render`
/// produces the exposition for each scrape.
pub(crate) fn serve(
    listener: TcpListener,
    bounds: ClientBounds,
    stop: &AtomicBool,
    render: impl Fn() -> String,
) {
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        match conn {
            Ok(stream) => {
                if let Err(e) = exchange(stream, bounds, &render) {
                    tracing::debug!(error = %e, "metrics client dropped");
                }
            }
            Err(e) => {
                // Out of descriptors, most likely: say so, and do not spin on it.
                tracing::warn!(error = %e, "metrics accept failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Unblock [`serve`]'s accept by connecting to it (after its stop flag is set). Returns
/// whether the connection was made.
pub(crate) fn wake(addr: SocketAddr) -> bool {
    let mut to = addr;
    if to.ip().is_unspecified() {
        // Bound to every address: any local one reaches it.
        to.set_ip(if addr.is_ipv4() { [127, 0, 0, 1].into() } else { std::net::Ipv6Addr::LOCALHOST.into() });
    }
    TcpStream::connect_timeout(&to, Duration::from_secs(1)).is_ok()
}

/// What a request asks for.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    /// The exposition; `body` is false for `HEAD`.
    Metrics {
        body: bool,
    },
    NotFound,
    MethodNotAllowed,
    BadRequest,
}

/// Judge a request head (request line and headers) by its request line.
fn route(head: &[u8]) -> Route {
    let Some(line) = head.split(|&b| b == b'\n').next() else { return Route::BadRequest };
    let Ok(line) = std::str::from_utf8(line) else { return Route::BadRequest };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Route::BadRequest;
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Route::BadRequest;
    }
    let path = target.split_once('?').map_or(target, |(path, _)| path);
    let body = match method {
        "GET" => true,
        "HEAD" => false,
        _ => return Route::MethodNotAllowed,
    };
    if path == "/metrics" {
        Route::Metrics { body }
    } else {
        Route::NotFound
    }
}

/// Why a request head could not be read whole.
enum HeadError {
    TooLarge,
    Io(io::Error),
}

/// Read up to the blank line that ends the request head, within the bounds.
fn read_head(stream: &mut TcpStream, bounds: ClientBounds, deadline: Instant) -> Result<Vec<u8>, HeadError> {
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HeadError::Io(io::ErrorKind::TimedOut.into()));
        }
        stream.set_read_timeout(Some(left)).map_err(HeadError::Io)?;
        let n = stream.read(&mut chunk).map_err(HeadError::Io)?;
        if n == 0 {
            return Err(HeadError::Io(io::ErrorKind::UnexpectedEof.into()));
        }
        head.extend_from_slice(&chunk[..n]);
        if let Some(end) = head_end(&head) {
            head.truncate(end);
            return Ok(head);
        }
        if head.len() > bounds.head_bytes_max {
            return Err(HeadError::TooLarge);
        }
    }
}

/// Where the head ends: after the first empty line (CRLF or bare LF line endings).
fn head_end(bytes: &[u8]) -> Option<usize> {
    let crlf = bytes.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    let lf = bytes.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn exchange(mut stream: TcpStream, bounds: ClientBounds, render: &impl Fn() -> String) -> io::Result<()> {
    let deadline = Instant::now() + bounds.time_max;
    let response = match read_head(&mut stream, bounds, deadline) {
        Ok(head) => match route(&head) {
            Route::Metrics { body } => {
                let text = render();
                let mut r = header("200 OK", super::CONTENT_TYPE, text.len(), "");
                if body {
                    r.extend_from_slice(text.as_bytes());
                }
                r
            }
            Route::NotFound => plain("404 Not Found", "not found: the metrics are at /metrics\n", ""),
            Route::MethodNotAllowed => {
                plain("405 Method Not Allowed", "only GET and HEAD\n", "Allow: GET, HEAD\r\n")
            }
            Route::BadRequest => plain("400 Bad Request", "bad request\n", ""),
        },
        Err(HeadError::TooLarge) => {
            plain("431 Request Header Fields Too Large", "request head too large\n", "")
        }
        Err(HeadError::Io(e)) => return Err(e),
    };
    write_within(&mut stream, &response, deadline)?;
    // Close our side first so the client sees the end of the response, not a reset.
    let _ = stream.shutdown(Shutdown::Write);
    Ok(())
}

fn header(status: &str, content_type: &str, len: usize, extra: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len}\r\n{extra}Connection: close\r\n\r\n"
    )
    .into_bytes()
}

fn plain(status: &str, body: &str, extra: &str) -> Vec<u8> {
    let mut r = header(status, "text/plain; charset=utf-8", body.len(), extra);
    r.extend_from_slice(body.as_bytes());
    r
}

/// Write all of `bytes` before `deadline`, however slowly the client reads.
fn write_within(stream: &mut TcpStream, mut bytes: &[u8], deadline: Instant) -> io::Result<()> {
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_write_timeout(Some(left))?;
        match stream.write(bytes)? {
            0 => return Err(io::ErrorKind::WriteZero.into()),
            n => bytes = &bytes[n..],
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn requests_route_by_method_and_path() {
        assert_eq!(route(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), Route::Metrics { body: true });
        assert_eq!(route(b"HEAD /metrics?x=1 HTTP/1.0\n\n"), Route::Metrics { body: false });
        assert_eq!(route(b"GET / HTTP/1.1\r\n\r\n"), Route::NotFound);
        assert_eq!(route(b"GET /metrics/ HTTP/1.1\r\n\r\n"), Route::NotFound);
        assert_eq!(route(b"POST /metrics HTTP/1.1\r\n\r\n"), Route::MethodNotAllowed);
        assert_eq!(route(b"GET /metrics\r\n\r\n"), Route::BadRequest);
        assert_eq!(route(b"GET metrics HTTP/1.1\r\n\r\n"), Route::BadRequest);
        assert_eq!(route(b"GET /metrics SPDY/3\r\n\r\n"), Route::BadRequest);
        assert_eq!(route(b"\xff\xfe /metrics HTTP/1.1\r\n\r\n"), Route::BadRequest);
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n\r\nbody"), Some(24));
        assert_eq!(head_end(b"GET / HTTP/1.1\nA: b\n\n"), Some(21));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n"), None);
    }

    /// An endpoint on an ephemeral port with short client bounds; stopped on drop.
    struct Endpoint {
        addr: SocketAddr,
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl Endpoint {
        fn start(bounds: ClientBounds) -> Endpoint {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let flag = stop.clone();
            let thread = std::thread::spawn(move || serve(listener, bounds, &flag, || "up 1\n".to_owned()));
            Endpoint { addr, stop, thread: Some(thread) }
        }

        /// Send `request` and read the whole response.
        fn ask(&self, request: &[u8]) -> String {
            let mut s = TcpStream::connect(self.addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            s.write_all(request).unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            out
        }
    }

    impl Drop for Endpoint {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Release);
            assert!(wake(self.addr));
            self.thread.take().unwrap().join().unwrap();
        }
    }

    #[test]
    fn answers_scrapes_and_refuses_the_rest() {
        let e = Endpoint::start(ClientBounds::default());
        let ok = e.ask(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains("Content-Type: text/plain; version=0.0.4") && ok.ends_with("\r\n\r\nup 1\n"),
            "{ok}"
        );
        let head = e.ask(b"HEAD /metrics HTTP/1.1\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n") && head.contains("Content-Length: 5\r\n"), "{head}");
        assert!(head.ends_with("\r\n\r\n"), "no body for HEAD: {head}");
        assert!(e.ask(b"GET /favicon.ico HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
        assert!(e.ask(b"DELETE /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405 "));
        assert!(e.ask(b"nonsense\r\n\r\n").starts_with("HTTP/1.1 400 "));
    }

    #[test]
    fn an_oversized_head_is_refused() {
        let e = Endpoint::start(ClientBounds { head_bytes_max: 256, ..ClientBounds::default() });
        let mut big = b"GET /metrics HTTP/1.1\r\n".to_vec();
        big.extend(std::iter::repeat_n(b'a', 1024));
        let reply = e.ask(&big);
        assert!(reply.starts_with("HTTP/1.1 431 "), "{reply}");
    }

    #[test]
    fn a_stalled_client_does_not_hold_the_endpoint() {
        let e =
            Endpoint::start(ClientBounds { time_max: Duration::from_millis(200), ..ClientBounds::default() });
        // Connected, half a request line, and then nothing: dropped at its deadline.
        let mut stalled = TcpStream::connect(e.addr).unwrap();
        stalled.write_all(b"GET /met").unwrap();
        let reply = e.ask(b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
        stalled.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut rest = Vec::new();
        assert_eq!(
            stalled.read_to_end(&mut rest).unwrap(),
            0,
            "the stalled client got no answer, only a close"
        );
    }
}
