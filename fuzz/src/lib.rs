//! kxp's fuzz targets, as plain functions of the fuzzer's bytes: each panics where an
//! invariant breaks, and nowhere else.
//!
//! - [`packet`]: the packet parser, the header rewrite and the replies (IPv4/IPv6,
//!   TCP/UDP/SCTP, ICMP errors, extension headers, fragments);
//! - [`engine`]: a worker's whole pipeline (parse → conntrack → decide → rewrite) over a
//!   sequence of packets on a fake clock, against a model of the flows it forwarded;
//! - [`state`]: the restore of state files a previous process left (headers, records);
//! - [`config`]: kube-proxy's configuration file;
//! - [`snapshot`]: the change tracker against a fresh build over random Services and
//!   EndpointSlices.
//!
//! `fuzz/run` builds them with libFuzzer and coverage instrumentation on the stable
//! toolchain; the tests below replay the seed corpora and every input a fuzzer found
//! (`fuzz/regressions/`) through the same functions.

pub mod config;
pub mod engine;
pub mod packet;
pub mod seeds;
pub mod snapshot;
pub mod state;

/// A target: the fuzzer's bytes in, a panic where an invariant breaks.
pub type Target = fn(&[u8]);

/// The targets, by name, as `fuzz/run` knows them.
pub const TARGETS: [(&str, Target); 5] = [
    ("packet", packet::run),
    ("engine", engine::run),
    ("state", state::run),
    ("config", config::run),
    ("snapshot", snapshot::run),
];

/// Reads one byte at a time from a fuzzer's input: 0 once it runs out.
#[derive(Debug)]
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Input<'a> {
        Input { data }
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    pub fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((b, rest)) => {
                self.data = rest;
                *b
            }
            None => 0,
        }
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.byte(), self.byte()])
    }
    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u8) -> u8 {
        self.byte() % n
    }
    /// Up to `n` bytes.
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (a, b) = self.data.split_at(n.min(self.data.len()));
        self.data = b;
        a
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::TARGETS;

    /// Every file in `fuzz/<dir>/<target>/` through its target.
    fn replay(dir: &str) -> usize {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        let mut n = 0;
        for (name, run) in TARGETS {
            let Ok(files) = std::fs::read_dir(root.join(name)) else {
                continue;
            };
            for f in files {
                let path = f.unwrap().path();
                let data = std::fs::read(&path).unwrap();
                eprintln!("{}", path.display());
                run(&data);
                n += 1;
            }
        }
        n
    }

    #[test]
    fn the_seed_corpora_pass() {
        assert!(replay("corpus") >= 30);
    }

    #[test]
    fn every_input_a_fuzzer_found_passes() {
        // As many as are committed (a replay that finds none replays nothing).
        let committed: usize = TARGETS
            .iter()
            .filter_map(|(name, _)| {
                std::fs::read_dir(
                    Path::new(env!("CARGO_MANIFEST_DIR"))
                        .join("regressions")
                        .join(name),
                )
                .ok()
            })
            .map(Iterator::count)
            .sum();
        assert!(committed >= 8, "{committed} regression inputs committed");
        assert_eq!(replay("regressions"), committed);
    }

    #[test]
    fn the_committed_seeds_are_the_generated_ones() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
        for (target, name, data) in super::seeds::all() {
            let path = root.join(target).join(&name);
            let committed = std::fs::read(&path).unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (run `cargo run -p kxp-fuzz --bin fuzz-seeds`)",
                    path.display()
                )
            });
            assert_eq!(
                committed,
                data,
                "{} differs from what fuzz-seeds writes",
                path.display()
            );
        }
    }
}
