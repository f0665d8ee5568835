//! The fake's object store: objects of every kind, one resourceVersion counter, and the
//! event history watches replay from.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use super::{FakeError, Kind};

/// The type of a stored change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One change, as the watch cache keeps it: the object after (for a delete: the object
/// as deleted, with the delete's resourceVersion) and the object before.
#[derive(Clone, Debug)]
pub(crate) struct StoredEvent {
    pub rv: u64,
    pub kind: Kind,
    pub etype: EventType,
    pub obj: Value,
    pub prev: Option<Value>,
}

/// `(namespace, name)`; namespace "" for cluster-scoped kinds.
pub(crate) type Key = (String, String);

/// Everything the fake knows, behind one lock.
#[derive(Debug, Default)]
pub(crate) struct State {
    pub rv: u64,
    pub objects: HashMap<Kind, BTreeMap<Key, Value>>,
    pub history: VecDeque<StoredEvent>,
    /// Lists/watches/continue tokens at a resourceVersion below this get 410 Expired.
    pub compacted: u64,
    pub faults: VecDeque<u16>,
    pub silenced: bool,
    pub drop_gen: u64,
    pub counts: BTreeMap<(String, String), u64>,
    uid_seq: u64,
}

/// How a write treats an existing object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WriteMode {
    Create,
    Replace,
    Apply,
}

pub(crate) fn key_of(kind: Kind, obj: &Value) -> Key {
    let ns = if kind.namespaced() {
        obj.pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or("default")
    } else {
        ""
    };
    let name = obj
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    (ns.to_string(), name.to_string())
}

pub(crate) fn set_rv(obj: &mut Value, rv: u64) {
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
    }
}

/// Parses a non-empty resourceVersion.
pub(crate) fn parse_rv(s: &str) -> Result<u64, FakeError> {
    s.parse().map_err(|_| {
        FakeError::new(
            400,
            "BadRequest",
            format!("invalid resource version: {s:?}"),
        )
    })
}

impl State {
    pub fn count(&mut self, kind: Kind, verb: &str) {
        *self
            .counts
            .entry((kind.plural().to_string(), verb.to_string()))
            .or_default() += 1;
    }

