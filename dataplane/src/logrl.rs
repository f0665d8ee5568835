//! Repeated warnings, rate-limited: the first of a kind (a key: an interface, an error's
//! text) is logged at once, then at most one a minute, saying how many were suppressed
//! in between. Per-packet events never log (they are counters); this is for what a
//! retry loop or every sync would otherwise repeat.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How often one kind of warning is logged at most.
pub const EVERY: Duration = Duration::from_secs(60);

/// Keys remembered at most (the oldest are forgotten beyond).
const MAX_KEYS: usize = 4096;

/// When each kind was last logged, and how many were suppressed since.
#[derive(Debug, Default)]
pub struct RateLimited {
    seen: Mutex<HashMap<String, (Instant, u64)>>,
}

impl RateLimited {
    /// Whether a warning of kind `key` may be logged at `now`: `Some(suppressed since
    /// the last one)`, or `None` (suppressed, and counted).
    pub fn allow_at(&self, key: &str, now: Instant, every: Duration) -> Option<u64> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((last, suppressed)) = seen.get_mut(key) {
            if now.duration_since(*last) < every {
                *suppressed += 1;
                return None;
            }
            let n = std::mem::take(suppressed);
            *last = now;
            return Some(n);
        }
        if seen.len() >= MAX_KEYS {
            seen.retain(|_, (last, _)| now.duration_since(*last) < every);
            if seen.len() >= MAX_KEYS {
                seen.clear();
            }
        }
        seen.insert(key.to_string(), (now, 0));
        Some(0)
    }

    /// [`RateLimited::allow_at`] now, once a minute.
    pub fn allow(&self, key: &str) -> Option<u64> {
        self.allow_at(key, Instant::now(), EVERY)
    }
}

/// The process's limiter (what [`warn_limited!`](crate::warn_limited) uses).
pub fn global() -> &'static RateLimited {
    static G: OnceLock<RateLimited> = OnceLock::new();
    G.get_or_init(RateLimited::default)
}

/// `tracing::warn!`, at most once a minute per `key` (a `&str`), with `suppressed = N`
/// when some were held back.
#[macro_export]
macro_rules! warn_limited {
    ($key:expr, $($arg:tt)+) => {
        match $crate::logrl::global().allow(&$key) {
            Some(0) => tracing::warn!($($arg)+),
            Some(n) => tracing::warn!(suppressed = n, $($arg)+),
            None => {}
        }
    };
}

/// `tracing::error!`, at most once a minute per `key`.
#[macro_export]
macro_rules! error_limited {
    ($key:expr, $($arg:tt)+) => {
        match $crate::logrl::global().allow(&$key) {
            Some(0) => tracing::error!($($arg)+),
            Some(n) => tracing::error!(suppressed = n, $($arg)+),
            None => {}
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_is_logged_then_one_a_minute_with_the_count() {
        let r = RateLimited::default();
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        assert_eq!(r.allow_at("eth0", t0, EVERY), Some(0));
        assert_eq!(r.allow_at("eth0", t0 + s, EVERY), None);
        assert_eq!(r.allow_at("eth0", t0 + 10 * s, EVERY), None);
        // Another kind is independent.
        assert_eq!(r.allow_at("eth1", t0 + 10 * s, EVERY), Some(0));
        assert_eq!(r.allow_at("eth0", t0 + 61 * s, EVERY), Some(2));
        assert_eq!(r.allow_at("eth0", t0 + 62 * s, EVERY), None);
    }

    #[test]
    fn keys_are_bounded() {
        let r = RateLimited::default();
        let t0 = Instant::now();
        for i in 0..(MAX_KEYS * 2) {
            assert_eq!(r.allow_at(&i.to_string(), t0, EVERY), Some(0));
        }
        assert!(r.seen.lock().unwrap().len() <= MAX_KEYS);
    }
}
