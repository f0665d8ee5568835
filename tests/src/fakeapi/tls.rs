//! TLS for the fake API server, as a real API server serves: a throw-away CA (made per
//! server) that signed a certificate for 127.0.0.1 and `localhost`; the kubeconfig the
//! fake writes trusts that CA and nothing else.

use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A server's TLS material.
#[derive(Clone)]
pub(crate) struct Tls {
    pub acceptor: tokio_rustls::TlsAcceptor,
    /// The CA certificate (PEM), for kubeconfigs.
    pub ca_pem: String,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls { .. }")
    }
}

/// A fresh CA and server certificate, and the acceptor that serves it.
pub(crate) fn make() -> Tls {
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "kxp fake API server CA");
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");

    let key = KeyPair::generate().expect("server key");
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .expect("server params");
    params
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    let cert = params
        .signed_by(&key, &ca_cert, &ca_key)
        .expect("server certificate");

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(cert.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .expect("server TLS config");
    Tls {
        acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        ca_pem: ca_cert.pem(),
    }
}
