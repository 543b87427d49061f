//! Where each role listens and what it tells the cluster.
//!
//! A role has a control listener (the proxy's: where the roles register; a
//! stage's or decode's: where the proxy and the previous stage connect) and, on
//! the tcp transport, a transport listener (where the stages write into decode's
//! regions). Each has a **bind** address (where the socket listens) and an
//! **advertise** address (what the others are told: the registered control
//! address, the endpoint in the region handles). They differ behind NAT, in
//! containers, or when a role binds every interface (`0.0.0.0`).
//!
//! Each address comes from the command line (`--bind`, `--advertise`,
//! `--transport-bind`, `--transport-advertise`), else the topology's
//! `[cluster]` table ([`ClusterConfig`]), else loopback: nothing listens beyond
//! loopback unless asked. A listener beyond loopback is refused at startup
//! without a cluster secret ([`require_secret`]): other hosts could reach it, and
//! the secret is what they must prove.
//!
//! An address is `HOST:PORT` or `HOST` (an IP address or a host name, resolved
//! once at startup). A bind without a port takes any free port (the proxy's
//! control listener: 8001); an advertise without a port takes the bound port.

use handoff_components::Topology;
use handoff_components::cluster::ClusterConfig;
use handoff_components::config::TransportKind;
use handoff_components::failure::ProcessRole;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};

/// The proxy's control port when nothing names one.
pub const PROXY_CONTROL_PORT: u16 = 8001;

/// Which listener of a role: its control listener, or its transport's, named
/// by what that transport listens for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenerKind {
    Control,
    Transport(TransportKind),
}

impl fmt::Display for ListenerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenerKind::Control => f.write_str("control listener"),
            // The tcp transport's listener takes the bytes themselves; ucx's
            // takes only the write-done notices (the bytes go by UCX's own
            // lanes); rdma's the queue-pair and key exchange.
            ListenerKind::Transport(TransportKind::Tcp) => f.write_str("tcp transport"),
            ListenerKind::Transport(TransportKind::Ucx) => f.write_str("ucx notice listener"),
            ListenerKind::Transport(TransportKind::Rdma) => f.write_str("rdma bootstrap listener"),
            ListenerKind::Transport(other) => write!(f, "{} transport", other.name()),
        }
    }
}

/// Why a role's addresses cannot be used. Each names the role, the listener, the
/// value and where it came from (a flag or a `[cluster]` field).
#[derive(Debug, thiserror::Error)]
pub enum AddrError {
    #[error("{role} {which}: {from} {value:?} is not an address: expected HOST:PORT or HOST (an IP address or a host name)")]
    Syntax { role: ProcessRole, which: ListenerKind, from: String, value: String },
    #[error("{role} {which}: {from} {value:?} does not resolve: {reason}")]
    Resolve { role: ProcessRole, which: ListenerKind, from: String, value: String, reason: String },
    #[error(
        "{role} {which}: binds {bind} ({from}), every interface, and nothing says which address the other roles reach it at: give {flag} (or the [cluster] field) the address of this host"
    )]
    NoAdvertise { role: ProcessRole, which: ListenerKind, from: String, bind: SocketAddr, flag: &'static str },
    #[error("{role} {which}: {from} {advertise} is not an address another host can connect to (it is unspecified)")]
    Unspecified { role: ProcessRole, which: ListenerKind, from: String, advertise: SocketAddr },
    #[error(
        "{role}: {from} {value:?} names a transport address, but transport.kind = {kind:?} does not listen on one (only \"tcp\", \"ucx\" and \"rdma\", for its bootstrap, do)"
    )]
    NotTcp { role: ProcessRole, from: String, value: String, kind: &'static str },
    #[error(
        "{role} {which}: binds {bind} ({from}), beyond loopback, and no cluster secret was given: every host that can reach it must prove one. Set {file_env} to a file of mode 0600 holding 64 hex digits (or {env} to the digits), the same on every host, or bind 127.0.0.1"
    )]
    NoSecret { role: ProcessRole, which: ListenerKind, from: String, bind: SocketAddr, file_env: &'static str, env: &'static str },
}

