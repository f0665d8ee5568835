//! The macro benchmark's results as a file: what it measured, on what machine, with what
//! command, so that two runs can be compared (`macro-bench --compare A.json B.json`) and
//! charted ([`crate::chart`]).

use serde::{Deserialize, Serialize};

/// Version of the file's layout.
pub const VERSION: u32 = 1;

/// One run of the macro benchmark.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    pub version: u32,
    /// When it ran (UTC, RFC 3339).
    pub date: String,
    /// The command line.
    pub command: Vec<String>,
    pub machine: Machine,
    /// `xsk` or `trafgen`.
    pub generator: String,
    /// Runs per case and mode in each round.
    pub runs: usize,
    /// Interleaved rounds of the throughput phase (`--rounds`; 1 in files of before).
    #[serde(default = "one")]
    pub rounds: usize,
    pub secs: f64,
    pub probe_rate: u32,
    pub cases: Vec<Case>,
}

fn one() -> usize {
    1
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    pub kernel: String,
    pub cpu_model: String,
    pub cpus: usize,
    pub load_before: String,
    pub load_after: String,
}

/// A router: `plain`, `nft`, `kxp`, ...
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Case {
    pub name: String,
    pub describe: String,
    pub modes: Vec<Mode>,
    /// One-way latency with no load.
    pub idle: Option<Latency>,
    /// Latency under offered loads.
    pub loaded: Vec<LoadPoint>,
    pub error: Option<String>,
}

/// Rate runs of one traffic mode (`est`, `new`, ...).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Mode {
    pub mode: String,
    /// Median of the runs' delivered rates (packets/s).
    pub median_pps: Option<f64>,
    pub runs: Vec<Run>,
    pub kxp_totals: Option<String>,
    pub kernel_conntrack: Option<u64>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Run {
    /// Packets/s counted at the backend.
    pub pps: f64,
    /// What the generator sent per second.
    pub offered_pps: Option<f64>,
    /// Packets/s lost before the backend.
    pub drop_pps: f64,
    /// (busy %, softirq %) per CPU; busy includes the steal.
    pub cpu: Vec<(f64, f64)>,
    /// Steal % per CPU: time the hypervisor gave the vCPU to something else (empty in
    /// files of before).
    #[serde(default)]
    pub steal_pct: Vec<f64>,
    /// CPU other processes used (% of one).
    pub foreign_pct: f64,
    /// How long a cache line took from CPU0 to CPU1 just before and just after the run
    /// (ns; `null` if not measured, empty in files of before): under 40, the two vCPUs
    /// were the two threads of one core.
    #[serde(default)]
    pub line_ns: Vec<Option<f64>>,
}

/// A latency distribution (one-way, µs).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Latency {
    pub sent: u64,
    pub got: u64,
    pub loss_pct: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    /// (quantile, µs) at [`QUANTILES`].
    pub quantiles: Vec<(f64, f64)>,
    /// The most steal of either CPU while the probes ran (%; 0 in files of before).
    #[serde(default)]
    pub steal_pct: f64,
}

/// The quantiles kept of every distribution.
pub const QUANTILES: &[f64] = &[
    0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.995, 0.998, 0.999, 0.9995, 1.0,
];

/// Latency under one offered load.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoadPoint {
    pub mode: String,
    /// As given: `50%` (of the slowest router's rate in that mode), `0.2 Mpps`, `max`.
    pub load: String,
    /// What the generator was asked for (None: unpaced).
    pub target_pps: Option<f64>,
    pub offered_pps: Option<f64>,
    pub delivered_pps: f64,
    /// The router forwarded less than was offered.
    pub saturated: bool,
    pub latency: Latency,
}

