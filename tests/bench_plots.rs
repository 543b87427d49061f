//! The `--plot` pictures of `bench serve` and `bench compute` are SVG a browser
//! renders: drawn from fixed data, each file parses as XML and carries the
//! series, axis titles and figures it should; the roofline fractions drawn are
//! the bench's own bytes over its own bandwidth.

use handoff::bench::compute::{batched_floor_bytes, compute_chart};
use handoff::bench::plot::{ComputeChart, RooflineOp, ServeChart, ServePoint, draw_compute, draw_serve};
use handoff::model::Dims;
use handoff::model::bench::{BatchFigure, ComputeFigures};
use handoff_components::Topology;
use handoff_components::config::DeviceConfig;
use std::path::PathBuf;

fn temp_svg(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("handoff-plot-{}-{name}.svg", std::process::id()))
}

/// The file parsed as XML (a parse error fails the test), its root element,
/// and the text of every `<text>` element in document order.
fn svg_texts(path: &PathBuf) -> Vec<String> {
    let body = std::fs::read_to_string(path).expect("read svg");
    let doc = roxmltree::Document::parse(&body).unwrap_or_else(|e| panic!("{} is not XML: {e}", path.display()));
    assert_eq!(doc.root_element().tag_name().name(), "svg", "root element");
    doc.descendants().filter(|n| n.has_tag_name("text")).map(|n| n.descendants().filter(|t| t.is_text()).filter_map(|t| t.text()).collect::<String>()).collect()
}

fn has(texts: &[String], want: &str) -> bool {
    texts.iter().any(|t| t.trim() == want)
}

fn serve_fixture() -> ServeChart {
    let p = |c, tok_s, ttft_p50, ttft_p99, itl_p50, itl_p99| ServePoint { concurrency: c, tok_s, ttft_p50, ttft_p99, itl_p50, itl_p99 };
    ServeChart {
        // Markup characters in a label must come out escaped, or the file is not XML.
        title: "serve <fixture> & co".into(),
        subtitle: "config/small.toml, 2 host cores".into(),
        points: vec![
            p(1, 941.0, 4.1, 9.0, 1.0, 2.2),
            p(8, 2814.0, 12.0, 40.0, 2.6, 8.0),
            p(32, 2938.0, 90.0, 300.0, 9.8, 30.0),
            p(88, 2923.0, 600.0, 1500.0, 10.0, 33.0),
        ],
    }
}

#[test]
fn serve_plot_is_xml_with_every_series_and_axis() {
    let path = temp_svg("serve");
    draw_serve(&serve_fixture(), &path).expect("draw serve");
    let texts = svg_texts(&path);
    std::fs::remove_file(&path).ok();
    for want in ["serve <fixture> & co", "config/small.toml, 2 host cores", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"] {
        assert!(has(&texts, want), "no text {want:?} in {texts:?}");
    }
    for want in ["generated tokens/s (successful requests)", "TTFT (ms, log scale)", "ITL (ms, log scale)"] {
        assert!(has(&texts, want), "no axis title {want:?} in {texts:?}");
    }
    // One x axis title per panel, and each level as a tick label of each panel.
    assert_eq!(texts.iter().filter(|t| t.trim() == "concurrency (clients in flight)").count(), 3, "{texts:?}");
    for level in ["C1", "C8", "C32", "C88"] {
        assert_eq!(texts.iter().filter(|t| t.trim() == level).count(), 3, "tick {level} in {texts:?}");
    }
}

#[test]
fn serve_plot_refuses_an_empty_sweep() {
    let chart = ServeChart { points: Vec::new(), ..serve_fixture() };
    let path = temp_svg("serve-empty");
    let e = draw_serve(&chart, &path).expect_err("an empty sweep has nothing to draw");
    assert!(e.to_string().contains("no concurrency levels"), "{e}");
}

