//! The official `openai` Python client (PyPI `openai`) against a running cluster:
//! models, completions and chat (stream and not), stop strings, n, seeded sampling
//! equal to the colocated run, and the error cases. What each request must return
//! comes from the colocated single-rank reference, computed here.
//!
//! Under CI (`CI=true`) a missing python3 or `openai` package fails the test; on a
//! developer's machine without them it says so and passes.

use handoff::model::{Model, run_colocated};
use handoff::roles::openai::chat_prompt;
use handoff::roles::sampling::{self, Sampling};
use handoff::roles::up::{Deployment, free_port};
use handoff_components::Topology;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_handoff");
const SMALL: &str = include_str!("../config/small.toml");

fn python_with_openai() -> bool {
    Command::new("python3").args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success())
}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn the_official_openai_client_gets_what_the_colocated_reference_says() {
    if !python_with_openai() {
        let msg = "python3 with the `openai` package is needed (pip install openai)";
        assert!(std::env::var("CI").map_or(true, |v| v != "true"), "{msg}");
        eprintln!("skipped: {msg}");
        return;
    }
    let base = SMALL.split("[serve]").next().expect("small.toml");
    let text = format!("{base}[serve]\nmax_context = 256\nmax_requests = 8\nqueue = 32\n");
    let path = std::env::temp_dir().join(format!("handoff-openai-{}.toml", std::process::id()));
    std::fs::write(&path, &text).expect("write config");
    let topo = Topology::load(path.to_str().expect("path")).expect("topology");
    let model = Model::new(&topo).expect("model");
    let port = free_port().expect("port");
    let mut c = Deployment::start(Some(&path), "127.0.0.1", port, Some(PathBuf::from(BIN))).expect("start cluster");
    c.wait_healthy(Duration::from_secs(60), false).expect("healthy");

    let greedy = |prompt: &[u8], n: u32| run_colocated(&model, prompt, n - 1).expect("reference").tokens;
    let g_prompt = "The client speaks OpenAI.";
    let g = greedy(g_prompt.as_bytes(), 8);
    // A stop string: the first ASCII byte the greedy run produces after its second token.
    let (s_prompt, s_tokens, cut) = ["stop here", "another prompt", "and a third one", "x"]
        .iter()
        .find_map(|p| {
            let t = greedy(p.as_bytes(), 24);
            let i = (2..t.len()).find(|&i| t[i].is_ascii() && t[i] != 0)?;
            Some((*p, t.clone(), i))
        })
        .expect("an ASCII token in some greedy run");
    let stop = (s_tokens[cut] as char).to_string();
    let cut = s_tokens.iter().position(|&b| b == s_tokens[cut]).expect("stop byte");
    let sampled = |prompt: &[u8], k: u32, s: Sampling| sampling::colocated(&model, prompt, k, &s).expect("sampled reference");
    let (n_prompt, seed, temperature, top_p) = ("seeded sampling, three choices", 1234u64, 0.9f32, 0.95f32);
    let choices: Vec<Vec<u8>> = (0..3).map(|i| sampled(n_prompt.as_bytes(), 10, Sampling { temperature, top_p, seed, choice: i })).collect();
    let messages = vec![("system".to_string(), "Be brief.".to_string()), ("user".to_string(), "hi".to_string())];
    let chat = chat_prompt(&messages);
    let chat_tokens = greedy(&chat, 6);
    let chat_sampled = sampled(&chat, 6, Sampling { temperature: 1.0, top_p: 1.0, seed: 5, choice: 0 });
    let spec = serde_json::json!({
        "base_url": format!("http://{}/v1", c.addr),
        "model": topo.model().name,
        "body_limit": (1 << 20) + 16 * topo.config.serve.max_context as usize,
        "greedy": {"prompt": g_prompt, "max_tokens": 8, "tokens": g, "text": lossy(&g)},
        "stop": {"prompt": s_prompt, "max_tokens": 24, "stop": stop, "text": lossy(&s_tokens[..cut])},
        "sampled": {"prompt": n_prompt, "max_tokens": 10, "seed": seed, "temperature": temperature, "top_p": top_p, "choices": choices},
        "chat": {"messages": messages.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c})).collect::<Vec<_>>(),
                 "max_tokens": 6, "prompt_tokens": chat.len(), "text": lossy(&chat_tokens)},
        "chat_sampled": {"temperature": 1.0, "seed": 5, "text": lossy(&chat_sampled)},
    });
    let spec_path = std::env::temp_dir().join(format!("handoff-openai-spec-{}.json", std::process::id()));
    std::fs::write(&spec_path, spec.to_string()).expect("write spec");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = Command::new("python3").arg(script).arg(&spec_path).output().expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the openai client failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("every check passed"), "{stdout}");
    c.shutdown();
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&spec_path);
}
