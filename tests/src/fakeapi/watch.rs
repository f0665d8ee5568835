//! Watches: a chunked stream of JSON event lines, fed from the store's history.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use hyper::{Response, header};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::request::{Body, Query, Target, flag, partial_metadata, selectors};
use super::selector::{FieldSelector, LabelSelector};
use super::store::{EventType, StoredEvent, expired, parse_rv, set_rv};
use super::{FakeError, Kind, Shared};

/// How often watches that allow bookmarks get one.
pub const BOOKMARK_EVERY: Duration = Duration::from_secs(1);

/// The default watch length when `timeoutSeconds` is absent (the apiserver picks 30-60 min).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

type Chunk = Result<Bytes, std::io::Error>;

/// A response body fed by a channel; an `Err` item aborts the connection mid-body.
struct ChannelBody(mpsc::Receiver<Chunk>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.0.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data)))
    }
}

enum Start {
    /// Synthetic ADDED events for the current state first (rv ""/"0" or sendInitialEvents).
    Now { initial: bool, end_bookmark: bool },
    /// Replay history after this resourceVersion.
    From(u64),
}

struct Spec {
    kind: Kind,
    ns: Option<String>,
    name: Option<String>,
    labels: LabelSelector,
    fields: FieldSelector,
    bookmarks: bool,
    timeout: Duration,
    start: Start,
    /// The client asked for metadata only (`as=PartialObjectMetadata`).
    meta_only: bool,
}

impl Spec {
    fn matches(&self, o: &Value) -> bool {
        let meta = |k: &str| o.pointer(&format!("/metadata/{k}")).and_then(Value::as_str);
        self.ns
            .as_deref()
            .is_none_or(|ns| meta("namespace") == Some(ns))
            && self.name.as_deref().is_none_or(|n| meta("name") == Some(n))
            && self.labels.matches(o)
            && self.fields.matches(o)
    }

    /// The event this watch sees for a stored change, as the watch cache converts it.
    fn convert(&self, ev: &StoredEvent) -> Option<Bytes> {
        let cur = ev.etype != EventType::Deleted && self.matches(&ev.obj);
        let old = ev.prev.as_ref().is_some_and(|p| self.matches(p));
        match (cur, old) {
            (true, false) => Some(self.line("ADDED", &ev.obj)),
            (true, true) => Some(self.line("MODIFIED", &ev.obj)),
            (false, true) => {
                let mut o = ev.prev.clone().unwrap_or_default();
                set_rv(&mut o, ev.rv);
                Some(self.line("DELETED", &o))
            }
            (false, false) => None,
        }
    }

