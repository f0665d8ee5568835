//! The sync loop of `kxp run`, kube-proxy's: what changed in the input goes through the
//! tracker into the dataplane, the Services' health servers and the localhost NodePorts;
//! changes are batched by minSyncPeriod, and the whole state is re-synced every
//! syncPeriod. When to sync is decided by [`Schedule`], a function of the clock it is
//! given; the loop does what it decides.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use dataplane::plane::{Dataplane, DataplaneError};
use nat::snapshot::Update;
use translate::k8s::NodeSettings;
use translate::tracker::{Synced, Tracker};

use super::input::Input;
use super::{host_addresses, node_eligible};
use crate::hcnp::ServiceHealthServers;
use crate::health::Health;
use crate::localnp::LocalhostNodePorts;
use crate::metrics::Metrics;

/// What the sync loop drives: the parts [`super::run`] set up (and owns, to drop them in
/// its order).
pub(super) struct Parts<'a> {
    pub(super) input: &'a mut Input,
    pub(super) tracker: &'a mut Tracker,
    pub(super) dp: &'a mut Dataplane,
    pub(super) hc: &'a mut ServiceHealthServers,
    pub(super) localnp: &'a mut Option<LocalhostNodePorts>,
    pub(super) health: &'a Health,
    pub(super) metrics: &'a Metrics,
}

/// Runs the sync loop until `stop` is set (SIGTERM / SIGINT): the input is watched, the
/// metrics and the host's addresses are refreshed every second, and the syncs
/// [`Schedule`] calls for are done. `settings` are the node's settings of the first sync,
/// `generation` its generation, `(min_sync, resync)` kube-proxy's minSyncPeriod and
/// syncPeriod.
pub(super) fn sync_loop(
    parts: Parts<'_>,
    settings: NodeSettings,
    generation: u64,
    (min_sync, resync): (Duration, Duration),
    stop: &AtomicBool,
) {
    let now = Instant::now();
    let mut l = SyncLoop {
        p: parts,
        settings,
        generation,
        schedule: Schedule::new(min_sync, resync, now),
        no_local: NoLocal::default(),
        stats_every: std::env::var("KXP_LOG_STATS")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .map(Duration::from_secs),
        last_stats: now,
        last_metrics: now,
        last_host_check: now,
    };
    l.no_local.apply(&Update::full(l.p.dp.current()));
    while !stop.load(Ordering::Relaxed) {
        // Wake up for a change (then wait out minSyncPeriod), or every 100 ms.
        l.p.input.wait(l.schedule.wait(Instant::now()));
        l.log_stats();
        l.refresh_metrics();
        if l.p.input.changed() {
            l.schedule.pending = true;
            l.p.health.queued();
            l.p.metrics.set_queued_now();
        }
        l.follow_host_addresses();
        if let Some(due) = l.schedule.due(l.p.input.resyncs(), Instant::now()) {
            l.sync(due);
        }
    }
}

/// When the sync loop syncs, as kube-proxy does: changes are batched by minSyncPeriod,
/// the whole state is re-synced every syncPeriod even without changes, and a failed
/// programming is retried after syncPeriod. It reads no clock: the loop gives it the
/// time.
#[derive(Debug)]
struct Schedule {
    min_sync: Duration,
    resync: Duration,
    /// A change waits for the next sync.
    pending: bool,
    /// When the last sync started.
    last_sync: Instant,
    /// When a failed programming is retried.
    retry_at: Option<Instant>,
}

/// A sync that is due: `periodic`, the full re-sync of syncPeriod; `retry`, the retry of
/// a failed programming; neither, one for changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Due {
    periodic: bool,
    retry: bool,
}

impl Schedule {
    fn new(min_sync: Duration, resync: Duration, now: Instant) -> Schedule {
        Schedule {
            min_sync,
            resync,
            pending: false,
            last_sync: now,
            retry_at: None,
        }
    }

    /// How long to wait for a change at `now`: 100 ms, or less while a change waits out
    /// minSyncPeriod.
    fn wait(&self, now: Instant) -> Duration {
        let tick = Duration::from_millis(100);
        if self.pending {
            self.min_sync
                .saturating_sub(now.saturating_duration_since(self.last_sync))
                .min(tick)
        } else {
            tick
        }
    }

