//! A cluster across network namespaces: the proxy, decode and each prefill
//! stage in a namespace of its own, joined by veth pairs on a bridge
//! (`tools/netns_cluster.sh net-up`), started with `--bind`/`--advertise`/
//! `--transport-bind`/`--transport-advertise` and a cluster secret. Driven
//! through HTTP from the proxy's namespace, its completions equal the
//! colocated reference over the tcp transport and over the ucx transport
//! (UCX's tcp lanes on the veth); a stage SIGKILLed in its namespace and
//! started again there (the test plays the per-host supervisor, as `up` does
//! on one host) leaves the cluster serving: every answer during the fault is
//! 200 with the reference's tokens or 503 (refused at admission while the
//! stage is down), never a failure or a wrong completion, and requests after
//! it complete equal to the reference. (Before stage 0 checked its link to the
//! next stage for a close, about half the tcp runs lost a request here: its job
//! went into the dead process's socket after the restart, and it failed at its
//! compute timeout.)
//!
//! Needs root (ip netns): skips elsewhere, printing why, but fails under CI
//! (CI=true), which runs as root.

use handoff::model::{Model, run_colocated};
use handoff::roles::wire;
use handoff_components::Topology;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_handoff");
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tools/netns_cluster.sh");
const PP: u32 = 2;

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn addr_of(role: &str) -> String {
    match role {
        "proxy" => "10.77.0.1".into(),
        "decode" => "10.77.0.2".into(),
        s => format!("10.77.0.{}", 10 + s.trim_start_matches('s').parse::<u32>().expect("stage")),
    }
}

/// The namespaces, the roles in them; killed and removed on drop.
struct Cluster {
    name: String,
    config: PathBuf,
    secret: PathBuf,
    children: Vec<(String, Child)>,
}

impl Cluster {
    /// Creates the namespaces with the documented script; `Err` where that is refused.
    fn net_up(name: &str, config: PathBuf, secret: PathBuf) -> Result<Cluster, String> {
        let c = Cluster { name: name.to_string(), config, secret, children: Vec::new() };
        let out = Command::new("bash").args([SCRIPT, "net-up", name, &PP.to_string()]).output().map_err(|e| format!("{SCRIPT}: {e}"))?;
        if !out.status.success() {
            return Err(format!("{SCRIPT} net-up: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(c)
    }

    fn args(&self, role: &str) -> Vec<String> {
        let config = self.config.to_str().expect("utf8").to_string();
        let (p, me) = (addr_of("proxy"), addr_of(role));
        let v: Vec<String> = match role {
            "proxy" => vec!["proxy", "--config", &config, "--host", "127.0.0.1", "--port", "8000", "--bind", &format!("{p}:8001"), "--advertise", &p]
                .into_iter()
                .map(String::from)
                .collect(),
            "decode" => ["decode", "--config", &config, "--proxy", &format!("{p}:8001"), "--bind", &format!("{me}:7100"), "--advertise", &me]
                .into_iter()
                .chain(["--transport-bind", &format!("{me}:7200"), "--transport-advertise", &me])
                .map(String::from)
                .collect(),
            s => {
                let stage = s.trim_start_matches('s').to_string();
                ["prefill", "--config", &config, "--stage", &stage, "--proxy", &format!("{p}:8001"), "--bind", &format!("{me}:7100"), "--advertise", &me]
                    .into_iter()
                    .chain(["--transport-bind", &format!("{me}:0"), "--transport-advertise", &me])
                    .map(String::from)
                    .collect()
            }
        };
        v
    }

    /// Starts `role` in its namespace.
    fn start(&mut self, role: &str) {
        let ns = format!("{}-{role}", self.name);
        let log = std::fs::File::create(std::env::temp_dir().join(format!("{ns}.log"))).expect("log file");
        let child = Command::new("ip")
            .args(["netns", "exec", &ns, BIN])
            .args(self.args(role))
            .env("HANDOFF_CLUSTER_SECRET_FILE", &self.secret)
            .env_remove("HANDOFF_CLUSTER_SECRET")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn role");
        self.children.push((role.to_string(), child));
    }

    /// SIGKILLs `role` (`ip netns exec` execs the role: its pid is the role's).
    fn kill(&mut self, role: &str) {
        let i = self.children.iter().position(|(r, _)| r == role).expect("role started");
        let (_, mut child) = self.children.remove(i);
        child.kill().expect("kill");
        let _ = child.wait();
    }

    fn log(&self, role: &str) -> String {
        std::fs::read_to_string(std::env::temp_dir().join(format!("{}-{role}.log", self.name))).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("bash").args([SCRIPT, "net-down", &self.name, &PP.to_string()]).output();
    }
}

/// Runs `f` on a thread inside network namespace `ns` (setns is per thread).
fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        // SAFETY: setns(2) on a namespace file we hold open; it moves this thread only.
        let rc = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .expect("thread in the namespace")
}

const PUBLIC: &str = "127.0.0.1:8000";

fn complete(prompt: &str, max_tokens: u32) -> (u16, Option<Vec<u8>>, String) {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens}).to_string();
    match wire::http(PUBLIC, "POST", "/v1/completions", Some(&body), Duration::from_secs(60)) {
        Ok(r) => {
            let ids = r.json().and_then(|v| v["choices"][0]["token_ids"].as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as u8).collect()));
            (r.status, ids, r.body)
        }
        Err(e) => (0, None, e.to_string()),
    }
}

