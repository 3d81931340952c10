//! `skiff floor`: what this machine charges for the primitives an I/O is made of, measured the
//! same way every time, so that skiff's CPU per I/O can be broken into parts beside its floor
//! (docs/PERFORMANCE.md, "The floor"; issue 31).
//!
//! Each primitive runs in batches on a thread pinned to `--cpu` (its peer, where it has one,
//! on `--peer-cpu`); the figure is the median over the batches of the mean cost per operation,
//! so one interruption (another task, a VM exit) spoils a batch, not the result.
//!
//! - `memcpy_4k_hot`: copying 4 KiB between two buffers that stay in the cache.
//! - `memcpy_4k_cold`: copying a 4 KiB block picked at random from 64 MiB into another, so
//!   that both miss the caches: what a copy of data nobody touched lately costs.
//! - `syscall`: the cheapest system call there is (`getppid`): entering and leaving the kernel.
//! - `recv_empty`: a non-blocking receive on a socket with nothing in it (`EAGAIN`): a poll
//!   that finds nothing.
//! - `tcp_4k`, `tcp_64k`: 4 KiB (64 KiB) sent on a loopback TCP connection and received at
//!   the other end by the same thread: two system calls, the kernel's two copies and its TCP
//!   path, no wake-up. The two sizes split the cost into a part per call and a part per byte.
//! - `tcp_4k_apart`, `tcp_64k_apart`: the same messages sent by a thread on the peer CPU
//!   and received on this one, as between a target and an initiator pinned apart: the CPU
//!   time of both threads per message, wake-ups of a full or empty socket
//!   included (`CLOCK_THREAD_CPUTIME_ID`).
//! - `cache_line`: a cache line moving from one CPU to the other (half a ping-pong of an
//!   atomic between two spinning threads).
//! - `wakeup`: one thread waking another asleep on the other CPU (half a ping-pong over a
//!   Unix socket pair, each side blocked in `read`): the cross-core wake-up that decides
//!   low-queue-depth latency on this VM.
//! - `veth_N`, `veth_N_apart` (with `--veth`): frames of N payload bytes over a veth pair
//!   through AF_PACKET rings, as the raw-Ethernet transport sends them (queued in the transmit
//!   ring, one `sendto` per window of 128, taken from the receive ring): in CPU time per frame,
//!   on one thread, and from a sender on the peer CPU to a receiver here.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;

use crate::CliResult;

#[derive(Args)]
pub struct FloorArgs {
    /// The CPU the measuring thread runs on.
    #[arg(long, default_value_t = 0)]
    cpu: usize,
    /// The CPU of the peer thread (cache-line transfer, wake-up).
    #[arg(long, default_value_t = 1)]
    peer_cpu: usize,
    /// Batches per primitive (the figure is their median).
    #[arg(long, default_value_t = 15)]
    batches: usize,
    /// Each batch runs for about this long.
    #[arg(long, value_parser = crate::units::parse_duration, default_value = "20ms")]
    batch: Duration,
    /// Also measure raw frames over a veth pair: `HOST,NS/PEER`, the host end in this
    /// network namespace and the peer end in namespace NS (`ip netns add NS`). Needs root.
    #[arg(long, value_name = "HOST,NS/PEER")]
    veth: Option<String>,
    /// Payload bytes of the frames sent over `--veth` (each at most the pair's MTU).
    #[arg(long, value_delimiter = ',', default_value = "1500,9000")]
    frame_bytes: Vec<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// One primitive's cost.
#[derive(Debug, serde::Serialize)]
struct Figure {
    name: String,
    /// Median over the batches of the mean nanoseconds per operation.
    ns: f64,
    /// The lowest and highest batch means, for the spread.
    ns_min: f64,
    ns_max: f64,
    what: String,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    cpu: usize,
    peer_cpu: usize,
    batches: usize,
    figures: Vec<Figure>,
}

pub fn run(args: FloorArgs) -> CliResult {
    // A bad --veth fails before anything is measured.
    let veth = args.veth.as_deref().map(VethEnds::parse).transpose()?;
    rt::task::pin_to_cpu(args.cpu)?;
    let m = Measure { batches: args.batches.max(1), batch: args.batch };
    let mut figures = vec![
        m.figure("memcpy_4k_hot", "copy 4 KiB, both buffers in cache", memcpy_hot()),
        m.figure("memcpy_4k_cold", "copy 4 KiB, a random block of 64 MiB into another", memcpy_cold()),
        m.figure("syscall", "getppid(2): into the kernel and back", syscall()),
        m.figure("recv_empty", "non-blocking recv on an empty socket (EAGAIN)", recv_empty()?),
        m.figure("tcp_4k", "4 KiB over loopback TCP, sent and received by one thread", tcp(4096)?),
        m.figure("tcp_64k", "64 KiB over loopback TCP, sent and received by one thread", tcp(65536)?),
        tcp_apart(&m, args.peer_cpu, 4096)?,
        tcp_apart(&m, args.peer_cpu, 65536)?,
        cache_line(&m, args.peer_cpu)?,
        wakeup(&m, args.peer_cpu)?,
    ];
    if let Some(pair) = &veth {
        for &bytes in &args.frame_bytes {
            figures.push(veth_frames(&m, pair, bytes, None)?);
            figures.push(veth_frames(&m, pair, bytes, Some(args.peer_cpu))?);
        }
    }
    let report = Report { cpu: args.cpu, peer_cpu: args.peer_cpu, batches: m.batches, figures };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "the floor on this machine (thread on CPU {}, peer on CPU {}), median of {} batches:",
            report.cpu, report.peer_cpu, report.batches
        );
        println!("| primitive | ns per op | batch range | what |");
        println!("|---|---:|---:|---|");
        for f in &report.figures {
            println!("| {} | {:.1} | {:.1}-{:.1} | {} |", f.name, f.ns, f.ns_min, f.ns_max, f.what);
        }
    }
    Ok(ExitCode::SUCCESS)
}

