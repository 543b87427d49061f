//! The `[cluster]` table of a topology file: where each role listens and what
//! address it tells the rest of the cluster, for a deployment whose roles run on
//! different hosts.
//!
//! ```toml
//! [cluster.proxy]            # the proxy's control listener (the roles register there)
//! bind = "0.0.0.0:8001"
//! advertise = "10.0.0.1:8001"
//!
//! [cluster.decode]
//! bind = "0.0.0.0:7100"              # its control listener
//! advertise = "10.0.0.2"             # no port: the bound one
//! transport_bind = "0.0.0.0:7200"    # its tcp transport
//! transport_advertise = "10.0.0.2"
//!
//! [[cluster.prefill]]                # stage 0, then stage 1, ...
//! bind = "0.0.0.0:7100"
//! advertise = "10.0.0.3"
//! ```
//!
//! Every field is optional and is a string as written (`HOST:PORT` or `HOST`, an
//! IP address or a host name): the roles resolve and check them at startup
//! (`src/roles/addr.rs`), and the command line's `--bind`, `--advertise`,
//! `--transport-bind` and `--transport-advertise` override them. Absent, every
//! listener stays on loopback.

use serde::{Deserialize, Serialize};

/// The `[cluster]` table. Empty (the default): every role on this host, on
/// loopback.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// The proxy's control listener; its `advertise` is where the roles
    /// register (their default `--proxy`).
    #[serde(default)]
    pub proxy: ProxyAddrs,
    #[serde(default)]
    pub decode: RoleAddrs,
    /// One entry per prefill PP stage, in stage order (none, or exactly `pp`).
    #[serde(default)]
    pub prefill: Vec<RoleAddrs>,
}

/// The proxy's control listener: where it binds and where the roles reach it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyAddrs {
    pub bind: Option<String>,
    pub advertise: Option<String>,
}

/// A prefill stage's or decode's addresses: its control listener and its
/// transport's (tcp only).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleAddrs {
    /// Where the control listener listens (`HOST:PORT`; port 0 or no port: any free one).
    pub bind: Option<String>,
    /// The control address the proxy and the other roles are told (`HOST:PORT`;
    /// no port: the bound one).
    pub advertise: Option<String>,
    /// Where the tcp transport listens.
    pub transport_bind: Option<String>,
    /// The transport address written into this role's region handles.
    pub transport_advertise: Option<String>,
}

impl ClusterConfig {
    /// Whether the table names anything at all.
    pub fn is_empty(&self) -> bool {
        *self == ClusterConfig::default()
    }

    /// The addresses of prefill stage `stage` (empty when the table lists none).
    pub fn stage(&self, stage: u32) -> RoleAddrs {
        self.prefill.get(stage as usize).cloned().unwrap_or_default()
    }
}
