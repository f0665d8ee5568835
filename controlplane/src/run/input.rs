//! Where `kxp run` reads the cluster's objects: a state file, watched, or the API server.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use translate::tracker::Tracker;
use translate::tracker::build;

use crate::state::load_state;

/// Where the cluster's objects come from.
pub(super) enum Input {
    File {
        path: PathBuf,
        watch: FileWatch,
    },
    Kube {
        // Field order = drop order: the watchers before their runtime.
        source: crate::kube_source::KubeSource,
        changes: tokio::sync::watch::Receiver<u64>,
        /// A change arrived while [`Input::wait`] waited.
        signalled: bool,
        _rt: tokio::runtime::Runtime,
    },
}

impl Input {
    pub(super) fn file(path: &Path) -> Input {
        Input::File {
            path: path.to_path_buf(),
            watch: FileWatch::new(path),
        }
    }

    /// Connects to the API server and waits (while not stopped) for the first lists.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kube(
        kubeconfig: Option<&Path>,
        master: Option<&str>,
        limit: Option<crate::kube_source::RateLimit>,
        node_name: &str,
        service_proxy_name: Option<String>,
        network_policy: bool,
        kernel_policy: bool,
        stop: &AtomicBool,
    ) -> anyhow::Result<Input> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kxp-kube")
            .enable_all()
            .build()
            .context("starting the Kubernetes client's runtime")?;
        let client = rt.block_on(crate::kube_source::client_from(kubeconfig, master, limit))?;
        // Policy objects kxp does not enforce: the CNI enforces them in the kernel, which
        // never sees the connections kxp translates.
        let foreign = rt.block_on(crate::kube_source::foreign_policy_groups(&client));
        log_foreign_policy(&foreign, kernel_policy);
        let source = {
            let _guard = rt.enter();
            crate::kube_source::KubeSource::start(
                client,
                crate::kube_source::SourceConfig {
                    node_name: node_name.to_string(),
                    service_proxy_name,
                    network_policy,
                },
            )
        };
        let listing = Instant::now();
        wait_first_lists(&rt, &source, stop)?;
        let objects: usize = source.status().resources.iter().map(|r| r.objects).sum();
        tracing::info!(
            "first lists from the API server: {objects} objects in {:.1} ms",
            listing.elapsed().as_secs_f64() * 1e3
        );
        let changes = source.subscribe();
        Ok(Input::Kube {
            source,
            changes,
            signalled: false,
            _rt: rt,
        })
    }

    pub(super) fn describe(&self) -> String {
        match self {
            Input::File { path, .. } => format!("state file {}", path.display()),
            Input::Kube { .. } => "the API server's state".to_string(),
        }
    }

    /// Hands what changed to the tracker (`everything`: the whole state, for the first
    /// and the periodic sync). A state file is read whole and must be valid as a whole:
    /// an invalid edit changes nothing.
    pub(super) fn feed(&self, tracker: &mut Tracker, everything: bool) -> anyhow::Result<()> {
        match self {
            Input::File { path, .. } => {
                let state = load_state(path)?;
                build(&state, tracker.settings(), 0)?;
                tracker.replace_all(&state);
            }
            Input::Kube { source, .. } => {
                let changes = if everything {
                    source.everything()
                } else {
                    source.take_changes()
                };
                changes.apply(tracker);
            }
        }
        Ok(())
    }

    pub(super) fn changed(&mut self) -> bool {
        match self {
            Input::File { watch, .. } => watch.changed(),
            Input::Kube {
                changes, signalled, ..
            } => {
                let c = std::mem::take(signalled) || changes.has_changed().unwrap_or(false);
                changes.borrow_and_update();
                c
            }
        }
    }

    /// Sleeps up to `d`; the Kubernetes source wakes up as soon as a change arrives.
    pub(super) fn wait(&mut self, d: Duration) {
        match self {
            // A change settling is looked at again sooner.
            Input::File { watch, .. } => {
                std::thread::sleep(if watch.settling() {
                    d.min(SETTLE / 5)
                } else {
                    d
                });
            }
            Input::Kube {
                changes,
                signalled,
                _rt,
                ..
            } => {
                if *signalled {
                    return;
                }
                let got = _rt.block_on(async { tokio::time::timeout(d, changes.changed()).await });
                match got {
                    Ok(Ok(())) => *signalled = true,
                    Ok(Err(_)) => std::thread::sleep(d),
                    Err(_) => {}
                }
            }
        }
    }

    /// Whether the periodic full re-sync (syncPeriod) applies.
    pub(super) fn resyncs(&self) -> bool {
        matches!(self, Input::Kube { .. })
    }
}