/// The command line's address flags of one role (`None`: the topology's, else loopback).
#[derive(Debug, Clone, Default)]
pub struct AddrFlags {
    pub bind: Option<String>,
    /// How the bind was spelled, when not `--bind` (the proxy's
    /// `--control-host`/`--control-port`).
    pub bind_label: Option<&'static str>,
    pub advertise: Option<String>,
    pub transport_bind: Option<String>,
    pub transport_advertise: Option<String>,
}

/// One listener's addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenAddr {
    /// Where it listens (port 0: any free port).
    pub bind: SocketAddr,
    /// Where `bind` came from: `--bind`, `[cluster.decode] bind`, `the default`.
    pub bind_from: String,
    /// What the others are told; `None`: the bound address; port 0: the bound port.
    pub advertise: Option<SocketAddr>,
}

impl ListenAddr {
    /// The address the others are told, once the socket is bound at `bound`.
    pub fn advertised(&self, bound: SocketAddr) -> SocketAddr {
        match self.advertise {
            None => bound,
            Some(a) if a.port() == 0 => SocketAddr::new(a.ip(), bound.port()),
            Some(a) => a,
        }
    }

    /// Whether hosts other than this one may reach it (anything but 127/8 and ::1).
    pub fn beyond_loopback(&self) -> bool {
        !self.bind.ip().is_loopback()
    }

    /// `bind -> advertise`, as `handoff check` prints it, before anything is bound.
    pub fn describe(&self) -> String {
        let port = |p: u16| if p == 0 { "(any free port)".to_string() } else { p.to_string() };
        let bind = format!("{}:{}", host_text(self.bind.ip()), port(self.bind.port()));
        let adv = match self.advertise {
            None if self.bind.port() == 0 => format!("{}:(the bound port)", host_text(self.bind.ip())),
            None => self.bind.to_string(),
            Some(a) if a.port() == 0 && self.bind.port() == 0 => format!("{}:(the bound port)", host_text(a.ip())),
            Some(a) if a.port() == 0 => SocketAddr::new(a.ip(), self.bind.port()).to_string(),
            Some(a) => a.to_string(),
        };
        let scope = if self.beyond_loopback() { "beyond loopback" } else { "loopback" };
        format!("bind {bind} ({scope}, from {}), advertise {adv}", self.bind_from)
    }
}

fn host_text(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v) => v.to_string(),
        IpAddr::V6(v) => format!("[{v}]"),
    }
}

/// A role's listeners.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoleListeners {
    pub role: ProcessRole,
    pub control: ListenAddr,
    /// The transport's listener (tcp: the bytes; ucx: the notices; rdma: the
    /// bootstrap); `None` on shm (and for the proxy).
    pub transport: Option<ListenAddr>,
    /// The transport whose listener `transport` is.
    pub transport_kind: TransportKind,
}

impl RoleListeners {
    /// Every listener of the role that binds beyond loopback.
    pub fn beyond_loopback(&self) -> impl Iterator<Item = (ListenerKind, &ListenAddr)> {
        std::iter::once((ListenerKind::Control, &self.control))
            .chain(self.transport.iter().map(|t| (ListenerKind::Transport(self.transport_kind), t)))
            .filter(|(_, l)| l.beyond_loopback())
    }
}

/// Parses `value` as `HOST:PORT` or `HOST` (then `default_port`), resolving a
/// host name to its first address.
fn parse(value: &str, default_port: u16, role: ProcessRole, which: ListenerKind, from: &str) -> Result<SocketAddr, AddrError> {
    let syntax = || AddrError::Syntax { role, which, from: from.to_string(), value: value.to_string() };
    let v = value.trim();
    if v.is_empty() {
        return Err(syntax());
    }
    if let Ok(a) = v.parse::<SocketAddr>() {
        return Ok(a);
    }
    let bare = v.strip_prefix('[').and_then(|s| s.strip_suffix(']')).unwrap_or(v);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, default_port));
    }
    let (host, port) = match v.rsplit_once(':') {
        Some((h, p)) => (h, p.parse::<u16>().map_err(|_| syntax())?),
        None => (v, default_port),
    };
    if host.is_empty() || host.contains(':') || host.contains(char::is_whitespace) {
        return Err(syntax());
    }
    let resolve = |reason: String| AddrError::Resolve { role, which, from: from.to_string(), value: value.to_string(), reason };
    let mut addrs = (host, port).to_socket_addrs().map_err(|e| resolve(e.to_string()))?;
    addrs.next().ok_or_else(|| resolve("no address".to_string()))
}

