//! kube-proxy's lenient address parsing (k8s.io/utils/net's `ParseIPSloppy` and
//! `ParseCIDRSloppy`), for objects written before the API server's validation tightened.

use std::net::IpAddr;

use ipnet::IpNet;

/// kube-proxy's `ParseIPSloppy`: like `IpAddr::from_str`, but IPv4 octets may carry
/// leading zeros, read as decimal (legacy objects the API server no longer accepts).
pub fn parse_ip_sloppy(s: &str) -> Option<IpAddr> {
    let s = s.trim();
    if let Ok(ip) = s.parse() {
        return Some(ip);
    }
    let parts: Vec<&str> = s.split('.').collect();
    if parts.len() != 4 {
        return None;
    }
    let mut octets = [0u8; 4];
    for (o, p) in octets.iter_mut().zip(&parts) {
        if p.is_empty() || p.len() > 3 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *o = p.parse().ok()?;
    }
    Some(IpAddr::from(octets))
}

/// kube-proxy's `ParseCIDRSloppy`, masked to its network; a bare address is a host route.
pub fn parse_cidr_sloppy(s: &str) -> Option<IpNet> {
    let s = s.trim();
    match s.split_once('/') {
        Some((ip, len)) => {
            let ip = parse_ip_sloppy(ip)?;
            let len: u8 = len.parse().ok()?;
            IpNet::new(ip, len).ok().map(|n| n.trunc())
        }
        None => parse_ip_sloppy(s).map(IpNet::from),
    }
}
