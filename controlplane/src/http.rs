//! The small HTTP/1.1 server behind kxp's health, metrics and health-check-node-port
//! endpoints: what a kubelet probe, a cloud load balancer's probe or a Prometheus scrape
//! needs, with nothing to configure, and no client able to hold it up.
//!
//! - Every listener of the process is served by one thread ("kxp-http") running a
//!   single-threaded tokio runtime: each connection is its own task, so a client that
//!   sends its request a byte at a time delays nobody else.
//! - A request head (request line and headers) must arrive within [`HEAD_TIMEOUT`] and
//!   fit in [`MAX_HEAD`] bytes (else 408 / 431 and the connection is closed); the answer
//!   must be taken within [`WRITE_TIMEOUT`]. One request per connection
//!   (`Connection: close`).
//! - A listener holds at most [`MAX_CONNECTIONS`] connections: a new one beyond that
//!   closes the oldest, so a crowd of idle or slow clients cannot lock a probe out.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// Longest time a client may take to send its request line and headers.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest request head accepted, bytes.
pub const MAX_HEAD: usize = 8192;
/// Longest time a client may take to receive the answer.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections one listener holds at once; the oldest is closed for a new one.
pub const MAX_CONNECTIONS: usize = 1024;

/// An answer: status line text (`"200 OK"`), content type and body.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: &'static str,
    pub content_type: &'static str,
    pub body: String,
    /// More header lines (name, value).
    pub headers: Vec<(&'static str, String)>,
}

impl Response {
    pub fn not_found() -> Response {
        Response::text("404 Not Found", "404 page not found\n")
    }

    fn text(status: &'static str, body: &str) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.to_string(),
            headers: Vec::new(),
        }
    }
}

/// What answers a request: `(method, path without its query)`.
pub type Handler = Arc<dyn Fn(&str, &str) -> Response + Send + Sync>;

/// The runtime every listener runs on (started on first use, for the process's life).
fn runtime() -> std::io::Result<&'static tokio::runtime::Handle> {
    static RT: OnceLock<tokio::runtime::Handle> = OnceLock::new();
    if let Some(h) = RT.get() {
        return Ok(h);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    let handle = rt.handle().clone();
    std::thread::Builder::new()
        .name("kxp-http".into())
        .spawn(move || rt.block_on(std::future::pending::<()>()))?;
    Ok(RT.get_or_init(|| handle))
}

/// A running server; stops on [`HttpServer::stop`] or when dropped.
#[derive(Debug)]
pub struct HttpServer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl HttpServer {
    /// Binds `addr` and answers every request with `handler(method, path)`. `name` says
    /// what is served, in logs.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start(
        addr: SocketAddr,
        name: &str,
        handler: impl Fn(&str, &str) -> Response + Send + Sync + 'static,
    ) -> std::io::Result<HttpServer> {
        let listener = std::net::TcpListener::bind(addr)?;
        Self::on(listener, name, Arc::new(handler))
    }

    /// Serves an already bound listener.
    ///
    /// # Errors
    /// The listener cannot be handed to the runtime.
    pub fn on(
        listener: std::net::TcpListener,
        name: &str,
        handler: Handler,
    ) -> std::io::Result<HttpServer> {
        Self::on_limited(listener, name, handler, MAX_CONNECTIONS)
    }

    fn on_limited(
        listener: std::net::TcpListener,
        name: &str,
        handler: Handler,
        max_connections: usize,
    ) -> std::io::Result<HttpServer> {
        let rt = runtime()?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let listener = {
            let _guard = rt.enter();
            tokio::net::TcpListener::from_std(listener)?
        };
        let name = name.to_string();
        let task = rt.spawn(accept_loop(listener, name, handler, max_connections));
        Ok(HttpServer { addr, task })
    }

    /// As [`HttpServer::start`], but an address that cannot be bound now is logged and
    /// tried again every 5 s until it can, as kube-proxy does for its health and metrics
    /// servers without `bindAddressHardFail`.
    ///
    /// # Errors
    /// With `hard_fail`, the address cannot be bound now.
    pub fn start_or_retry(
        addr: SocketAddr,
        name: &str,
        hard_fail: bool,
        handler: impl Fn(&str, &str) -> Response + Send + Sync + 'static,
    ) -> std::io::Result<HttpServer> {
        match std::net::TcpListener::bind(addr) {
            Ok(l) => Self::on(l, name, Arc::new(handler)),
            Err(e) if hard_fail => Err(e),
            Err(e) => {
                tracing::error!(
                    "cannot serve {name} on {addr}: {e}; trying again every 5 s (bindAddressHardFail makes this fatal)"
                );
                let rt = runtime()?;
                let handler: Handler = Arc::new(handler);
                let name = name.to_string();
                let task = rt.spawn(async move {
                    let listener = loop {
                        tokio::time::sleep(Duration::from_secs(5)).await;
                        match tokio::net::TcpListener::bind(addr).await {
                            Ok(l) => break l,
                            Err(e) => tracing::debug!("still cannot serve {name} on {addr}: {e}"),
                        }
                    };
                    tracing::info!("serving {name} on {addr} now");
                    accept_loop(listener, name, handler, MAX_CONNECTIONS).await;
                });
                Ok(HttpServer { addr, task })
            }
        }
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and closes the connections in progress.
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        // The accept task owns the listener and the connections' tasks (aborted with
        // it); wait for it to be gone so that the port is free when this returns (not
        // from the runtime's own thread, which would wait for itself).
        self.task.abort();
        if tokio::runtime::Handle::try_current().is_err() {
            let _ = futures::executor::block_on(&mut self.task);
        }
    }
}

