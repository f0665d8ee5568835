//! `kxp trace`: what kxp does with the first packet of a connection, and why.

use std::fmt::Write as _;
use std::net::IpAddr;

use nat::decide::{Decision, NewPacket, decide};
use nat::model::Affinity;
use nat::snapshot::Snapshot;
use nat::tuple::Protocol;
use serde::Serialize;

/// The answer, in the JSON shape `kxp trace --output json` prints.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct TraceResult {
    /// `dnat`, `reject`, `drop` or `pass`.
    pub verdict: &'static str,
    /// Every endpoint the connection may be sent to, sorted (`IP:PORT`, `[IPv6]:PORT`).
    pub endpoints: Vec<String>,
    pub masquerade: bool,
    /// `namespace/name:port` of the Service port, if one is involved.
    pub service: Option<String>,
    pub reason: String,
    /// The endpoints NetworkPolicy denies this client, each with why (a connection
    /// that lands on one is dropped); empty when none or no policy applies.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub network_policy_denied: Vec<String>,
}

/// The packet to trace.
#[derive(Debug, Clone)]
pub struct TraceInput {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub dport: u16,
    pub proto: Protocol,
    pub in_interface: Option<String>,
}

/// Extra facts for the text output.
#[derive(Debug, Clone, Default)]
pub struct TraceDetail {
    pub frontend: Option<String>,
    pub policy: Option<&'static str>,
    pub scheduler: Option<&'static str>,
    pub affinity: Option<u32>,
    pub topology: Option<String>,
}

/// Decides for `input` against `snap`.
pub fn trace(snap: &Snapshot, input: &TraceInput) -> (TraceResult, TraceDetail) {
    let pkt = NewPacket {
        src: input.src,
        dst: input.dst,
        dport: input.dport,
        proto: input.proto,
        in_interface: input.in_interface.as_deref(),
    };
    let dest = format!(
        "{}/{}",
        std::net::SocketAddr::new(input.dst, input.dport),
        input.proto
    );
    let mut detail = TraceDetail::default();
    let not_forwarded = |verdict, service: Option<String>, reason| TraceResult {
        verdict,
        endpoints: vec![],
        masquerade: false,
        service,
        reason,
        network_policy_denied: vec![],
    };
    let result = match decide(snap, &pkt) {
        Decision::Pass => not_forwarded(
            "pass",
            None,
            format!("{dest} is not a Service frontend: the kernel handles it"),
        ),
        Decision::Drop { reason, port } => {
            not_forwarded("drop", port.map(|p| p.name.to_string()), reason.to_string())
        }
        Decision::Reject { reason, port } => not_forwarded(
            "reject",
            port.map(|p| p.name.to_string()),
            reason.to_string(),
        ),
        Decision::Forward(fwd) => forwarded(snap, input, &fwd, &dest, &mut detail),
    };
    (result, detail)
}