    /// The sync due at `now`, if any (`resyncs`: whether the periodic full re-sync
    /// applies, see [`Input::resyncs`]); a sync due starts at `now`, and takes every
    /// pending change.
    fn due(&mut self, resyncs: bool, now: Instant) -> Option<Due> {
        let since = now.saturating_duration_since(self.last_sync);
        // kube-proxy's sync loop: changes are batched by minSyncPeriod, and the whole
        // state is re-synced every syncPeriod even without changes.
        let periodic = resyncs && since >= self.resync;
        // A failed programming is retried after syncPeriod, as kube-proxy does.
        let retry = self.retry_at.is_some_and(|t| now >= t);
        if !(periodic || retry || (self.pending && since >= self.min_sync)) {
            return None;
        }
        self.pending = false;
        self.last_sync = now;
        Some(Due { periodic, retry })
    }

    /// The programming failed at `now`: it is retried after syncPeriod.
    fn failed(&mut self, now: Instant) {
        self.retry_at = Some(now + self.resync);
    }

    /// The programming succeeded: no retry.
    fn succeeded(&mut self) {
        self.retry_at = None;
    }
}

/// The sync loop's parts and its own state.
struct SyncLoop<'a> {
    p: Parts<'a>,
    settings: NodeSettings,
    generation: u64,
    schedule: Schedule,
    no_local: NoLocal,
    /// `KXP_LOG_STATS=SECONDS`: how often the totals are logged.
    stats_every: Option<Duration>,
    last_stats: Instant,
    last_metrics: Instant,
    last_host_check: Instant,
}

impl SyncLoop<'_> {
    /// Logs the dataplane's totals, every `KXP_LOG_STATS` seconds if set.
    fn log_stats(&mut self) {
        if let Some(every) = self.stats_every
            && self.last_stats.elapsed() >= every
        {
            self.last_stats = Instant::now();
            tracing::info!("{}", totals_line(self.p.dp));
        }
    }

    /// Every second: the dataplane's, the process's, the XDP program's, the AF_XDP
    /// sockets' and the API server watchers' counters into the metrics.
    fn refresh_metrics(&mut self) {
        if self.last_metrics.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.last_metrics = Instant::now();
        let (metrics, dp) = (self.p.metrics, &*self.p.dp);
        update_metrics(metrics, dp, self.schedule.last_sync);
        metrics.update_process();
        metrics.update_xdp(&dp.steer_stats());
        metrics.update_steering_sets(&dp.steering_sets());
        metrics.update_xsk(&dp.shared.socket_stats_per_queue(Duration::from_millis(200)));
        if let Input::Kube { source, .. } = &*self.p.input {
            let api: Vec<crate::metrics::ApiCounters> = source
                .status()
                .resources
                .into_iter()
                .map(|r| crate::metrics::ApiCounters {
                    resource: r.resource.to_string(),
                    events: r.events,
                    errors: r.errors,
                    relists: r.relists,
                    failing: r.failing,
                    objects: r.objects,
                    pending: r.pending,
                })
                .collect();
            metrics.update_api(&api);
            metrics.update_rest_requests(&source.rest_requests());
        }
    }

    /// The host's addresses, followed as they change (an address added to or removed
    /// from a link): checked every second; a change is synced as any other.
    fn follow_host_addresses(&mut self) {
        if self.last_host_check.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.last_host_check = Instant::now();
        let now = host_addresses(self.p.dp);
        if now != self.settings.host_addrs {
            tracing::info!(
                from = ?self.settings.host_addrs,
                to = ?now,
                "the host's addresses changed"
            );
            self.settings.host_addrs = now;
            self.p.tracker.set_settings(self.settings.clone());
            self.schedule.pending = true;
        }
    }

    /// One sync: what changed (everything, for the periodic one) from the input through
    /// the tracker to [`SyncLoop::publish`], with its metrics and a log line of its
    /// times. An input that cannot be read keeps the last good state; a failed
    /// programming is retried after syncPeriod.
    fn sync(&mut self, Due { periodic, retry }: Due) {
        let started = Instant::now();
        let fed = self.p.input.feed(self.p.tracker, periodic);
        let t_feed = started.elapsed();
        if let Err(e) = fed {
            tracing::warn!(
                "{}: {e:#}; keeping the last good state",
                self.p.input.describe()
            );
            self.p.health.programmed();
            return;
        }
        self.generation += 1;
        let generation = self.generation;
        let synced = self.p.tracker.sync(generation);
        let t_track = started.elapsed();
        report(&synced, self.p.input);
        self.p
            .health
            .set_node_eligible(node_eligible(self.p.tracker.node_object().map(|n| &**n)));
        self.p.metrics.add_service_changes(synced.service_changes);
        self.p.metrics.add_endpoint_changes(synced.endpoint_changes);
        self.no_local.apply(&synced.update);
        self.p
            .metrics
            .set_no_local_endpoints(self.no_local.internal, self.no_local.external);
        let mut update = synced.update;
        // The periodic re-sync also redoes the XDP maps in full (repairs any drift).
        update.full |= periodic;
        let rebuilt = synced.rebuilt;
        let published = self.publish(update);
        let done = started.elapsed();
        if let Err(e) = published {
            dataplane::error_limited!(
                "publish",
                "programming the XDP maps: {e:#}; retrying every {} s",
                self.schedule.resync.as_secs()
            );
            self.schedule.failed(Instant::now());
            return;
        }
        self.schedule.succeeded();
        self.p.health.programmed();
        self.p
            .metrics
            .observe_sync(started.elapsed(), periodic || retry);
        self.p.metrics.set_last_sync_now();
        observe_programming_latency(self.p.metrics, &synced.trigger_times);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        tracing::info!(
            "{} applied (generation {generation}, {rebuilt} Service(s) rebuilt; \
             changes {:.3} + tracker {:.3} + dataplane {:.3} = {:.3} ms)",
            self.p.input.describe(),
            ms(t_feed),
            ms(t_track - t_feed),
            ms(done - t_track),
            ms(done)
        );
    }

    /// Hands `update` to the Services' health servers and the localhost NodePorts (their
    /// errors are logged), then publishes it to the dataplane.
    ///
    /// # Errors
    /// The dataplane's, programming the XDP maps.
    fn publish(&mut self, update: Update) -> Result<(), DataplaneError> {
        for e in self.p.hc.sync(&update) {
            let text = e.to_string();
            dataplane::warn_limited!(text, "{text}");
        }
        if let Some(l) = &mut *self.p.localnp {
            for text in l.sync(&update) {
                dataplane::warn_limited!(text, "{text}");
            }
        }
        self.p.dp.publish(update)
    }
}

