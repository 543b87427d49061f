use handoff::verify::verify;
use handoff_components::Topology;

#[test]
fn shipped_configs_verify() {
    for f in ["config/small.toml", "config/pp3-tp2-to-tp4dcp2.toml"] {
        let topo = Topology::load(f).unwrap();
        for tokens in [1, 17, 64, 100] {
            let r = verify(&topo, tokens, 2, |_| {});
            assert!(r.is_ok(), "{f} tokens {tokens}: {}", r.unwrap_err());
        }
    }
}
