//! Worker processes and their turns on a coordination [`Board`] (rstore::coordination), shared
//! by RSort and Carafe.
//!
//! The coordinator's side: [`Workers`] starts the processes, tells the board's `gather` when
//! one of them exited before its time ([`Workers::watch`]), and collects what each printed.
//! A worker's side: [`serve`] waits for each phase, runs it, and reports it, or reports the
//! error that ended it, so that the coordinator names this worker and its reason.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rstore::{Board, Segment, Step};

use crate::Result;

/// Worker processes started by a coordinator; those still running when this is dropped are
/// killed.
pub struct Workers {
    children: Vec<Option<Child>>,
    /// What each printed on stdout, once it exited.
    out: Vec<Vec<u8>>,
}

impl Workers {
    /// Start `n` workers, worker `i` from the command `command(i)` (its stdout is taken; its
    /// stderr is this process's).
    pub fn spawn(n: usize, mut command: impl FnMut(usize) -> Command) -> Result<Workers> {
        let mut workers = Workers { children: Vec::with_capacity(n), out: vec![Vec::new(); n] };
        for i in 0..n {
            let child =
                command(i).stdout(Stdio::piped()).spawn().map_err(|e| format!("starting worker {i}: {e}"))?;
            workers.children.push(Some(child));
        }
        Ok(workers)
    }

    /// No process: the workers are started by somebody else.
    pub fn none() -> Workers {
        Workers { children: Vec::new(), out: Vec::new() }
    }

    /// An error naming the first worker that exited while the run still needs it: for
    /// [`Board::gather`]'s watch.
    pub fn watch(&mut self) -> std::result::Result<(), String> {
        for (i, slot) in self.children.iter_mut().enumerate() {
            if let Some(child) = slot {
                match child.try_wait() {
                    Ok(None) => {}
                    Ok(Some(status)) => {
                        *slot = None;
                        return Err(format!("worker {i} exited before the run ended ({status})"));
                    }
                    Err(e) => return Err(format!("worker {i}: {e}")),
                }
            }
        }
        Ok(())
    }

    /// Wait for every worker to exit once the board said done, and parse the last line each
    /// printed as JSON (its report).
    pub fn finish(mut self, patience: Duration) -> Result<Vec<serde_json::Value>> {
        let deadline = std::time::Instant::now() + patience;
        for i in 0..self.children.len() {
            let Some(mut child) = self.children[i].take() else {
                return Err(format!("worker {i} exited before the run ended").into());
            };
            let status = loop {
                if let Some(status) = child.try_wait()? {
                    break status;
                }
                if std::time::Instant::now() >= deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("worker {i} did not exit after the run ended").into());
                }
                std::thread::sleep(Duration::from_millis(2));
            };
            if let Some(mut pipe) = child.stdout.take() {
                std::io::Read::read_to_end(&mut pipe, &mut self.out[i])?;
            }
            if !status.success() {
                return Err(format!("worker {i} failed ({status})").into());
            }
        }
        self.out
            .iter()
            .enumerate()
            .map(|(i, out)| {
                let text = String::from_utf8_lossy(out);
                let last = text.lines().last().unwrap_or("");
                serde_json::from_str(last).map_err(|e| format!("worker {i}'s report {last:?}: {e}").into())
            })
            .collect()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for child in self.children.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Worker `i`'s turns on `board` (in `seg`): for each phase the coordinator starts, `phase(seg,
/// p, orders)` runs (reading its assignment from the board if it has one) and its result is
/// reported; until the coordinator says done. An error in a phase is reported on the board
/// (the coordinator names this worker and the reason) and returned.
pub fn serve(
    board: &Board,
    seg: &mut Segment,
    i: usize,
    mut phase: impl FnMut(&mut Segment, u64, &[u8]) -> Result<Vec<u8>>,
) -> Result<()> {
    let mut after = None;
    loop {
        let p = match board.next(seg, i, after)? {
            Step::Done => return Ok(()),
            Step::Phase(p) => p,
        };
        let ran = (|| {
            let orders = board.orders(seg)?;
            phase(seg, p, &orders)
        })();
        match ran {
            Ok(report) => board.report(seg, i, p, &report)?,
            Err(e) => {
                let _ = board.fail(seg, i, &format!("phase {p}: {e}"));
                return Err(e);
            }
        }
        after = Some(p);
    }
}
