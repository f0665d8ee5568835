//! How often this machine takes a CPU away from a thread that only spins.
//!
//! kxp's worker counts a "stall" when a round of its loop takes a millisecond or more
//! (`stalls [...]` in its totals line). This program does nothing but read the clock in
//! a loop pinned to one CPU, with no system call, no memory beyond a few words and
//! nothing to wait for, and counts the same gaps. What it sees is the machine's share of
//! the worker's stalls: the hypervisor running something else on the vCPU, or the
//! kernel's own work on that CPU (interrupts, softirqs, kernel threads). With `--load
//! CPU` a second thread spins on that CPU too, as the macro benchmark's generator does
//! on CPU0 while the worker runs on CPU1.
//!
//! `cargo run --release -p kxp-bench --example cpu-gaps -- [--cpu 1] [--secs 12]
//! [--load 0] [--threshold-us 1000]`

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dataplane::sys::{monotonic_ns, pin_to_cpu};

struct Opts {
    cpu: usize,
    secs: u64,
    load: Option<usize>,
    threshold_ns: u64,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        cpu: 1,
        secs: 12,
        load: None,
        threshold_ns: 1_000_000,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            let v = args.next().ok_or(format!("{name} needs a value"))?;
            v.parse()
                .map_err(|_| format!("{name}: {v:?} is not a whole number"))
        };
        match a.as_str() {
            "--cpu" => o.cpu = value("--cpu")? as usize,
            "--secs" => o.secs = value("--secs")?.clamp(1, 600),
            "--load" => o.load = Some(value("--load")? as usize),
            "--threshold-us" => o.threshold_ns = value("--threshold-us")?.max(1) * 1000,
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: cpu-gaps [--cpu N] [--secs S] [--load CPU] [--threshold-us US]"
                ));
            }
        }
    }
    Ok(o)
}

/// The steal time of one CPU from /proc/stat, in clock ticks (USER_HZ).
fn steal_ticks(cpu: usize) -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let name = format!("cpu{cpu}");
    let line = stat
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name.as_str()))?;
    line.split_whitespace().nth(8)?.parse().ok()
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("cpu-gaps: {e}");
            std::process::exit(2);
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let loader = o.load.map(|cpu| {
        let stop = stop.clone();
        std::thread::spawn(move || {
            if let Err(e) = pin_to_cpu(cpu) {
                eprintln!("cpu-gaps: cannot pin the load to CPU {cpu}: {e}");
                return;
            }
            while !stop.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        })
    });
    if let Err(e) = pin_to_cpu(o.cpu) {
        eprintln!("cpu-gaps: cannot pin to CPU {}: {e}", o.cpu);
        std::process::exit(1);
    }
    // Let the pinning and the load settle before counting.
    std::thread::sleep(Duration::from_millis(100));
    let steal_before = steal_ticks(o.cpu);
    let start = monotonic_ns();
    let end = start + o.secs * 1_000_000_000;
    let (mut gaps, mut total, mut longest) = (0u64, 0u64, 0u64);
    // Gaps by length: [threshold, 2 ms), [2, 5), [5, 10), [10, ∞) ms.
    let mut by_len = [0u64; 4];
    let mut prev = start;
    while prev < end {
        let now = monotonic_ns();
        let gap = now - prev;
        if gap >= o.threshold_ns {
            gaps += 1;
            total += gap;
            longest = longest.max(gap);
            by_len[[2_000_000, 5_000_000, 10_000_000]
                .iter()
                .take_while(|&&b| gap >= b)
                .count()] += 1;
        }
        prev = now;
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(l) = loader {
        let _ = l.join();
    }
    let steal = match (steal_before, steal_ticks(o.cpu)) {
        (Some(a), Some(b)) => format!("{} ms", (b.saturating_sub(a)) * 10),
        _ => "unknown".to_string(),
    };
    let ms = |ns: u64| ns as f64 / 1e6;
    println!(
        "CPU{} spun {} s{}: {gaps} gaps of {} µs or more ({:.1} ms in all, longest {:.1} ms; \
         under 2 ms {}, 2-5 ms {}, 5-10 ms {}, 10 ms or more {}); steal counted by the kernel: {steal}",
        o.cpu,
        o.secs,
        o.load
            .map(|c| format!(" with CPU{c} spinning"))
            .unwrap_or_default(),
        o.threshold_ns / 1000,
        ms(total),
        ms(longest),
        by_len[0],
        by_len[1],
        by_len[2],
        by_len[3],
    );
}
