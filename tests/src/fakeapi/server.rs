//! The HTTP side: routing, discovery, get, list (with pagination) and writes.
//! Watches are in `watch.rs`.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, header};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

use super::request::{Body, Query, Target, flag, partial_metadata, selectors};
use super::store::{State, WriteMode, parse_rv};
use super::{FakeError, Kind, Shared, watch};

/// Accepts connections (over TLS with `tls`) until `shutdown` fires.
pub(crate) async fn serve(
    listener: std::net::TcpListener,
    shared: Arc<Shared>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    mut shutdown: tokio::sync::oneshot::Receiver<()>,
) {
    let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            acc = listener.accept() => {
                let Ok((stream, _)) = acc else { continue };
                // As the API server (Go's net package) has it: a watch event is written
                // at once, not held by Nagle's algorithm until the client's delayed ACK
                // (40 ms stalls in sync-bench's write-to-programmed latency).
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                let tls = tls.clone();
                conns.spawn(async move {
                    match tls {
                        None => serve_conn(stream, shared).await,
                        Some(acceptor) => {
                            // A failed handshake (e.g. a client that does not trust
                            // the CA) just closes the connection.
                            if let Ok(stream) = acceptor.accept(stream).await {
                                serve_conn(stream, shared).await;
                            }
                        }
                    }
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    conns.abort_all();
}

async fn serve_conn<IO>(io: IO, shared: Arc<Shared>)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req| handle(shared.clone(), req));
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(io), svc)
        .await;
}

pub(crate) fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

pub(crate) fn json_response(code: u16, v: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, "application/json")
        .body(full(serde_json::to_vec(v).expect("json")))
        .expect("response")
}

