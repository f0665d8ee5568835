//! kxp's control plane: kube-proxy's configuration and inputs, snapshot building, and the
//! `kxp` command line.
#![forbid(unsafe_code)]

pub mod admin;
pub mod cli;
pub mod config;
pub mod demo;
pub mod hcnp;
pub mod health;
pub mod http;
pub mod kpflags;
pub mod kube_source;
pub mod leftovers;
pub mod localnp;
pub mod metrics;
pub mod run;
pub mod settings;
pub mod state;
pub mod trace;
