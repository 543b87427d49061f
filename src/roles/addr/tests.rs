use super::*;

const SMALL: &str = include_str!("../../../config/small.toml");

/// `config/small.toml` over tcp, with `cluster` appended (a `[cluster...]` table).
fn tcp_topology(cluster: &str) -> Topology {
    Topology::parse(&format!("{}\n{cluster}", SMALL.replace("kind = \"shm\"", "kind = \"tcp\""))).expect("topology")
}

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

#[test]
fn without_flags_or_cluster_table_every_listener_is_loopback() {
    let topo = tcp_topology("");
    let roles = every_role(&topo).expect("addresses");
    assert_eq!(roles.len(), 2 + topo.prefill().pp as usize);
    for r in &roles {
        assert!(r.control.bind.ip().is_loopback(), "{:?}", r);
        assert_eq!(r.control.advertise, None, "{:?}", r);
        assert!(r.beyond_loopback().next().is_none(), "{:?}", r);
    }
    assert_eq!(roles[0].control.bind, addr("127.0.0.1:8001"));
    assert_eq!(roles[1].control.bind, addr("127.0.0.1:0"));
    assert_eq!(roles[1].transport.as_ref().map(|t| t.bind), Some(addr("127.0.0.1:0")));
    assert_eq!(proxy_address(&topo, None).expect("proxy"), addr("127.0.0.1:8001"));
    // Loopback needs no secret.
    for r in &roles {
        require_secret(r, false).expect("loopback without a secret is allowed");
    }
}

#[test]
fn advertise_not_bind_is_what_peers_are_told() {
    let topo = tcp_topology(
        "[cluster.decode]\nbind = \"0.0.0.0:7100\"\nadvertise = \"10.0.0.2\"\ntransport_bind = \"0.0.0.0\"\ntransport_advertise = \"10.0.0.2:7300\"\n",
    );
    let d = resolve(&topo, ProcessRole::Decode, &AddrFlags::default()).expect("decode");
    assert_eq!(d.control.bind, addr("0.0.0.0:7100"));
    assert_eq!(d.control.bind_from, "[cluster.decode] bind");
    // No port in the advertise: the port the socket was bound at.
    assert_eq!(d.control.advertised(addr("0.0.0.0:7100")), addr("10.0.0.2:7100"));
    let t = d.transport.expect("tcp transport");
    assert_eq!(t.bind, addr("0.0.0.0:0"));
    // A port in the advertise wins over the bound one (a NAT's forwarded port).
    assert_eq!(t.advertised(addr("0.0.0.0:45678")), addr("10.0.0.2:7300"));
    // Without an advertise, the bound address itself.
    let s = resolve(&topo, ProcessRole::Prefill { stage: 1 }, &AddrFlags::default()).expect("stage 1");
    assert_eq!(s.control.advertised(addr("127.0.0.1:40001")), addr("127.0.0.1:40001"));
}

#[test]
fn flags_override_the_cluster_table() {
    let topo = tcp_topology("[[cluster.prefill]]\nbind = \"127.0.0.1:7100\"\n[[cluster.prefill]]\nbind = \"127.0.0.1:7101\"\nadvertise = \"127.0.0.9\"\n");
    let s0 = resolve(&topo, ProcessRole::Prefill { stage: 0 }, &AddrFlags::default()).expect("stage 0");
    assert_eq!(s0.control.bind, addr("127.0.0.1:7100"));
    let s1 = resolve(&topo, ProcessRole::Prefill { stage: 1 }, &AddrFlags::default()).expect("stage 1");
    assert_eq!(s1.control.advertised(addr("127.0.0.1:7101")), addr("127.0.0.9:7101"));
    let flags = AddrFlags { bind: Some("127.0.0.2:7200".into()), advertise: Some("127.0.0.3:7201".into()), ..Default::default() };
    let s1 = resolve(&topo, ProcessRole::Prefill { stage: 1 }, &flags).expect("stage 1 with flags");
    assert_eq!(s1.control.bind, addr("127.0.0.2:7200"));
    assert_eq!(s1.control.bind_from, "--bind");
    assert_eq!(s1.control.advertised(addr("127.0.0.2:7200")), addr("127.0.0.3:7201"));
    // The proxy: --bind over [cluster.proxy]; a host alone keeps port 8001.
    let topo = tcp_topology("[cluster.proxy]\nbind = \"127.0.0.1:9001\"\nadvertise = \"127.0.0.7\"\n");
    let p = resolve(&topo, ProcessRole::Proxy, &AddrFlags { bind: Some("127.0.0.4".into()), ..Default::default() }).expect("proxy");
    assert_eq!(p.control.bind, addr("127.0.0.4:8001"));
    // The roles register at the proxy's advertised address, with its bound port.
    assert_eq!(proxy_address(&topo, None).expect("proxy address"), addr("127.0.0.7:9001"));
    assert_eq!(proxy_address(&topo, Some("127.0.0.1:5555")).expect("--proxy"), addr("127.0.0.1:5555"));
}

