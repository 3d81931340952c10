//! One measured run: a server thread in the mode under test, a client thread on plain syscalls,
//! one loopback TCP connection between them.

use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;

use crate::client::{self, ClientStats, Stop, Workload};
use crate::error::ProbeError;
use crate::server::{self, Mode, ServerStats};

#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub mode: Mode,
    pub server: ServerStats,
    pub client: ClientStats,
}

impl Sample {
    pub fn caravans_per_s(&self) -> f64 {
        self.client.caravans as f64 / self.client.elapsed.as_secs_f64()
    }

    pub fn payloads_per_s(&self) -> f64 {
        self.client.payloads as f64 / self.client.elapsed.as_secs_f64()
    }

    pub fn server_cpu_us_per_payload(&self) -> f64 {
        cpu_us(&self.server.usage) as f64 / self.server.payloads as f64
    }

    pub fn client_cpu_us_per_payload(&self) -> f64 {
        cpu_us(&self.client.usage) as f64 / self.client.payloads as f64
    }

    pub fn server_syscalls_per_caravan(&self) -> f64 {
        self.server.syscalls as f64 / self.server.caravans as f64
    }

    pub fn server_ctx_per_caravan(&self) -> f64 {
        self.server.usage.ctx_switches() as f64 / self.server.caravans as f64
    }

    pub fn client_ctx_per_caravan(&self) -> f64 {
        self.client.usage.ctx_switches() as f64 / self.client.caravans as f64
    }
}

/// Run `mode` once. Fails if either side saw a malformed or corrupt frame, or if the two sides
/// disagree on how many caravans and payloads went through.
pub fn run_mode(mode: Mode, w: &Workload, stop: Stop) -> Result<Sample, ProbeError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(ProbeError::io("bind"))?;
    let addr = listener.local_addr().map_err(ProbeError::io("local_addr"))?;
    let limits = w.limits();
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let server = thread::Builder::new()
        .name(format!("server-{}", mode.name()))
        .spawn(move || {
            let (sock, _) = listener.accept().map_err(ProbeError::io("accept"))?;
            sock.set_nodelay(true).map_err(ProbeError::io("set_nodelay"))?;
            server::serve(mode, sock, limits, &|| {
                let _ = ready_tx.send(());
            })
        })
        .map_err(ProbeError::io("spawn"))?;

    let client = TcpStream::connect(addr)
        .and_then(|sock| sock.set_nodelay(true).map(|()| sock))
        .map_err(ProbeError::io("connect"))
        .and_then(|sock| match ready_rx.recv() {
            Ok(()) => client::run(sock, w, stop),
            // The server failed during set-up; its own error says why.
            Err(_) => Err(ProbeError::Corrupt("the server ended before it was ready".into())),
        });
    let server = server.join().map_err(|_| ProbeError::Corrupt("the server thread panicked".into()))?;
    // The server's error comes first: a failing server shows up at the client only as a
    // closed connection.
    let (server, client) = (server?, client?);
    if server.caravans != client.caravans || server.payloads != client.payloads {
        return Err(ProbeError::Corrupt(format!(
            "server answered {} caravans ({} payloads), client checked {} ({})",
            server.caravans, server.payloads, client.caravans, client.payloads
        )));
    }
    Ok(Sample { mode, server, client })
}

/// User plus system time, as getrusage reports it.
fn cpu_us(u: &rt::usage::Usage) -> u64 {
    u.user_us + u.sys_us
}
