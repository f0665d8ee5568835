//! Shared set-up for kxp benchmarks.