struct Measure {
    batches: usize,
    batch: Duration,
}

impl Measure {
    /// Time `op` (which does `n` operations when called with `n`) in batches, by the wall
    /// clock.
    fn figure(&self, name: &str, what: &str, mut op: impl FnMut(u64)) -> Figure {
        self.figure_by(name, what, |n| {
            let started = Instant::now();
            op(n);
            started.elapsed().as_nanos() as f64
        })
    }

    /// Measure `op` in batches: called with `n`, it does `n` operations and returns what they
    /// cost in nanoseconds (of the wall clock, or of CPU time).
    fn figure_by(&self, name: &str, what: &str, mut op: impl FnMut(u64) -> f64) -> Figure {
        // How many operations fill a batch: from a short trial, doubling.
        let mut n = 1u64;
        loop {
            let started = Instant::now();
            op(n);
            if started.elapsed() >= self.batch / 8 || n >= 1 << 30 {
                break;
            }
            n *= 2;
        }
        let mut means: Vec<f64> = (0..self.batches)
            .map(|_| {
                let per = n * 8;
                op(per) / per as f64
            })
            .collect();
        means.sort_by(f64::total_cmp);
        Figure {
            name: name.to_owned(),
            ns: means[means.len() / 2],
            ns_min: means[0],
            ns_max: means[means.len() - 1],
            what: what.to_owned(),
        }
    }

    /// A primitive with a peer thread pinned to `peer_cpu`, running `peer` until `stop` tells
    /// it to end. `op` does `n` round trips; the figure is half a round trip.
    fn pair_figure(
        &self,
        (name, what): (&'static str, &'static str),
        peer_cpu: usize,
        peer: impl FnOnce() + Send + 'static,
        op: impl FnMut(u64),
        stop: impl FnOnce(),
    ) -> std::io::Result<Figure> {
        let (pinned_tx, pinned_rx) = std::sync::mpsc::channel();
        let peer = std::thread::spawn(move || {
            let pinned = rt::task::pin_to_cpu(peer_cpu);
            let ok = pinned.is_ok();
            let _ = pinned_tx.send(pinned);
            if ok {
                peer();
            }
        });
        // A peer that cannot run where asked never answers: measure nothing then.
        let pinned = pinned_rx.recv().unwrap_or_else(|_| Err(std::io::Error::other("the peer thread died")));
        let figure = pinned.map(|()| self.figure(name, what, op));
        stop();
        peer.join().map_err(|_| std::io::Error::other("the peer thread panicked"))?;
        let mut f = figure?;
        for v in [&mut f.ns, &mut f.ns_min, &mut f.ns_max] {
            *v /= 2.0;
        }
        Ok(f)
    }
}