fn health() -> (u16, String) {
    match wire::http(PUBLIC, "GET", "/health", None, Duration::from_secs(5)) {
        Ok(r) => (r.status, r.body),
        Err(e) => (0, e.to_string()),
    }
}

fn wait_health(ns: &str, want_ok: bool, within: Duration) -> (u16, String) {
    let deadline = Instant::now() + within;
    loop {
        let got = in_netns(ns, health);
        if (got.0 == 200) == want_ok || Instant::now() >= deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn reference(topo: &Topology, prompt: &str, max_tokens: u32) -> Vec<u8> {
    let model = Model::new(topo).expect("model");
    run_colocated(&model, prompt.as_bytes(), max_tokens - 1).expect("reference").tokens
}

fn write(dir: &Path, name: &str, text: &str, mode: u32) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
    p
}

/// One answer of the load: when, status, token ids, body.
type Answer = (Instant, u16, Option<Vec<u8>>, String);

/// The whole check for one `[transport]` section.
fn cluster_across_namespaces(tag: &str, transport: &str) {
    let _serial = serial();
    let name = format!("hn{tag}{}", std::process::id() % 100_000);
    let dir = std::env::temp_dir().join(format!("{name}-files"));
    std::fs::create_dir_all(&dir).expect("dir");
    let base = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/small.toml")).expect("small.toml");
    let text = format!(
        "{}\n{transport}\n[timeouts]\nadmission_s = 30\ncompute_s = 10\ntransfer_s = 10\n",
        base.replace("[transport]\nkind = \"shm\"\n", "").replace("[serve]", "[serve]\ndrain_s = 1")
    );
    let config = write(&dir, "topology.toml", &text, 0o644);
    let topo = Topology::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let secret = write(&dir, "secret", &"5a".repeat(32), 0o600);

    let mut c = match Cluster::net_up(&name, config, secret) {
        Ok(c) => c,
        Err(reason) => {
            assert!(std::env::var_os("CI").is_none(), "{tag}: network namespaces unavailable under CI: {reason}");
            eprintln!("SKIPPED cluster across namespaces ({tag}, not under CI): {reason}");
            return;
        }
    };
    let proxy_ns = format!("{name}-proxy");
    c.start("proxy");
    c.start("decode");
    for s in 0..PP {
        c.start(&format!("s{s}"));
    }
    let (status, body) = wait_health(&proxy_ns, true, Duration::from_secs(60));
    assert_eq!(status, 200, "{tag}: the cluster never became healthy: {body}\ndecode log:\n{}", c.log("decode"));
    let health: serde_json::Value = serde_json::from_str(&body).expect("health json");
    let addrs: Vec<String> = health["roles"].as_array().expect("roles").iter().filter_map(|r| r["addr"].as_str().map(String::from)).collect();
    for want in ["10.77.0.2:7100", "10.77.0.10:7100", "10.77.0.11:7100"] {
        assert!(addrs.iter().any(|a| a == want), "{tag}: {want} not registered: {addrs:?}");
    }

    // Completions equal the colocated reference.
    let prompts = ["across namespaces", "a veth and a bridge", "hello"];
    for p in prompts {
        let (status, ids, body) = in_netns(&proxy_ns, move || complete(p, 6));
        assert_eq!(status, 200, "{tag}: {p:?}: {body}");
        assert_eq!(ids.expect("token ids"), reference(&topo, p, 6), "{tag}: {p:?} differs from the colocated reference");
    }

    // A stage SIGKILLed in its namespace under a steady load, then started again
    // there after a supervisor's backoff.
    let stop = Arc::new(AtomicBool::new(false));
    let answers: Arc<Mutex<Vec<Answer>>> = Arc::default();
    let load = {
        let (stop, answers, ns) = (stop.clone(), answers.clone(), proxy_ns.clone());
        std::thread::spawn(move || {
            in_netns(&ns, move || {
                while !stop.load(Ordering::Relaxed) {
                    let (s, ids, body) = complete("under the fault", 6);
                    answers.lock().unwrap_or_else(|p| p.into_inner()).push((Instant::now(), s, ids, body));
                    if s == 503 {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            })
        })
    };
    std::thread::sleep(Duration::from_millis(800));
    let killed = Instant::now();
    c.kill("s1");
    let (status, body) = wait_health(&proxy_ns, false, Duration::from_secs(10));
    assert_eq!(status, 503, "{tag}: /health still ok after the stage was killed: {body}");
    assert!(body.contains("prefill stage 1"), "{tag}: /health does not name the killed stage: {body}");
    std::thread::sleep(Duration::from_millis(500));
    c.start("s1");
    let (status, body) = wait_health(&proxy_ns, true, Duration::from_secs(30));
    assert_eq!(status, 200, "{tag}: not healthy after the stage came back: {body}\nstage 1 log:\n{}", c.log("s1"));
    let back = Instant::now();
    // Let the load see the cluster whole again.
    let deadline = back + Duration::from_secs(30);
    while !answers.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|(t, s, _, _)| *t > back && *s == 200) {
        if Instant::now() >= deadline {
            let seen: Vec<(u16, String)> =
                answers.lock().unwrap_or_else(|p| p.into_inner()).iter().filter(|(t, ..)| *t > back).map(|(_, s, _, b)| (*s, b.clone())).take(5).collect();
            panic!("{tag}: nothing served after the stage came back: {seen:?}\nstage 1 log:\n{}\ndecode log:\n{}", c.log("s1"), c.log("decode"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    load.join().expect("load");
    let want = reference(&topo, "under the fault", 6);
    let answers = std::mem::take(&mut *answers.lock().unwrap_or_else(|p| p.into_inner()));
    let (mut ok, mut unavailable) = (0, 0);
    for (_, s, ids, body) in &answers {
        match s {
            200 => {
                assert_eq!(ids.as_ref(), Some(&want), "{tag}: a completion under the fault differs from the reference: {body}");
                ok += 1;
            }
            503 => unavailable += 1,
            _ => panic!("{tag}: a request failed under the fault ({s}): {body}"),
        }
    }
    let after = {
        let p = "after the fault";
        let (status, ids, body) = in_netns(&proxy_ns, move || complete(p, 6));
        assert_eq!(status, 200, "{tag}: {body}");
        assert_eq!(ids.expect("ids"), reference(&topo, p, 6), "{tag}: after the fault, differs from the reference");
        p
    };
    eprintln!(
        "{tag}: {} answers under the fault ({ok} x 200 equal to the reference, {unavailable} x 503), stage 1 back {:.2} s after its kill; {after:?} equal to the reference",
        answers.len(),
        (back - killed).as_secs_f64()
    );
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tcp_cluster_across_network_namespaces_equals_the_reference_and_recovers_from_a_killed_stage() {
    cluster_across_namespaces("tcp", "[transport]\nkind = \"tcp\"\n");
}

/// UCX's tcp lanes on each namespace's veth (hv0).
#[cfg(feature = "ucx")]
#[test]
fn ucx_cluster_across_network_namespaces_equals_the_reference_and_recovers_from_a_killed_stage() {
    cluster_across_namespaces("ucx", "[transport]\nkind = \"ucx\"\n\n[transport.ucx]\ntls = \"tcp\"\nnet_devices = \"hv0\"\n");
}