#[test]
fn a_bind_beyond_loopback_without_a_secret_is_refused_naming_the_address() {
    let topo = tcp_topology("");
    let flags = AddrFlags { bind: Some("0.0.0.0:7100".into()), advertise: Some("10.1.2.3".into()), ..Default::default() };
    let d = resolve(&topo, ProcessRole::Decode, &flags).expect("decode");
    let e = require_secret(&d, false).expect_err("0.0.0.0 without a secret").to_string();
    for want in ["decode", "control listener", "--bind", "0.0.0.0:7100", "beyond loopback", "HANDOFF_CLUSTER_SECRET_FILE"] {
        assert!(e.contains(want), "{e:?} does not say {want:?}");
    }
    require_secret(&d, true).expect("allowed with a secret");
    // The transport alone beyond loopback is refused too, naming it.
    let flags = AddrFlags { transport_bind: Some("10.1.2.3:0".into()), ..Default::default() };
    let s = resolve(&topo, ProcessRole::Prefill { stage: 0 }, &flags).expect("stage 0");
    let e = require_secret(&s, false).expect_err("transport beyond loopback").to_string();
    for want in ["prefill stage 0", "tcp transport", "--transport-bind", "10.1.2.3:0"] {
        assert!(e.contains(want), "{e:?} does not say {want:?}");
    }
}

#[test]
fn unusable_addresses_are_refused_naming_the_value() {
    let topo = tcp_topology("");
    let cases: Vec<(AddrFlags, &[&str])> = vec![
        (AddrFlags { bind: Some("0.0.0.0:7100".into()), ..Default::default() }, &["every interface", "--advertise", "0.0.0.0:7100"]),
        (AddrFlags { bind: Some("127.0.0.1:port".into()), ..Default::default() }, &["--bind", "\"127.0.0.1:port\"", "not an address"]),
        (AddrFlags { bind: Some(String::new()), ..Default::default() }, &["--bind", "not an address"]),
        (AddrFlags { advertise: Some("0.0.0.0".into()), ..Default::default() }, &["--advertise", "0.0.0.0", "unspecified"]),
        (AddrFlags { transport_bind: Some("0.0.0.0:7200".into()), ..Default::default() }, &["tcp transport", "--transport-advertise", "0.0.0.0:7200"]),
        (AddrFlags { bind: Some("no-such-host.invalid:7100".into()), ..Default::default() }, &["does not resolve", "no-such-host.invalid"]),
    ];
    for (flags, wants) in cases {
        let e = resolve(&topo, ProcessRole::Decode, &flags).expect_err(&format!("{flags:?}")).to_string();
        for want in wants {
            assert!(e.contains(want), "{flags:?}: {e:?} does not say {want:?}");
        }
    }
    // A transport address on shm, from a flag or from the table.
    let shm = Topology::parse(SMALL).expect("small");
    let e = resolve(&shm, ProcessRole::Decode, &AddrFlags { transport_bind: Some("127.0.0.1:0".into()), ..Default::default() }).expect_err("shm").to_string();
    assert!(e.contains("--transport-bind") && e.contains("\"shm\""), "{e}");
    let shm = Topology::parse(&format!("{SMALL}\n[cluster.decode]\ntransport_advertise = \"10.0.0.2\"\n")).expect("small");
    let e = resolve(&shm, ProcessRole::Decode, &AddrFlags::default()).expect_err("shm").to_string();
    assert!(e.contains("[cluster.decode] transport_advertise"), "{e}");
}