    fn bookmark(&self, rv: u64, initial_end: bool) -> Bytes {
        let mut meta = json!({"resourceVersion": rv.to_string()});
        if initial_end {
            meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        let obj = json!({"kind": self.kind.kind(), "apiVersion": self.kind.api_version(), "metadata": meta});
        self.line("BOOKMARK", &obj)
    }

    /// An event line, the object projected to its metadata when asked.
    fn line(&self, etype: &str, obj: &Value) -> Bytes {
        if self.meta_only && etype != "ERROR" {
            line(etype, &partial_metadata(obj))
        } else {
            line(etype, obj)
        }
    }
}

fn line(etype: &str, obj: &Value) -> Bytes {
    let mut v = serde_json::to_vec(&json!({"type": etype, "object": obj})).expect("json");
    v.push(b'\n');
    Bytes::from(v)
}

/// Validates a watch request and starts streaming it.
/// `drop_gen`: the drop generation when the request was counted (a drop after that
/// cuts this watch, even one before its task first looks at the state).
pub(crate) fn start(
    shared: Arc<Shared>,
    t: Target,
    q: &Query,
    drop_gen: u64,
    meta_only: bool,
) -> Result<Response<Body>, FakeError> {
    let bad = |m: &str| FakeError::new(400, "BadRequest", m.to_string());
    let (labels, fields) = selectors(t.kind, q)?;
    let bookmarks = flag(q, "allowWatchBookmarks") == Some(true);
    let timeout = match q.get("timeoutSeconds").map(String::as_str) {
        None | Some("") => DEFAULT_TIMEOUT,
        Some(s) => Duration::from_secs(s.parse().map_err(|_| bad("invalid timeoutSeconds"))?),
    };
    let rv = q.get("resourceVersion").map_or("", String::as_str);
    let rv_match = q.get("resourceVersionMatch").map_or("", String::as_str);
    let send_initial = flag(q, "sendInitialEvents");
    match send_initial {
        None if !rv_match.is_empty() => {
            return Err(bad(
                "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
            ));
        }
        Some(_) if rv_match != "NotOlderThan" => {
            return Err(bad(
                "sendInitialEvents is forbidden for watch unless resourceVersionMatch is set to NotOlderThan",
            ));
        }
        Some(true) if !bookmarks => {
            return Err(bad(
                "sendInitialEvents is forbidden for watch unless allowWatchBookmarks is set to true",
            ));
        }
        _ => {}
    }
    let start = match (send_initial, rv) {
        (Some(true), _) => {
            if !rv.is_empty() && rv != "0" {
                parse_rv(rv)?;
            }
            Start::Now {
                initial: true,
                end_bookmark: true,
            }
        }
        (Some(false), "" | "0") => Start::Now {
            initial: false,
            end_bookmark: false,
        },
        (None, "" | "0") => Start::Now {
            initial: true,
            end_bookmark: false,
        },
        (_, rv) => Start::From(parse_rv(rv)?),
    };
    let spec = Spec {
        kind: t.kind,
        ns: t.ns,
        name: t.name,
        labels,
        fields,
        bookmarks,
        timeout,
        start,
        meta_only,
    };
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(run(shared, spec, tx, drop_gen));
    Ok(Response::builder()
        .status(200)
        .header(header::CONTENT_TYPE, "application/json")
        .body(ChannelBody(rx).boxed())
        .expect("response"))
}

async fn run(shared: Arc<Shared>, spec: Spec, tx: mpsc::Sender<Chunk>, drop_gen: u64) {
    let mut poke = shared.poke.subscribe();
    let deadline = Instant::now() + spec.timeout;
    let mut next_bookmark = Instant::now() + BOOKMARK_EVERY;
    // Lines computed at start but held back while watches are silenced.
    let mut pending = Vec::new();
    let mut terminal = false;
    let mut cursor = {
        let st = shared.lock();
        match spec.start {
            Start::From(rv) if rv < st.compacted => {
                pending.push(line("ERROR", &expired(rv, st.compacted).status()));
                terminal = true;
                rv
            }
            Start::From(rv) => rv,
            Start::Now {
                initial,
                end_bookmark,
            } => {
                if initial {
                    let objs = st
                        .objects
                        .get(&spec.kind)
                        .into_iter()
                        .flat_map(|m| m.values());
                    pending.extend(
                        objs.filter(|o| spec.matches(o))
                            .map(|o| spec.line("ADDED", o)),
                    );
                }
                if end_bookmark {
                    pending.push(spec.bookmark(st.rv, true));
                }
                st.rv
            }
        }
    };
    loop {
        let mut out = Vec::new();
        let dropped;
        {
            let st = shared.lock();
            dropped = st.drop_gen != drop_gen;
            if !dropped && !st.silenced {
                out.append(&mut pending);
                if !terminal {
                    let from = st.history.partition_point(|e| e.rv <= cursor);
                    out.extend(
                        st.history
                            .range(from..)
                            .filter(|e| e.kind == spec.kind)
                            .filter_map(|e| spec.convert(e)),
                    );
                    cursor = cursor.max(st.rv);
                    if spec.bookmarks && Instant::now() >= next_bookmark {
                        out.push(spec.bookmark(cursor, false));
                    }
                }
            }
        }
        if Instant::now() >= next_bookmark {
            next_bookmark = Instant::now() + BOOKMARK_EVERY;
        }
        if dropped {
            let _ = tx
                .send(Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "fakeapi: watch dropped",
                )))
                .await;
            return;
        }
        for b in out {
            if tx.send(Ok(b)).await.is_err() {
                return;
            }
        }
        if terminal && pending.is_empty() {
            return;
        }
        tokio::select! {
            r = poke.changed() => if r.is_err() { return },
            _ = tokio::time::sleep_until(next_bookmark), if spec.bookmarks => {}
            _ = tokio::time::sleep_until(deadline) => return,
            _ = tx.closed() => return,
        }
    }
}
