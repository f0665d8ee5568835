//! The workers' scheduling priority, and the kernel's softirq threads on their CPUs.
//!
//! A pinned worker polls its CPU without pause. At the default nice 0 any other task
//! woken on that CPU (a node agent's timer, a kworker) shares it with the worker by
//! equal weight: measured here, a host agent woken once a second took the worker's CPU
//! for up to 20 ms at a time (12 runs, 88 ms in 10 s), and what arrived meanwhile
//! waited in the rings. At nice -20 the worker weighs 87 times a nice-0 task: the
//! scheduler wakes other tasks on other CPUs, and one that does run there gets a small
//! share. So workers pinned by `--cpus` run at nice -20 by default (`--worker-nice`).
//!
//! Softirq work raised on a worker's CPU runs ahead of any task, at interrupt exit or
//! in the syscall that raised it; what the kernel defers to that CPU's `ksoftirqd/N`
//! (a sustained receive load) competes as a task. At nice 0 against a -20 worker it
//! would get about 1% of the CPU and the interface's receive side would starve, so kxp
//! gives each worker CPU's `ksoftirqd` the workers' nice while it runs (the share the
//! two had before, half each when both are busy) and puts its nice back at exit.

use std::fs;

/// The nice workers pinned to CPUs run at unless told otherwise.
pub const PINNED_WORKER_NICE: i32 = -20;

