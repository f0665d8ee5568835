//! Batches of 64 received packets written on one CPU and parsed on the other, as in
//! copy-mode AF_XDP: the kernel copies each received frame into the UMEM on the CPU of
//! the receiving interface (the generator's, in the macro benchmark), and the worker reads
//! it on its own CPU, where the frame's first line is a miss. Two ways, taking turns batch
//! by batch: the packets parsed one by one as they come, and with the headers of the
//! whole batch prefetched first (`dataplane::sys::prefetch`, what a worker does since
//! 2026-12-03). Taking turns puts this VM's drift on both alike.
//!
//! `cargo run --release -p kxp-bench --example frames-ab [BATCHES]`

use std::hint::black_box;
use std::sync::mpsc::sync_channel;
use std::time::Instant;

use nat::rewrite::testutil::{Endpoints, build};
use nat::rewrite::{Parsed, parse};
use nat::tuple::Protocol;

/// Where a frame's data starts in its UMEM chunk (the kernel's XDP headroom).
const HEADROOM: usize = 256;
const ETH_HLEN: usize = 14;
const BATCH: usize = 64;
/// Frames in the pool the writer cycles through (16 MiB of 4 KiB chunks, a UMEM's size).
const POOL: usize = 4096;

type Frame = Box<[u8; 4096]>;

fn main() {
    let batches: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(40_000);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let transfer =
        || kxp_bench::line_transfer_ns((0, 1), 20_000).map_or("?".into(), |ns| format!("{ns:.0}"));
    let before = transfer();
    let packet = build(&Endpoints::v4(), Protocol::Udp, &[0u8; 18]);
    let len = ETH_HLEN + packet.len();
    let (to_worker, from_writer) = sync_channel::<Vec<Frame>>(1);
    let (to_writer, from_worker) = sync_channel::<Vec<Frame>>(POOL / BATCH);
    for _ in 0..POOL / BATCH {
        let b = (0..BATCH).map(|_| Box::new([0u8; 4096])).collect();
        to_writer.send(b).expect("the pool fits the channel");
    }
    let writer = std::thread::spawn(move || {
        if cpus > 1 {
            let _ = dataplane::sys::pin_to_cpu(0);
        }
        let mut port = 0u16;
        while let Ok(mut b) = from_worker.recv() {
            for f in b.iter_mut() {
                let data = &mut f[HEADROOM..];
                data[ETH_HLEN..ETH_HLEN + packet.len()].copy_from_slice(&packet);
                // A source port of its own, as new connections have.
                port = port.wrapping_add(1);
                data[ETH_HLEN + 20..ETH_HLEN + 22].copy_from_slice(&port.to_be_bytes());
            }
            if to_worker.send(b).is_err() {
                break;
            }
        }
    });
    if cpus > 1 {
        let _ = dataplane::sys::pin_to_cpu(1);
    }
    let names = ["one by one", "batch prefetched"];
    let mut times: [Vec<u64>; 2] = Default::default();
    for round in 0..batches {
        let way = round % 2;
        let b = from_writer.recv().expect("the writer runs until we stop");
        let start = Instant::now();
        if way == 1 {
            for f in &b {
                dataplane::sys::prefetch(&f[HEADROOM]);
            }
        }
        let mut ports = 0u32;
        for f in &b {
            let data = &f[HEADROOM..HEADROOM + len];
            if let Ok(Parsed::Flow(fl)) = parse(&data[ETH_HLEN..]) {
                ports = ports.wrapping_add(u32::from(fl.tuple().sport));
            }
        }
        black_box(ports);
        times[way].push(start.elapsed().as_nanos() as u64);
        to_writer.send(b).expect("the pool fits the channel");
    }
    drop(from_writer);
    drop(to_writer);
    let _ = writer.join();
    println!(
        "{batches} batches of {BATCH} UDP/IPv4 packets written on CPU0 and parsed on CPU1, taking turns{}; a line's transfer CPU0 -> CPU1 {before} ns before, {} ns after (kxp_bench::line_transfer_ns):",
        if cpus > 1 {
            ""
        } else {
            " (one CPU: both threads unpinned)"
        },
        transfer()
    );
    kxp_bench::print_turns(&mut times, &names, "packet");
}
