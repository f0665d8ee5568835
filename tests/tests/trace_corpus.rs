//! Conformance corpus: upstream kube-proxy's nftables packet-flow tests, run through the
//! real `kxp trace` binary.
//!
//! Every `trace-cases/*.yaml` file holds the Kubernetes objects one upstream test creates
//! (`state`), an optional KubeProxyConfiguration (`config`), the `kxp` flags that stand for
//! the upstream fake proxier's node set-up (`flags`) and the packet flows with the verdict
//! kube-proxy reaches (`cases`). See `trace-cases/README.md`.
//!
//! The binary is not built here: `cargo build -p controlplane` first, or point `KXP_BIN` at
//! a `kxp` binary.

use kxp_tests::kxp_bin;
use std::collections::BTreeSet;
use std::fmt;
use std::fs;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;

/// One corpus file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CorpusFile {
    source: String,
    description: String,
    #[serde(default)]
    flags: Vec<String>,
    #[serde(default)]
    config: Option<String>,
    state: String,
    cases: Vec<Case>,
}

/// One new connection to trace.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    src: String,
    dst: String,
    dport: u16,
    #[serde(default = "default_protocol")]
    protocol: String,
    expect: Expect,
}

fn default_protocol() -> String {
    "TCP".to_owned()
}

/// What kube-proxy decides for the connection.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
struct Expect {
    verdict: String,
    #[serde(default)]
    endpoints: Vec<String>,
    #[serde(default)]
    masquerade: bool,
}

impl fmt::Display for Expect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "verdict={} endpoints=[{}] masquerade={}",
            self.verdict,
            self.endpoints.join(", "),
            self.masquerade
        )
    }
}

/// `kxp trace --output json`. Extra fields are allowed.
#[derive(Debug, Deserialize)]
struct TraceOutput {
    verdict: String,
    #[serde(default)]
    endpoints: Vec<String>,
    #[serde(default)]
    masquerade: bool,
    #[serde(default)]
    service: Option<String>,
    #[serde(default)]
    reason: Option<String>,
}

const VERDICTS: [&str; 4] = ["dnat", "reject", "drop", "pass"];
const PROTOCOLS: [&str; 3] = ["TCP", "UDP", "SCTP"];
const STATE_KINDS: [(&str, &str); 4] = [
    ("v1", "Service"),
    ("discovery.k8s.io/v1", "EndpointSlice"),
    ("v1", "Node"),
    ("networking.k8s.io/v1", "ServiceCIDR"),
];

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("trace-cases")
}

/// Every corpus file, sorted by name, parsed.
fn load_corpus() -> Vec<(String, CorpusFile)> {
    let dir = corpus_dir();
    let mut paths: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.expect("readdir entry").path())
        .filter(|p| {
            p.extension()
                .is_some_and(|ext| ext == "yaml" || ext == "yml")
        })
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let name = path
                .file_name()
                .expect("file name")
                .to_string_lossy()
                .into_owned();
            let text = fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            let file: CorpusFile = serde_yaml::from_str(&text)
                .unwrap_or_else(|e| panic!("{name}: not a valid corpus file: {e}"));
            (name, file)
        })
        .collect()
}

