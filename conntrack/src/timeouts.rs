//! How long an idle flow is kept, per protocol state.
//!
//! kube-proxy does not time flows out itself: it writes a few `nf_conntrack_*_timeout`
//! sysctls from the `conntrack` section of its KubeProxyConfiguration and leaves the rest
//! to the kernel. kxp replaces the kernel table, so it takes the same four settings and
//! Linux's defaults for everything else, to keep flows living as long as they would under
//! kube-proxy. [`Timeouts`] is the configuration (durations); [`TimeoutsNs`] is the same
//! resolved once to nanoseconds for the per-packet path.

use std::time::Duration;

use crate::tcp::TcpState;

const fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// Idle timeouts, per protocol and state. Expiry is refreshed to `now + timeout` on every
/// packet that the state machine accepts.
///
/// [`Default`] gives what a node running kube-proxy with a default configuration has:
/// kube-proxy's `tcpEstablishedTimeout` (24h) and `tcpCloseWaitTimeout` (1h), and Linux's
/// defaults for the rest. [`Timeouts::LINUX`] is the kernel's defaults alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// SYN seen, no answer yet (`nf_conntrack_tcp_timeout_syn_sent`, 120s).
    pub tcp_syn_sent: Duration,
    /// SYN/ACK seen, waiting for the final ACK (`…_syn_recv`, 60s).
    pub tcp_syn_recv: Duration,
    /// Handshake done (`…_established`; kube-proxy `tcpEstablishedTimeout`, 24h).
    pub tcp_established: Duration,
    /// A FIN seen (`…_fin_wait`, 120s).
    pub tcp_fin_wait: Duration,
    /// The first FIN acknowledged, the other side still open (`…_close_wait`;
    /// kube-proxy `tcpCloseWaitTimeout`, 1h).
    pub tcp_close_wait: Duration,
    /// FINs seen both ways, waiting for the last ACK (`…_last_ack`, 30s).
    pub tcp_last_ack: Duration,
    /// Closed in both directions (`…_time_wait`, 120s).
    pub tcp_time_wait: Duration,
    /// Reset (`…_close`, 10s).
    pub tcp_close: Duration,
    /// Cap on ESTABLISHED while no reply has been seen, i.e. a flow picked up mid-stream
    /// (`…_unacknowledged`, 300s), so that a stray ACK cannot pin an entry for a day.
    pub tcp_unacknowledged: Duration,
    /// UDP not yet a stream (`nf_conntrack_udp_timeout`; kube-proxy `udpTimeout`, 30s).
    pub udp: Duration,
    /// UDP stream: replied and still active 2s after it began
    /// (`nf_conntrack_udp_timeout_stream`; kube-proxy `udpStreamTimeout`, 120s).
    pub udp_stream: Duration,
    /// SCTP with no reply yet (30s). kxp does not parse SCTP chunks, so it cannot use
    /// Linux's per-chunk states (COOKIE_WAIT 3s, …); this is kept like unreplied UDP.
    pub sctp_unreplied: Duration,
    /// SCTP once replied (`nf_conntrack_sctp_timeout_established`, 210s since Linux 5.x,
    /// which relies on SCTP heartbeats, sent every 30s by default, to refresh it).
    pub sctp_established: Duration,
}

impl Timeouts {
    /// Linux's defaults (`nf_conntrack` sysctls on a node where nothing changed them).
    pub const LINUX: Timeouts = Timeouts {
        tcp_syn_sent: secs(120),
        tcp_syn_recv: secs(60),
        tcp_established: secs(5 * 24 * 3600),
        tcp_fin_wait: secs(120),
        tcp_close_wait: secs(60),
        tcp_last_ack: secs(30),
        tcp_time_wait: secs(120),
        tcp_close: secs(10),
        tcp_unacknowledged: secs(300),
        udp: secs(30),
        udp_stream: secs(120),
        sctp_unreplied: secs(30),
        sctp_established: secs(210),
    };

    /// kube-proxy's default `tcpEstablishedTimeout`.
    pub const KUBE_PROXY_TCP_ESTABLISHED: Duration = secs(24 * 3600);
    /// kube-proxy's default `tcpCloseWaitTimeout`.
    pub const KUBE_PROXY_TCP_CLOSE_WAIT: Duration = secs(3600);

