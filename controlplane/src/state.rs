//! A state file: the cluster's Services, EndpointSlices, Nodes and ServiceCIDRs as YAML,
//! either several documents or a `kind: List` (what
//! `kubectl get svc,endpointslices,nodes,servicecidrs -A -o yaml` prints).

use std::path::Path;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use serde::Deserialize;
use serde_yaml::Value;
use translate::k8s::ClusterState;

/// A state file kxp cannot use. Names the document (1-based), the item inside a List,
/// and the field.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot read state file {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("state file {path}: {place}: {message}")]
    Invalid {
        path: String,
        place: String,
        message: String,
    },
}

/// Reads a state file.
///
/// # Errors
/// See [`parse_state`].
pub fn load_state(path: &Path) -> Result<ClusterState, StateError> {
    let text = std::fs::read_to_string(path).map_err(|source| StateError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse_state(&text, &path.display().to_string())
}

/// Parses state text; `origin` names it in errors.
///
/// # Errors
/// Text that is not YAML, an object of a kind kxp does not read, or an object whose fields
/// do not fit the Kubernetes schema.
pub fn parse_state(text: &str, origin: &str) -> Result<ClusterState, StateError> {
    let mut state = ClusterState::default();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let place = format!("document {}", i + 1);
        let value = Value::deserialize(doc).map_err(|e| StateError::Invalid {
            path: origin.into(),
            place: place.clone(),
            message: format!("not YAML: {e}"),
        })?;
        if value.is_null() {
            continue;
        }
        if value.get("kind").and_then(Value::as_str) == Some("List") {
            let items = value
                .get("items")
                .and_then(Value::as_sequence)
                .cloned()
                .unwrap_or_default();
            for (j, item) in items.into_iter().enumerate() {
                add_object(&mut state, item, &format!("{place}, items[{j}]"), origin)?;
            }
        } else {
            add_object(&mut state, value, &place, origin)?;
        }
    }
    Ok(state)
}

fn add_object(
    state: &mut ClusterState,
    v: Value,
    place: &str,
    origin: &str,
) -> Result<(), StateError> {
    let invalid = |place: String, message: String| StateError::Invalid {
        path: origin.into(),
        place,
        message,
    };
    let api = v
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let kind = v
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let name = v
        .get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let place = if name.is_empty() {
        format!("{place} ({kind})")
    } else {
        format!("{place} ({kind} {name})")
    };
    fn typed<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, (String, String)> {
        serde_path_to_error::deserialize(v).map_err(|e| {
            let path = e.path().to_string();
            (path, e.into_inner().to_string())
        })
    }
    let wrap =
        |(path, msg): (String, String)| invalid(place.clone(), format!("field {path}: {msg}"));
    match (api.as_str(), kind.as_str()) {
        ("v1", "Service") => state.services.push(typed::<Service>(v).map_err(wrap)?),
        ("discovery.k8s.io/v1", "EndpointSlice") => state
            .endpoint_slices
            .push(typed::<EndpointSlice>(v).map_err(wrap)?),
        ("v1", "Node") => state.nodes.push(typed::<Node>(v).map_err(wrap)?),
        ("v1", "Pod") => state.pods.push(typed(v).map_err(wrap)?),
        ("v1", "Namespace") => state.namespaces.push(typed(v).map_err(wrap)?),
        ("networking.k8s.io/v1", "NetworkPolicy") => {
            state.network_policies.push(typed(v).map_err(wrap)?)
        }
        ("networking.k8s.io/v1" | "networking.k8s.io/v1beta1", "ServiceCIDR") => {
            let mut v = v;
            if let Some(m) = v.as_mapping_mut() {
                m.insert("apiVersion".into(), "networking.k8s.io/v1".into());
            }
            state
                .service_cidrs
                .push(typed::<ServiceCIDR>(v).map_err(wrap)?)
        }
        ("", _) | (_, "") => {
            return Err(invalid(
                place.clone(),
                "an object needs apiVersion and kind".into(),
            ));
        }
        _ => {
            return Err(invalid(
                place.clone(),
                format!(
                    "kxp does not read {kind} ({api}); a state file holds v1 Service, \
                     discovery.k8s.io/v1 EndpointSlice, v1 Node, networking.k8s.io/v1 \
                     ServiceCIDR, and for NetworkPolicy v1 Pod, v1 Namespace and \
                     networking.k8s.io/v1 NetworkPolicy"
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multi_document_and_list() {
        let text = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  clusterIP: 198.19.0.10
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: List
items:
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: web-abc
    namespace: demo
    labels: {kubernetes.io/service-name: web}
  addressType: IPv4
  ports: [{name: "", port: 8080, protocol: TCP}]
  endpoints:
  - addresses: [198.18.1.1]
- apiVersion: v1
  kind: Node
  metadata: {name: node-a}
---
"#;
        let s = parse_state(text, "t").unwrap();
        assert_eq!(s.services.len(), 1);
        assert_eq!(s.endpoint_slices.len(), 1);
        assert_eq!(s.nodes.len(), 1);
    }

    #[test]
    fn errors_name_document_and_field() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  ports: [{port: eighty}]\n";
        let e = parse_state(text, "s.yaml").unwrap_err().to_string();
        assert!(e.contains("document 2"), "{e}");
        assert!(e.contains("Service web"), "{e}");
        assert!(e.contains("spec.ports[0].port"), "{e}");
    }

    #[test]
    fn unknown_kind_and_bad_yaml() {
        let e = parse_state(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: p}\n",
            "s",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("does not read ConfigMap"), "{e}");
        // Pods, Namespaces and NetworkPolicies are read (for NetworkPolicy).
        let st = parse_state(
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: n}\n---\n\
             apiVersion: v1\nkind: Namespace\nmetadata: {name: n}\n---\n\
             apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: d, namespace: n}\nspec: {podSelector: {}}\n",
            "s",
        )
        .unwrap();
        assert_eq!(
            (
                st.pods.len(),
                st.namespaces.len(),
                st.network_policies.len()
            ),
            (1, 1, 1)
        );
        let e = parse_state("a: [\n", "s").unwrap_err().to_string();
        assert!(e.contains("document 1"), "{e}");
        let e = parse_state("just text\n", "s").unwrap_err().to_string();
        assert!(e.contains("apiVersion and kind"), "{e}");
    }
}