/// Checks one file beyond its schema; returns every problem found.
fn validate(name: &str, file: &CorpusFile) -> Vec<String> {
    let mut problems = Vec::new();
    let mut bad = |msg: String| problems.push(format!("{name}: {msg}"));

    if file.source.trim().is_empty() {
        bad("empty `source`".into());
    }
    if file.description.trim().is_empty() {
        bad("empty `description`".into());
    }
    if file.cases.is_empty() {
        bad("no cases".into());
    }

    // state: a multi-document YAML stream of the four supported kinds (or a `kind: List`).
    let mut docs = 0;
    for doc in serde_yaml::Deserializer::from_str(&file.state) {
        let value = match serde_yaml::Value::deserialize(doc) {
            Ok(v) => v,
            Err(e) => {
                bad(format!("state is not valid YAML: {e}"));
                break;
            }
        };
        if value.is_null() {
            continue;
        }
        docs += 1;
        let api_version = value
            .get("apiVersion")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        let kind = value.get("kind").and_then(|v| v.as_str()).unwrap_or("");
        if kind == "List" {
            continue;
        }
        if !STATE_KINDS.contains(&(api_version, kind)) {
            bad(format!(
                "state document {docs} has unsupported apiVersion/kind {api_version}/{kind}"
            ));
        }
        if value
            .get("metadata")
            .and_then(|m| m.get("name"))
            .and_then(|n| n.as_str())
            .is_none()
        {
            bad(format!(
                "state document {docs} ({kind}) has no metadata.name"
            ));
        }
        if kind == "EndpointSlice"
            && value
                .get("metadata")
                .and_then(|m| m.get("labels"))
                .and_then(|l| l.get("kubernetes.io/service-name"))
                .is_none()
        {
            bad(format!(
                "state document {docs}: EndpointSlice without kubernetes.io/service-name"
            ));
        }
    }
    if docs == 0 {
        bad("state holds no objects".into());
    }

    if let Some(config) = &file.config {
        match serde_yaml::from_str::<serde_yaml::Value>(config) {
            Ok(v) => {
                if v.get("kind").and_then(|k| k.as_str()) != Some("KubeProxyConfiguration") {
                    bad("config is not a KubeProxyConfiguration".into());
                }
            }
            Err(e) => bad(format!("config is not valid YAML: {e}")),
        }
    }

    let mut names = BTreeSet::new();
    for case in &file.cases {
        let c = &case.name;
        if !names.insert(c.as_str()) {
            bad(format!("duplicate case name {c:?}"));
        }
        let src = case.src.parse::<IpAddr>();
        let dst = case.dst.parse::<IpAddr>();
        if src.is_err() {
            bad(format!("case {c:?}: bad src {:?}", case.src));
        }
        if dst.is_err() {
            bad(format!("case {c:?}: bad dst {:?}", case.dst));
        }
        if let (Ok(s), Ok(d)) = (src, dst)
            && s.is_ipv4() != d.is_ipv4()
        {
            bad(format!("case {c:?}: src and dst of different families"));
        }
        if !PROTOCOLS.contains(&case.protocol.as_str()) {
            bad(format!(
                "case {c:?}: protocol {:?} is not TCP, UDP or SCTP",
                case.protocol
            ));
        }
        let e = &case.expect;
        if !VERDICTS.contains(&e.verdict.as_str()) {
            bad(format!(
                "case {c:?}: verdict {:?} is not dnat, reject, drop or pass",
                e.verdict
            ));
        }
        if e.verdict == "dnat" && e.endpoints.is_empty() {
            bad(format!("case {c:?}: dnat without endpoints"));
        }
        if e.verdict != "dnat" && !e.endpoints.is_empty() {
            bad(format!(
                "case {c:?}: endpoints listed for verdict {}",
                e.verdict
            ));
        }
        if e.verdict != "dnat" && e.masquerade {
            bad(format!("case {c:?}: masquerade without dnat"));
        }
        let mut sorted = e.endpoints.clone();
        sorted.sort();
        sorted.dedup();
        if sorted != e.endpoints {
            bad(format!("case {c:?}: endpoints not sorted and unique"));
        }
        for endpoint in &e.endpoints {
            match endpoint.parse::<SocketAddr>() {
                Ok(sa) if sa.to_string() == *endpoint => {}
                _ => bad(format!(
                    "case {c:?}: endpoint {endpoint:?} is not a canonical IP:PORT / [IPv6]:PORT"
                )),
            }
        }
    }
    problems
}

#[test]
fn corpus_is_non_empty_and_every_file_parses() {
    let corpus = load_corpus();
    assert!(
        !corpus.is_empty(),
        "no corpus files in {}",
        corpus_dir().display()
    );
    let problems: Vec<String> = corpus
        .iter()
        .flat_map(|(name, file)| validate(name, file))
        .collect();
    assert!(
        problems.is_empty(),
        "invalid corpus:\n  {}",
        problems.join("\n  ")
    );
    let cases: usize = corpus.iter().map(|(_, f)| f.cases.len()).sum();
    assert!(cases > 0, "the corpus has no cases");
}