pub(crate) fn error_response(e: &FakeError) -> Response<Body> {
    let mut resp = json_response(e.code, &e.status());
    if e.code == 429 {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    }
    resp
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16)
                {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(q: &str) -> Query {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

pub(crate) fn b64_encode(data: &[u8]) -> String {
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, &b)| acc | (u32::from(b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

fn b64_decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in s.bytes() {
        let v = B64.iter().position(|&x| x == c)? as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

fn parse_target(segs: &[&str]) -> Option<Target> {
    let (group, version, rest) = match segs {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return None,
    };
    let (ns, plural, name) = match rest {
        ["namespaces", ns, plural] => (Some(*ns), *plural, None),
        ["namespaces", ns, plural, name] => (Some(*ns), *plural, Some(*name)),
        [plural] => (None, *plural, None),
        [plural, name] => (None, *plural, Some(*name)),
        _ => return None,
    };
    let kind = Kind::from_path(group, version, plural)?;
    if ns.is_some() && !kind.namespaced() {
        return None;
    }
    if name.is_some() && ns.is_none() && kind.namespaced() {
        return None;
    }
    Some(Target {
        kind,
        ns: ns.map(str::to_string),
        name: name.map(str::to_string),
    })
}

fn discovery(segs: &[&str], addr: &str, extra: &[(String, Vec<String>)]) -> Option<Value> {
    let group = |g: &str| {
        let gv = json!({"groupVersion": format!("{g}/v1"), "version": "v1"});
        json!({"name": g, "versions": [gv], "preferredVersion": gv})
    };
    let resources = |group: &str| {
        let rs: Vec<Value> = Kind::ALL
            .into_iter()
            .filter(|k| k.group() == group)
            .map(|k| {
                let mut r = json!({
                    "name": k.plural(), "singularName": k.kind().to_lowercase(),
                    "namespaced": k.namespaced(), "kind": k.kind(),
                    "verbs": ["create", "delete", "get", "list", "update", "watch"],
                });
                if k == Kind::Service {
                    r["shortNames"] = json!(["svc"]);
                    r["categories"] = json!(["all"]);
                }
                r
            })
            .collect();
        let gv = if group.is_empty() {
            "v1".to_string()
        } else {
            format!("{group}/v1")
        };
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": rs})
    };
    let mut groups = vec!["discovery.k8s.io", "networking.k8s.io"];
    groups.extend(extra.iter().map(|(g, _)| g.as_str()));
    if let ["apis", g, "v1"] = segs
        && let Some((_, kinds)) = extra.iter().find(|(name, _)| name == g)
    {
        let rs: Vec<Value> = kinds
            .iter()
            .map(|k| {
                json!({"name": format!("{}s", k.to_lowercase()), "singularName": k.to_lowercase(),
                       "namespaced": true, "kind": k, "verbs": ["get", "list", "watch"]})
            })
            .collect();
        return Some(
            json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": format!("{g}/v1"), "resources": rs}),
        );
    }
    Some(match segs {
        ["version"] => json!({
            "major": "1", "minor": "34", "gitVersion": "v1.34.0", "gitCommit": "fakeapi",
            "gitTreeState": "clean", "buildDate": "2025-08-27T00:00:00Z",
            "goVersion": "go1.24.6", "compiler": "gc", "platform": "linux/amd64",
        }),
        ["api"] => json!({
            "kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": addr}],
        }),
        ["apis"] => json!({
            "kind": "APIGroupList", "apiVersion": "v1",
            "groups": groups.iter().map(|g| group(g)).collect::<Vec<_>>(),
        }),
        ["api", "v1"] => resources(""),
        ["apis", g] if groups.contains(g) => {
            let mut v = group(g);
            v["kind"] = json!("APIGroup");
            v["apiVersion"] = json!("v1");
            v
        }
        ["apis", g, "v1"] if groups.contains(g) => resources(g),
        _ => return None,
    })
}

/// The Status for an injected failure with HTTP code `code`.
fn injected(code: u16, t: &Target, verb: &str) -> FakeError {
    let (reason, message) = match code {
        429 => (
            "TooManyRequests",
            "Too many requests, please try again later.".to_string(),
        ),
        500 => (
            "InternalError",
            "Internal error occurred: injected by fakeapi".to_string(),
        ),
        503 => (
            "ServiceUnavailable",
            "The server is currently unable to handle the request".into(),
        ),
        403 => (
            "Forbidden",
            format!(
                "{} is forbidden: User \"system:anonymous\" cannot {verb} resource \"{}\" in \
                 API group \"{}\" at the cluster scope",
                t.kind.plural(),
                t.kind.plural(),
                t.kind.group()
            ),
        ),
        404 => (
            "NotFound",
            "the server could not find the requested resource".into(),
        ),
        _ => ("", format!("injected failure {code}")),
    };
    FakeError::new(code, reason, message)
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    if let Some(token) = &shared.token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|h| h.to_str().ok())
            .and_then(|h| h.strip_prefix("Bearer "));
        if given != Some(token.as_str()) {
            let e = FakeError::new(401, "Unauthorized", "Unauthorized".into());
            return Ok(error_response(&e));
        }
    }
    let path = req.uri().path().to_string();
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let q = parse_query(req.uri().query().unwrap_or(""));
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    if req.method() == Method::GET
        && let Some(v) = discovery(
            &segs,
            host,
            &shared
                .extra_groups
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    {
        return Ok(json_response(200, &v));
    }
    let Some(t) = parse_target(&segs) else {
        let e = FakeError::new(
            404,
            "NotFound",
            "the server could not find the requested resource".into(),
        );
        return Ok(error_response(&e));
    };
    let watching = flag(&q, "watch") == Some(true);
    // `Accept: application/json;as=PartialObjectMetadata[List];g=meta.k8s.io;v=v1`: the
    // objects' metadata only, as the API server's projection gives it.
    let meta_only = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|h| h.to_str().ok())
        .is_some_and(|h| h.contains("as=PartialObjectMetadata"));
    let verb = match (req.method().clone(), &t.name) {
        (Method::GET, _) if watching => "watch",
        (Method::GET, Some(_)) => "get",
        (Method::GET, None) => "list",
        (Method::POST, None) => "create",
        (Method::PUT, Some(_)) => "update",
        (Method::DELETE, Some(_)) => "delete",
        _ => {
            let e = FakeError::new(
                405,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource".into(),
            );
            return Ok(error_response(&e));
        }
    };
    // A watch counted is open from here: a drop after its count cuts it.
    let drop_gen = {
        let mut st = shared.lock();
        // Metadata-only requests counted apart ("list-metadata", "watch-metadata").
        st.count(
            t.kind,
            match (verb, meta_only) {
                ("list", true) => "list-metadata",
                ("watch", true) => "watch-metadata",
                ("get", true) => "get-metadata",
                _ => verb,
            },
        );
        if let Some(code) = st.faults.pop_front() {
            return Ok(error_response(&injected(code, &t, verb)));
        }
        st.drop_gen
    };
    let out = match verb {
        "watch" => {
            return Ok(watch::start(shared, t, &q, drop_gen, meta_only)
                .unwrap_or_else(|e| error_response(&e)));
        }
        "get" => get(&shared.lock(), &t, meta_only),
        "list" => list(&shared.lock(), &t, &q, meta_only),
        _ => {
            let body = match req.into_body().collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => {
                    return Ok(error_response(&FakeError::new(
                        400,
                        "BadRequest",
                        e.to_string(),
                    )));
                }
            };
            let r = write(&shared, &t, verb, &body);
            shared.poke();
            r.map(|(code, v)| json_response(code, &v))
        }
    };
    Ok(match out {
        Ok(resp) => resp,
        Err(e) => error_response(&e),
    })
}

