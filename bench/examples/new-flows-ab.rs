//! Batches of 64 new connections into a full table of kxp's default size per worker
//! (262,144 unanswered flows: each new one evicts the oldest), as the macro benchmark's
//! new-connection mode does, three ways taking turns batch by batch: the keys looked up
//! and inserted as they come, with the batch's keys warmed first (`ConnTable::warm`, its
//! lines prefetched with `dataplane::sys::prefetch` as a worker does), and with the reply
//! tuples warmed as well (`ConnTable::warm_tuples`, as a worker does once its new flows'
//! endpoints are chosen). Taking turns puts this VM's drift on all three
//! alike, which criterion's one-after-the-other runs do not.
//!
//! `cargo run --release -p kxp-bench --example new-flows-ab [BATCHES]`

use std::hint::black_box;
use std::time::Instant;

use dataplane::sys::prefetch;
use kxp_bench::flows::{SYN, flow, holding};
use nat::tuple::Tuple;

fn main() {
    let batches: u32 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(60_000);
    let cap = 262_144u32;
    let mut t = holding(cap as usize, cap);
    let mut next = cap;
    let names = ["as they come", "keys warmed", "keys and replies warmed"];
    let mut times: [Vec<u64>; 3] = Default::default();
    for round in 0..batches {
        let way = (round % 3) as usize;
        let batch: [(Tuple, Tuple); 64] = std::array::from_fn(|j| flow(next + j as u32));
        next = next.wrapping_add(64);
        let keys: [Tuple; 64] = std::array::from_fn(|j| batch[j].0);
        let replies: [Tuple; 64] = std::array::from_fn(|j| batch[j].1);
        let start = Instant::now();
        if way >= 1 {
            black_box(t.warm(&keys, prefetch));
        }
        if way == 2 {
            t.warm_tuples(&replies, prefetch);
        }
        let mut made = 0u32;
        for (o, r) in &batch {
            if t.on_packet(o, SYN, 3).is_none() {
                made += u32::from(t.insert(*o, *r, 0, SYN, 3).is_ok());
            }
        }
        black_box(made);
        times[way].push(start.elapsed().as_nanos() as u64);
    }
    println!("{batches} batches of 64 new flows into a full table of {cap}, taking turns:");
    kxp_bench::print_turns(&mut times, &names, "flow");
}