/// A scratch directory under the system temp dir, removed on drop.
#[derive(Debug)]
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(tag: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "kxp-trace-corpus-{}-{}-{nanos}-{tag}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        Self(dir)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[derive(Debug)]
struct Mismatch {
    file: String,
    case: String,
    expected: Expect,
    got: String,
    reason: String,
}

fn snippet(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim();
    if text.chars().count() > 400 {
        format!("{}…", text.chars().take(400).collect::<String>())
    } else {
        text.to_owned()
    }
}

/// Runs one case; `Ok(())` when kxp agrees with kube-proxy.
fn run_case(
    bin: &Path,
    state: &Path,
    config: Option<&Path>,
    flags: &[String],
    case: &Case,
) -> Result<(), (String, String)> {
    let mut cmd = Command::new(bin);
    cmd.arg("trace").arg("--state").arg(state);
    if let Some(config) = config {
        cmd.arg("--config").arg(config);
    }
    cmd.args(flags)
        .args(["--src", &case.src, "--dst", &case.dst])
        .args(["--dport", &case.dport.to_string()])
        .args(["--protocol", &case.protocol, "-o", "json"]);
    let out = cmd
        .output()
        .map_err(|e| (format!("failed to run {}", bin.display()), e.to_string()))?;
    if !out.status.success() {
        return Err((
            format!("kxp exited with {}", out.status),
            format!(
                "stderr: {} | stdout: {}",
                snippet(&out.stderr),
                snippet(&out.stdout)
            ),
        ));
    }
    let trace: TraceOutput = serde_json::from_slice(out.stdout.trim_ascii()).map_err(|e| {
        (
            format!("unparsable JSON ({e})"),
            format!(
                "stdout: {} | stderr: {}",
                snippet(&out.stdout),
                snippet(&out.stderr)
            ),
        )
    })?;
    let mut endpoints = trace.endpoints.clone();
    endpoints.sort();
    let got = Expect {
        verdict: trace.verdict.clone(),
        endpoints,
        masquerade: trace.masquerade,
    };
    let mut expected = case.expect.clone();
    expected.endpoints.sort();
    if got == expected {
        Ok(())
    } else {
        let service = trace.service.as_deref().unwrap_or("null");
        Err((
            got.to_string(),
            format!(
                "service={service} reason={}",
                trace.reason.as_deref().unwrap_or("")
            ),
        ))
    }
}

#[test]
fn kxp_trace_agrees_with_kube_proxy_on_the_corpus() {
    let corpus = load_corpus();
    assert!(
        !corpus.is_empty(),
        "no corpus files in {}",
        corpus_dir().display()
    );
    let bin = kxp_bin();

    let mut total = 0usize;
    let mut mismatches = Vec::new();
    for (name, file) in &corpus {
        let scratch = ScratchDir::new(name.trim_end_matches(".yaml"));
        let state = scratch.0.join("state.yaml");
        fs::write(&state, &file.state).expect("write state");
        let config = file.config.as_ref().map(|text| {
            let path = scratch.0.join("config.yaml");
            fs::write(&path, text).expect("write config");
            path
        });
        for case in &file.cases {
            total += 1;
            if let Err((got, reason)) = run_case(&bin, &state, config.as_deref(), &file.flags, case)
            {
                mismatches.push(Mismatch {
                    file: name.clone(),
                    case: format!(
                        "{} ({} {} -> {}:{})",
                        case.name, case.protocol, case.src, case.dst, case.dport
                    ),
                    expected: case.expect.clone(),
                    got,
                    reason,
                });
            }
        }
    }

    let summary = format!("trace corpus: {total} cases, {} files", corpus.len());
    println!("{summary}");
    if !mismatches.is_empty() {
        let report: Vec<String> = mismatches
            .iter()
            .map(|m| {
                format!(
                    "{} :: {}\n      expected: {}\n      got:      {}\n      {}",
                    m.file, m.case, m.expected, m.got, m.reason
                )
            })
            .collect();
        panic!(
            "{summary}: {} mismatch(es) with kube-proxy (binary {}):\n  {}",
            mismatches.len(),
            bin.display(),
            report.join("\n  ")
        );
    }
}
