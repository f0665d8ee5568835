//! Which interfaces kxp attaches to: names and shell-style patterns (`eth0`, `veth*`,
//! `cali*`, `lxc*`, `tap[0-9]*`), as `--interface` and `kxp.interfaces` give them.
//!
//! A name without a wildcard must exist when kxp starts (a typo is an error); a pattern
//! may match nothing yet (pods come later). Matching is the shell's: `*` any run of
//! characters, `?` one character, `[abc]`, `[a-z]` and `[!a-z]` one character of (or not
//! of) a set; `\` takes the next character literally.

/// Whether `s` holds a wildcard (`*`, `?` or `[`), i.e. is a pattern and not a name.
pub fn is_pattern(s: &str) -> bool {
    s.bytes().any(|b| matches!(b, b'*' | b'?' | b'['))
}

/// Whether the interface name `name` matches the shell pattern `pattern`.
pub fn matches(pattern: &str, name: &str) -> bool {
    glob(pattern.as_bytes(), name.as_bytes())
}

/// Whether a link a *pattern* matched is one kxp attaches to: an Ethernet link
/// (`ARPHRD_ETHER`: physical NICs, veths, VXLAN, VLAN devices) that is neither a bridge
/// nor a bond (kxp attaches to their ports: an XDP program on a bond runs on its ports,
/// whose queues need sockets of their own). Loopback, tunnels without an Ethernet header
/// (`tunl0`, WireGuard) and the like are left alone. A link named without a wildcard is
/// attached whatever it is, a bond excepted (refused, see [`bond_ports`]).
pub fn eligible_for_pattern(name: &str) -> bool {
    let dev = std::path::Path::new("/sys/class/net").join(name);
    let ether = std::fs::read_to_string(dev.join("type")).is_ok_and(|t| t.trim() == "1");
    ether && !dev.join("bridge").exists() && !dev.join("bonding").exists()
}

/// The ports of bond `name` (`/sys/class/net/NAME/bonding/slaves`), or `None` when it
/// is no bond.
pub fn bond_ports(name: &str) -> Option<Vec<String>> {
    let dev = std::path::Path::new("/sys/class/net").join(name);
    if !dev.join("bonding").exists() {
        return None;
    }
    Some(
        std::fs::read_to_string(dev.join("bonding/slaves"))
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect(),
    )
}

/// Whether a link is wanted: named by a literal, or matched by a pattern and
/// [`eligible_for_pattern`].
pub fn wanted(patterns: &[String], name: &str) -> bool {
    patterns.iter().any(|p| {
        if is_pattern(p) {
            matches(p, name) && eligible_for_pattern(name)
        } else {
            p == name
        }
    })
}

/// Checks that a pattern is well-formed (a `[` set is closed).
///
/// # Errors
/// What is wrong with it, for the user.
pub fn check(pattern: &str) -> Result<(), String> {
    if pattern.is_empty() {
        return Err("an empty interface name".into());
    }
    let b = pattern.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'[' => match set_end(b, i) {
                Some(end) => i = end + 1,
                None => return Err(format!("{pattern:?}: '[' without a closing ']'")),
            },
            _ => i += 1,
        }
    }
    Ok(())
}

/// The index of the `]` closing the set that starts at `b[start] == '['`.
fn set_end(b: &[u8], start: usize) -> Option<usize> {
    let mut i = start + 1;
    if b.get(i) == Some(&b'!') || b.get(i) == Some(&b'^') {
        i += 1;
    }
    if b.get(i) == Some(&b']') {
        i += 1; // a leading ']' is a member
    }
    while i < b.len() {
        if b[i] == b']' {
            return Some(i);
        }
        i += 1;
    }
    None
}

/// Whether `c` is in the set `b[start..=end]` (`[` … `]`).
fn in_set(b: &[u8], start: usize, end: usize, c: u8) -> bool {
    let mut i = start + 1;
    let negate = matches!(b[i], b'!' | b'^');
    if negate {
        i += 1;
    }
    let mut found = false;
    let mut first = true;
    while i < end && (first || b[i] != b']') {
        first = false;
        if i + 2 < end && b[i + 1] == b'-' {
            if b[i] <= c && c <= b[i + 2] {
                found = true;
            }
            i += 3;
        } else {
            if b[i] == c {
                found = true;
            }
            i += 1;
        }
    }
    found != negate
}

/// Iterative glob matching with backtracking to the last `*` (linear in practice).
fn glob(p: &[u8], s: &[u8]) -> bool {
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        let step = match p.get(pi) {
            Some(b'*') => {
                star = Some((pi, si));
                pi += 1;
                continue;
            }
            Some(b'?') => Some(1),
            Some(b'[') => match set_end(p, pi) {
                Some(end) if in_set(p, pi, end, s[si]) => Some(end + 1 - pi),
                Some(_) => None,
                None => (s[si] == b'[').then_some(1),
            },
            Some(b'\\') if pi + 1 < p.len() => (p[pi + 1] == s[si]).then_some(2),
            Some(&c) => (c == s[si]).then_some(1),
            None => None,
        };
        match step {
            Some(n) => {
                pi += n;
                si += 1;
            }
            None => match star {
                Some((sp, ss)) => {
                    pi = sp + 1;
                    si = ss + 1;
                    star = Some((sp, ss + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_patterns_as_a_shell_matches_them() {
        for (p, n, want) in [
            ("eth0", "eth0", true),
            ("eth0", "eth01", false),
            ("veth*", "veth", true),
            ("veth*", "veth3a9f", true),
            ("veth*", "xveth1", false),
            ("cali*", "cali0123456789a", true),
            ("lxc*", "lxc_health", true),
            ("*", "anything", true),
            ("e?h0", "eth0", true),
            ("e?h0", "eh0", false),
            ("tap[0-9]*", "tap3", true),
            ("tap[0-9]*", "tapx", false),
            ("tap[!0-9]", "tapx", true),
            ("tap[!0-9]", "tap1", false),
            ("ens[13]f*", "ens1f0", true),
            ("ens[13]f*", "ens2f0", false),
            ("*-dp", "kxp0-dp", true),
            ("a*b*c", "aXbYc", true),
            ("a*b*c", "aXbY", false),
            ("br\\*", "br*", true),
            ("br\\*", "br0", false),
        ] {
            assert_eq!(matches(p, n), want, "{p} vs {n}");
        }
    }

    #[test]
    fn wildcards_tell_a_pattern_from_a_name_and_bad_sets_are_refused() {
        assert!(!is_pattern("eth0"));
        assert!(is_pattern("veth*"));
        assert!(is_pattern("tap[0-9]"));
        assert!(is_pattern("e?h0"));
        assert!(check("veth*").is_ok());
        assert!(check("tap[0-9]").is_ok());
        assert!(check("tap[0-9").unwrap_err().contains("closing"));
        assert!(check("").is_err());
    }
}
