//! The coordination service of RStore's applications (issue 30; `rstore::coordination`) on a
//! real etcd and two memory servers: a coordinator and three workers (threads, each with
//! mappings of its own, as processes on other machines would have) move through phases with
//! orders, assignments and reports; a worker's error ends the run naming it and its reason,
//! and aborts the others; a worker that stops beating is found; so is a coordinator that does.

use std::time::{Duration, Instant};

use rstore::{Board, Coordinator, Party, Segment, Step, Stop};
use skiff_tests::etcd::Cluster;
use skiff_tests::{memory_server, KillOnDrop};

const NS: &str = "board";
const WORKERS: usize = 3;

fn segment(c: &Coordinator) -> Segment {
    skiff_tests::rstore::segment(c, NS, 0)
}

fn board() -> Board {
    let mut b = Board::new(512, WORKERS).unwrap();
    // Long beside the 100 ms beat, so that a loaded CI machine does not pass for a dead one.
    b.dead_after = Duration::from_secs(2);
    b
}

/// Worker `i`: through phases until done, reporting `i * 100 + phase + orders[0]`; phase
/// `fail_at` fails instead, and `vanish_at` stops beating and never reports.
fn worker(
    c: Coordinator,
    i: usize,
    fail_at: Option<u64>,
    vanish_at: Option<u64>,
) -> std::thread::JoinHandle<Result<u64, String>> {
    std::thread::spawn(move || {
        let b = board();
        let mut seg = segment(&c);
        let mut beat = Some(b.heartbeat(segment(&c), Party::Worker(i)).unwrap());
        let mut phases = 0;
        let served = apps::workers::serve(&b, &mut seg, i, |seg, p, orders| {
            let assignment = b.assignment(seg, i)?;
            assert_eq!(assignment[0], i as u8 + 10, "each worker reads its own assignment");
            if fail_at == Some(p) {
                return Err(format!("no room for bucket {i}").into());
            }
            if vanish_at == Some(p) {
                beat.take();
                std::thread::sleep(Duration::from_secs(30));
            }
            phases += 1;
            Ok(vec![((i * 100) as u8).wrapping_add(p as u8).wrapping_add(orders[0])])
        });
        served.map(|()| phases).map_err(|e| e.to_string())
    })
}

/// A run of `phases` phases; the coordinator's error, if it stopped, and each worker's result.
fn run(
    c: &Coordinator,
    phases: u64,
    fail_at: Option<(usize, u64)>,
    vanish_at: Option<(usize, u64)>,
) -> (Result<(), Stop>, Vec<Result<u64, String>>) {
    let b = board();
    let mut seg = segment(c);
    b.reset(&mut seg).unwrap();
    let _beat = b.heartbeat(segment(c), Party::Coordinator).unwrap();
    for i in 0..WORKERS {
        b.assign(&mut seg, i, &[i as u8 + 10]).unwrap();
    }
    let threads: Vec<_> = (0..WORKERS)
        .map(|i| {
            let f = fail_at.filter(|&(w, _)| w == i).map(|(_, p)| p);
            let v = vanish_at.filter(|&(w, _)| w == i).map(|(_, p)| p);
            worker(c.again(), i, f, v)
        })
        .collect();
    let coordinated = (|| {
        for p in 0..phases {
            b.start(&mut seg, p, &[7]).unwrap();
            let reports = b.gather(&mut seg, p, || Ok(()))?;
            for (i, r) in reports.iter().enumerate() {
                assert_eq!(
                    r[0],
                    ((i * 100) as u8).wrapping_add(p as u8).wrapping_add(7),
                    "worker {i}'s report of phase {p}"
                );
            }
        }
        b.finish(&mut seg).unwrap();
        Ok(())
    })();
    let done: Vec<_> =
        threads
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                if vanish_at.is_some_and(|(w, _)| w == i) {
                    Err("vanished".into())
                } else {
                    t.join().unwrap()
                }
            })
            .collect();
    (coordinated, done)
}

#[test]
fn a_board_moves_workers_through_phases_and_ends_a_run_with_a_named_reason_never_a_hang() {
    let etcd = Cluster::start(1);
    let url = etcd.url();
    let _servers: Vec<KillOnDrop> =
        (0..2).map(|_| memory_server(env!("CARGO_BIN_EXE_skiff"), &url, "ram:16M", &[])).collect();
    let c = Coordinator::connect(std::slice::from_ref(&url));
    let start = Instant::now();
    while c.servers().map(|s| s.len()).unwrap_or(0) != 2 {
        assert!(start.elapsed() < Duration::from_secs(60), "the memory servers never registered");
        std::thread::sleep(Duration::from_millis(100));
    }
    c.create_ns(NS, coord::Scope::Ram, 1 << 20, 1).unwrap();
    c.reserve(NS, 1 << 20).unwrap();
    c.alloc(NS, 1 << 20, Some(0)).unwrap();

    // 300 phases: the phase tags wrap past 250 and every step still pairs up.
    let (coordinated, workers) = run(&c, 300, None, None);
    coordinated.unwrap();
    assert_eq!(workers, vec![Ok(300); WORKERS]);

    // Worker 1 fails in phase 2: the coordinator names it and its reason, the others stop
    // with the coordinator's abort.
    let (coordinated, workers) = run(&c, 5, Some((1, 2)), None);
    match coordinated {
        Err(Stop::Failed { worker: 1, why }) => assert!(why.contains("no room for bucket 1"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(workers[1].as_ref().unwrap_err().contains("no room for bucket 1"));
    for i in [0, 2] {
        let e = workers[i].as_ref().unwrap_err();
        assert!(e.contains("aborted") && e.contains("worker 1 failed"), "worker {i}: {e}");
    }

    // Worker 2 stops beating in phase 1 and never reports: found after dead_after, and the
    // others are aborted.
    let (coordinated, workers) = run(&c, 5, None, Some((2, 1)));
    match coordinated {
        Err(Stop::Silent { who: Party::Worker(2), for_ }) => assert!(for_ >= board().dead_after),
        other => panic!("{other:?}"),
    }
    for i in [0, 1] {
        assert!(workers[i].as_ref().unwrap_err().contains("worker 2 stopped beating"), "{:?}", workers[i]);
    }

    // A worker that comes before its run, on the board the last run left (aborted): it waits
    // for the new run's phase 0, not the old run's end.
    let early = {
        let c = c.again();
        std::thread::spawn(move || board().next(&mut segment(&c), 0, None))
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(!early.is_finished(), "a worker took an earlier run's end for its own");
    let b = board();
    let mut seg = segment(&c);
    b.reset(&mut seg).unwrap();
    let beat = b.heartbeat(segment(&c), Party::Coordinator).unwrap();
    b.start(&mut seg, 0, &[]).unwrap();
    assert_eq!(early.join().unwrap().unwrap(), Step::Phase(0));
    drop(beat);

    // The coordinator vanishes: a worker waiting for its next phase finds it silent.
    let b = board();
    let mut seg = segment(&c);
    b.reset(&mut seg).unwrap();
    {
        let _beat = b.heartbeat(segment(&c), Party::Coordinator).unwrap();
        b.start(&mut seg, 0, &[]).unwrap();
        assert_eq!(b.next(&mut seg, 0, None).unwrap(), Step::Phase(0));
    }
    match b.next(&mut seg, 0, Some(0)) {
        Err(Stop::Silent { who: Party::Coordinator, .. }) => {}
        other => panic!("{other:?}"),
    }
}