    /// Timeouts from the `conntrack` section of a KubeProxyConfiguration, after
    /// kube-proxy's defaulting (an absent `tcpEstablishedTimeout` is 24h, an absent
    /// `tcpCloseWaitTimeout` 1h, absent UDP timeouts 0).
    ///
    /// A zero duration means what it means to kube-proxy, "leave the kernel's value", so it
    /// gives Linux's default (5 days, 60s, 30s, 120s). Everything else is Linux's default.
    pub fn from_kube_proxy(
        tcp_established: Duration,
        tcp_close_wait: Duration,
        udp: Duration,
        udp_stream: Duration,
    ) -> Timeouts {
        let or_linux = |d: Duration, linux: Duration| if d.is_zero() { linux } else { d };
        let l = Timeouts::LINUX;
        Timeouts {
            tcp_established: or_linux(tcp_established, l.tcp_established),
            tcp_close_wait: or_linux(tcp_close_wait, l.tcp_close_wait),
            udp: or_linux(udp, l.udp),
            udp_stream: or_linux(udp_stream, l.udp_stream),
            ..l
        }
    }
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts::from_kube_proxy(
            Timeouts::KUBE_PROXY_TCP_ESTABLISHED,
            Timeouts::KUBE_PROXY_TCP_CLOSE_WAIT,
            Duration::ZERO,
            Duration::ZERO,
        )
    }
}

/// [`Timeouts`] in nanoseconds, the unit of `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TimeoutsNs {
    /// Indexed by `TcpState as usize`.
    tcp: [u64; TcpState::COUNT],
    pub(crate) tcp_unacknowledged: u64,
    pub(crate) udp: u64,
    pub(crate) udp_stream: u64,
    pub(crate) sctp_unreplied: u64,
    pub(crate) sctp_established: u64,
}

/// Nanoseconds in a duration, saturating (a timeout past year 2554 is "never").
fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl TimeoutsNs {
    pub(crate) fn new(t: &Timeouts) -> TimeoutsNs {
        let mut tcp = [0; TcpState::COUNT];
        for s in TcpState::ALL {
            let d = match s {
                TcpState::SynSent => t.tcp_syn_sent,
                TcpState::SynRecv => t.tcp_syn_recv,
                TcpState::Established => t.tcp_established,
                TcpState::FinWait => t.tcp_fin_wait,
                TcpState::CloseWait => t.tcp_close_wait,
                TcpState::LastAck => t.tcp_last_ack,
                TcpState::TimeWait => t.tcp_time_wait,
                TcpState::Close => t.tcp_close,
            };
            tcp[s as usize] = ns(d);
        }
        TimeoutsNs {
            tcp,
            tcp_unacknowledged: ns(t.tcp_unacknowledged),
            udp: ns(t.udp),
            udp_stream: ns(t.udp_stream),
            sctp_unreplied: ns(t.sctp_unreplied),
            sctp_established: ns(t.sctp_established),
        }
    }

    /// The timeout of a TCP state.
    pub(crate) fn tcp(&self, s: TcpState) -> u64 {
        self.tcp[s as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_kube_proxy_over_linux() {
        let t = Timeouts::default();
        assert_eq!(t.tcp_established, secs(86_400));
        assert_eq!(t.tcp_close_wait, secs(3600));
        assert_eq!(t.udp, secs(30));
        assert_eq!(t.udp_stream, secs(120));
        assert_eq!(t.tcp_syn_sent, secs(120));
        assert_eq!(t.tcp_time_wait, secs(120));
        assert_eq!(t.tcp_close, secs(10));
        assert_eq!(t.sctp_established, secs(210));
    }

    #[test]
    fn zero_means_the_kernels_value() {
        let z = Duration::ZERO;
        assert_eq!(Timeouts::from_kube_proxy(z, z, z, z), Timeouts::LINUX);
        let t = Timeouts::from_kube_proxy(secs(7), secs(8), secs(9), secs(10));
        assert_eq!(
            (t.tcp_established, t.tcp_close_wait, t.udp, t.udp_stream),
            (secs(7), secs(8), secs(9), secs(10))
        );
        assert_eq!(t.tcp_last_ack, Timeouts::LINUX.tcp_last_ack);
    }

    #[test]
    fn resolves_to_nanoseconds() {
        let n = TimeoutsNs::new(&Timeouts::default());
        assert_eq!(n.tcp(TcpState::Established), 86_400 * 1_000_000_000);
        assert_eq!(n.tcp(TcpState::Close), 10_000_000_000);
        assert_eq!(n.udp, 30_000_000_000);
        let huge = Timeouts {
            tcp_established: Duration::MAX,
            ..Timeouts::default()
        };
        assert_eq!(TimeoutsNs::new(&huge).tcp(TcpState::Established), u64::MAX);
    }
}
