//! A `kxp run` process in a lab namespace, and threads that run there.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::topology::{enter_netns, node_command};

/// Runs `f` on a thread inside network namespace `ns`.
pub fn spawn_in<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<anyhow::Result<T>> {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        enter_netns(&ns).with_context(|| format!("entering namespace {ns}"))?;
        Ok(f())
    })
}

/// The result of a thread started by [`spawn_in`] (its panic as an error).
pub fn join<T>(h: JoinHandle<anyhow::Result<T>>) -> anyhow::Result<T> {
    h.join()
        .map_err(|_| anyhow::anyhow!("a helper thread panicked"))?
}

/// `exe run ARGS` in namespace `ns`, its output to `out`.
fn run_in(
    exe: &Path,
    ns: &str,
    args: &[String],
    env: &[(String, String)],
    out: std::fs::File,
) -> anyhow::Result<Child> {
    let err = out.try_clone()?;
    // Invoked as `kube-proxy`, kxp is `kxp run` already.
    let as_kube_proxy = exe.file_name().is_some_and(|n| n == "kube-proxy");
    node_command(ns)
        .arg(exe)
        .args((!as_kube_proxy).then_some("run"))
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .context("starting kxp run")
}

/// A `kxp run` child process in a namespace. On drop: SIGTERM, wait, then `kxp
/// cleanup` in the namespace (a stopped kxp keeps its steering and state for the next
/// one, see `dataplane::statefile`; this one is not coming back).
#[derive(Debug)]
pub struct KxpProcess {
    pub child: Child,
    pub log: PathBuf,
    exe: PathBuf,
    ns: String,
    env: Vec<(String, String)>,
    /// `kxp cleanup` ran.
    cleaned: bool,
}

impl KxpProcess {
    pub fn spawn(ns: &str, args: &[String], log: &Path) -> anyhow::Result<KxpProcess> {
        let exe = std::env::current_exe().context("locating the kxp binary")?;
        Self::spawn_exe(&exe, ns, args, log)
    }

    pub fn spawn_exe(
        exe: &Path,
        ns: &str,
        args: &[String],
        log: &Path,
    ) -> anyhow::Result<KxpProcess> {
        Self::spawn_exe_env(exe, ns, args, &[], log)
    }

    /// As [`KxpProcess::spawn_exe`], with these environment variables besides this
    /// process's (kept for a restart).
    pub fn spawn_exe_env(
        exe: &Path,
        ns: &str,
        args: &[String],
        env: &[(String, String)],
        log: &Path,
    ) -> anyhow::Result<KxpProcess> {
        let child = run_in(exe, ns, args, env, std::fs::File::create(log)?)?;
        Ok(KxpProcess {
            child,
            log: log.to_path_buf(),
            exe: exe.to_path_buf(),
            ns: ns.to_string(),
            env: env.to_vec(),
            cleaned: false,
        })
    }

    /// Starts another `kxp run` (the same binary, or `exe`) in the same namespace with
    /// `args`, logging to the same file (appended), after this one has stopped: a restart.
    pub fn restart(&mut self, exe: Option<&Path>, args: &[String]) -> anyhow::Result<()> {
        let exe = exe.map_or_else(|| self.exe.clone(), Path::to_path_buf);
        let out = std::fs::OpenOptions::new().append(true).open(&self.log)?;
        self.child = run_in(&exe, &self.ns, args, &self.env, out)?;
        self.exe = exe;
        self.cleaned = false;
        Ok(())
    }

    /// SIGKILL, and wait.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// `kxp cleanup` in the namespace (after the process has stopped); once.
    pub fn cleanup(&mut self) -> anyhow::Result<String> {
        self.cleaned = true;
        let out = node_command(&self.ns)
            .arg(&self.exe)
            .arg("cleanup")
            .stdin(Stdio::null())
            .output()
            .context("running kxp cleanup")?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        anyhow::ensure!(out.status.success(), "kxp cleanup failed: {text}");
        Ok(text)
    }

    /// SIGTERM, then wait up to 10 s (SIGKILL after). Returns the exit status code.
    pub fn terminate(&mut self) -> Option<i32> {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).output();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        self.child.wait().ok().and_then(|s| s.code())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for KxpProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.terminate();
        }
        // A namespace already gone took everything kxp had in it (its state directory
        // goes at a later kxp's start, see dataplane::statefile::remove_stale_dirs).
        let gone = !Path::new("/run/netns").join(&self.ns).exists();
        if !self.cleaned
            && !gone
            && let Err(e) = self.cleanup()
        {
            tracing::warn!(error = %e, namespace = %self.ns, "kxp cleanup after the run");
        }
    }
}

/// Whether `http://addr/healthz` answers 200 now, asked from inside `ns`.
///
/// # Errors
/// The namespace cannot be entered.
pub fn healthz_ok(ns: &str, addr: SocketAddr) -> anyhow::Result<bool> {
    join(spawn_in(ns, move || -> bool {
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let _ = s.write_all(b"GET /healthz HTTP/1.0\r\n\r\n");
        let mut r = String::new();
        let _ = s.read_to_string(&mut r);
        r.starts_with("HTTP/1.1 200")
    }))
}

/// Waits until `http://addr/healthz` answers 200 from inside `ns`.
pub fn wait_healthy(
    ns: &str,
    addr: SocketAddr,
    timeout: Duration,
    kxp: &mut KxpProcess,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(st)) = kxp.child.try_wait() {
            bail!(
                "kxp run exited ({st}) before becoming healthy:\n{}",
                kxp.log_text()
            );
        }
        if healthz_ok(ns, addr)? {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "kxp run did not become healthy in {timeout:?}:\n{}",
                kxp.log_text()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