/// One listener from its flags, its `[cluster]` fields and its default bind.
#[allow(clippy::too_many_arguments)]
fn listener(
    role: ProcessRole,
    which: ListenerKind,
    (flag_bind, bind_flag): (Option<&str>, &'static str),
    (flag_adv, adv_flag): (Option<&str>, &'static str),
    (topo_bind, topo_adv): (Option<&str>, Option<&str>),
    table: &str,
    field: &str,
    default: SocketAddr,
) -> Result<ListenAddr, AddrError> {
    let (bind, bind_from) = match (flag_bind, topo_bind) {
        (Some(v), _) => (parse(v, default.port(), role, which, bind_flag)?, bind_flag.to_string()),
        (None, Some(v)) => {
            let from = format!("{table} {field}bind");
            (parse(v, default.port(), role, which, &from)?, from)
        }
        (None, None) => (default, "the default".to_string()),
    };
    let advertise = match (flag_adv, topo_adv) {
        (Some(v), _) => Some((parse(v, 0, role, which, adv_flag)?, adv_flag.to_string())),
        (None, Some(v)) => {
            let from = format!("{table} {field}advertise");
            Some((parse(v, 0, role, which, &from)?, from))
        }
        (None, None) => None,
    };
    if let Some((a, from)) = &advertise
        && a.ip().is_unspecified()
    {
        return Err(AddrError::Unspecified { role, which, from: from.clone(), advertise: *a });
    }
    if advertise.is_none() && bind.ip().is_unspecified() {
        return Err(AddrError::NoAdvertise { role, which, from: bind_from, bind, flag: adv_flag });
    }
    Ok(ListenAddr { bind, bind_from, advertise: advertise.map(|(a, _)| a) })
}

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// The addresses of `role`: its flags over the topology's `[cluster]` table over
/// loopback. Refuses what cannot be used, naming the value and where it came from.
pub fn resolve(topo: &Topology, role: ProcessRole, flags: &AddrFlags) -> Result<RoleListeners, AddrError> {
    let cluster: &ClusterConfig = &topo.config.cluster;
    if role == ProcessRole::Proxy {
        let p = &cluster.proxy;
        let control = listener(
            role,
            ListenerKind::Control,
            (flags.bind.as_deref(), flags.bind_label.unwrap_or("--bind")),
            (flags.advertise.as_deref(), "--advertise"),
            (p.bind.as_deref(), p.advertise.as_deref()),
            "[cluster.proxy]",
            "",
            SocketAddr::new(LOOPBACK, PROXY_CONTROL_PORT),
        )?;
        return Ok(RoleListeners { role, control, transport: None, transport_kind: topo.config.transport.kind });
    }
    let (t, table) = match role {
        ProcessRole::Prefill { stage: s } => (cluster.stage(s), format!("[[cluster.prefill]] (stage {s})")),
        _ => (cluster.decode.clone(), "[cluster.decode]".to_string()),
    };
    let any = SocketAddr::new(LOOPBACK, 0);
    let control = listener(
        role,
        ListenerKind::Control,
        (flags.bind.as_deref(), "--bind"),
        (flags.advertise.as_deref(), "--advertise"),
        (t.bind.as_deref(), t.advertise.as_deref()),
        &table,
        "",
        any,
    )?;
    let kind = topo.config.transport.kind;
    let transport = if kind.listens() {
        Some(listener(
            role,
            ListenerKind::Transport(kind),
            (flags.transport_bind.as_deref(), "--transport-bind"),
            (flags.transport_advertise.as_deref(), "--transport-advertise"),
            (t.transport_bind.as_deref(), t.transport_advertise.as_deref()),
            &table,
            "transport_",
            any,
        )?)
    } else {
        let named = [
            ("--transport-bind", flags.transport_bind.as_deref()),
            ("--transport-advertise", flags.transport_advertise.as_deref()),
            ("transport_bind", t.transport_bind.as_deref()),
            ("transport_advertise", t.transport_advertise.as_deref()),
        ];
        if let Some((name, Some(v))) = named.into_iter().find(|(_, v)| v.is_some()) {
            let from = if name.starts_with("--") { name.to_string() } else { format!("{table} {name}") };
            return Err(AddrError::NotTcp { role, from, value: v.to_string(), kind: kind.name() });
        }
        None
    };
    Ok(RoleListeners { role, control, transport, transport_kind: kind })
}

/// Refuses a role whose listener binds beyond loopback when no cluster secret
/// was given (`secret_given`): the secret is what other hosts must prove.
pub fn require_secret(addrs: &RoleListeners, secret_given: bool) -> Result<(), AddrError> {
    if secret_given {
        return Ok(());
    }
    match addrs.beyond_loopback().next() {
        Some((which, l)) => Err(AddrError::NoSecret {
            role: addrs.role,
            which,
            from: l.bind_from.clone(),
            bind: l.bind,
            file_env: crate::transport::auth::SECRET_FILE_ENV,
            env: crate::transport::auth::SECRET_ENV,
        }),
        None => Ok(()),
    }
}

/// Where the roles register: `--proxy` when given, else the proxy's advertised
/// control address from the topology (its bind when it names one host), else
/// 127.0.0.1:8001.
pub fn proxy_address(topo: &Topology, flag: Option<&str>) -> Result<SocketAddr, AddrError> {
    if let Some(v) = flag {
        return parse(v, PROXY_CONTROL_PORT, ProcessRole::Proxy, ListenerKind::Control, "--proxy");
    }
    let p = resolve(topo, ProcessRole::Proxy, &AddrFlags::default())?;
    let bind = if p.control.bind.ip().is_unspecified() { SocketAddr::new(LOOPBACK, p.control.bind.port()) } else { p.control.bind };
    Ok(p.control.advertised(bind))
}

/// Every role of the topology, proxy first, then decode, then the stages.
pub fn every_role(topo: &Topology) -> Result<Vec<RoleListeners>, AddrError> {
    let mut roles = vec![resolve(topo, ProcessRole::Proxy, &AddrFlags::default())?, resolve(topo, ProcessRole::Decode, &AddrFlags::default())?];
    for s in 0..topo.prefill().pp {
        roles.push(resolve(topo, ProcessRole::Prefill { stage: s }, &AddrFlags::default())?);
    }
    Ok(roles)
}

/// What `handoff check` prints: every role's listeners, bind and advertise.
pub fn summary(topo: &Topology) -> Result<String, AddrError> {
    let roles = every_role(topo)?;
    let mut s = String::from("addresses (flags override these: --bind, --advertise, --transport-bind, --transport-advertise):\n");
    for r in &roles {
        s += &format!("  {} {}: {}\n", r.role, ListenerKind::Control, r.control.describe());
        if let Some(t) = &r.transport {
            s += &format!("  {} {}: {}\n", r.role, ListenerKind::Transport(r.transport_kind), t.describe());
        }
    }
    if !topo.config.transport.kind.listens() {
        s += &format!("  transport {}: no listener (this host only)\n", topo.config.transport.kind.name());
    }
    s += &format!("  the roles register at {} (their default --proxy)\n", proxy_address(topo, None)?);
    if roles.iter().any(|r| r.beyond_loopback().next().is_some()) {
        s += "  beyond loopback: every role refuses to start without a cluster secret given to it (`handoff up` will not draw one)\n";
    } else {
        s += "  every listener on loopback (`handoff up` picks the proxy's control port unless --control-port)\n";
    }
    Ok(s)
}

#[cfg(test)]
mod tests;