impl Measure {
    /// Something sent by a thread pinned to `peer_cpu` (`send`, `n` at a time) and taken here
    /// (`receive`, the same `n`), in the CPU time of both threads per operation: each batch
    /// asks the sender for `n`, receives them, and adds the sender's CPU time to its own.
    fn apart_figure(
        &self,
        name: &str,
        what: &str,
        peer_cpu: usize,
        mut send: impl FnMut(u64) -> std::io::Result<()> + Send + 'static,
        mut receive: impl FnMut(u64) -> std::io::Result<()>,
    ) -> std::io::Result<Figure> {
        let gone = || std::io::Error::other("the sender is gone");
        let (ask, asked) = std::sync::mpsc::channel::<u64>();
        let (tell, told) = std::sync::mpsc::channel::<std::io::Result<u64>>();
        let sender = std::thread::spawn(move || {
            if let Err(e) = rt::task::pin_to_cpu(peer_cpu) {
                let _ = tell.send(Err(e));
                return;
            }
            // Each request is a batch: send it, then say what it cost this thread.
            while let Ok(n) = asked.recv() {
                let before = rt::usage::thread_cpu_ns();
                let cost = send(n).map(|()| rt::usage::thread_cpu_ns() - before);
                if tell.send(cost).is_err() {
                    return;
                }
            }
        });
        let mut failed = None;
        let figure = self.figure_by(name, what, |n| {
            if failed.is_some() {
                return f64::NAN;
            }
            let before = rt::usage::thread_cpu_ns();
            let received = ask.send(n).map_err(|_| gone()).and_then(|()| {
                receive(n)?;
                told.recv().map_err(|_| gone())?
            });
            match received {
                Ok(sender_ns) => (rt::usage::thread_cpu_ns() - before + sender_ns) as f64,
                Err(e) => {
                    // The sender may have said why it is gone (it could not run on its CPU).
                    failed = Some(told.try_recv().ok().and_then(Result::err).unwrap_or(e));
                    f64::NAN
                }
            }
        });
        // Whatever the sender waits on (the next batch, or the receiver's word) goes away.
        drop((ask, receive));
        sender.join().map_err(|_| std::io::Error::other("the sender thread panicked"))?;
        failed.map_or(Ok(figure), Err)
    }
}

fn memcpy_hot() -> impl FnMut(u64) {
    let src = vec![0x5Au8; 4096];
    let mut dst = vec![0u8; 4096];
    move |n| {
        for _ in 0..n {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        }
    }
}

fn memcpy_cold() -> impl FnMut(u64) {
    const BLOCKS: usize = (64 << 20) / 4096;
    let src: Vec<u8> = (0..BLOCKS * 4096).map(|i| i as u8).collect();
    let mut dst = vec![0u8; BLOCKS * 4096];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    move |n| {
        for _ in 0..n {
            // xorshift: a block far from the last, in an order the prefetcher cannot follow.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let (from, to) = ((x as usize) % BLOCKS, ((x >> 32) as usize) % BLOCKS);
            dst[to * 4096..][..4096].copy_from_slice(&src[from * 4096..][..4096]);
            std::hint::black_box(&mut dst);
        }
    }
}

fn syscall() -> impl FnMut(u64) {
    |n| {
        for _ in 0..n {
            std::hint::black_box(std::os::unix::process::parent_id());
        }
    }
}

fn recv_empty() -> std::io::Result<impl FnMut(u64)> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
    socket.set_nonblocking(true)?;
    let mut buf = [0u8; 64];
    Ok(move |n| {
        for _ in 0..n {
            let got = socket.recv(&mut buf);
            assert!(matches!(&got, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock), "{got:?}");
        }
    })
}

fn tcp(bytes: usize) -> std::io::Result<impl FnMut(u64)> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let mut a = std::net::TcpStream::connect(listener.local_addr()?)?;
    let (mut b, _) = listener.accept()?;
    a.set_nodelay(true)?;
    let out = vec![0xA5u8; bytes];
    let mut back = vec![0u8; bytes];
    Ok(move |n| {
        for _ in 0..n {
            a.write_all(&out).expect("a loopback send");
            b.read_exact(&mut back).expect("a loopback receive");
        }
    })
}