impl Results {
    pub fn case(&self, name: &str) -> Option<&Case> {
        self.cases.iter().find(|c| c.name == name)
    }
    /// Every mode any case measured, in order of first appearance.
    pub fn modes(&self) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        for m in self.cases.iter().flat_map(|c| c.modes.iter()) {
            if !v.contains(&m.mode) {
                v.push(m.mode.clone());
            }
        }
        v
    }
    /// Every load of the latency phase, in order of first appearance.
    pub fn loads(&self) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        for p in self.cases.iter().flat_map(|c| c.loaded.iter()) {
            if !v.contains(&p.load) {
                v.push(p.load.clone());
            }
        }
        v
    }
}

impl Case {
    pub fn median(&self, mode: &str) -> Option<f64> {
        self.modes
            .iter()
            .find(|m| m.mode == mode)
            .and_then(|m| m.median_pps)
    }
    pub fn at(&self, mode: &str, load: &str) -> Option<&LoadPoint> {
        self.loaded
            .iter()
            .find(|p| p.mode == mode && p.load == load)
    }
}

/// Two runs side by side: per router and mode, the rates and their ratio (b / a), and
/// per load the p50/p99; routers and modes only one run has are listed too.
pub fn compare(a: &Results, b: &Results) -> String {
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    line(format!(
        "A: {} ({}, {})\nB: {} ({}, {})",
        a.date, a.generator, a.machine.kernel, b.date, b.generator, b.machine.kernel
    ));
    let mut names: Vec<&str> = a.cases.iter().map(|c| c.name.as_str()).collect();
    for c in &b.cases {
        if !names.contains(&c.name.as_str()) {
            names.push(&c.name);
        }
    }
    let mut modes = a.modes();
    for m in b.modes() {
        if !modes.contains(&m) {
            modes.push(m);
        }
    }
    let mpps = |v: Option<f64>| v.map_or("-".to_string(), |p| format!("{:.3}", p / 1e6));
    line(String::new());
    line(format!(
        "{:<14} {:<5} {:>9} {:>9} {:>7}",
        "router", "mode", "A Mpps", "B Mpps", "B/A"
    ));
    for n in &names {
        for m in &modes {
            let x = a.case(n).and_then(|c| c.median(m));
            let y = b.case(n).and_then(|c| c.median(m));
            if x.is_none() && y.is_none() {
                continue;
            }
            let r = match (x, y) {
                (Some(x), Some(y)) if x > 0.0 => format!("{:.2}", y / x),
                _ => "-".into(),
            };
            line(format!(
                "{n:<14} {m:<5} {:>9} {:>9} {r:>7}",
                mpps(x),
                mpps(y)
            ));
        }
    }
    let mut loads = a.loads();
    for l in b.loads() {
        if !loads.contains(&l) {
            loads.push(l);
        }
    }
    if !loads.is_empty() {
        line(String::new());
        line(format!(
            "{:<14} {:<5} {:<10} {:>20} {:>20}",
            "router", "mode", "load", "A p50/p99 µs (loss)", "B p50/p99 µs (loss)"
        ));
        let cell = |p: Option<&LoadPoint>| {
            p.map_or("-".to_string(), |p| {
                format!(
                    "{:.0}/{:.0} ({:.1}%)",
                    p.latency.p50_us, p.latency.p99_us, p.latency.loss_pct
                )
            })
        };
        for n in &names {
            for m in &modes {
                for l in &loads {
                    let x = a.case(n).and_then(|c| c.at(m, l));
                    let y = b.case(n).and_then(|c| c.at(m, l));
                    if x.is_none() && y.is_none() {
                        continue;
                    }
                    line(format!(
                        "{n:<14} {m:<5} {l:<10} {:>20} {:>20}",
                        cell(x),
                        cell(y)
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(kxp_est: f64, p99: f64) -> Results {
        let lat = |p99_us: f64| Latency {
            sent: 2000,
            got: 1990,
            loss_pct: 0.5,
            p50_us: 10.0,
            p90_us: 20.0,
            p99_us,
            p999_us: p99_us * 2.0,
            max_us: p99_us * 3.0,
            quantiles: QUANTILES.iter().map(|&q| (q, 10.0 + q * p99_us)).collect(),
            steal_pct: 2.0,
        };
        let case = |name: &str, est: f64| Case {
            name: name.into(),
            describe: String::new(),
            modes: vec![Mode {
                mode: "est".into(),
                median_pps: Some(est),
                runs: vec![Run {
                    pps: est,
                    offered_pps: Some(est * 1.1),
                    drop_pps: 0.0,
                    cpu: vec![(100.0, 50.0), (100.0, 30.0)],
                    steal_pct: vec![1.0, 3.0],
                    foreign_pct: 1.0,
                    line_ns: vec![Some(15.0), Some(90.0)],
                }],
                kxp_totals: None,
                kernel_conntrack: None,
                error: None,
            }],
            idle: Some(lat(30.0)),
            loaded: vec![LoadPoint {
                mode: "est".into(),
                load: "90%".into(),
                target_pps: Some(300_000.0),
                offered_pps: Some(300_000.0),
                delivered_pps: 299_000.0,
                saturated: false,
                latency: lat(p99),
            }],
            error: None,
        };
        Results {
            version: VERSION,
            date: "2026-12-01T00:00:00Z".into(),
            command: vec!["macro-bench".into()],
            machine: Machine {
                kernel: "6.18".into(),
                cpu_model: "cpu".into(),
                cpus: 2,
                load_before: String::new(),
                load_after: String::new(),
            },
            generator: "xsk".into(),
            runs: 1,
            rounds: 1,
            secs: 3.0,
            probe_rate: 1000,
            cases: vec![case("nft", 400_000.0), case("kxp", kxp_est)],
        }
    }

    #[test]
    fn a_result_file_reads_back_and_two_compare_by_ratio() {
        let a = sample(600_000.0, 90.0);
        let b: Results =
            serde_json::from_str(&serde_json::to_string(&sample(900_000.0, 45.0)).unwrap())
                .unwrap();
        assert_eq!(b.case("kxp").and_then(|c| c.median("est")), Some(900_000.0));
        let text = compare(&a, &b);
        let kxp = text
            .lines()
            .find(|l| l.starts_with("kxp ") && l.contains("est "))
            .unwrap();
        assert!(
            kxp.contains("0.600") && kxp.contains("0.900") && kxp.ends_with("1.50"),
            "{text}"
        );
        let lat = text
            .lines()
            .find(|l| l.starts_with("kxp ") && l.contains("90%"))
            .unwrap();
        assert!(
            lat.contains("10/90 (0.5%)") && lat.contains("10/45 (0.5%)"),
            "{text}"
        );
        let nft = text
            .lines()
            .find(|l| l.starts_with("nft ") && l.contains("est "))
            .unwrap();
        assert!(nft.ends_with("1.00"), "{text}");
    }

    #[test]
    fn the_chart_has_every_router_and_panel() {
        let dir = std::env::temp_dir().join(format!("kxp-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let svg = dir.join("c.svg");
        crate::chart::render(&sample(600_000.0, 90.0), &svg).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        for want in [
            "<svg",
            "throughput",
            "latency, no load",
            "est: one-way latency vs load",
            "latency under est load 90%",
            "nft (0.5% lost)",
            "kxp (0.5% lost)",
        ] {
            assert!(text.contains(want), "{want} missing");
        }
    }

    /// A file written before `--rounds` existed (the reference run of 2026-12-01, bench/HISTORY.md) still
    /// reads, as one round.
    #[test]
    fn a_file_of_before_rounds_reads_as_one_round() {
        let r: Results =
            serde_json::from_str(include_str!("../results/reference-20261201.json")).unwrap();
        assert_eq!((r.runs, r.rounds), (3, 1));
        assert!(r.cases.iter().any(|c| c.name == "kxp-10k"));
        // Nor the steal, which reads as none.
        let kxp = r.case("kxp").unwrap();
        assert!(kxp.modes[0].runs[0].steal_pct.is_empty());
        assert_eq!(kxp.idle.as_ref().unwrap().steal_pct, 0.0);
    }
}
