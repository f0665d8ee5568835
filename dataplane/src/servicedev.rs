//! kxp's service device: a veth pair that kxp creates in its own network namespace and
//! removes when it stops.
//!
//! Its dataplane side (`NAME-dp`, one receive queue per worker) carries the first AF_XDP
//! socket of every worker. That socket is the UMEM's own (libxdp binds it on the UMEM's
//! file descriptor, which stays bound until the UMEM goes), and every other socket shares
//! the UMEM through it. Interfaces kxp attaches to come and go with the pods, so the
//! UMEM's socket must sit on a device that lives exactly as long as kxp: this one.
//!
//! The host side (`NAME`, default `kxp0`) is what the node's routing table can point at.
//!
//! A kxp killed with SIGKILL leaves the pair behind; the next start replaces it, and
//! `kxp cleanup` removes it.

use std::io;

use futures::TryStreamExt;
use rtnetlink::packet_route::link::LinkAttribute;
use rtnetlink::{Handle, LinkUnspec, LinkVeth};

/// The suffix of the dataplane side's name.
pub const DP_SUFFIX: &str = "-dp";

/// Creating or removing the service device failed.
#[derive(Debug, thiserror::Error)]
pub enum ServiceDeviceError {
    #[error(
        "service device name {name:?} is not usable: give 1 to {max} characters, no '/', ':' or \
         spaces (kxp.serviceDevice)"
    )]
    BadName { name: String, max: usize },
    #[error("cannot {op} kxp's service device {name}: {source}")]
    Netlink {
        op: &'static str,
        name: String,
        #[source]
        source: io::Error,
    },
}

/// The veth pair, deleted on drop.
#[derive(Debug)]
pub struct ServiceDevice {
    /// The host side (routes may point here).
    pub host: String,
    /// The dataplane side (kxp's sockets sit here).
    pub dp: String,
    pub host_ifindex: u32,
    pub dp_ifindex: u32,
}

fn runtime() -> io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

async fn index_of(handle: &Handle, name: &str) -> Option<u32> {
    let mut links = handle.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(m)) => Some(m.header.index),
        _ => None,
    }
}

fn netlink_err(
    op: &'static str,
    name: &str,
) -> impl FnOnce(rtnetlink::Error) -> ServiceDeviceError {
    let name = name.to_string();
    move |e| ServiceDeviceError::Netlink {
        op,
        name,
        source: io::Error::other(e.to_string()),
    }
}

/// Runs `f` with a netlink handle in the calling thread's network namespace.
fn with_handle<T>(
    name: &str,
    f: impl AsyncFnOnce(&Handle) -> Result<T, ServiceDeviceError>,
) -> Result<T, ServiceDeviceError> {
    let io_err = |op: &'static str| {
        let name = name.to_string();
        move |source: io::Error| ServiceDeviceError::Netlink { op, name, source }
    };
    let rt = runtime().map_err(io_err("start a runtime for"))?;
    rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(io_err("open netlink for"))?;
        tokio::spawn(conn);
        f(&handle).await
    })
}

impl ServiceDevice {
    /// Creates the pair `host` / `host-dp` (replacing one a dead kxp left), with `queues`
    /// receive and transmit queues on the dataplane side, both ends up.
    ///
    /// # Errors
    /// A bad name, or what netlink answered.
    pub fn create(host: &str, queues: u32) -> Result<ServiceDevice, ServiceDeviceError> {
        let dp = format!("{host}{DP_SUFFIX}");
        let max = libc::IFNAMSIZ - 1 - DP_SUFFIX.len();
        if host.is_empty()
            || host.len() > max
            || host
                .bytes()
                .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace())
        {
            return Err(ServiceDeviceError::BadName {
                name: host.to_string(),
                max,
            });
        }
        let q = queues.max(1);
        let (host_ifindex, dp_ifindex) = with_handle(host, async |h| {
            if let Some(old) = index_of(h, host).await {
                h.link()
                    .del(old)
                    .execute()
                    .await
                    .map_err(netlink_err("remove the stale", host))?;
            }
            let msg = LinkVeth::new(&dp, host)
                .append_extra_attribute(LinkAttribute::NumRxQueues(q))
                .append_extra_attribute(LinkAttribute::NumTxQueues(q))
                .up()
                .build();
            h.link()
                .add(msg)
                .execute()
                .await
                .map_err(netlink_err("create", host))?;
            let host_ifindex = index_of(h, host).await.unwrap_or(0);
            let dp_ifindex = index_of(h, &dp).await.unwrap_or(0);
            h.link()
                .set(LinkUnspec::new_with_index(host_ifindex).up().build())
                .execute()
                .await
                .map_err(netlink_err("bring up", host))?;
            Ok((host_ifindex, dp_ifindex))
        })?;
        Ok(ServiceDevice {
            host: host.to_string(),
            dp,
            host_ifindex,
            dp_ifindex,
        })
    }

    /// Whether `name` is one of the pair's two ends (never attached as a pod interface).
    pub fn owns(&self, name: &str) -> bool {
        name == self.host || name == self.dp
    }
}

/// Removes the service device `host` (and its peer) if it exists; returns whether it did.
///
/// # Errors
/// What netlink answered.
pub fn remove(host: &str) -> Result<bool, ServiceDeviceError> {
    with_handle(host, async |h| match index_of(h, host).await {
        Some(i) => h
            .link()
            .del(i)
            .execute()
            .await
            .map(|()| true)
            .map_err(netlink_err("remove", host)),
        None => Ok(false),
    })
}

impl Drop for ServiceDevice {
    fn drop(&mut self) {
        if let Err(e) = remove(&self.host) {
            tracing::warn!(error = %e, "kxp's service device was not removed");
        }
    }
}
