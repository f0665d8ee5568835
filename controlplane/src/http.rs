//! The small HTTP/1.1 server behind kxp's health and metrics endpoints: one thread, one
//! connection at a time, `Connection: close` — what a kubelet probe or a Prometheus
//! scrape needs, with nothing to configure.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

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
        Response {
            status: "404 Not Found",
            content_type: "text/plain; charset=utf-8",
            body: "404 page not found\n".to_string(),
            headers: Vec::new(),
        }
    }
}

/// A running server; stops (and joins its thread) on [`HttpServer::stop`].
#[derive(Debug)]
pub struct HttpServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HttpServer {
    /// Binds `addr` and answers every request with `handler(method, path)` (the path
    /// without its query) in a thread named `name`.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start(
        addr: SocketAddr,
        name: &str,
        handler: impl Fn(&str, &str) -> Response + Send + 'static,
    ) -> std::io::Result<HttpServer> {
        let listener = TcpListener::bind(addr)?;
        Self::serve_on(Some(listener), addr, name, handler)
    }

    /// As [`HttpServer::start`], but an address that cannot be bound now is logged and
    /// tried again every 5 s in the server's thread until it can, as kube-proxy does for
    /// its health and metrics servers without `bindAddressHardFail`.
    ///
    /// # Errors
    /// With `hard_fail`, the address cannot be bound now.
    pub fn start_or_retry(
        addr: SocketAddr,
        name: &str,
        hard_fail: bool,
        handler: impl Fn(&str, &str) -> Response + Send + 'static,
    ) -> std::io::Result<HttpServer> {
        match TcpListener::bind(addr) {
            Ok(l) => Self::serve_on(Some(l), addr, name, handler),
            Err(e) if hard_fail => Err(e),
            Err(e) => {
                tracing::error!(
                    "cannot serve {name} on {addr}: {e}; trying again every 5 s (bindAddressHardFail makes this fatal)"
                );
                Self::serve_on(None, addr, name, handler)
            }
        }
    }

    fn serve_on(
        listener: Option<TcpListener>,
        addr: SocketAddr,
        name: &str,
        handler: impl Fn(&str, &str) -> Response + Send + 'static,
    ) -> std::io::Result<HttpServer> {
        let local = match &listener {
            Some(l) => {
                l.set_nonblocking(true)?;
                l.local_addr()?
            }
            None => addr,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let what = name.to_string();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let mut listener = listener;
                let mut next_try = std::time::Instant::now() + Duration::from_secs(5);
                while !stop2.load(Ordering::Relaxed) {
                    let Some(l) = &listener else {
                        std::thread::sleep(Duration::from_millis(50));
                        if std::time::Instant::now() < next_try {
                            continue;
                        }
                        next_try = std::time::Instant::now() + Duration::from_secs(5);
                        match TcpListener::bind(addr).and_then(|l| {
                            l.set_nonblocking(true)?;
                            Ok(l)
                        }) {
                            Ok(l) => {
                                tracing::info!("serving {what} on {addr} now");
                                listener = Some(l);
                            }
                            Err(e) => tracing::debug!("still cannot serve {what} on {addr}: {e}"),
                        }
                        continue;
                    };
                    match l.accept() {
                        Ok((stream, _)) => {
                            let _ = serve(stream, &handler);
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            })?;
        Ok(HttpServer {
            addr: local,
            stop,
            thread: Some(thread),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads one request from `stream`, answers it with `handler(method, path)`, closes.
///
/// # Errors
/// The connection failed.
pub fn serve(stream: TcpStream, handler: &impl Fn(&str, &str) -> Response) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    // Drain the headers.
    let mut h = String::new();
    while reader.read_line(&mut h)? > 2 {
        h.clear();
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("");
    let path = parts.next().unwrap_or("/");
    let path = path.split('?').next().unwrap_or(path);
    let r = handler(method, path);
    let mut stream = stream;
    let mut head = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nX-Content-Type-Options: nosniff\r\nContent-Length: {}\r\nConnection: close\r\n",
        r.status,
        r.content_type,
        r.body.len()
    );
    for (name, value) in &r.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    if method != "HEAD" {
        stream.write_all(r.body.as_bytes())?;
    }
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(_: &str, _: &str) -> Response {
        Response {
            status: "200 OK",
            content_type: "text/plain",
            body: "ok".into(),
            headers: Vec::new(),
        }
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
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut s) = TcpStream::connect(addr) {
                s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
                let mut text = String::new();
                let _ = std::io::Read::read_to_string(&mut s, &mut text);
                if text.ends_with("ok") {
                    break;
                }
            }
            assert!(std::time::Instant::now() < deadline, "never served");
            std::thread::sleep(Duration::from_millis(100));
        }
        server.stop();
    }
}