fn get(st: &State, t: &Target, meta_only: bool) -> Result<Response<Body>, FakeError> {
    let key = (
        t.ns.clone().unwrap_or_default(),
        t.name.clone().unwrap_or_default(),
    );
    match st.objects.get(&t.kind).and_then(|m| m.get(&key)) {
        Some(o) if meta_only => Ok(json_response(200, &partial_metadata(o))),
        Some(o) => Ok(json_response(200, o)),
        None => Err(FakeError::new(
            404,
            "NotFound",
            format!(
                "{}{} {:?} not found",
                t.kind.plural(),
                group_suffix(t.kind),
                key.1
            ),
        )),
    }
}

fn group_suffix(k: Kind) -> String {
    if k.group().is_empty() {
        String::new()
    } else {
        format!(".{}", k.group())
    }
}

fn write(shared: &Shared, t: &Target, verb: &str, body: &[u8]) -> Result<(u16, Value), FakeError> {
    let mut st = shared.lock();
    if verb == "delete" {
        let ns = t.ns.clone().unwrap_or_default();
        return st
            .delete(t.kind, &ns, t.name.as_deref().unwrap_or(""))
            .map(|o| (200, o));
    }
    let mut obj: Value = serde_json::from_slice(body)
        .map_err(|e| FakeError::new(400, "BadRequest", format!("invalid JSON body: {e}")))?;
    if obj.get("kind").is_none() {
        obj["kind"] = json!(t.kind.kind());
    }
    if obj.get("apiVersion").is_none() {
        obj["apiVersion"] = json!(t.kind.api_version());
    }
    if !obj.get("metadata").is_some_and(Value::is_object) {
        return Err(FakeError::new(
            400,
            "BadRequest",
            "metadata is required".into(),
        ));
    }
    if let Some(ns) = &t.ns {
        match obj.pointer("/metadata/namespace").and_then(Value::as_str) {
            None | Some("") => obj["metadata"]["namespace"] = json!(ns),
            Some(have) if have != ns => {
                return Err(FakeError::new(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent \
                     on the request"
                        .into(),
                ));
            }
            Some(_) => {}
        }
    }
    if let Some(name) = &t.name
        && obj.pointer("/metadata/name").and_then(Value::as_str) != Some(name)
    {
        return Err(FakeError::new(
            400,
            "BadRequest",
            "the name of the object does not match the name on the URL".into(),
        ));
    }
    let mode = if verb == "create" {
        WriteMode::Create
    } else {
        WriteMode::Replace
    };
    let (_, o) = st.write(obj, mode)?;
    Ok((if verb == "create" { 201 } else { 200 }, o))
}

/// Whether `ns/name` sorts after a continue token's `start` (without building the string).
fn after_start(ns: &str, name: &str, start: &str) -> bool {
    ns.bytes()
        .chain(std::iter::once(b'/'))
        .chain(name.bytes())
        .cmp(start.bytes())
        == std::cmp::Ordering::Greater
}

