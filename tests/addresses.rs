//! Where the roles listen and what they tell the cluster (`src/roles/addr.rs`):
//! `up --control-port` serves the roles' control listener on that port; a role
//! that binds every interface registers the address it advertises, and the
//! cluster serves through it; a bind beyond loopback without a given cluster
//! secret is refused, naming the address; `handoff check` lists every listener.

use handoff::roles::wire;
use handoff::transport::auth::{ClusterSecret, SECRET_ENV, SECRET_FILE_ENV};
use handoff::transport::{PeerAddr, TcpOptions, TcpTransport, Transport};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_handoff");
const SMALL: &str = include_str!("../config/small.toml");
const T: Duration = Duration::from_secs(5);

/// `config/small.toml` over tcp with decode on every interface, advertising
/// 127.0.0.2 (a loopback address other than the one any default binds) for its
/// control listener and its transport.
fn advertising_topology(name: &str) -> PathBuf {
    let text = format!(
        "{}\n[cluster.decode]\nbind = \"0.0.0.0\"\nadvertise = \"127.0.0.2\"\ntransport_bind = \"0.0.0.0\"\ntransport_advertise = \"127.0.0.2\"\n",
        SMALL.replace("kind = \"shm\"", "kind = \"tcp\"")
    );
    let path = std::env::temp_dir().join(format!("handoff-addresses-{name}-{}.toml", std::process::id()));
    std::fs::write(&path, text).expect("write topology");
    path
}

fn free_port() -> u16 {
    handoff::roles::up::free_port().expect("free port")
}

/// `handoff up`, stopped (SIGTERM, then SIGKILL) when dropped.
struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn up_with_control_port_serves_there_and_decode_registers_its_advertised_address() {
    let path = advertising_topology("up");
    let (port, control) = (free_port(), free_port());
    assert_ne!(port, control);
    let secret = ClusterSecret::generate().expect("secret");
    let child = Command::new(BIN)
        .args(["up", "--config", path.to_str().expect("utf8"), "--port", &port.to_string(), "--control-port", &control.to_string()])
        .env(SECRET_ENV, secret.to_hex())
        .env_remove(SECRET_FILE_ENV)
        .stdin(Stdio::null())
        .spawn()
        .expect("start up");
    let mut up = Up(child);
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(90);
    let health = loop {
        if let Ok(Some(status)) = up.0.try_wait() {
            panic!("up exited early: {status}");
        }
        if let Ok(r) = wire::http(&addr, "GET", "/health", None, T)
            && r.status == 200
        {
            break r.json().expect("health is JSON");
        }
        assert!(Instant::now() < deadline, "the cluster did not become healthy");
        std::thread::sleep(Duration::from_millis(200));
    };
    // The proxy's control listener is on --control-port: it answers a
    // registration there (401 without the secret's proof), and every role
    // registered there (health is 200), since it is the only control listener.
    let control_addr = format!("127.0.0.1:{control}");
    let r = wire::http(&control_addr, "POST", "/internal/register", Some("{}"), T).expect("the control port answers");
    assert_eq!(r.status, 401, "{}", r.body);
    assert!(r.body.contains("invalid_cluster_secret"), "{}", r.body);
    // The public port does not serve the roles' route.
    let r = wire::http(&addr, "POST", "/internal/register", Some("{}"), T).expect("public");
    assert_eq!(r.status, 404, "{}", r.body);
    // Decode binds 0.0.0.0 and advertises 127.0.0.2: the proxy was told 127.0.0.2.
    let roles = health["roles"].as_array().expect("roles");
    let decode = roles.iter().find(|r| r["role"] == "decode").expect("decode listed");
    let told: SocketAddr = decode["addr"].as_str().expect("addr").parse().expect("socket address");
    assert_eq!(told.ip().to_string(), "127.0.0.2", "{health}");
    assert_ne!(told.port(), 0, "{health}");
    let stage = roles.iter().find(|r| r["role"] == "prefill stage 0").expect("stage 0 listed");
    assert!(stage["addr"].as_str().expect("addr").starts_with("127.0.0.1:"), "{health}");
    // And the cluster serves through the advertised addresses: the proxy's
    // link to decode and the stages' tcp writes into decode's regions.
    let body = r#"{"prompt": "The cluster", "max_tokens": 6}"#;
    let r = wire::http(&addr, "POST", "/v1/completions", Some(body), Duration::from_secs(60)).expect("completion");
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json().expect("JSON");
    assert!(v["choices"][0]["text"].is_string(), "{}", r.body);
    drop(up);
    let _ = std::fs::remove_file(path);
}

