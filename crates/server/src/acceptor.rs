//! The acceptor: takes new connections, admits them ([`crate::admission`]), and deals them to
//! workers round-robin. It is the only thread that ever hands work to a worker, and only once
//! per connection; it wakes a worker otherwise only to have it close a connection it evicted.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use transport::event::{Events, Interest, Poll, Token, Waker};
use transport::Listener;

use crate::conn::Protocol;
use crate::worker::Inbox;

use crate::Shared;

const WAKE: Token = Token(usize::MAX);

pub(crate) struct Acceptor {
    poll: Poll,
    waker: Arc<Waker>,
    listeners: Vec<(Listener, Protocol)>,
    inboxes: Vec<Inbox>,
    shared: Arc<Shared>,
    next: usize,
}

impl Acceptor {
    pub fn new(
        mut listeners: Vec<(Listener, Protocol)>,
        inboxes: Vec<Inbox>,
        shared: Arc<Shared>,
    ) -> io::Result<Acceptor> {
        let poll = Poll::new()?;
        for (i, (l, _)) in listeners.iter_mut().enumerate() {
            poll.registry().register(l, Token(i), Interest::READABLE)?;
        }
        let waker = Arc::new(Waker::new(poll.registry(), WAKE)?);
        Ok(Acceptor { poll, waker, listeners, inboxes, shared, next: 0 })
    }

    pub fn waker(&self) -> Arc<Waker> {
        self.waker.clone()
    }

    pub fn run(mut self) {
        self.shared.acceptor_tid.store(rt::usage::thread_id(), Ordering::Relaxed);
        let mut events = Events::with_capacity(16);
        while !self.shared.shutdown.load(Ordering::Acquire) {
            if let Err(e) = self.poll.poll(&mut events, None) {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(error = %e, "acceptor poll failed; no new connections");
                    return;
                }
            }
            for ev in events.iter() {
                if ev.token() != WAKE {
                    self.accept_all(ev.token().0);
                }
            }
        }
    }

    fn accept_all(&mut self, index: usize) {
        loop {
            let (listener, protocol) = &mut self.listeners[index];
            let protocol = *protocol;
            let stream = match listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: log and go on.
                    tracing::warn!(error = %e, "accept failed");
                    return;
                }
            };
            let worker = self.next % self.inboxes.len();
            let shared = &self.shared;
            let admitted =
                shared.admission.admit(stream.peer_ip(), worker, &shared.config.bounds, &shared.connections);
            let admitted = match admitted {
                Ok(a) => a,
                Err(why) => {
                    let refused = shared.listener.connections_refused.fetch_add(1, Ordering::Relaxed) + 1;
                    // Said at 1, 2, 4, 8, ... refusals: a flood must not flood the log too.
                    if refused.is_power_of_two() {
                        tracing::warn!(peer = %stream.peer(), refused, "connection refused: {why}");
                    }
                    continue;
                }
            };
            self.next += 1;
            for victim in &admitted.evicted {
                shared.listener.connections_evicted.fetch_add(1, Ordering::Relaxed);
                let _ = self.inboxes[victim.worker].1.wake();
            }
            let (inbox, waker) = &self.inboxes[worker];
            if inbox.send((stream, protocol, admitted.ticket)).is_ok() {
                let _ = waker.wake();
            }
        }
    }
}