fn list(st: &State, t: &Target, q: &Query, meta_only: bool) -> Result<Response<Body>, FakeError> {
    let bad = |m: &str| FakeError::new(400, "BadRequest", m.to_string());
    let (labels, fields) = selectors(t.kind, q)?;
    let limit: usize = match q.get("limit").map(String::as_str) {
        None | Some("") => 0,
        Some(l) => l.parse().map_err(|_| bad("invalid limit"))?,
    };
    let rv_param = q.get("resourceVersion").map_or("", String::as_str);
    let rv_match = q.get("resourceVersionMatch").map_or("", String::as_str);
    let cont = q.get("continue").map_or("", String::as_str);
    let (at, list_rv, start) = if !cont.is_empty() {
        if !rv_param.is_empty() && rv_param != "0" {
            return Err(bad(
                "specifying resource version is not allowed when using continue",
            ));
        }
        let tok: Value = b64_decode(cont)
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| bad("continue key is not valid: illegal base64 data"))?;
        let rv = tok["rv"]
            .as_u64()
            .ok_or_else(|| bad("continue key is not valid: bad rv"))?;
        let start = tok["start"].as_str().unwrap_or("").to_string();
        if rv < st.compacted {
            return Err(FakeError::new(
                410,
                "Expired",
                "The provided continue parameter is too old to display a consistent list result. \
                 You can start a new list without the continue parameter, or use the continue \
                 token in this response to retrieve the remainder of the results. Continuing with \
                 the provided token results in an inconsistent list - objects that were created, \
                 modified, or deleted between the time the first chunk was returned and now may \
                 show up in the list."
                    .into(),
            ));
        }
        (Some(rv), rv, Some(start))
    } else {
        match (rv_param, rv_match) {
            ("", "") | ("0", "") | ("0", "NotOlderThan") => (None, st.rv, None),
            ("", _) => {
                return Err(bad(
                    "resourceVersionMatch is forbidden unless resourceVersion is provided",
                ));
            }
            ("0", _) => {
                return Err(bad(
                    "resourceVersionMatch \"Exact\" is forbidden for resourceVersion \"0\"",
                ));
            }
            (rv, m) => {
                let rv = parse_rv(rv)?;
                let exact = match m {
                    "Exact" => true,
                    "NotOlderThan" => false,
                    "" => limit > 0,
                    _ => return Err(bad("resourceVersionMatch: unsupported value")),
                };
                if exact {
                    (Some(rv), rv, None)
                } else {
                    if rv > st.rv {
                        return Err(FakeError::new(
                            504,
                            "Timeout",
                            format!("Too large resource version: {rv}, current: {}", st.rv),
                        ));
                    }
                    (None, st.rv, None)
                }
            }
        }
    };
    let objs = st.snapshot(t.kind, at)?;
    let mut matching = objs.iter().filter(|((ns, name), o)| {
        t.ns.as_ref().is_none_or(|want| want == ns)
            && start.as_ref().is_none_or(|s| after_start(ns, name, s))
            && labels.matches(o)
            && fields.matches(o)
    });
    let mut items = Vec::new();
    let mut last = None;
    let take = if limit > 0 { limit } else { usize::MAX };
    for ((ns, name), o) in matching.by_ref().take(take) {
        let mut o = if meta_only {
            partial_metadata(o)
        } else {
            o.clone()
        };
        if let Some(m) = o.as_object_mut().filter(|_| !meta_only) {
            m.remove("kind");
            m.remove("apiVersion");
        }
        items.push(o);
        last = Some(format!("{ns}/{name}"));
    }
    let remaining = matching.count();
    let mut meta = json!({"resourceVersion": list_rv.to_string()});
    if remaining > 0 {
        let tok = json!({"v": "meta.k8s.io/v1", "rv": list_rv, "start": last});
        meta["continue"] = json!(b64_encode(&serde_json::to_vec(&tok).expect("json")));
        meta["remainingItemCount"] = json!(remaining);
    }
    let (list_kind, api_version) = if meta_only {
        ("PartialObjectMetadataList".to_string(), "meta.k8s.io/v1")
    } else {
        (format!("{}List", t.kind.kind()), t.kind.api_version())
    };
    Ok(json_response(
        200,
        &json!({"kind": list_kind, "apiVersion": api_version, "metadata": meta, "items": items}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trip() {
        for s in [
            "",
            "a",
            "ab",
            "abc",
            "abcd",
            "{\"rv\":12,\"start\":\"default/x\"}",
        ] {
            assert_eq!(b64_decode(&b64_encode(s.as_bytes())).unwrap(), s.as_bytes());
        }
        assert_eq!(b64_encode(b"abc"), "YWJj");
        assert_eq!(percent_decode("%21a%3Db+c"), "!a=b c");
    }
}