#[test]
fn up_refuses_a_bind_beyond_loopback_without_a_given_secret_naming_it() {
    let path = advertising_topology("refused");
    let out = Command::new(BIN)
        .args(["up", "--config", path.to_str().expect("utf8"), "--port", &free_port().to_string()])
        .env_remove(SECRET_ENV)
        .env_remove(SECRET_FILE_ENV)
        .stdin(Stdio::null())
        .output()
        .expect("run up");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "up started: {err}");
    for want in ["decode control listener", "0.0.0.0:0", "[cluster.decode] bind", "beyond loopback", SECRET_FILE_ENV] {
        assert!(err.contains(want), "{err:?} does not say {want:?}");
    }
    let _ = std::fs::remove_file(path);
}

#[test]
fn a_role_refuses_a_bind_beyond_loopback_without_a_secret_naming_the_address() {
    let small = concat!(env!("CARGO_MANIFEST_DIR"), "/config/small.toml");
    for role in [
        vec!["decode", "--config", small, "--bind", "0.0.0.0:0", "--advertise", "127.0.0.2"],
        vec!["prefill", "--config", small, "--stage", "1", "--bind", "0.0.0.0:0", "--advertise", "127.0.0.2"],
        vec!["proxy", "--config", small, "--port", "0", "--control-host", "0.0.0.0", "--advertise", "127.0.0.2"],
    ] {
        let out = Command::new(BIN).args(&role).env_remove(SECRET_ENV).env_remove(SECRET_FILE_ENV).stdin(Stdio::null()).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{role:?} started: {err}");
        for want in ["0.0.0.0:", "beyond loopback", "no cluster secret", SECRET_FILE_ENV] {
            assert!(err.contains(want), "{role:?}: {err:?} does not say {want:?}");
        }
    }
}

#[test]
fn up_refuses_a_control_port_of_0_or_the_public_port() {
    let port = free_port();
    for (control, want) in [("0", "--control-port 0"), (&*port.to_string(), "is the public --port too")] {
        let out = Command::new(BIN)
            .args(["up", "--config", concat!(env!("CARGO_MANIFEST_DIR"), "/config/small.toml"), "--port", &port.to_string(), "--control-port", control])
            .stdin(Stdio::null())
            .output()
            .expect("run up");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{err}");
    }
}

#[test]
fn check_lists_what_each_role_binds_and_advertises() {
    let path = advertising_topology("check");
    let out = Command::new(BIN).args(["check", "--config", path.to_str().expect("utf8")]).output().expect("check");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    for want in [
        "proxy control listener: bind 127.0.0.1:8001 (loopback, from the default), advertise 127.0.0.1:8001",
        "decode control listener: bind 0.0.0.0:(any free port) (beyond loopback, from [cluster.decode] bind), advertise 127.0.0.2:(the bound port)",
        "decode tcp transport: bind 0.0.0.0:(any free port) (beyond loopback, from [cluster.decode] transport_bind), advertise 127.0.0.2:(the bound port)",
        "prefill stage 0 control listener: bind 127.0.0.1:(any free port)",
        "prefill stage 1 tcp transport: bind 127.0.0.1:(any free port)",
        "the roles register at 127.0.0.1:8001",
        "refuses to start without a cluster secret",
    ] {
        assert!(text.contains(want), "{text}\ndoes not say {want:?}");
    }
    // A topology whose address is unusable is refused by check, naming it.
    let bad = std::env::temp_dir().join(format!("handoff-addresses-bad-{}.toml", std::process::id()));
    std::fs::write(&bad, format!("{SMALL}\n[cluster.decode]\nbind = \"0.0.0.0:7100\"\n")).expect("write");
    let out = Command::new(BIN).args(["check", "--config", bad.to_str().expect("utf8")]).output().expect("check");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("every interface") && err.contains("0.0.0.0:7100"), "{err}");
    let _ = std::fs::remove_file(path);
    let _ = std::fs::remove_file(bad);
}

/// A tcp transport told to advertise a host without a port writes that host and
/// the port it bound into its endpoint, and a peer reaches it there.
#[test]
fn a_tcp_transport_advertises_its_host_with_the_bound_port() {
    let opts = TcpOptions { bind: "0.0.0.0:0".parse().expect("addr"), advertise: Some("127.0.0.2:0".parse().expect("addr")), ..TcpOptions::default() };
    let t = TcpTransport::bind(opts).expect("bind");
    let a = t.addr();
    assert_eq!(a.ip().to_string(), "127.0.0.2");
    assert_ne!(a.port(), 0);
    assert_eq!(t.endpoint(), PeerAddr::Tcp { addr: a });
    std::net::TcpStream::connect_timeout(&a, T).expect("reachable at the advertised address");
}