    /// Creates, replaces or applies `obj` (which names its kind by kind/apiVersion).
    pub fn write(&mut self, mut obj: Value, mode: WriteMode) -> Result<(Kind, Value), FakeError> {
        let kind = Kind::of_object(&obj)?;
        let key = key_of(kind, &obj);
        if key.1.is_empty() {
            return Err(FakeError::new(
                422,
                "Invalid",
                "metadata.name: Required value".into(),
            ));
        }
        let prev = self.objects.entry(kind).or_default().get(&key).cloned();
        let meta = obj
            .as_object_mut()
            .ok_or_else(|| FakeError::new(400, "BadRequest", "object is not a JSON object".into()))?
            .entry("metadata")
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .ok_or_else(|| FakeError::new(400, "BadRequest", "metadata is not an object".into()))?;
        if kind.namespaced() {
            meta.insert("namespace".into(), json!(key.0));
        } else {
            meta.remove("namespace");
        }
        let what = format!("{}.{} {:?}", kind.plural(), kind.group_or_core(), key.1);
        match (&prev, mode) {
            (Some(_), WriteMode::Create) => {
                return Err(FakeError::new(
                    409,
                    "AlreadyExists",
                    format!("{what} already exists"),
                ));
            }
            (None, WriteMode::Replace) => {
                return Err(FakeError::new(404, "NotFound", format!("{what} not found")));
            }
            (Some(p), WriteMode::Replace) => {
                let want = meta
                    .get("resourceVersion")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let have = p
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str);
                if !want.is_empty() && Some(want) != have {
                    return Err(FakeError::new(
                        409,
                        "Conflict",
                        format!(
                            "Operation cannot be fulfilled on {what}: the object has been \
                             modified; please apply your changes to the latest version and try again"
                        ),
                    ));
                }
            }
            _ => {}
        }
        match &prev {
            Some(p) => {
                for field in ["uid", "creationTimestamp"] {
                    if let Some(v) = p.pointer(&format!("/metadata/{field}")) {
                        meta.insert(field.into(), v.clone());
                    }
                }
                let generation = p.pointer("/metadata/generation").and_then(Value::as_i64);
                let changed_spec = p.get("spec") != obj.get("spec");
                let gen_val = generation.unwrap_or(1) + i64::from(changed_spec);
                obj["metadata"]["generation"] = json!(gen_val);
            }
            None => {
                self.uid_seq += 1;
                let seq = self.uid_seq;
                meta.insert(
                    "uid".into(),
                    json!(format!("6b7a3e1c-{:04x}-4000-8000-{:012x}", seq >> 48, seq)),
                );
                meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
                meta.insert("generation".into(), json!(1));
            }
        }
        obj["kind"] = json!(kind.kind());
        obj["apiVersion"] = json!(kind.api_version());
        self.rv += 1;
        set_rv(&mut obj, self.rv);
        self.objects
            .entry(kind)
            .or_default()
            .insert(key, obj.clone());
        let etype = if prev.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        self.history.push_back(StoredEvent {
            rv: self.rv,
            kind,
            etype,
            obj: obj.clone(),
            prev,
        });
        Ok((kind, obj))
    }

    /// Deletes an object; returns it with the delete's resourceVersion.
    pub fn delete(&mut self, kind: Kind, ns: &str, name: &str) -> Result<Value, FakeError> {
        let ns = if kind.namespaced() { ns } else { "" };
        let key = (ns.to_string(), name.to_string());
        let Some(prev) = self.objects.entry(kind).or_default().remove(&key) else {
            return Err(FakeError::new(
                404,
                "NotFound",
                format!(
                    "{}.{} {name:?} not found",
                    kind.plural(),
                    kind.group_or_core()
                ),
            ));
        };
        self.rv += 1;
        let mut obj = prev.clone();
        set_rv(&mut obj, self.rv);
        self.history.push_back(StoredEvent {
            rv: self.rv,
            kind,
            etype: EventType::Deleted,
            obj: obj.clone(),
            prev: Some(prev),
        });
        Ok(obj)
    }

    /// Marks history at and below `rv` as compacted: new watches, exact lists and continue
    /// tokens at an older resourceVersion get 410. (Watches already open keep streaming,
    /// as the watch cache feeds them from memory.)
    pub fn compact(&mut self, rv: u64) {
        self.compacted = self.compacted.max(rv);
    }

    /// The objects of `kind` at resourceVersion `at` (None: now), rebuilt by undoing history
    /// (borrowed when nothing of that kind changed since `at`, so paging through a big
    /// list does not copy it page after page).
    pub fn snapshot(
        &self,
        kind: Kind,
        at: Option<u64>,
    ) -> Result<Cow<'_, BTreeMap<Key, Value>>, FakeError> {
        let current = match self.objects.get(&kind) {
            Some(o) => Cow::Borrowed(o),
            None => Cow::Owned(BTreeMap::new()),
        };
        let Some(at) = at else { return Ok(current) };
        if at < self.compacted {
            return Err(expired(at, self.compacted));
        }
        if at > self.rv {
            return Err(FakeError::new(
                504,
                "Timeout",
                format!("Too large resource version: {at}, current: {}", self.rv),
            ));
        }
        let newer: Vec<&StoredEvent> = self
            .history
            .iter()
            .rev()
            .take_while(|e| e.rv > at)
            .filter(|e| e.kind == kind)
            .collect();
        if newer.is_empty() {
            return Ok(current);
        }
        let mut objs = current.into_owned();
        for ev in newer {
            let key = key_of(kind, &ev.obj);
            match &ev.prev {
                Some(p) => objs.insert(key, p.clone()),
                None => objs.remove(&key),
            };
        }
        Ok(Cow::Owned(objs))
    }
}

/// The 410 a read at a compacted resourceVersion gets.
pub(crate) fn expired(rv: u64, compacted: u64) -> FakeError {
    FakeError::new(
        410,
        "Expired",
        format!("too old resource version: {rv} ({compacted})"),
    )
}

/// Now as RFC 3339 UTC with seconds, as metadata.creationTimestamp is written.
pub(crate) fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = ((secs / 86400) as i64, secs % 86400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}
