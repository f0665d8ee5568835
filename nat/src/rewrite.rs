//! Header rewrite (being written).