/// Accepts connections, each served by its own task; beyond [`MAX_CONNECTIONS`] the
/// oldest is closed. Aborting this task aborts every connection's.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    name: String,
    handler: Handler,
    max_connections: usize,
) {
    struct Conns(VecDeque<tokio::task::AbortHandle>);
    impl Drop for Conns {
        fn drop(&mut self) {
            for c in &self.0 {
                c.abort();
            }
        }
    }
    let mut conns = Conns(VecDeque::new());
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors and the like: wait instead of spinning.
                dataplane::warn_limited!(
                    format!("http accept {name}"),
                    "serving {name}: cannot accept a connection: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        conns.0.retain(|c| !c.is_finished());
        if conns.0.len() >= max_connections
            && let Some(oldest) = conns.0.pop_front()
        {
            oldest.abort();
        }
        let h = handler.clone();
        let task = tokio::spawn(async move {
            let _ = serve_conn(stream, &h).await;
        });
        conns.0.push_back(task.abort_handle());
    }
}

/// Reads one request head (within the limits), answers it, closes.
async fn serve_conn(mut stream: tokio::net::TcpStream, handler: &Handler) -> std::io::Result<()> {
    let head = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream)).await;
    let r = match head {
        Err(_) => Response::text(
            "408 Request Timeout",
            "the request did not arrive in time\n",
        ),
        Ok(Err(Head::TooLarge)) => Response::text(
            "431 Request Header Fields Too Large",
            "request head too large\n",
        ),
        Ok(Err(Head::Closed)) => return Ok(()),
        Ok(Ok(head)) => {
            let line = head.lines().next().unwrap_or("");
            let mut parts = line.split_whitespace();
            let method = parts.next().unwrap_or("");
            let target = parts.next().unwrap_or("/");
            let path = target.split('?').next().unwrap_or(target);
            let mut r = handler(method, path);
            if method == "HEAD" {
                r.body.clear();
            }
            r
        }
    };
    let mut out = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nX-Content-Type-Options: nosniff\r\nContent-Length: {}\r\nConnection: close\r\n",
        r.status,
        r.content_type,
        r.body.len()
    );
    for (name, value) in &r.headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(&r.body);
    let write = async {
        stream.write_all(out.as_bytes()).await?;
        stream.shutdown().await
    };
    tokio::time::timeout(WRITE_TIMEOUT, write)
        .await
        .unwrap_or(Ok(()))
}

enum Head {
    TooLarge,
    Closed,
}

