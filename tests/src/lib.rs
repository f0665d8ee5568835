//! Helpers for kxp end-to-end tests.