/// kube-proxy's network programming latency: from the change that triggered an
/// EndpointSlice update to the sync that programmed it.
fn observe_programming_latency(metrics: &Metrics, trigger_times: &[String]) {
    let now = SystemTime::now();
    for t in trigger_times {
        if let Some(d) = since_trigger(t, now) {
            metrics.observe_network_programming(d);
        }
    }
}

/// How long ago `t` (RFC 3339, the `last-change-trigger-time` annotation) was; `None`
/// for an unreadable time or one in the future (clock skew), as kube-proxy skips them.
fn since_trigger(t: &str, now: SystemTime) -> Option<Duration> {
    let ts: k8s_openapi::jiff::Timestamp = t.parse().ok()?;
    let then = SystemTime::from(ts);
    now.duration_since(then).ok()
}

/// Logs what a sync noticed: objects skipped as kube-proxy skips them, and objects in
/// error (each keeps its last good version).
pub(super) fn report(s: &Synced, input: &Input) {
    for n in &s.notes {
        tracing::info!("note: {n}");
    }
    for e in &s.errors {
        let text = e.to_string();
        dataplane::warn_limited!(
            text,
            "{}: {text}; its last good version stays in force",
            input.describe()
        );
    }
}

/// Services whose traffic policy is Local and that have endpoints, but none on this node
/// (kube-proxy's `sync_proxy_rules_no_local_endpoints_total`, internal / external), kept
/// by difference.
#[derive(Debug, Default)]
struct NoLocal {
    internal: u64,
    external: u64,
}

impl NoLocal {
    fn apply(&mut self, u: &Update) {
        if u.full {
            *self = NoLocal::default();
            for sp in u.snapshot.ports() {
                self.count(sp, true);
            }
            return;
        }
        for sp in &u.added {
            self.count(sp, true);
        }
        for sp in &u.removed {
            self.count(sp, false);
        }
    }

    fn count(&mut self, sp: &nat::model::ServicePort, add: bool) {
        if !sp.cat.has_endpoints || !sp.cat.local.is_empty() {
            return;
        }
        let step = |n: &mut u64, yes: bool| {
            if yes {
                *n = if add { *n + 1 } else { n.saturating_sub(1) };
            }
        };
        step(&mut self.internal, sp.internal_policy_local);
        step(
            &mut self.external,
            sp.external_policy_local && sp.externally_accessible(),
        );
    }
}

/// The dataplane's counters into the metrics (`last_sync`: when the snapshot in force
/// was made).
fn update_metrics(m: &crate::metrics::Metrics, dp: &Dataplane, last_sync: Instant) {
    let t = dp.totals();
    m.update_dataplane(&crate::metrics::DataplaneCounters {
        forwarded: t.forwarded,
        forwarded_bytes: t.forwarded_bytes,
        rejected: t.rejected,
        dropped: t.dropped,
        passed: t.passed,
        drops: t.drops.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        conntrack_entries: t.conntrack_entries,
        conntrack_inserts: t.conntrack_inserts,
        conntrack_evictions: t.conntrack_evictions,
        affinity_entries: t.affinity.entries,
        affinity_expired: t.affinity.expired,
        affinity_evictions: t.affinity.evictions,
        handoffs: t.handoffs,
        pass_checksums_completed: t.pass_checksums_completed,
        vlan_untagged: t.vlan_untagged,
        vlan_tagged: t.vlan_tagged,
        policy_handover: t.policy_handover,
        generation: t.generation,
        snapshot_age_secs: last_sync.elapsed().as_secs_f64(),
        busy_ratio: t.busy_ratio,
        stalls: t.stalls,
    });
}

