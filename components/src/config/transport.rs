//! The `[transport]` table: which transport moves the bytes and the settings of
//! the rdma and ucx transports. Split from config.rs so the file stays a readable
//! size; `config` re-exports every type here.

use super::error::ConfigError;
use serde::{Deserialize, Serialize};

/// Which transport moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// In-process memcpy (rayon).
    #[default]
    Local,
    /// Shared memory between processes on one host.
    Shm,
    /// TCP streams, for hosts without RDMA.
    Tcp,
    /// RDMA WRITE over ibverbs RC queue pairs (the `rdma` cargo feature), with
    /// a tcp bootstrap for the queue pair and key exchange.
    Rdma,
    /// UCX one-sided puts (the `ucx` cargo feature; `[transport.ucx]` picks
    /// UCX's own transports).
    Ucx,
}

impl TransportKind {
    pub const fn name(self) -> &'static str {
        match self {
            TransportKind::Local => "local",
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::Rdma => "rdma",
            TransportKind::Ucx => "ucx",
        }
    }
    /// Whether the transport listens on a socket of its own that other hosts
    /// reach (tcp; ucx for its notices; rdma for its bootstrap), so its roles take a
    /// transport address.
    pub const fn listens(self) -> bool {
        matches!(self, TransportKind::Tcp | TransportKind::Ucx | TransportKind::Rdma)
    }
    /// Whether the transport can take writes from several PP stages for one request.
    pub const fn serves_pp(self) -> bool {
        true
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransportConfig {
    #[serde(default)]
    pub kind: TransportKind,
    /// Most descriptors submitted in one batch.
    #[serde(default = "default_max_batch")]
    pub max_batch: u32,
    /// Staging buffers in the pool for the DCP relayout, and the bytes of each.
    #[serde(default = "default_staging_buffers")]
    pub staging_buffers: u32,
    #[serde(default = "default_staging_bytes")]
    pub staging_bytes: u64,
    /// UCX's settings, for `kind = "ucx"`.
    #[serde(default)]
    pub ucx: UcxConfig,
    /// The verbs device, port and GID, for `kind = "rdma"`.
    #[serde(default)]
    pub rdma: RdmaConfig,
}

/// `[transport.rdma]`: the verbs device, port and GID table entry the rdma
/// transport's queue pairs use. Unset: the first device listed, port 1, GID
/// index 0 (on RoCE the entry of the interface's IPv4 address for RoCE v2 is
/// usually another: `show_gids` or `ibv_devinfo -v` lists them).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RdmaConfig {
    /// The verbs device, as `ibv_devices` names it: `"mlx5_0"`, `"rxe0"`.
    #[serde(default)]
    pub device: Option<String>,
    /// The device's port, 1-based (verbs numbers ports from 1; at most 255).
    #[serde(default)]
    pub port: Option<u32>,
    /// The GID table index (0 to 255).
    #[serde(default)]
    pub gid_index: Option<u32>,
}

impl RdmaConfig {
    /// The port, checked: 1 to 255 (default 1).
    pub fn port(&self) -> Result<u8, ConfigError> {
        match self.port {
            None => Ok(1),
            Some(p) => u8::try_from(p).ok().filter(|&p| p >= 1).ok_or_else(|| ConfigError::Rdma {
                field: "port",
                value: p.to_string(),
                reason: "verbs numbers a device's ports from 1 to at most 255",
            }),
        }
    }

    /// The GID index, checked: 0 to 255 (default 0).
    pub fn gid_index(&self) -> Result<u8, ConfigError> {
        match self.gid_index {
            None => Ok(0),
            Some(g) => u8::try_from(g).map_err(|_| ConfigError::Rdma { field: "gid_index", value: g.to_string(), reason: "a GID table index is 0 to 255" }),
        }
    }

    /// The device name, checked: what `ibv_devices` can list (letters, digits,
    /// `_`, `-`, `.`; 1 to 63 bytes), so a typo such as a path or a blank fails
    /// at startup, naming the field, not as an unknown device later.
    pub fn device(&self) -> Result<Option<&str>, ConfigError> {
        let Some(d) = self.device.as_deref() else { return Ok(None) };
        let ok = !d.is_empty() && d.len() < 64 && d.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if !ok {
            return Err(ConfigError::Rdma {
                field: "device",
                value: format!("{d:?}"),
                reason: "a verbs device name (as ibv_devices lists it: letters, digits, '_', '-', '.'; 1 to 63 bytes)",
            });
        }
        Ok(Some(d))
    }

    /// Every field checked.
    pub fn check(&self) -> Result<(), ConfigError> {
        self.device()?;
        self.port()?;
        self.gid_index()?;
        Ok(())
    }
}

/// `[transport.ucx]`: which of UCX's own transports carry the puts, applied to
/// the UCX context with `ucp_config_modify` (UCX's `TLS` and `NET_DEVICES`
/// settings). Unset, UCX picks (on one host: shared memory).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UcxConfig {
    /// UCX transports, as UCX names them: `"tcp"`, `"sm"`, `"posix,cma"`, `"rc,sm"` ...
    #[serde(default)]
    pub tls: Option<String>,
    /// Network devices UCX may use: `"eth0"`, `"mlx5_0:1"`, `"all"`.
    #[serde(default)]
    pub net_devices: Option<String>,
}

fn default_max_batch() -> u32 {
    1024
}
fn default_staging_buffers() -> u32 {
    8
}
fn default_staging_bytes() -> u64 {
    4 << 20
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            kind: TransportKind::Local,
            max_batch: default_max_batch(),
            staging_buffers: default_staging_buffers(),
            staging_bytes: default_staging_bytes(),
            ucx: UcxConfig::default(),
            rdma: RdmaConfig::default(),
        }
    }
}