#[test]
fn compute_plot_draws_each_op_against_the_roofline() {
    let chart = ComputeChart {
        title: "compute fixture".into(),
        subtitle: "cpu".into(),
        roofline: "roofline: host memcpy 10.00 GB/s".into(),
        ops: vec![
            RooflineOp { op: "fused step B=88".into(), floor_us: 638.0, runs: vec![("handoff".into(), 3190.0), ("same step, graphs off".into(), 6380.0)] },
            RooflineOp { op: "KDA decode kernel".into(), floor_us: 50.0, runs: vec![("handoff".into(), 100.0)] },
        ],
    };
    let path = temp_svg("compute");
    draw_compute(&chart, &path).expect("draw compute");
    let texts = svg_texts(&path);
    std::fs::remove_file(&path).ok();
    for want in [
        "compute fixture",
        "fused step B=88",
        "KDA decode kernel",
        "handoff",
        "same step, graphs off",
        "roofline: host memcpy 10.00 GB/s",
        "op (as `bench compute` prints it)",
        "achieved fraction of roofline (floor time / measured time, %)",
        // The bars' own labels: 638 / 3190, 638 / 6380, 50 / 100, with the times.
        "20% (3190 us)",
        "10% (6380 us)",
        "50% (100 us)",
    ] {
        assert!(has(&texts, want), "no text {want:?} in {texts:?}");
    }
}

#[test]
fn compute_plot_refuses_no_ops() {
    let chart = ComputeChart { title: "t".into(), subtitle: "s".into(), roofline: "r".into(), ops: Vec::new() };
    assert!(draw_compute(&chart, &temp_svg("compute-empty")).is_err());
}

#[test]
fn compute_chart_quotes_the_benchs_bytes_over_its_bandwidth() {
    let topo = Topology::parse(include_str!("../config/small.toml")).expect("small.toml");
    let dims = Dims::from_topology(&topo);
    // small.toml: KKKM x 8 = 6 KDA layers of 4 heads x 16 x 16 f32 state, read
    // and written; 2 MLA layers of 32 + 8 f32 columns a row, 128 rows read.
    let per_request = 2 * 6 * 4 * 16 * 16 * 4 + 2 * 128 * 40 * 4;
    assert_eq!(batched_floor_bytes(&dims, 0, 128), dims.weight_bytes() as u64);
    assert_eq!(batched_floor_bytes(&dims, 3, 128) - batched_floor_bytes(&dims, 2, 128), per_request);

    let f = ComputeFigures {
        threads: 2,
        batch_prompt_tokens: 128,
        batched: vec![BatchFigure { batch: 8, step_us: 1000.0, tokens_per_s: 8000.0 }],
        memcpy_bytes_per_s: 10e9,
        kda_step_us: 20.0,
        kda_step_bytes: 100_000,
        mla_step_us: 40.0,
        mla_step_bytes: 100_000,
        ..ComputeFigures::default()
    };
    let chart = compute_chart(&f, &topo, &DeviceConfig::default(), "config/small.toml");
    let names: Vec<&str> = chart.ops.iter().map(|o| o.op.as_str()).collect();
    assert_eq!(names, ["decode step B=8", "KDA decode kernel", "MLA decode kernel"]);
    // 100 kB at 10 GB/s is 10 us: half the KDA kernel's 20 us, a quarter of MLA's 40.
    let frac = |i: usize| chart.ops[i].fraction(chart.ops[i].runs[0].1);
    assert!((frac(1) - 0.5).abs() < 1e-9 && (frac(2) - 0.25).abs() < 1e-9, "{chart}");
    let step_floor_us = batched_floor_bytes(&dims, 8, 128) as f64 / 10e9 * 1e6;
    assert!((chart.ops[0].floor_us - step_floor_us).abs() < 1e-9, "{chart}");
    assert!(chart.roofline.contains("host memcpy 10.00 GB/s"), "{}", chart.roofline);
    let table = chart.to_string();
    assert!(table.contains("KDA decode kernel") && table.contains("50.0% of roofline"), "{table}");
}
