//! kxp's per-worker connection table.
#![forbid(unsafe_code)]