/// The trace of a forwarded connection: its endpoints, masquerade, traffic policy, and
/// the endpoints NetworkPolicy denies this client.
fn forwarded(
    snap: &Snapshot,
    input: &TraceInput,
    fwd: &nat::Forward<'_>,
    dest: &str,
    detail: &mut TraceDetail,
) -> TraceResult {
    let mut endpoints: Vec<String> = fwd.candidate_endpoints().map(|e| e.key()).collect();
    endpoints.sort();
    let hairpin = fwd.candidate_endpoints().any(|e| e.addr.ip() == input.src);
    let masquerade = fwd.masquerade || hairpin;
    let policy = match fwd.policy {
        nat::Policy::Cluster => "Cluster",
        nat::Policy::Local => "Local",
    };
    detail.frontend = Some(format!("{} {dest}", fwd.frontend.name()));
    detail.policy = Some(policy);
    detail.scheduler = Some(fwd.port.scheduler.name());
    if let Affinity::ClientIp { timeout_secs } = fwd.port.affinity {
        detail.affinity = Some(timeout_secs);
    }
    detail.topology = match fwd.port.cat.topology {
        nat::model::Topology::None => None,
        t => Some(format!("{t:?}")),
    };
    let mut reason = format!(
        "{} {dest} of {}: {policy} traffic policy, {} endpoint(s); {}",
        fwd.frontend.name(),
        fwd.port.name,
        endpoints.len(),
        fwd.why
    );
    if hairpin {
        reason.push_str("; hairpin: the source is one of the endpoints");
    }
    // NetworkPolicy, per endpoint: the client's connection is checked once an
    // endpoint is chosen (after DNAT, before SNAT).
    let mut denied = Vec::new();
    if let Some(pv) = &snap.policy {
        let mut eps: Vec<_> = fwd.candidate_endpoints().collect();
        eps.sort_by_key(|e| e.key());
        for e in eps {
            let v = pv.check(
                input.src,
                e.addr,
                input.proto,
                snap.node.is_local_addr(input.src),
            );
            if !v.allowed() {
                denied.push(format!("{} ({})", e.key(), policy_why(&v)));
            }
        }
    }
    let all_denied = !denied.is_empty() && denied.len() == endpoints.len();
    if all_denied {
        reason.push_str("; NetworkPolicy denies every endpoint to this client: dropped");
    } else if !denied.is_empty() {
        reason.push_str(&format!(
            "; NetworkPolicy denies {} of them to this client (a connection that lands on one is dropped)",
            denied.len()
        ));
    }
    TraceResult {
        verdict: if all_denied { "drop" } else { "dnat" },
        endpoints,
        masquerade,
        service: Some(fwd.port.name.to_string()),
        reason,
        network_policy_denied: denied,
    }
}

/// Which policies deny a connection, and on which side.
fn policy_why(v: &nat::policy::Verdict) -> String {
    use nat::policy::Decision;
    let mut parts = Vec::new();
    if let Decision::Denied { policies } = &v.ingress {
        parts.push(format!(
            "the endpoint pod's ingress, where none of {} allows it",
            policies.join(", ")
        ));
    }
    if let Decision::Denied { policies } = &v.egress {
        parts.push(format!(
            "the client pod's egress, where none of {} allows it",
            policies.join(", ")
        ));
    }
    format!("denied by NetworkPolicy, {}", parts.join("; "))
}

/// The text form of a trace, for a person.
pub fn render_text(input: &TraceInput, r: &TraceResult, d: &TraceDetail) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} {} -> {}",
        input.proto,
        input.src,
        std::net::SocketAddr::new(input.dst, input.dport)
    );
    if let Some(svc) = &r.service {
        let _ = writeln!(s, "  service:    {svc}");
    }
    if let Some(f) = &d.frontend {
        let _ = writeln!(s, "  frontend:   {f}");
    }
    let verdict = match r.verdict {
        "dnat" => format!(
            "DNAT to one of {} endpoint(s){}",
            r.endpoints.len(),
            d.scheduler.map(|x| format!(" ({x})")).unwrap_or_default()
        ),
        "reject" => {
            "REJECT (the client is refused at once: TCP RST / ICMP port unreachable)".into()
        }
        "drop" => "DROP".into(),
        _ => "PASS (not kxp's: the kernel handles it)".into(),
    };
    let _ = writeln!(s, "  verdict:    {verdict}");
    for e in &r.endpoints {
        let _ = writeln!(s, "                {e}");
    }
    for e in &r.network_policy_denied {
        let _ = writeln!(s, "  denied:     {e}");
    }
    if let Some(p) = d.policy {
        let _ = writeln!(s, "  policy:     {p}");
    }
    if let Some(t) = &d.topology {
        let _ = writeln!(s, "  topology:   {t}");
    }
    if let Some(a) = d.affinity {
        let _ = writeln!(s, "  affinity:   ClientIP, {a}s");
    }
    if r.verdict == "dnat" {
        let _ = writeln!(
            s,
            "  masquerade: {}",
            if r.masquerade {
                "yes (SNAT to the node's address)"
            } else {
                "no (the endpoint sees the client's address)"
            }
        );
    }
    let _ = writeln!(s, "  reason:     {}", r.reason);
    s
}
