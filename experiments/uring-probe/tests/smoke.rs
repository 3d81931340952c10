//! Every mode moves a fixed number of caravans intact: the client checks sequence, tags and every
//! data byte, and both sides must agree on the counts. No time or speed is asserted.

use skiff_uring_probe::{check_available, run_mode, Mode, ProbeError, Stop, Workload};

fn require_io_uring() {
    if let Err(e) = check_available() {
        panic!("io_uring is unavailable, so the io_uring modes cannot be tested here: {e}");
    }
}

fn run_all_modes(w: Workload, caravans: u64) {
    require_io_uring();
    for mode in Mode::ALL {
        let sample = match run_mode(mode, &w, Stop::Caravans(caravans)) {
            Ok(sample) => sample,
            Err(e @ ProbeError::Unavailable(_)) => {
                panic!("mode {} cannot run on this kernel: {e}", mode.name())
            }
            Err(e) => panic!("mode {} failed with {w:?}: {e}", mode.name()),
        };
        let payloads = caravans * w.caravan as u64;
        assert_eq!(sample.client.caravans, caravans, "{}: caravans checked", mode.name());
        assert_eq!(sample.client.payloads, payloads, "{}: payloads checked", mode.name());
        assert_eq!(sample.server.caravans, caravans, "{}: caravans served", mode.name());
        assert_eq!(sample.server.payloads, payloads, "{}: payloads served", mode.name());
        assert!(sample.server.syscalls > 0, "{}: syscalls counted", mode.name());
    }
}

#[test]
fn default_shape_arrives_intact() {
    run_all_modes(Workload { caravan: 16, outstanding: 8, bs: 4096 }, 64);
}

#[test]
fn ping_pong_arrives_intact() {
    run_all_modes(Workload { caravan: 1, outstanding: 1, bs: 4096 }, 64);
}

/// 4 MiB in flight: sends fill the socket (short writes, EAGAIN) and one batch needs more than
/// IOV_MAX iovecs, so the resume paths of every mode run.
#[test]
fn full_socket_and_iov_max_arrive_intact() {
    run_all_modes(Workload { caravan: 64, outstanding: 16, bs: 4096 }, 48);
}

/// Odd sizes: blocks that are not page multiples shift every later byte if one is lost.
#[test]
fn odd_block_size_arrives_intact() {
    run_all_modes(Workload { caravan: 3, outstanding: 5, bs: 520 }, 100);
}