/// The nice value of process or thread `pid` (`/proc/PID/stat`, field 19), if it exists.
pub fn nice_of(pid: libc::pid_t) -> Option<i32> {
    parse_stat_nice(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Field 19 (nice) of a `/proc/PID/stat` line; the command name (field 2) is in
/// parentheses and may hold spaces and parentheses, so fields count from the last `)`.
fn parse_stat_nice(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After the name: field 3 (state) is the first; nice is field 19.
    rest.split_whitespace().nth(19 - 3)?.parse().ok()
}

/// The CPU a `ksoftirqd/N` kthread serves, from its name.
fn ksoftirqd_cpu(comm: &str) -> Option<usize> {
    let n = comm.strip_prefix("ksoftirqd/")?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

/// The `ksoftirqd` kthreads of `cpus` this process can see: (CPU, PID).
fn ksoftirqd_of(cpus: &[usize]) -> Vec<(usize, libc::pid_t)> {
    crate::napi::candidate_pids()
        .into_iter()
        .filter_map(|pid| {
            let comm = fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            let cpu = ksoftirqd_cpu(comm.trim_end())?;
            cpus.contains(&cpu).then_some((cpu, pid))
        })
        .collect()
}

/// The `ksoftirqd` kthreads of the workers' CPUs kept at the workers' nice, put back
/// when dropped.
#[derive(Debug)]
pub struct SoftirqNice {
    cpus: Vec<usize>,
    nice: i32,
    /// (CPU, PID, nice before kxp changed it).
    raised: Vec<(usize, libc::pid_t, i32)>,
    /// The kthreads found by the last scan of /proc (per-CPU: scanned again only when
    /// one is gone, a CPU taken offline).
    found: Vec<(usize, libc::pid_t)>,
}

impl SoftirqNice {
    /// For workers on `cpus` at nice `nice`; nothing is changed before [`Self::check`].
    pub fn new(cpus: Vec<usize>, nice: i32) -> Self {
        SoftirqNice {
            cpus,
            nice,
            raised: Vec::new(),
            found: Vec::new(),
        }
    }

    /// Gives the `ksoftirqd` of each of the workers' CPUs the workers' nice where its
    /// own is higher (a lower priority): at start, and again whenever something put it
    /// back (another kxp that ended, a tuning script). Each change is logged, each
    /// failure warned about at most once a minute.
    pub fn check(&mut self) {
        let (cpus, nice) = (&self.cpus, self.nice);
        if self.found.is_empty() || self.found.iter().any(|&(_, p)| nice_of(p).is_none()) {
            self.found = ksoftirqd_of(cpus);
        }
        let found = self.found.clone();
        if found.is_empty() {
            crate::warn_limited!(
                "ksoftirqd-unseen",
                "kxp sees no ksoftirqd thread of the workers' CPUs {cpus:?} (another PID namespace: a pod without hostPID?): softirq work the kernel defers there runs at its own priority against workers at nice {nice}"
            );
        }
        for (cpu, pid) in found {
            let Some(now) = nice_of(pid) else { continue };
            if now <= nice {
                continue;
            }
            match crate::sys::set_nice(pid, nice) {
                Ok(()) => {
                    tracing::info!(
                        "ksoftirqd/{cpu} (pid {pid}) set to nice {nice} (was {now}) while kxp runs, beside the worker on CPU {cpu}"
                    );
                    if !self.raised.iter().any(|r| r.1 == pid) {
                        self.raised.push((cpu, pid, now));
                    }
                }
                Err(e) => crate::warn_limited!(
                    format!("ksoftirqd-nice-{cpu}"),
                    "cannot set ksoftirqd/{cpu} (pid {pid}) to nice {nice}: {e} (needs CAP_SYS_NICE); softirq work deferred to it competes with the worker at nice {now}"
                ),
            }
        }
    }
}

impl Drop for SoftirqNice {
    fn drop(&mut self) {
        for &(cpu, pid, before) in &self.raised {
            match crate::sys::set_nice(pid, before) {
                Ok(()) => tracing::debug!("ksoftirqd/{cpu} (pid {pid}) back to nice {before}"),
                Err(e) => tracing::warn!(
                    "cannot put ksoftirqd/{cpu} (pid {pid}) back to nice {before}: {e}"
                ),
            }
        }
    }
}

/// A start with no kxp forwarding (the first, or a restart after a crash or a stop)
/// holds the node's Service traffic until its first publication (the steering left by
/// the previous kxp redirects into sockets nobody serves), and on a busy node its threads
/// share their CPUs with everything else there: so kxp runs its start at the workers'
/// nice and puts its threads back at the first publication. Measured under the macro
/// benchmark's load (`macro-bench --restart`), a kill -9 with 110 pod veths stalled the
/// backend 0.26-0.29 s at nice 0 and 0.17 s at -20.
static START_BOOST: std::sync::Mutex<Option<Boost>> = std::sync::Mutex::new(None);

#[derive(Debug, Clone, Copy)]
struct Boost {
    before: i32,
    nice: i32,
}

/// Raises the calling thread (and so the threads and processes it starts from here on)
/// to nice `nice`, until [`end_start_boost`]; nothing if it already runs there or higher,
/// or may not (no `CAP_SYS_NICE`: said at debug level).
pub fn boost_start(nice: i32) {
    if let Some(before) = raise_calling_thread(nice) {
        *START_BOOST.lock().unwrap_or_else(|e| e.into_inner()) = Some(Boost { before, nice });
    }
}

/// Raises the calling thread to nice `nice`: its nice before, if it was raised (not if
/// it already runs there or higher, or may not: no `CAP_SYS_NICE`, said at debug level).
fn raise_calling_thread(nice: i32) -> Option<i32> {
    let before = nice_of(crate::sys::gettid())?;
    if nice >= before {
        return None;
    }
    match crate::sys::set_nice(0, nice) {
        Ok(()) => Some(before),
        Err(e) => {
            tracing::debug!("a thread at nice {before} cannot raise itself to {nice}: {e}");
            None
        }
    }
}

/// Ends [`boost_start`]: every thread of this process but `workers` (pinned, at a nice of
/// their own), and every thread of process `child` (the socket holder, started meanwhile),
/// back at the nice kxp had before. Nothing if no start was boosted.
pub fn end_start_boost(workers: &[libc::pid_t], child: Option<libc::pid_t>) {
    let Some(b) = START_BOOST.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        return;
    };
    let mut failed = 0;
    // Threads started while this runs (the socket holder starts a lane when a socket
    // comes, from a thread still at the start's nice) are looked for again, until a
    // look finds none new.
    let mut done = std::collections::HashSet::new();
    for _ in 0..8 {
        let mine = crate::sys::thread_ids()
            .into_iter()
            .filter(|t| !workers.contains(t));
        let theirs = child.map(crate::sys::thread_ids_of).unwrap_or_default();
        let new: Vec<libc::pid_t> = mine.chain(theirs).filter(|t| done.insert(*t)).collect();
        if new.is_empty() {
            break;
        }
        for tid in new {
            if crate::sys::set_nice(tid, b.before).is_err() {
                failed += 1;
            }
        }
    }
    tracing::info!(
        "start-up ran at nice {} until the first publication (the node's Service traffic \
         waits for it); kxp's threads are back at nice {}{}",
        b.nice,
        b.before,
        if failed > 0 {
            format!(" ({failed} could not be put back)")
        } else {
            String::new()
        }
    );
}

/// Runs `f` with the calling thread at nice `nice` (where it may raise itself there),
/// then puts the thread back: for the running kxp's part of a hand-over, between its
/// workers' stop and the sockets sent, which forwarding waits for (sent 3 ms after the
/// stop at nice 0 beside the benchmark's generator, against 0.3 ms in most runs).
pub fn at_nice<T>(nice: i32, f: impl FnOnce() -> T) -> T {
    let before = raise_calling_thread(nice);
    let out = f();
    if let Some(b) = before {
        let _ = crate::sys::set_nice(0, b);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_nice_after_the_last_parenthesis() {
        // A real line of a nice -20 kthread, and a name with spaces and parentheses.
        let line = "74 (tokio-rt-worker) S 1 1 0 0 -1 4194368 1 0 0 0 5 3 0 0 0 -20 9 0 120 0 0";
        assert_eq!(parse_stat_nice(line), Some(-20));
        let odd = "5 (a) b (c) R 1 1 0 0 -1 0 0 0 0 0 0 0 0 0 20 7 1 0 1 0 0";
        assert_eq!(parse_stat_nice(odd), Some(7));
        assert_eq!(parse_stat_nice("5 (short) R 1"), None);
        assert_eq!(parse_stat_nice("no parenthesis"), None);
    }

    #[test]
    fn nice_of_this_thread_is_what_the_kernel_says() {
        // A thread of its own, niced up (allowed without privilege) and read back.
        let n = std::thread::spawn(|| {
            let tid = crate::sys::gettid();
            let before = nice_of(tid).expect("own stat");
            let to = (before + 3).min(19);
            crate::sys::set_nice(tid, to).expect("raising one's own nice");
            (nice_of(tid), to)
        })
        .join()
        .unwrap();
        assert_eq!(n.0, Some(n.1));
        assert_eq!(nice_of(-1), None);
    }

    #[test]
    fn ksoftirqd_names() {
        assert_eq!(ksoftirqd_cpu("ksoftirqd/0"), Some(0));
        assert_eq!(ksoftirqd_cpu("ksoftirqd/17"), Some(17));
        assert_eq!(ksoftirqd_cpu("ksoftirqd/"), None);
        assert_eq!(ksoftirqd_cpu("ksoftirqd/1x"), None);
        assert_eq!(ksoftirqd_cpu("kworker/1:0"), None);
    }

    #[test]
    fn finds_the_ksoftirqd_of_each_cpu_it_can_see() {
        // On the host's PID namespace every online CPU has one.
        let cpus = crate::sys::allowed_cpus().expect("affinity");
        let found = ksoftirqd_of(&cpus);
        if std::path::Path::new("/proc/2/comm").exists() {
            for (cpu, pid) in &found {
                assert!(cpus.contains(cpu));
                assert!(nice_of(*pid).is_some());
            }
            assert_eq!(found.len(), cpus.len(), "{found:?} for {cpus:?}");
        }
    }
}