/// Messages of `bytes` from a thread on `peer_cpu` to this one over loopback TCP, in the CPU
/// time of both threads.
fn tcp_apart(m: &Measure, peer_cpu: usize, bytes: usize) -> std::io::Result<Figure> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let mut sender = std::net::TcpStream::connect(listener.local_addr()?)?;
    let (mut receiver, _) = listener.accept()?;
    sender.set_nodelay(true)?;
    let out = vec![0xA5u8; bytes];
    let mut back = vec![0u8; bytes];
    let kib = bytes / 1024;
    m.apart_figure(
        &format!("tcp_{kib}k_apart"),
        &format!("{kib} KiB over loopback TCP from the peer CPU: CPU of both threads"),
        peer_cpu,
        move |n| (0..n).try_for_each(|_| sender.write_all(&out)),
        move |n| (0..n).try_for_each(|_| receiver.read_exact(&mut back)),
    )
}

/// An atomic ping-pong between two spinning threads: this side writes an odd number, the
/// peer answers with the next even one, so each round trip moves the line across and back.
fn cache_line(m: &Measure, peer_cpu: usize) -> std::io::Result<Figure> {
    let line = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (peer_line, peer_stop) = (line.clone(), stop.clone());
    let peer = move || {
        while !peer_stop.load(Ordering::Acquire) {
            let v = peer_line.load(Ordering::Acquire);
            if v % 2 == 1 {
                peer_line.store(v + 1, Ordering::Release);
            }
            std::hint::spin_loop();
        }
    };
    let mut next = 1u64;
    let op = move |n: u64| {
        for _ in 0..n {
            line.store(next, Ordering::Release);
            while line.load(Ordering::Acquire) != next + 1 {
                std::hint::spin_loop();
            }
            next += 2;
        }
    };
    let what = ("cache_line", "a cache line from one CPU to the other");
    m.pair_figure(what, peer_cpu, peer, op, move || stop.store(true, Ordering::Release))
}

/// A byte ping-pong over a Unix socket pair, each side asleep in a blocking `read` until the
/// other writes: every half round trip is a wake-up across CPUs. The peer stops when this side
/// closes its end.
fn wakeup(m: &Measure, peer_cpu: usize) -> std::io::Result<Figure> {
    let (mut here, mut there) = std::os::unix::net::UnixStream::pair()?;
    let peer = move || {
        let mut b = [0u8; 1];
        while let Ok(1) = there.read(&mut b) {
            if there.write_all(&b).is_err() {
                return;
            }
        }
    };
    let closer = here.try_clone()?;
    let op = move |n: u64| {
        let mut b = [7u8; 1];
        for _ in 0..n {
            here.write_all(&b).expect("a write to the peer");
            here.read_exact(&mut b).expect("the peer's answer");
        }
    };
    let what = ("wakeup", "waking a thread asleep on the other CPU (Unix socket)");
    m.pair_figure(what, peer_cpu, peer, op, move || {
        let _ = closer.shutdown(std::net::Shutdown::Both);
    })
}

/// The two ends of a veth pair: `host` in this namespace, `peer` in namespace `ns`.
struct VethEnds {
    host: String,
    ns: String,
    peer: String,
}

impl VethEnds {
    fn parse(s: &str) -> std::io::Result<VethEnds> {
        let bad = || {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("--veth {s:?}: expected HOST,NS/PEER"),
            )
        };
        let (host, far) = s.split_once(',').ok_or_else(bad)?;
        let (ns, peer) = far.split_once('/').ok_or_else(bad)?;
        if host.is_empty() || ns.is_empty() || peer.is_empty() {
            return Err(bad());
        }
        Ok(VethEnds { host: host.to_owned(), ns: ns.to_owned(), peer: peer.to_owned() })
    }

    /// AF_PACKET sockets on both ends (the peer's opened inside its namespace; a socket stays
    /// in the namespace it was opened in wherever it is used), with slots for `bytes`.
    fn open(&self, bytes: usize) -> std::io::Result<(eth::packet::PacketSocket, eth::packet::PacketSocket)> {
        // A slot holds the ring's header, an Ethernet header and a frame of the interface's
        // MTU (the two ends of a pair share it; a peer whose MTU is larger fails to open).
        let mtu_path = format!("/sys/class/net/{}/mtu", self.host);
        let mtu: usize = std::fs::read_to_string(&mtu_path)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{mtu_path}: {e}")))?
            .trim()
            .parse()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{mtu_path}: {e}")))?;
        let slot_bytes =
            (mtu.max(bytes) + eth::packet::ETH_HEADER_LEN + 128).next_multiple_of(4096).max(16 << 10);
        let ring = eth::packet::RingConfig { slot_bytes, rx_slots: 256, tx_slots: 64, ..Default::default() };
        let host = eth::packet::PacketSocket::open(&self.host, eth::packet::ETHERTYPE, ring)?;
        let (iface, path) = (self.peer.clone(), format!("/run/netns/{}", self.ns));
        let peer = std::thread::spawn(move || {
            rt::netns::enter(std::path::Path::new(&path))?;
            eth::packet::PacketSocket::open(&iface, eth::packet::ETHERTYPE, ring)
        })
        .join()
        .map_err(|_| std::io::Error::other("the thread opening the peer end panicked"))??;
        for (end, s) in [(&self.host, &host), (&self.peer, &peer)] {
            if s.mtu() < bytes {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{end} has an MTU of {}, below the {bytes}-byte frames asked for", s.mtu()),
                ));
            }
        }
        Ok((host, peer))
    }
}

