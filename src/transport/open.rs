//! Opening a transport by its configured kind. This is the one place that knows
//! every backend, so it sits beside them rather than in the module root, which
//! they all import from.

use super::auth::ClusterSecret;
use super::ucx::{UcxOptions, UcxTransport};
use super::{LocalTransport, Result, ShmTransport, TcpOptions, TcpTransport, Transport, shm};
use std::net::SocketAddr;
use std::sync::Arc;

/// Builds a transport of the configured kind for this process. TCP (and the
/// rdma transport's bootstrap) listens on `tcp_bind` (loopback, any port, when `None`).
pub fn open(kind: handoff_components::config::TransportKind, tcp_bind: Option<SocketAddr>) -> Result<Arc<dyn Transport>> {
    open_with(kind, tcp_bind, None, ClusterSecret::process())
}

/// [`open`] with the cluster secret its peers must prove (tcp, shm), and the
/// address a tcp transport advertises in its handles (`None`: the bound one;
/// port 0: the bound port).
pub fn open_with(
    kind: handoff_components::config::TransportKind,
    tcp_bind: Option<SocketAddr>,
    tcp_advertise: Option<SocketAddr>,
    secret: ClusterSecret,
) -> Result<Arc<dyn Transport>> {
    let config = handoff_components::config::TransportConfig { kind, ..Default::default() };
    open_config(&config, tcp_bind, tcp_advertise, secret)
}

/// [`open_with`] for a topology's whole `[transport]` section: its kind and, for
/// ucx, its `[transport.ucx]` settings, for rdma its `[transport.rdma]` device,
/// port and GID index. A ucx transport's notice listener (and rdma's bootstrap)
/// binds and advertises as a tcp transport's listener does.
pub fn open_config(
    config: &handoff_components::config::TransportConfig,
    tcp_bind: Option<SocketAddr>,
    tcp_advertise: Option<SocketAddr>,
    secret: ClusterSecret,
) -> Result<Arc<dyn Transport>> {
    use handoff_components::config::TransportKind;
    Ok(match config.kind {
        TransportKind::Ucx => {
            let mut notify = TcpOptions { secret, advertise: tcp_advertise, ..TcpOptions::default() };
            if let Some(bind) = tcp_bind {
                notify.bind = bind;
            }
            Arc::new(UcxTransport::open(UcxOptions { ucx: config.ucx.clone(), notify, ..UcxOptions::default() })?)
        }
        TransportKind::Local => Arc::new(LocalTransport::new()),
        TransportKind::Shm => Arc::new(ShmTransport::with_secret(shm::default_dir(), secret)?),
        TransportKind::Tcp => {
            let mut opts = TcpOptions { secret, advertise: tcp_advertise, ..TcpOptions::default() };
            if let Some(bind) = tcp_bind {
                opts.bind = bind;
            }
            Arc::new(TcpTransport::bind(opts)?)
        }
        TransportKind::Rdma => {
            // The bootstrap listener takes the tcp transport's address flags.
            let mut bootstrap = TcpOptions { secret, advertise: tcp_advertise, ..TcpOptions::default() };
            if let Some(bind) = tcp_bind {
                bootstrap.bind = bind;
            }
            let opts = super::rdma::RdmaOptions::from_config(&config.rdma, bootstrap)?;
            Arc::new(super::rdma::RdmaTransport::open_with(opts)?)
        }
    })
}

/// A producer and a consumer transport of one kind in this process, wired as two
/// processes would be (two shm prefixes, two TCP endpoints on loopback). For
/// benchmarks and tests.
pub fn loopback_pair(kind: handoff_components::config::TransportKind) -> Result<(Arc<dyn Transport>, Arc<dyn Transport>)> {
    Ok((open(kind, None)?, open(kind, None)?))
}

/// [`loopback_pair`] for a whole `[transport]` section (ucx: its UCX settings).
pub fn loopback_pair_config(config: &handoff_components::config::TransportConfig) -> Result<(Arc<dyn Transport>, Arc<dyn Transport>)> {
    let secret = ClusterSecret::process();
    Ok((open_config(config, None, None, secret.clone())?, open_config(config, None, None, secret)?))
}
