//! A packet generator on an AF_XDP socket, for the macro benchmark's `--generator xsk`:
//! the same packets as its trafgen configs (60-byte frames, UDP to the VIP's sink port;
//! `est`: 1,024 flows from one address, source ports 10000–11023; `new`: source
//! 198.18.[64–127].[1–251] and ports 1024–65535 all changing, a new tuple every packet),
//! sent in batches of 64 through kxp's own socket code (`dataplane::xsk`) instead of one
//! `sendto` per packet. On a veth (copy mode) the kernel still builds one skb per frame;
//! what it saves is the system call and the per-packet socket work, which is what limits
//! trafgen on one core.
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
    /// Interface to send on (queue 0).
    #[arg(long)]
    dev: String,
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

fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn sum16(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum()
}

/// One 60-byte frame: Ethernet, IPv4 (no options), UDP, 18 bytes of payload.
fn frame(a: &Args, src_mac: [u8; 6], dst_mac: [u8; 6], src: Ipv4Addr, sport: u16) -> [u8; 60] {
    let mut f = [0x2eu8; 60];
    f[0..6].copy_from_slice(&dst_mac);
    f[6..12].copy_from_slice(&src_mac);
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip = &mut f[14..34];
    ip[0] = 0x45;
    ip[1] = 0;
    ip[2..4].copy_from_slice(&46u16.to_be_bytes());
    ip[4..8].copy_from_slice(&[0, 0, 0x40, 0]);
    ip[8] = 64;
    ip[9] = 17;
    ip[10..12].copy_from_slice(&[0, 0]);
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&a.dst_ip.octets());
    let c = fold(sum16(ip));
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f[34..36].copy_from_slice(&sport.to_be_bytes());
    f[36..38].copy_from_slice(&a.dport.to_be_bytes());
    f[38..40].copy_from_slice(&26u16.to_be_bytes());
    f[40..42].copy_from_slice(&[0, 0]);
    // UDP checksum over the pseudo-header, header and payload.
    let mut s = sum16(&f[26..34]) + 17 + 26;
    s += sum16(&f[34..60]);
    let c = match fold(s) {
        0 => 0xffff,
        c => c,
    };
    f[40..42].copy_from_slice(&c.to_be_bytes());
    f
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let (src_mac, dst_mac) = (mac(&a.src_mac)?, mac(&a.dst_mac)?);
    let new = match a.mode.as_str() {
        "est" => false,
        "new" => true,
        m => bail!("unknown mode {m:?} (est, new)"),
    };
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let sockets = Sockets::open(&XskConfig::default(), std::slice::from_ref(&a.dev), 0)
        .with_context(|| format!("opening an AF_XDP socket on {}", a.dev))?;
    let (sent, t) = sockets.with(|mut io| {
        let started = Instant::now();
        let mut sent = 0u64;
        // Tuple counters, as trafgen's dinc(): periods 1,024 (est) or 64 × 251 × 64,512 (new).
        let (mut b2, mut b3, mut port) = (0u32, 0u32, 0u32);
        while sent < a.max && !stop.load(Ordering::Relaxed) {
            for _ in 0..64 {
                let Some(mut f) = io.alloc() else { break };
                let (src, sport) = if new {
                    let src = Ipv4Addr::new(198, 18, 64 + b2 as u8, 1 + b3 as u8);
                    let sport = 1024 + port as u16;
                    b2 = (b2 + 1) % 64;
                    b3 = (b3 + 1) % 251;
                    port = (port + 1) % 64_512;
                    (src, sport)
                } else {
                    let sport = 10_000 + port as u16;
                    port = (port + 1) % 1024;
                    (a.src_ip, sport)
                };
                let bytes = frame(&a, src_mac, dst_mac, src, sport);
                io.set_len(&mut f, 60);
                io.bytes(&mut f).copy_from_slice(&bytes);
                io.send(0, f);
                sent += 1;
            }
            io.flush();
        }
        (sent, started.elapsed())
    });
    println!("\n{sent:>12} packets outgoing");
    println!("{:>12} bytes outgoing", sent * 60);
    println!(
        "{:>12} sec, {} usec on CPU0 ({sent} packets)",
        t.as_secs(),
        t.subsec_micros()
    );
    Ok(())
}