/// Says which policy objects of the CNI's the API server serves (`foreign`): with
/// `kernel_policy` the CNI enforces them on the connections kxp hands to the kernel;
/// without it nothing enforces them on the connections kxp translates, and the warning
/// says what to set.
fn log_foreign_policy(foreign: &[String], kernel_policy: bool) {
    if !foreign.is_empty() && kernel_policy {
        tracing::info!(
            "the API server serves policy objects of the CNI's: {}; the CNI enforces them \
             on the connections kxp translates to this node's pods, handed to the kernel \
             (kxp.networkPolicy: kernel; docs/network-policy.md)",
            foreign.join(", ")
        );
    } else if !foreign.is_empty() {
        tracing::warn!(
            "the API server serves policy objects kxp does not enforce on the connections \
             it translates: {}; kxp enforces Kubernetes NetworkPolicy only, and the CNI, \
             which enforces these in the kernel, does not see those connections: set \
             kxp.networkPolicy: kernel to hand them to it (docs/network-policy.md)",
            foreign.join(", ")
        );
    }
}

/// Waits, while not stopped, for the first lists of every resource `source` watches;
/// every 10 s it says which are still missing, and why.
///
/// # Errors
/// Stopped (SIGTERM / SIGINT) before the first lists.
fn wait_first_lists(
    rt: &tokio::runtime::Runtime,
    source: &crate::kube_source::KubeSource,
    stop: &AtomicBool,
) -> anyhow::Result<()> {
    let mut waited = 0;
    while !rt.block_on(source.wait_synced(Duration::from_secs(1))) {
        if stop.load(Ordering::Relaxed) {
            anyhow::bail!("stopped before the first sync with the API server");
        }
        waited += 1;
        if waited % 10 == 0 {
            // Which lists are missing, and why (a 403 names the RBAC rule to add).
            let missing: Vec<String> = source
                .status()
                .resources
                .iter()
                .filter(|r| !r.synced)
                .map(|r| match &r.last_error {
                    Some(e) => format!("{} ({e})", r.resource),
                    None => r.resource.to_string(),
                })
                .collect();
            let policy_hint = if missing.iter().any(|m| {
                m.starts_with("pods")
                    || m.starts_with("namespaces")
                    || m.starts_with("networkpolicies")
            }) {
                "; NetworkPolicy enforcement needs list and watch on pods, namespaces and \
                 networking.k8s.io networkpolicies (deploy/kxp.yaml's ClusterRole), or \
                 kxp.networkPolicy: off"
            } else {
                ""
            };
            tracing::warn!(
                "still waiting for the first lists from the API server ({waited} s): {}{policy_hint}",
                missing.join(", ")
            );
        }
    }
    Ok(())
}

/// Notices changes of a file by modification time, size and inode (an editor that
/// writes a new file and renames it over the old one changes the inode), once the file
/// has stayed the same for [`SETTLE`]: a file written in place is truncated first and
/// written after (a shell's `>`, `kubectl get -o yaml > file`), and read in between it
/// is empty or cut short, which would remove Services that are still there.
#[derive(Debug)]
pub(super) struct FileWatch {
    path: PathBuf,
    last: Option<Probe>,
    /// A change seen but not yet settled: the file as probed, and since when.
    pending: Option<(Option<Probe>, Instant)>,
}

/// A file's modification time, size and inode.
type Probe = (SystemTime, u64, u64);

/// How long a changed file must stay unchanged before it is read.
const SETTLE: Duration = Duration::from_millis(50);

impl FileWatch {
    fn new(path: &Path) -> FileWatch {
        let mut w = FileWatch {
            path: path.to_path_buf(),
            last: None,
            pending: None,
        };
        w.last = w.probe();
        w
    }

    fn probe(&self) -> Option<Probe> {
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(&self.path).ok()?;
        Some((meta.modified().ok()?, meta.len(), meta.ino()))
    }

    fn changed(&mut self) -> bool {
        self.changed_at(Instant::now())
    }

    fn changed_at(&mut self, now: Instant) -> bool {
        let probe = self.probe();
        if probe.is_none() || probe == self.last {
            self.pending = None;
            return false;
        }
        match self.pending {
            Some((seen, since)) if seen == probe => {
                if now.duration_since(since) < SETTLE {
                    return false;
                }
                self.last = probe;
                self.pending = None;
                true
            }
            _ => {
                self.pending = Some((probe, now));
                false
            }
        }
    }

    /// Whether a change waits to settle (then [`Self::changed`] is worth asking again
    /// sooner).
    pub(super) fn settling(&self) -> bool {
        self.pending.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_read_once_it_has_stayed_the_same_for_the_settle_time() {
        let dir = std::env::temp_dir().join(format!("kxp-filewatch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("state.yaml");
        std::fs::write(&path, "a: 1\n").unwrap();
        let mut w = FileWatch::new(&path);
        let t0 = Instant::now();
        assert!(!w.changed_at(t0), "nothing changed yet");
        // Truncated, as a shell's `>` does before writing.
        std::fs::write(&path, "").unwrap();
        assert!(!w.changed_at(t0), "a change is not read at once");
        // Written while settling: the settle time starts again.
        std::fs::write(&path, "a: 1\nb: 2\n").unwrap();
        assert!(!w.changed_at(t0 + SETTLE), "the file changed again");
        assert!(!w.changed_at(t0 + SETTLE + SETTLE / 2));
        assert!(w.changed_at(t0 + SETTLE * 2 + Duration::from_millis(1)));
        assert!(!w.changed_at(t0 + SETTLE * 4), "reported once");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
