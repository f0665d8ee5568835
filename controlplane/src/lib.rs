//! kxp's control plane.
#![forbid(unsafe_code)]
