//! Admission: which connections the target takes, and which it lets go to make room.
//!
//! Three bounds hold at accept ([`Bounds`]): connections open in all (`connections_max`),
//! connections from one address (`connections_per_address_max`), and connections still in
//! their handshake (`handshakes_max`). A connection that completed its handshake is never
//! evicted; one still in its handshake is the first to go when a bound is reached, oldest
//! first, so a flood of connections that stall before or during the handshake can only ever
//! push out each other, never lock out a client that completes its own.
//!
//! The book is behind a mutex taken at accept, once when a handshake completes, and at close:
//! never on the data path. An evicted connection leaves the counts at once; its worker closes
//! it when the acceptor wakes it.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::Bounds;

/// One admitted connection's place in the book.
#[derive(Debug)]
pub(crate) struct Ticket {
    /// The worker that owns the connection, to wake when it is evicted.
    pub worker: usize,
    addr: Option<IpAddr>,
    /// Set (under the book's lock) when the acceptor evicted it: its worker closes it, and it
    /// no longer counts.
    evicted: AtomicBool,
    /// Set (under the book's lock) once it has left the book, by eviction or close.
    released: AtomicBool,
}

impl Ticket {
    pub fn is_evicted(&self) -> bool {
        self.evicted.load(Relaxed)
    }
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    ConnectionsMax,
    PerAddressMax,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Refusal::ConnectionsMax => "connections_max reached",
            Refusal::PerAddressMax => "connections_per_address_max reached for this address",
        })
    }
}

/// An admission: the new connection's ticket, and the tickets evicted to make room for it
/// (their workers must be woken).
#[derive(Debug)]
pub(crate) struct Admitted {
    pub ticket: Arc<Ticket>,
    pub evicted: Vec<Arc<Ticket>>,
}

#[derive(Debug, Default)]
struct Book {
    per_address: HashMap<IpAddr, usize>,
    /// Connections in their handshake, oldest first.
    handshaking: VecDeque<Arc<Ticket>>,
}

#[derive(Debug, Default)]
pub(crate) struct Admission {
    book: Mutex<Book>,
}

impl Admission {
    fn book(&self) -> MutexGuard<'_, Book> {
        // A panic elsewhere while holding the lock leaves counts that are still consistent
        // (every update is a single step), so a poisoned lock is used as it is.
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admit a connection from `addr` for `worker`, evicting handshakes if a bound needs it.
    /// `open` is the target's gauge of open connections, kept here.
    pub fn admit(
        &self,
        addr: Option<IpAddr>,
        worker: usize,
        bounds: &Bounds,
        open: &AtomicUsize,
    ) -> Result<Admitted, Refusal> {
        let mut book = self.book();
        let mut evicted = Vec::new();
        if let Some(ip) = addr {
            let from_here = book.per_address.get(&ip).copied().unwrap_or(0);
            if from_here >= bounds.connections_per_address_max.max(1) {
                let pos = book.handshaking.iter().position(|t| t.addr == Some(ip));
                let victim = pos.and_then(|i| book.handshaking.remove(i)).ok_or(Refusal::PerAddressMax)?;
                evict(&mut book, &victim, open);
                evicted.push(victim);
            }
        }
        if open.load(Relaxed) >= bounds.connections_max.max(1) {
            let victim = book.handshaking.pop_front().ok_or(Refusal::ConnectionsMax)?;
            evict(&mut book, &victim, open);
            evicted.push(victim);
        }
        if book.handshaking.len() >= bounds.handshakes_max.max(1) {
            if let Some(victim) = book.handshaking.pop_front() {
                evict(&mut book, &victim, open);
                evicted.push(victim);
            }
        }
        let ticket = Arc::new(Ticket {
            worker,
            addr,
            evicted: AtomicBool::new(false),
            released: AtomicBool::new(false),
        });
        if let Some(ip) = addr {
            *book.per_address.entry(ip).or_default() += 1;
        }
        book.handshaking.push_back(ticket.clone());
        open.fetch_add(1, Relaxed);
        Ok(Admitted { ticket, evicted })
    }

    /// The connection completed its handshake: it can no longer be evicted.
    pub fn established(&self, ticket: &Arc<Ticket>) {
        let mut book = self.book();
        if let Some(i) = book.handshaking.iter().position(|t| Arc::ptr_eq(t, ticket)) {
            book.handshaking.remove(i);
        }
    }

