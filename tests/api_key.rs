//! `--api-key` (HANDOFF_API_KEY): the proxy's /v1 routes require
//! `Authorization: Bearer KEY`; without it, or with another key, 401 with an
//! OpenAI-style JSON body. Health and metrics stay open.

use handoff::roles::up::{Deployment, free_port};
use handoff::roles::wire;
use std::path::PathBuf;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_handoff");

#[test]
fn a_request_without_the_api_key_gets_401_json_and_one_with_it_is_served() {
    let port = free_port().expect("port");
    let envs = vec![("HANDOFF_API_KEY".to_string(), "sekrit-key".to_string())];
    let mut c = Deployment::start_with(None, "127.0.0.1", port, Some(PathBuf::from(BIN)), envs).expect("start");
    c.wait_healthy(Duration::from_secs(60), false).expect("health is not behind the key");
    let body = r#"{"prompt": "hello", "max_tokens": 3}"#;
    let t = Duration::from_secs(60);
    for (what, headers) in [
        ("no Authorization", vec![]),
        ("another key", vec![("Authorization", "Bearer sekrit-kez")]),
        ("a prefix of the key", vec![("Authorization", "Bearer sekrit")]),
        ("not a bearer", vec![("Authorization", "Basic sekrit-key")]),
    ] {
        for (method, path, b) in [("POST", "/v1/completions", Some(body)), ("GET", "/v1/models", None)] {
            let r = wire::http_with(&c.addr, method, path, b, &headers, t).expect("http");
            assert_eq!(r.status, 401, "{what} {path}: {}", r.body);
            let v = r.json().unwrap_or_else(|| panic!("{what}: not JSON: {}", r.body));
            assert_eq!(v["error"]["code"], "invalid_api_key", "{}", r.body);
            assert_eq!(v["error"]["type"], "invalid_request_error", "{}", r.body);
        }
    }
    let ok = [("Authorization", "Bearer sekrit-key")];
    let r = wire::http_with(&c.addr, "POST", "/v1/completions", Some(body), &ok, t).expect("http");
    assert_eq!(r.status, 200, "{}", r.body);
    let r = wire::http_with(&c.addr, "GET", "/v1/models", None, &ok, t).expect("http");
    assert_eq!(r.status, 200, "{}", r.body);
    let m = wire::http(&c.addr, "GET", "/metrics", None, t).expect("metrics");
    assert_eq!(m.status, 200);
    assert!(m.body.contains("handoff_refusals_total{reason=\"invalid_api_key\"} 8"), "{}", m.body);
    c.shutdown();
}