/// Frames of `bytes` over the veth pair, in CPU time per frame: queued in the host end's
/// transmit ring and sent with one `sendto` per window, taken from the peer end's receive
/// ring. On one thread (`apart` `None`), or sent by a thread on another CPU and received here
/// (the CPU time of both threads). A window never exceeds the receive ring, so nothing drops.
fn veth_frames(m: &Measure, pair: &VethEnds, bytes: usize, apart: Option<usize>) -> std::io::Result<Figure> {
    const WINDOW: u64 = 128;
    let (mut host, mut peer) = pair.open(bytes)?;
    let dst = peer.mac();
    let payload = vec![0x5Au8; bytes];
    // Take `n` frames from the peer end, sleeping in poll when none wait.
    let take = |peer: &mut eth::packet::PacketSocket, n: u64| -> std::io::Result<()> {
        let mut got = 0;
        while got < n {
            let now = peer.receive(|_, _| {}) as u64;
            got += now;
            if now == 0 {
                let ready = transport::wait_fd(peer.as_raw_fd(), false, Some(Duration::from_secs(5)))?;
                if !ready.readable {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "frames sent over the veth pair never arrived",
                    ));
                }
            }
        }
        Ok(())
    };
    // Send `n` frames in windows; `between` runs after each window (the receiver's turn).
    fn send(
        host: &mut eth::packet::PacketSocket,
        dst: eth::packet::Mac,
        payload: &[u8],
        n: u64,
        mut between: impl FnMut(u64) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let mut left = n;
        while left > 0 {
            let window = left.min(WINDOW);
            let mut queued = 0;
            while queued < window {
                if host.queue(dst, &[payload])? {
                    queued += 1;
                } else {
                    host.flush()?;
                }
            }
            host.flush()?;
            between(window)?;
            left -= window;
        }
        Ok(())
    }
    let Some(peer_cpu) = apart else {
        let name = format!("veth_{bytes}");
        let what =
            format!("a {bytes}-byte frame over veth (AF_PACKET rings), sent and received by one thread");
        let mut failed = None;
        let figure = m.figure_by(&name, &what, |n| {
            let before = rt::usage::thread_cpu_ns();
            if let Err(e) = send(&mut host, dst, &payload, n, |w| take(&mut peer, w)) {
                failed.get_or_insert(e);
            }
            (rt::usage::thread_cpu_ns() - before) as f64
        });
        return failed.map_or(Ok(figure), Err);
    };
    // Each window the sender waits for the receiver's word that it is in.
    let (got_tx, got_rx) = std::sync::mpsc::channel::<()>();
    m.apart_figure(
        &format!("veth_{bytes}_apart"),
        &format!("a {bytes}-byte frame over veth from the peer CPU: CPU of both threads"),
        peer_cpu,
        move |n| {
            send(&mut host, dst, &payload, n, |_| {
                got_rx.recv().map_err(|_| std::io::Error::other("the receiver is gone"))
            })
        },
        move |n| {
            let mut left = n;
            while left > 0 {
                let window = left.min(WINDOW);
                take(&mut peer, window)?;
                got_tx.send(()).map_err(|_| std::io::Error::other("the sender is gone"))?;
                left -= window;
            }
            Ok(())
        },
    )
}
