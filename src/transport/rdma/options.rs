//! The rdma transport's settings and the reasons it cannot open: what every
//! part of the backend (the verbs wrapper, the live transport, its feature-off
//! twin) imports, kept apart from the module root that re-exports them.

use super::plan;
use crate::transport::{TcpOptions, TransportError};
use handoff_components::config::{ConfigError, RdmaConfig};
use std::time::Duration;

/// Settings of an RDMA transport.
#[derive(Debug, Clone)]
pub struct RdmaOptions {
    /// The verbs device (`mlx5_0`); `None`: the first listed.
    pub device: Option<String>,
    /// The device's port (1-based).
    pub port: u8,
    /// The GID table index the queue pairs send from on RoCE (the RoCE v2
    /// entry of the interface's address is usually 1 or 3; `show_gids` lists them).
    pub gid_index: u8,
    /// Bytes of each memory registration of a region (a multiple of 4 KiB, at
    /// most [`plan::MAX_MR_CHUNK`]).
    pub mr_chunk: u64,
    /// Send queue depth of a producer's queue pair; a batch of more work
    /// requests is posted in rounds.
    pub sq_depth: u32,
    /// Receives a consumer keeps posted per producer (one per write with immediate in flight).
    pub rq_depth: u32,
    /// Gather entries per work request.
    pub max_sge: u32,
    /// The bootstrap listener: where it binds, what it advertises, the cluster
    /// secret, its timeouts (`idle_timeout` also bounds a wait for send queue room).
    pub bootstrap: TcpOptions,
    /// How long a CONNECT or KEYS_REQUEST waits for its answer.
    pub reply_timeout: Duration,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        RdmaOptions {
            device: None,
            port: 1,
            gid_index: 0,
            mr_chunk: plan::MAX_MR_CHUNK,
            sq_depth: 256,
            rq_depth: 256,
            max_sge: 4,
            bootstrap: TcpOptions::default(),
            reply_timeout: Duration::from_secs(10),
        }
    }
}

impl RdmaOptions {
    /// The topology's `[transport.rdma]` (device, port, GID index) over the
    /// defaults, with the bootstrap listener's settings; a bad value is refused
    /// here, naming its field, before any device is opened.
    pub fn from_config(config: &RdmaConfig, bootstrap: TcpOptions) -> Result<Self, RdmaError> {
        let bad = |e: ConfigError| RdmaError::Options(e.to_string());
        Ok(RdmaOptions {
            device: config.device().map_err(bad)?.map(str::to_string),
            port: config.port().map_err(bad)?,
            gid_index: config.gid_index().map_err(bad)?,
            bootstrap,
            ..RdmaOptions::default()
        })
    }
}

/// Why the RDMA transport cannot be opened.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RdmaError {
    #[error("built without the `rdma` feature (cargo build --features rdma)")]
    NotBuilt,
    #[error("cannot load {library} ({reason}): install rdma-core's libibverbs (Debian: apt-get install libibverbs1 ibverbs-providers)")]
    NoLibrary { library: &'static str, reason: String },
    #[error(
        "no RDMA device: {detail}; the rdma transport needs an InfiniBand or RoCE NIC with its driver loaded (see ibv_devices), or use transport.kind = \"tcp\""
    )]
    NoDevice { detail: String },
    #[error("no RDMA device named {name:?} (devices: {available:?})")]
    UnknownDevice { name: String, available: Vec<String> },
    #[error("RDMA device {device} port {port} is not active (state {state}; 4 is ACTIVE)")]
    PortDown { device: String, port: u8, state: u32 },
    #[error(
        "RDMA device {device} refuses {field} {value} ({call}: {message}): set [transport.rdma] {field} to one it has (ibv_devinfo -v lists its ports and GIDs)"
    )]
    NotOnDevice { device: String, field: &'static str, value: u8, call: &'static str, message: String },
    #[error("{call} on {device} failed: {message} (errno {errno})")]
    Verbs { call: &'static str, device: String, errno: i32, message: String },
    #[error("rdma options: {0}")]
    Options(String),
    #[error("rdma bootstrap listener: {0}")]
    Bootstrap(TransportError),
}

impl From<RdmaError> for TransportError {
    fn from(e: RdmaError) -> Self {
        match e {
            RdmaError::Bootstrap(t) => t,
            e => TransportError::Unavailable { what: "rdma transport".into(), reason: e.to_string() },
        }
    }
}

/// The names of RDMA devices (`mlx5_0`, ...), as `ibv_get_device_list` lists them.
pub type DeviceNames = Vec<String>;

#[cfg(test)]
mod tests {
    use super::*;

    /// `[transport.rdma]` reaches the options the device is opened with; unset
    /// fields keep the defaults (first device, port 1, GID index 0).
    #[test]
    fn the_topologys_device_port_and_gid_index_reach_the_options() {
        let o = RdmaOptions::from_config(&RdmaConfig::default(), TcpOptions::default()).expect("defaults");
        assert_eq!((o.device.as_deref(), o.port, o.gid_index), (None, 1, 0));
        let c = RdmaConfig { device: Some("mlx5_1".into()), port: Some(2), gid_index: Some(3) };
        let o = RdmaOptions::from_config(&c, TcpOptions::default()).expect("set");
        assert_eq!((o.device.as_deref(), o.port, o.gid_index), (Some("mlx5_1"), 2, 3));
        assert_eq!(o.mr_chunk, RdmaOptions::default().mr_chunk, "the rest stays default");
    }

    /// A value verbs cannot take is refused before any device is opened, the
    /// message naming the field and the value.
    #[test]
    fn bad_device_port_and_gid_index_are_refused_by_name() {
        for (c, want) in [
            (RdmaConfig { port: Some(0), ..Default::default() }, "[transport.rdma] port = 0"),
            (RdmaConfig { port: Some(256), ..Default::default() }, "[transport.rdma] port = 256"),
            (RdmaConfig { gid_index: Some(300), ..Default::default() }, "[transport.rdma] gid_index = 300"),
            (RdmaConfig { device: Some("mlx5 0".into()), ..Default::default() }, "[transport.rdma] device = \"mlx5 0\""),
            (RdmaConfig { device: Some(String::new()), ..Default::default() }, "[transport.rdma] device = \"\""),
            (RdmaConfig { device: Some("/dev/infiniband/uverbs0".into()), ..Default::default() }, "device = \"/dev/infiniband/uverbs0\""),
        ] {
            let Err(e) = RdmaOptions::from_config(&c, TcpOptions::default()) else { panic!("{c:?} accepted") };
            assert!(matches!(e, RdmaError::Options(_)), "{e}");
            assert!(e.to_string().contains(want), "{e} does not name {want:?}");
        }
    }
}
