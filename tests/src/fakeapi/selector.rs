//! Label and field selectors, parsed and matched as kube-apiserver does
//! (`k8s.io/apimachinery/pkg/labels` and `pkg/fields`, the subset kube clients use).

use serde_json::Value;

/// One label requirement.
#[derive(Clone, Debug, PartialEq, Eq)]
enum LabelReq {
    Eq(String, String),
    NotEq(String, String),
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed `labelSelector`: every requirement must hold (empty matches everything).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<LabelReq>);

/// Splits on commas that are not inside parentheses.
fn split_top(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 316
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && k.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
}

fn valid_value(v: &str) -> bool {
    v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

impl LabelSelector {
    /// Parses a label selector; `Err` carries the apiserver-style message.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self(reqs));
        }
        for part in split_top(s) {
            let part = part.trim();
            let bad = || format!("unable to parse requirement: invalid label selector: {part:?}");
            let req = if let Some(open) = part.find('(') {
                let close = part
                    .rfind(')')
                    .filter(|&c| c == part.len() - 1)
                    .ok_or_else(bad)?;
                let head: Vec<&str> = part[..open].split_whitespace().collect();
                let values: Vec<String> = part[open + 1..close]
                    .split(',')
                    .map(|v| v.trim().to_string())
                    .filter(|v| !v.is_empty())
                    .collect();
                if head.len() != 2 || !valid_key(head[0]) || !values.iter().all(|v| valid_value(v))
                {
                    return Err(bad());
                }
                match head[1] {
                    "in" if !values.is_empty() => LabelReq::In(head[0].into(), values),
                    "notin" if !values.is_empty() => LabelReq::NotIn(head[0].into(), values),
                    _ => return Err(bad()),
                }
            } else if let Some(key) = part.strip_prefix('!') {
                let key = key.trim();
                if !valid_key(key) {
                    return Err(bad());
                }
                LabelReq::NotExists(key.into())
            } else if let Some((k, v)) = part.split_once("!=") {
                LabelReq::NotEq(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once("==") {
                LabelReq::Eq(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once('=') {
                LabelReq::Eq(k.trim().into(), v.trim().into())
            } else {
                if !valid_key(part) {
                    return Err(bad());
                }
                LabelReq::Exists(part.into())
            };
            if let LabelReq::Eq(k, v) | LabelReq::NotEq(k, v) = &req
                && (!valid_key(k) || !valid_value(v))
            {
                return Err(bad());
            }
            reqs.push(req);
        }
        Ok(Self(reqs))
    }

    /// Whether the object's `metadata.labels` satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels").and_then(Value::as_object);
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::NotExists(k) => get(k).is_none(),
            LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
        })
    }
}

/// A parsed `fieldSelector`: `path=value`, `path==value`, `path!=value`, comma-joined.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// Parses a field selector; `supported` says which field paths the kind allows
    /// (the apiserver answers 400 "field label not supported" for others).
    pub fn parse(s: &str, supported: impl Fn(&str) -> bool) -> Result<Self, String> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self(reqs));
        }
        for part in s.split(',') {
            let part = part.trim();
            let (field, eq, value) = if let Some((f, v)) = part.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = part.split_once("==") {
                (f, true, v)
            } else if let Some((f, v)) = part.split_once('=') {
                (f, true, v)
            } else {
                return Err(format!(
                    "invalid selector: '{s}'; can't understand '{part}'"
                ));
            };
            let field = field.trim();
            if !supported(field) {
                return Err(format!("field label not supported: {field}"));
            }
            reqs.push((field.to_string(), eq, value.trim().to_string()));
        }
        Ok(Self(reqs))
    }

    /// Whether every requirement holds; a missing field reads as "".
    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(field, eq, want)| {
            let mut cur = Some(obj);
            for seg in field.split('.') {
                cur = cur.and_then(|v| v.get(seg));
            }
            let got = match cur {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Bool(b)) => b.to_string(),
                Some(Value::Number(n)) => n.to_string(),
                _ => String::new(),
            };
            (got == *want) == *eq
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn label_selectors() {
        let o = json!({"metadata": {"labels": {"a": "b", "t": "x"}}});
        for (sel, want) in [
            ("", true),
            ("a=b", true),
            ("a==b", true),
            ("a!=b", false),
            ("a", true),
            ("!a", false),
            ("!service.kubernetes.io/service-proxy-name", true),
            ("t in (x,y)", true),
            ("t in (y)", false),
            ("t notin (x)", false),
            ("c notin (x)", true),
            ("a=b,t in (y, x),!c", true),
        ] {
            assert_eq!(
                LabelSelector::parse(sel).unwrap().matches(&o),
                want,
                "{sel}"
            );
        }
        assert!(LabelSelector::parse("a in x").is_err());
        assert!(LabelSelector::parse("=b").is_err());
    }

    #[test]
    fn field_selectors() {
        let o =
            json!({"metadata": {"name": "n", "namespace": "ns"}, "spec": {"clusterIP": "None"}});
        let ok = |_: &str| true;
        assert!(
            FieldSelector::parse("metadata.name=n", ok)
                .unwrap()
                .matches(&o)
        );
        assert!(
            !FieldSelector::parse("spec.clusterIP!=None", ok)
                .unwrap()
                .matches(&o)
        );
        assert!(
            FieldSelector::parse("metadata.namespace==ns,spec.x!=1", ok)
                .unwrap()
                .matches(&o)
        );
        assert!(FieldSelector::parse("spec.bogus=1", |f| f.starts_with("metadata.")).is_err());
    }
}