#[test]
fn host_names_and_ipv6_resolve() {
    let topo = tcp_topology("");
    let d = resolve(&topo, ProcessRole::Decode, &AddrFlags { bind: Some("localhost:7100".into()), ..Default::default() }).expect("localhost");
    assert!(d.control.bind.ip().is_loopback() && d.control.bind.port() == 7100, "{:?}", d.control.bind);
    let d = resolve(&topo, ProcessRole::Decode, &AddrFlags { bind: Some("[::1]:7100".into()), advertise: Some("[::1]".into()), ..Default::default() })
        .expect("::1");
    assert_eq!(d.control.bind, addr("[::1]:7100"));
    assert_eq!(d.control.advertised(d.control.bind), addr("[::1]:7100"));
}

#[test]
fn a_cluster_table_must_list_every_stage_or_none() {
    let e = Topology::parse(&format!("{SMALL}\n[[cluster.prefill]]\nbind = \"127.0.0.1:7100\"\n")).expect_err("one of two stages").to_string();
    assert!(e.contains("lists 1 prefill stages but prefill pp is 2"), "{e}");
    let e = Topology::parse(&format!("{SMALL}\n[cluster.decode]\nport = 7\n")).expect_err("unknown field").to_string();
    assert!(e.contains("port"), "{e}");
}

#[test]
fn the_summary_lists_every_listener() {
    let topo = tcp_topology("[cluster.decode]\nbind = \"0.0.0.0:7100\"\nadvertise = \"10.0.0.2\"\n");
    let s = summary(&topo).expect("summary");
    for want in [
        "proxy control listener: bind 127.0.0.1:8001",
        "decode control listener: bind 0.0.0.0:7100 (beyond loopback, from [cluster.decode] bind), advertise 10.0.0.2:7100",
        "decode tcp transport: bind 127.0.0.1:(any free port)",
        "prefill stage 1 control listener",
        "prefill stage 1 tcp transport",
        "the roles register at 127.0.0.1:8001",
        "refuses to start without a cluster secret",
    ] {
        assert!(s.contains(want), "{s}\ndoes not say {want:?}");
    }
}

/// `handoff check` names each transport's listener for what it is: the tcp
/// transport's takes the bytes, ucx's only the write-done notices, rdma's the
/// bootstrap; none of the latter two is called "tcp transport".
#[test]
fn the_summary_names_the_transport_listener_by_its_transport() {
    for (kind, label) in [("tcp", "tcp transport"), ("ucx", "ucx notice listener"), ("rdma", "rdma bootstrap listener")] {
        let topo = Topology::parse(&SMALL.replace("kind = \"shm\"", &format!("kind = \"{kind}\""))).expect("topology");
        let s = summary(&topo).expect("summary");
        for role in ["decode", "prefill stage 0", "prefill stage 1"] {
            let want = format!("{role} {label}: bind 127.0.0.1:(any free port)");
            assert!(s.contains(&want), "{kind}: {s}\ndoes not say {want:?}");
        }
        if kind != "tcp" {
            assert!(!s.contains("tcp transport"), "{kind}: {s}");
        }
        // Errors name it the same way.
        let flags = AddrFlags { transport_bind: Some("0.0.0.0:7200".into()), ..Default::default() };
        let e = resolve(&topo, ProcessRole::Decode, &flags).expect_err("no advertise").to_string();
        assert!(e.contains(&format!("decode {label}: binds 0.0.0.0:7200")), "{kind}: {e}");
    }
}