    /// The connection closed: it leaves the counts (unless an eviction already took it out).
    pub fn closed(&self, ticket: &Arc<Ticket>, open: &AtomicUsize) {
        let mut book = self.book();
        if ticket.released.load(Relaxed) {
            return;
        }
        if let Some(i) = book.handshaking.iter().position(|t| Arc::ptr_eq(t, ticket)) {
            book.handshaking.remove(i);
        }
        release(&mut book, ticket, open);
    }

    /// Connections in their handshake now.
    #[cfg(test)]
    fn handshaking(&self) -> usize {
        self.book().handshaking.len()
    }
}

fn evict(book: &mut Book, victim: &Ticket, open: &AtomicUsize) {
    victim.evicted.store(true, Relaxed);
    release(book, victim, open);
}

fn release(book: &mut Book, ticket: &Ticket, open: &AtomicUsize) {
    ticket.released.store(true, Relaxed);
    open.fetch_sub(1, Relaxed);
    if let Some(ip) = ticket.addr {
        if let Some(n) = book.per_address.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                book.per_address.remove(&ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(total: usize, per_address: usize, handshakes: usize) -> Bounds {
        Bounds {
            connections_max: total,
            connections_per_address_max: per_address,
            handshakes_max: handshakes,
            ..Bounds::default()
        }
    }

    fn ip(last: u8) -> Option<IpAddr> {
        Some(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn stalled_handshakes_make_room_oldest_first_and_established_ones_stay() {
        let (a, open) = (Admission::default(), AtomicUsize::new(0));
        let b = bounds(4, 100, 100);
        let est = a.admit(ip(1), 0, &b, &open).unwrap().ticket;
        a.established(&est);
        let stalled: Vec<_> = (0..3).map(|_| a.admit(ip(2), 0, &b, &open).unwrap().ticket).collect();
        assert_eq!(open.load(Relaxed), 4);
        // Full: the next one evicts the oldest handshake, not the established connection.
        let next = a.admit(ip(3), 1, &b, &open).unwrap();
        assert_eq!(next.evicted.len(), 1);
        assert!(Arc::ptr_eq(&next.evicted[0], &stalled[0]));
        assert!(stalled[0].is_evicted() && !est.is_evicted());
        assert_eq!(open.load(Relaxed), 4);
        // Closing an evicted connection does not count it twice.
        a.closed(&stalled[0], &open);
        assert_eq!(open.load(Relaxed), 4);
        // With every connection established, a full target refuses.
        for t in stalled[1..].iter().chain([&next.ticket]) {
            a.established(t);
        }
        assert_eq!(a.admit(ip(4), 0, &b, &open).unwrap_err(), Refusal::ConnectionsMax);
        a.closed(&est, &open);
        assert_eq!(open.load(Relaxed), 3);
        assert!(a.admit(ip(4), 0, &b, &open).is_ok());
    }

    #[test]
    fn the_per_address_cap_evicts_that_address_handshakes_or_refuses() {
        let (a, open) = (Admission::default(), AtomicUsize::new(0));
        let b = bounds(100, 2, 100);
        let other = a.admit(ip(9), 0, &b, &open).unwrap().ticket;
        let first = a.admit(ip(1), 0, &b, &open).unwrap().ticket;
        let second = a.admit(ip(1), 0, &b, &open).unwrap().ticket;
        let third = a.admit(ip(1), 0, &b, &open).unwrap();
        assert!(Arc::ptr_eq(&third.evicted[0], &first), "the address's own oldest handshake goes");
        assert!(!other.is_evicted());
        a.established(&second);
        a.established(&third.ticket);
        assert_eq!(a.admit(ip(1), 0, &b, &open).unwrap_err(), Refusal::PerAddressMax);
        // Unix-socket peers have no address and no per-address cap.
        for _ in 0..5 {
            a.admit(None, 0, &b, &open).unwrap();
        }
    }

    #[test]
    fn handshakes_are_bounded_on_their_own() {
        let (a, open) = (Admission::default(), AtomicUsize::new(0));
        let b = bounds(100, 100, 3);
        let mut evicted = 0;
        for _ in 0..10 {
            evicted += a.admit(ip(1), 0, &b, &open).unwrap().evicted.len();
        }
        assert_eq!((evicted, a.handshaking(), open.load(Relaxed)), (7, 3, 3));
    }
}