/// The dataplane's totals as one log line (with `KXP_LOG_STATS`, and when stopping).
pub(super) fn totals_line(dp: &Dataplane) -> String {
    let t = dp.totals();
    let drops: Vec<String> = t.drops.iter().map(|(k, v)| format!("{k}={v}")).collect();
    // What the interfaces dropped before kxp saw it (the kernel's AF_XDP counters, as
    // kxp_xsk_rx_drops_total): a fill ring kept to the queue budget runs empty.
    let xsk: Vec<String> = dp
        .shared
        .socket_stats(Duration::from_millis(200))
        .iter()
        .map(|(ifname, st)| {
            format!(
                "{ifname}:fill_ring_empty={},rx_ring_full={},other={}",
                st.rx_fill_ring_empty,
                st.rx_ring_full,
                st.rx_dropped.saturating_sub(st.rx_fill_ring_empty)
            )
        })
        .collect();
    // Gaps of over a millisecond in a worker's polling (its CPU taken by another task,
    // or a long round of its own): what arrived meanwhile waited in the rings.
    let stalls: Vec<String> = t
        .stalls
        .iter()
        .enumerate()
        .map(|(w, s)| {
            let parts: Vec<String> = dataplane::worker::Stalls::PARTS
                .iter()
                .zip(s.by_part)
                .filter(|&(_, n)| n > 0)
                .map(|(p, n)| format!("{p} {n}"))
                .collect();
            format!(
                "worker{w}:{} ({:.1} ms, longest {:.1} ms{}{})",
                s.count,
                s.total_ns as f64 / 1e6,
                s.longest_ns as f64 / 1e6,
                if parts.is_empty() {
                    ""
                } else {
                    "; longest part: "
                },
                parts.join(", ")
            )
        })
        .collect();
    format!(
        "totals: rx {} tx {} forwarded {} new_flows {} rejected {} dropped {} [{}] handoffs {} conntrack {} neighbour_pending {} no_route {} xsk_drops [{}] stalls [{}]",
        t.rx_packets,
        t.tx_packets,
        t.forwarded,
        t.new_flows,
        t.rejected,
        t.dropped,
        drops.join(" "),
        t.handoffs,
        t.conntrack_entries,
        t.neighbour_pending,
        t.no_route,
        xsk.join(" "),
        stalls.join(" ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trigger_times_give_programming_latency() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(
            since_trigger("2027-01-15T08:00:00Z", now),
            Some(Duration::ZERO)
        );
        assert_eq!(
            since_trigger("2027-01-15T07:59:58.5Z", now),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(since_trigger("2027-01-15T08:00:01Z", now), None);
        assert_eq!(since_trigger("yesterday", now), None);
    }

    #[test]
    fn changes_wait_out_min_sync_and_the_api_state_resyncs_every_sync_period() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let changes = Some(Due {
            periodic: false,
            retry: false,
        });
        let mut s = Schedule::new(Duration::from_secs(1), Duration::from_secs(30), t0);
        assert_eq!(s.wait(at(0)), Duration::from_millis(100));
        assert_eq!(s.due(true, at(500)), None);
        // A change waits out minSyncPeriod, and the loop wakes up for it.
        s.pending = true;
        assert_eq!(s.wait(at(950)), Duration::from_millis(50));
        assert_eq!(s.due(true, at(950)), None);
        assert_eq!(s.due(true, at(1000)), changes);
        assert!(!s.pending);
        // Without changes: a state file is not re-synced, the API server's state is.
        assert_eq!(s.due(false, at(31_000)), None);
        assert_eq!(
            s.due(true, at(31_000)),
            Some(Due {
                periodic: true,
                retry: false
            })
        );
        // A failed programming is retried after syncPeriod, until it succeeds.
        s.failed(at(31_000));
        assert_eq!(s.due(false, at(60_999)), None);
        assert_eq!(
            s.due(false, at(61_000)),
            Some(Due {
                periodic: false,
                retry: true
            })
        );
        s.succeeded();
        assert_eq!(s.due(false, at(200_000)), None);
    }
}
