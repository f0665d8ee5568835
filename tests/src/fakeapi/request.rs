//! What a request asks, shared by the plain handlers (`server`) and the watches
//! (`watch`): its query, the resource it addresses, its selectors, the response body,
//! and the metadata-only projection.

use std::collections::HashMap;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use serde_json::{Value, json};

use super::selector::{FieldSelector, LabelSelector};
use super::{FakeError, Kind};

pub(crate) type Body = BoxBody<Bytes, std::io::Error>;
pub(crate) type Query = HashMap<String, String>;

/// True for "true"/"1" (Go's strconv.ParseBool accepts more; clients send these).
pub(crate) fn flag(q: &Query, k: &str) -> Option<bool> {
    q.get(k)
        .map(|v| matches!(v.as_str(), "true" | "1" | "t" | "True" | "TRUE"))
}

/// Which resource (and optionally namespace/name) a path addresses.
#[derive(Debug)]
pub(crate) struct Target {
    pub kind: Kind,
    pub ns: Option<String>,
    pub name: Option<String>,
}

/// `obj` as a `PartialObjectMetadata` (its metadata only).
pub(crate) fn partial_metadata(obj: &Value) -> Value {
    json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
           "metadata": obj.get("metadata").cloned().unwrap_or_else(|| json!({}))})
}

/// Parses labelSelector and fieldSelector for `kind` (400 on a bad one).
pub(crate) fn selectors(
    kind: Kind,
    q: &Query,
) -> Result<(LabelSelector, FieldSelector), FakeError> {
    let bad = |m: String| FakeError::new(400, "BadRequest", m);
    let l = LabelSelector::parse(q.get("labelSelector").map_or("", String::as_str)).map_err(bad)?;
    let f = FieldSelector::parse(q.get("fieldSelector").map_or("", String::as_str), |f| {
        kind.supports_field(f)
    })
    .map_err(bad)?;
    Ok((l, f))
}
