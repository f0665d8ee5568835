//! Threaded NAPI kthreads kept off the workers' CPUs.
//!
//! With threaded NAPI (`/sys/class/net/DEV/threaded`, or a driver that defaults to it),
//! an interface's receive processing runs in kernel threads named `napi/DEV-ID`. A
//! pinned worker busy-polls its CPU; a NAPI kthread on the same CPU then gets it only
//! by scheduler slices, and during the worker's slice the kernel cannot receive: the
//! measured rate on veths fell from 0.47 to 0.01 Mpps (docs/benchmarks.md, the `kxp-threaded`
//! case). So, when the workers are pinned, kxp checks every second the NAPI kthreads of
//! the interfaces it is attached to and moves any that may run on a worker's CPU off
//! it, as it does its own threads, and logs each move. This needs `CAP_SYS_NICE` and
//! the host's PID namespace (the kthreads are invisible from another one); without
//! them kxp says what it could not do.

use std::collections::HashSet;
use std::fs;

/// A NAPI kthread: its PID and name (`napi/DEV-ID`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NapiThread {
    pub pid: libc::pid_t,
    pub name: String,
    /// The interface it serves (one of those asked for).
    pub ifname: String,
}

/// Whether `comm` names a NAPI kthread of `ifname`: `napi/IFNAME-ID`, ID decimal.
fn serves(comm: &str, ifname: &str) -> bool {
    comm.strip_prefix("napi/")
        .and_then(|r| r.strip_prefix(ifname))
        .and_then(|r| r.strip_prefix('-'))
        .is_some_and(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
}

/// The PIDs that may be kernel threads: kthreadd's children where the kernel lists
/// them (`CONFIG_PROC_CHILDREN`), else every process.
pub(crate) fn candidate_pids() -> Vec<libc::pid_t> {
    if let Ok(s) = fs::read_to_string("/proc/2/task/2/children")
        && !s.trim().is_empty()
    {
        return s
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
    }
    fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The NAPI kthreads of `ifnames` this process can see.
pub fn threads_of(ifnames: &[String]) -> Vec<NapiThread> {
    if ifnames.is_empty() {
        return Vec::new();
    }
    candidate_pids()
        .into_iter()
        .filter_map(|pid| {
            let comm = fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            let comm = comm.trim_end();
            let ifname = ifnames.iter().find(|i| serves(comm, i))?;
            Some(NapiThread {
                pid,
                name: comm.to_string(),
                ifname: ifname.clone(),
            })
        })
        .collect()
}

/// Where a thread allowed on `current` goes so that it keeps off `workers`: what it is
/// allowed on already minus the workers' CPUs, or, when that leaves nothing (pinned to
/// a worker's CPU), `rest` (the CPUs kxp's own other threads run on). `None`: it keeps
/// off them already, or there is nowhere else.
pub fn moved_to(current: &[usize], workers: &[usize], rest: &[usize]) -> Option<Vec<usize>> {
    if !current.iter().any(|c| workers.contains(c)) {
        return None;
    }
    let kept: Vec<usize> = current
        .iter()
        .copied()
        .filter(|c| !workers.contains(c))
        .collect();
    if !kept.is_empty() {
        Some(kept)
    } else if rest.is_empty() {
        None
    } else {
        Some(rest.to_vec())
    }
}

/// Keeps the NAPI kthreads of the attached interfaces off the workers' CPUs.
#[derive(Debug)]
pub struct NapiGuard {
    workers: Vec<usize>,
    rest: Vec<usize>,
    /// The interfaces already reported as threaded with no kthread in sight.
    unseen: HashSet<String>,
    /// The kthreads moved so far (a second move of one is put back there by someone
    /// else: logged at most once a minute).
    moved: HashSet<libc::pid_t>,
}

impl NapiGuard {
    /// For workers pinned to `workers`, kxp's other threads on `rest`.
    pub fn new(workers: Vec<usize>, rest: Vec<usize>) -> Self {
        Self {
            workers,
            rest,
            unseen: HashSet::new(),
            moved: HashSet::new(),
        }
    }

    /// Moves the NAPI kthreads of `ifnames` that may run on a worker's CPU; returns
    /// those moved (each one is logged).
    pub fn check(&mut self, ifnames: &[String]) -> Vec<NapiThread> {
        let threads = threads_of(ifnames);
        self.report_unseen(ifnames, &threads);
        self.moved.retain(|p| threads.iter().any(|t| t.pid == *p));
        let mut moved = Vec::new();
        for t in threads {
            let current = match crate::sys::affinity(t.pid) {
                Ok(c) => c,
                // It ended meanwhile (threaded NAPI turned off).
                Err(_) => continue,
            };
            let Some(to) = moved_to(&current, &self.workers, &self.rest) else {
                if current.iter().any(|c| self.workers.contains(c)) {
                    crate::warn_limited!(
                        format!("napi-nowhere-{}", t.name),
                        "NAPI thread {} (pid {}) of {} runs on the workers' CPUs {:?} and there is no other CPU to move it to: expect the interface's rate to collapse",
                        t.name,
                        t.pid,
                        t.ifname,
                        self.workers
                    );
                }
                continue;
            };
            match crate::sys::set_affinity(t.pid, &to) {
                Ok(()) => {
                    let what = format!(
                        "NAPI thread {} (pid {}) of {} could run on the workers' CPUs {:?} (allowed on {:?}): moved to CPUs {:?}",
                        t.name, t.pid, t.ifname, self.workers, current, to
                    );
                    if self.moved.insert(t.pid) {
                        tracing::info!("{what}, where a busy-polling worker does not starve it");
                    } else {
                        crate::warn_limited!(
                            format!("napi-again-{}", t.name),
                            "{what} again: it was put back there, and whatever pins it (a tuning script, irqbalance) fights kxp"
                        );
                    }
                    moved.push(t);
                }
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => crate::warn_limited!(
                    format!("napi-move-{}", t.name),
                    "cannot move NAPI thread {} (pid {}) of {} off the workers' CPUs {:?}: {e} (needs CAP_SYS_NICE); keep it off them yourself or expect the interface's rate to collapse",
                    t.name,
                    t.pid,
                    t.ifname,
                    self.workers
                ),
            }
        }
        moved
    }

    /// Warns once per interface whose NAPI is threaded (its sysfs attribute) while none
    /// of its kthreads is visible: kxp then runs in another PID namespace and cannot
    /// move them.
    fn report_unseen(&mut self, ifnames: &[String], threads: &[NapiThread]) {
        for ifname in ifnames {
            // Its kthreads in sight: nothing to report, no sysfs read.
            if threads.iter().any(|t| &t.ifname == ifname) {
                continue;
            }
            let threaded = fs::read_to_string(format!("/sys/class/net/{ifname}/threaded"))
                .is_ok_and(|s| matches!(s.trim(), "1" | "2" | "enabled" | "busy-poll"));
            if !threaded {
                self.unseen.remove(ifname);
                continue;
            }
            if !self.unseen.insert(ifname.clone()) {
                continue;
            }
            tracing::warn!(
                "{ifname} has threaded NAPI but kxp sees none of its napi/{ifname}-* threads (another PID namespace: a pod without hostPID?): keep them off the workers' CPUs {:?} yourself",
                self.workers
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_napi_thread_is_named_after_its_interface_and_a_decimal_id() {
        assert!(serves("napi/eth0-8193", "eth0"));
        assert!(!serves("napi/eth0-8193", "eth"));
        assert!(!serves("napi/eth01-8193", "eth0"));
        assert!(!serves("napi/eth0-", "eth0"));
        assert!(!serves("napi/eth0-81x", "eth0"));
        assert!(!serves("ksoftirqd/0", "eth0"));
        assert!(serves("napi/n-router-a-12", "n-router-a"));
    }

    #[test]
    fn a_thread_keeps_what_it_may_run_on_but_the_workers_cpus() {
        // Anywhere: everywhere but the worker's CPU.
        assert_eq!(moved_to(&[0, 1, 2, 3], &[1], &[0, 2]), Some(vec![0, 2, 3]));
        // Pinned to the worker's CPU: where kxp's other threads run.
        assert_eq!(moved_to(&[1], &[1], &[0]), Some(vec![0]));
        // Off it already.
        assert_eq!(moved_to(&[0, 2], &[1], &[0, 2]), None);
        // Nowhere else to go.
        assert_eq!(moved_to(&[0, 1], &[0, 1], &[]), None);
    }

    #[test]
    fn no_interface_no_scan() {
        assert!(threads_of(&[]).is_empty());
        // A name no kthread has.
        assert!(threads_of(&["kxp-no-such-if".to_string()]).is_empty());
    }
}