/// The request head, up to and without the blank line.
async fn read_head(stream: &mut tokio::net::TcpStream) -> Result<String, Head> {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await.map_err(|_| Head::Closed)?;
        if n == 0 {
            return Err(Head::Closed);
        }
        let from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = find_blank_line(&buf[from..]) {
            buf.truncate(from + end);
            return Ok(String::from_utf8_lossy(&buf).into_owned());
        }
        if buf.len() > MAX_HEAD {
            return Err(Head::TooLarge);
        }
    }
}

/// Where `\r\n\r\n` (or a bare `\n\n`) starts in `b`.
fn find_blank_line(b: &[u8]) -> Option<usize> {
    (0..b.len()).find(|&i| b[i..].starts_with(b"\r\n\r\n") || b[i..].starts_with(b"\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read as _, Write as _};
    use std::net::{TcpListener, TcpStream};
    use std::time::Instant;

    fn ok(_: &str, _: &str) -> Response {
        Response::text("200 OK", "ok")
    }

    fn get(addr: SocketAddr) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /healthz?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        text
    }

    /// kube-proxy's bindAddressHardFail: false keeps trying until the address is free,
    /// true refuses at once.
    #[test]
    fn a_busy_address_is_fatal_only_with_hard_fail() {
        let busy = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = busy.local_addr().unwrap();
        assert!(HttpServer::start_or_retry(addr, "t", true, ok).is_err());
        let server = HttpServer::start_or_retry(addr, "t", false, ok).unwrap();
        drop(busy);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut s) = TcpStream::connect(addr) {
                s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
                let mut text = String::new();
                let _ = s.read_to_string(&mut text);
                if text.ends_with("ok") {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "never served");
            std::thread::sleep(Duration::from_millis(100));
        }
        server.stop();
    }

    /// 200 clients sending their request a byte a second do not delay a normal probe;
    /// a head too large is refused; a silent client is cut at the head timeout.
    #[test]
    fn slow_and_abusive_clients_do_not_hold_up_a_probe() {
        let server = HttpServer::start("127.0.0.1:0".parse().unwrap(), "t", ok).unwrap();
        let addr = server.local_addr();
        let slow: Vec<TcpStream> = (0..200)
            .map(|_| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(b"G").unwrap();
                s
            })
            .collect();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let dripper = {
            let stop = stop.clone();
            let mut slow = slow;
            std::thread::spawn(move || {
                for b in b"ET /healthz HTTP/1.1\r\n".iter().cycle().take(3) {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    for s in &mut slow {
                        let _ = s.write_all(&[*b]);
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
                slow
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        let mut worst = Duration::ZERO;
        for _ in 0..10 {
            let t0 = Instant::now();
            let text = get(addr);
            worst = worst.max(t0.elapsed());
            assert!(
                text.starts_with("HTTP/1.1 200 OK") && text.ends_with("ok"),
                "{text}"
            );
        }
        assert!(worst < Duration::from_millis(100), "a probe took {worst:?}");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let slow = dripper.join().unwrap();
        // Too large a head: 431.
        let mut s = TcpStream::connect(addr).unwrap();
        let mut big = b"GET / HTTP/1.1\r\n".to_vec();
        big.extend(std::iter::repeat_n(b'a', MAX_HEAD + 10));
        let _ = s.write_all(&big);
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        assert!(text.starts_with("HTTP/1.1 431"), "{text}");
        // The slow ones are cut at the head timeout with 408.
        let mut s = slow.into_iter().next().unwrap();
        s.set_read_timeout(Some(HEAD_TIMEOUT + Duration::from_secs(3)))
            .unwrap();
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        server.stop();
    }

    /// More connections than the limit: the oldest go, the newest are served.
    #[test]
    fn the_oldest_idle_connections_make_room() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let server = HttpServer::on_limited(l, "t", Arc::new(ok), 64).unwrap();
        let addr = server.local_addr();
        let idle: Vec<TcpStream> = (0..64 + 20)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let text = get(addr);
        assert!(text.ends_with("ok"), "{text}");
        // The first ones were closed by the server.
        let mut first = &idle[0];
        first
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        let mut b = [0u8; 1];
        assert_eq!(first.read(&mut b).unwrap_or(0), 0);
        server.stop();
    }
}
