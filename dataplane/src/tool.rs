//! The node's command-line tools (nft, iptables, ip), for what kxp does not speak
//! netlink for: run one, with an optional standard input, and read what it printed.

use std::io::Write;
use std::process::{Command, Stdio};

/// Runs `tool args`; `None` when the tool is not installed.
pub fn run(
    tool: &'static str,
    args: &[&str],
    stdin: Option<&str>,
) -> Option<Result<String, String>> {
    let mut c = Command::new(tool);
    c.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = match c.spawn() {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => return Some(Err(format!("{tool}: {e}"))),
    };
    if let (Some(text), Some(mut w)) = (stdin, child.stdin.take())
        && let Err(e) = w.write_all(text.as_bytes())
    {
        return Some(Err(format!("{tool}: writing its input: {e}")));
    }
    Some(match child.wait_with_output() {
        Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        Ok(out) => Err(format!(
            "{tool} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!("{tool}: {e}")),
    })
}
