//! A packet generator on an AF_XDP socket, for the macro benchmark's `--generator xsk`:
//! the same packets as its trafgen configs (60-byte frames, UDP to the VIP's sink port;
//! `est`: 1,024 flows from one address, source ports 10000–11023; `new`: source
//! 198.18.[64–95].[1–251] and ports 1024–65535 all changing, a new tuple every packet),
//! sent in batches of 64 through kxp's own socket code (`dataplane::xsk`) instead of one
//! `sendto` per packet. On a veth (copy mode) the kernel still builds one skb per frame;
//! what it saves is the system call and the per-packet socket work, which is what limits
//! trafgen on one core.
//!
//! With `--rate` the packets are paced (bursts of `--burst` at even intervals), for the
//! benchmark's latency under a set offered load.
//!
//! Stops after `--max` packets or at SIGINT/SIGTERM and prints trafgen's closing lines
//! (`N packets outgoing`, `S sec, U usec on CPU0`) so the benchmark reads both alike.
#![forbid(unsafe_code)]

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context as _, bail};
use clap::Parser;
use dataplane::xsk::{Sockets, XskConfig};

#[derive(Debug, Parser)]
#[command(name = "xsk-gen")]
struct Args {
    /// Interface to send on.
    #[arg(long)]
    dev: String,
    /// Transmit queues to send on, 0 up to N-1 (a socket on each): flow k (`est`) or
    /// packet k (`new`) leaves on queue k mod N, so that a veth peer receives them on
    /// as many receive queues, as RSS spreads flows over a NIC's.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    queues: u32,
    /// est (1,024 flows) or new (a new tuple every packet).
    #[arg(long)]
    mode: String,
    #[arg(long)]
    src_mac: String,
    #[arg(long)]
    dst_mac: String,
    #[arg(long)]
    src_ip: Ipv4Addr,
    #[arg(long)]
    dst_ip: Ipv4Addr,
    #[arg(long)]
    dport: u16,
    /// Stop after this many packets.
    #[arg(long)]
    max: u64,
    /// Offered load in packets per second, sent in bursts of `--burst` at even
    /// intervals (0: as fast as the socket takes them).
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// Packets per burst when paced by `--rate`.
    #[arg(long, default_value_t = 8)]
    burst: u32,
    /// Destinations: with 1, `--dst-ip`; with more, the benchmark's first N ClusterIPs
    /// (`kxp_bench::service_vip`, `--dst-ip` the first of them), one after another.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(kxp_bench::SERVICE_VIPS)))]
    vips: u32,
    /// `est`: this many flows. Up to 50,000 they come from `--src-ip`, ports 10000 up;
    /// beyond, from 198.18.64.1 up (one address per 50,000 flows).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    flows: u32,
}

/// Source address and port of established flow `k`.
fn est_source(a: &Args, k: u32) -> (Ipv4Addr, u16) {
    if a.flows <= 50_000 {
        return (a.src_ip, 10_000 + k as u16);
    }
    let host = k / 50_000;
    (
        Ipv4Addr::new(198, 18, 64 + (host / 251) as u8, 1 + (host % 251) as u8),
        10_000 + (k % 50_000) as u16,
    )
}

fn mac(s: &str) -> anyhow::Result<[u8; 6]> {
    let v: Vec<u8> = s
        .split(':')
        .map(|h| u8::from_str_radix(h, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("{s:?} is not a MAC address"))?;
    v.try_into()
        .map_err(|_| anyhow::anyhow!("{s:?} is not a MAC address"))
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let (src_mac, dst_mac) = (mac(&a.src_mac)?, mac(&a.dst_mac)?);
    let new = match a.mode.as_str() {
        "est" => false,
        "new" => true,
        m => bail!("unknown mode {m:?} (est, new)"),
    };
    if a.vips > 1 && a.dst_ip != kxp_bench::service_vip(0) {
        bail!(
            "--vips {} sends to the benchmark's ClusterIPs, from {}: --dst-ip {} is not the first",
            a.vips,
            kxp_bench::service_vip(0),
            a.dst_ip
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let sockets = Sockets::open(&XskConfig::default(), std::slice::from_ref(&a.dev), 0)
        .with_context(|| format!("opening an AF_XDP socket on {}", a.dev))?;
    let ifindex = dataplane::xdp::ifindex_of(&a.dev).context("no such interface")?;
    let (sent, t) = sockets.with(|mut io| {
        for q in 1..a.queues {
            io.add_port(&a.dev, ifindex, q)
                .with_context(|| format!("opening an AF_XDP socket on {} queue {q}", a.dev))?;
        }
        let started = Instant::now();
        let mut sent = 0u64;
        // Tuple counters, as trafgen's dinc(): periods --flows (est) or 32 × 251 × 64,512
        // (new), and --vips for the destination (est: flow k goes to VIP k mod --vips).
        let (mut b2, mut b3, mut port, mut vip) = (0u32, 0u32, 0u32, 0u32);
        let dst_of = |k: u32| {
            if a.vips == 1 {
                a.dst_ip
            } else {
                kxp_bench::service_vip(k)
            }
        };
        // Paced: burst k leaves at start + k × burst / rate (busy-waiting on the clock;
        // the generator has its CPU to itself). A burst that is late goes at once, but
        // one more than 4 intervals late restarts the schedule from now: a moment the
        // generator lost is not made up for with bursts back to back.
        let burst = if a.rate > 0 { a.burst.clamp(1, 64) } else { 64 };
        let interval_ns = (a.rate > 0).then(|| 1e9 * f64::from(burst) / a.rate as f64);
        let mut bursts = 0u64;
        while sent < a.max && !stop.load(Ordering::Relaxed) {
            if let Some(ns) = interval_ns {
                let at = |k: u64| started + std::time::Duration::from_nanos((k as f64 * ns) as u64);
                let now = Instant::now();
                if now > at(bursts + 4) {
                    bursts = ((now - started).as_nanos() as f64 / ns) as u64;
                }
                let due = at(bursts);
                while Instant::now() < due && !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
                bursts += 1;
            }
            for _ in 0..burst {
                let Some(mut f) = io.alloc() else { break };
                let (source, dst, flow) = if new {
                    let src = Ipv4Addr::new(198, 18, 64 + b2 as u8, 1 + b3 as u8);
                    let sport = 1024 + port as u16;
                    b2 = (b2 + 1) % 32;
                    b3 = (b3 + 1) % 251;
                    port = (port + 1) % 64_512;
                    let dst = dst_of(vip);
                    vip = (vip + 1) % a.vips;
                    ((src, sport), dst, sent)
                } else {
                    let k = port;
                    port = (port + 1) % a.flows;
                    (est_source(&a, k), dst_of(k % a.vips), u64::from(k))
                };
                let bytes = kxp_bench::udp_frame(src_mac, dst_mac, source, (dst, a.dport));
                io.set_len(&mut f, 60);
                io.bytes(&mut f).copy_from_slice(&bytes);
                io.send((flow % u64::from(a.queues)) as usize, f);
                sent += 1;
            }
            io.flush();
        }
        anyhow::Ok((sent, started.elapsed()))
    })?;
    println!("\n{sent:>12} packets outgoing");
    println!("{:>12} bytes outgoing", sent * 60);
    println!(
        "{:>12} sec, {} usec on CPU0 ({sent} packets)",
        t.as_secs(),
        t.subsec_micros()
    );
    Ok(())
}
