//! The `--plot FILE.svg` pictures of `bench serve` and `bench compute`.
//!
//! The benches fill plain structs ([`ServeChart`], [`ComputeChart`]) from the
//! figures they print, and the functions here only draw them, so a test can draw
//! fixed data and read the file back. Only plotters' SVG backend is used: no
//! font or image library, and the file is plain XML a browser renders.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;

/// One concurrency level of a serve sweep, as drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct ServePoint {
    pub concurrency: u32,
    /// Generated tokens per second of the successful requests.
    pub tok_s: f64,
    /// Time to first token, ms.
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    /// Inter-token latency, ms.
    pub itl_p50: f64,
    pub itl_p99: f64,
}

/// A whole serve sweep: one point per level, in the order they ran.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeChart {
    pub title: String,
    /// What ran where (config, machine), printed under the title.
    pub subtitle: String,
    pub points: Vec<ServePoint>,
}

/// One op of the compute bench against its roofline: the least time its bytes
/// take at the bandwidth measured in the same run.
#[derive(Debug, Clone, PartialEq)]
pub struct RooflineOp {
    pub op: String,
    pub floor_us: f64,
    /// (series, measured time in us): handoff's own run first, then the peer
    /// measured in the same run where the bench has one.
    pub runs: Vec<(String, f64)>,
}

/// Every op of one compute bench run.
#[derive(Debug, Clone, PartialEq)]
pub struct ComputeChart {
    pub title: String,
    pub subtitle: String,
    /// What the roofline is, for the legend (e.g. "roofline: memcpy 9.8 GB/s").
    pub roofline: String,
    pub ops: Vec<RooflineOp>,
}

impl RooflineOp {
    /// Fraction of the roofline a run reached: floor time over measured time
    /// (the same as achieved bandwidth over the roofline's).
    pub fn fraction(&self, time_us: f64) -> f64 {
        if time_us > 0.0 { self.floor_us / time_us } else { 0.0 }
    }
}

impl std::fmt::Display for ComputeChart {
    /// The table behind the picture, so the printed figures and the drawn ones
    /// come from the same numbers.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "  against the {}:", self.roofline)?;
        for op in &self.ops {
            for (series, us) in &op.runs {
                writeln!(
                    f,
                    "    {:<22} {:<18} {:>10.1} us, floor {:>9.1} us = {:>6.1}% of roofline",
                    op.op,
                    series,
                    us,
                    op.floor_us,
                    100.0 * op.fraction(*us)
                )?;
            }
        }
        Ok(())
    }
}

type PlotResult<T> = Result<T, Box<dyn std::error::Error>>;

const FONT: &str = "sans-serif";
/// Series colours, in legend order; distinct in print and for the common
/// colour-vision deficiencies (the Okabe-Ito set).
const PALETTE: [RGBColor; 6] =
    [RGBColor(0, 114, 178), RGBColor(230, 159, 0), RGBColor(0, 158, 115), RGBColor(204, 121, 167), RGBColor(86, 180, 233), RGBColor(213, 94, 0)];

/// Draws `chart` into the SVG file `path`: tok/s, TTFT and ITL (p50 and p99),
/// each against the concurrency level.
pub fn draw_serve(chart: &ServeChart, path: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(!chart.points.is_empty(), "plot: no concurrency levels to draw");
    serve_svg(chart, path).map_err(|e| anyhow::anyhow!("plot {}: {e}", path.display()))
}

fn serve_svg(chart: &ServeChart, path: &Path) -> PlotResult<()> {
    let root = SVGBackend::new(path, (1500, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let body = header(&root, &chart.title, &chart.subtitle)?;
    let panels = body.split_evenly((1, 3));
    let pts = &chart.points;
    let levels: Vec<u32> = pts.iter().map(|p| p.concurrency).collect();
    let tok: Vec<f64> = pts.iter().map(|p| p.tok_s).collect();
    level_panel(&panels[0], &levels, "throughput", "generated tokens/s (successful requests)", false, &[("tok/s", tok)])?;
    let ttft = [("TTFT p50", pts.iter().map(|p| p.ttft_p50).collect()), ("TTFT p99", pts.iter().map(|p| p.ttft_p99).collect())];
    level_panel(&panels[1], &levels, "time to first token", "TTFT (ms, log scale)", true, &ttft)?;
    let itl = [("ITL p50", pts.iter().map(|p| p.itl_p50).collect()), ("ITL p99", pts.iter().map(|p| p.itl_p99).collect())];
    level_panel(&panels[2], &levels, "inter-token latency", "ITL (ms, log scale)", true, &itl)?;
    root.present()?;
    Ok(())
}

/// The title and subtitle across the top; returns the area below them.
fn header<'a>(root: &DrawingArea<SVGBackend<'a>, Shift>, title: &str, subtitle: &str) -> PlotResult<DrawingArea<SVGBackend<'a>, Shift>> {
    let (top, body) = root.split_vertically(60);
    let w = top.dim_in_pixel().0 as i32;
    top.draw(&Text::new(title.to_string(), (w / 2, 8), centred(22, BLACK, VPos::Top)))?;
    top.draw(&Text::new(subtitle.to_string(), (w / 2, 36), centred(14, RGBColor(80, 80, 80), VPos::Top)))?;
    Ok(body)
}

fn centred(size: u32, colour: RGBColor, v: VPos) -> TextStyle<'static> {
    (FONT, size).into_font().color(&colour).pos(Pos::new(HPos::Center, v))
}

/// The category names under the x axis, one centred under each of x = 0, 1, ...
/// The mesh's own labels sit at "nice" numbers, not at the categories, so they
/// are switched off and these are drawn at the categories' pixels instead.
fn x_ticks<X, Y>(area: &DrawingArea<SVGBackend<'_>, Shift>, c: &ChartContext<'_, SVGBackend<'_>, Cartesian2d<X, Y>>, names: &[String]) -> PlotResult<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let (bx, by) = area.get_base_pixel();
    let y0 = c.y_range().start;
    for (i, name) in names.iter().enumerate() {
        let (px, py) = c.backend_coord(&(i as f64, y0));
        area.draw(&Text::new(name.clone(), (px - bx, py - by + 8), centred(13, BLACK, VPos::Top)))?;
    }
    Ok(())
}

/// One panel of the serve picture: each series against the levels, which sit
/// at even steps (the sweep's levels are 1, 8, 32, 88, not a linear scale).
fn level_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    levels: &[u32],
    caption: &str,
    y_desc: &str,
    log: bool,
    series: &[(&str, Vec<f64>)],
) -> PlotResult<()> {
    let n = levels.len();
    let xs = -0.5f64..n as f64 - 0.5;
    let all: Vec<f64> = series.iter().flat_map(|s| s.1.iter().copied()).filter(|v| v.is_finite() && *v > 0.0).collect();
    let hi = all.iter().copied().fold(0.0f64, f64::max).max(1e-3);
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min).min(hi);
    let names: Vec<String> = levels.iter().map(|c| format!("C{c}")).collect();
    let mut b = ChartBuilder::on(area);
    b.caption(caption, (FONT, 16)).margin(12).x_label_area_size(50).y_label_area_size(70);
    if log {
        // Log scale, so C1's few ms and C88's queueing seconds are both
        // readable; a factor of 1.5 of room past the extremes.
        let mut c = b.build_cartesian_2d(xs, (lo / 1.5..hi * 1.5).log_scale())?;
        // plotters' log axis labels only some decades here; 1-2-5 steps are
        // drawn by hand instead (log_ticks), so every panel reads alike.
        // (y_labels(0) still leaves one key point on a log axis: blank its label.)
        c.configure_mesh()
            .disable_mesh()
            .x_labels(0)
            .y_labels(0)
            .y_label_formatter(&|_| String::new())
            .x_desc("concurrency (clients in flight)")
            .y_desc(y_desc)
            .draw()?;
        log_ticks(area, &mut c, lo / 1.5, hi * 1.5)?;
        lines(&mut c, series)?;
        x_ticks(area, &c, &names)?;
    } else {
        let mut c = b.build_cartesian_2d(xs, 0.0..hi * 1.15)?;
        c.configure_mesh().disable_x_mesh().x_labels(0).x_desc("concurrency (clients in flight)").y_desc(y_desc).y_label_formatter(&|y| short(*y)).draw()?;
        lines(&mut c, series)?;
        x_ticks(area, &c, &names)?;
    }
    Ok(())
}

/// Each series as a line with a marker at each level, and the legend.
fn lines<'a, X, Y>(c: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>, series: &[(&str, Vec<f64>)]) -> PlotResult<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    for (k, (name, ys)) in series.iter().enumerate() {
        let colour = PALETTE[k % PALETTE.len()];
        let pts: Vec<(f64, f64)> = ys.iter().enumerate().filter(|(_, y)| y.is_finite() && **y > 0.0).map(|(i, y)| (i as f64, *y)).collect();
        c.draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
        c.draw_series(pts.iter().map(|p| Circle::new(*p, 4, colour.filled())))?;
    }
    c.configure_series_labels().position(SeriesLabelPosition::UpperLeft).background_style(WHITE.mix(0.85)).border_style(BLACK).label_font((FONT, 13)).draw()?;
    Ok(())
}

/// Faint lines and labels at 1, 2 and 5 times each power of ten in `lo..hi`.
fn log_ticks<X, Y>(area: &DrawingArea<SVGBackend<'_>, Shift>, c: &mut ChartContext<'_, SVGBackend<'_>, Cartesian2d<X, Y>>, lo: f64, hi: f64) -> PlotResult<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let (bx, by) = area.get_base_pixel();
    let xr = c.x_range();
    let mut ticks = Vec::new();
    for d in lo.log10().floor() as i32..=hi.log10().ceil() as i32 {
        for m in [1.0, 2.0, 5.0] {
            let v = m * 10f64.powi(d);
            if (lo..=hi).contains(&v) {
                ticks.push(v);
            }
        }
    }
    for v in ticks {
        c.draw_series(LineSeries::new(vec![(xr.start, v), (xr.end, v)], BLACK.mix(0.12)))?;
        let (px, py) = c.backend_coord(&(xr.start, v));
        let style = (FONT, 12).into_font().color(&BLACK).pos(Pos::new(HPos::Right, VPos::Center));
        area.draw(&Text::new(short(v), (px - bx - 6, py - by), style))?;
    }
    Ok(())
}

/// An axis value without trailing noise: 2,814 -> "2814", 0.39 -> "0.39".
fn short(v: f64) -> String {
    if v == 0.0 || v >= 10.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// A time in us as a bar label reads it: 282 us, 16.3 ms.
fn micros(us: f64) -> String {
    if us >= 10_000.0 { format!("{:.1} ms", us / 1000.0) } else { format!("{us:.0} us") }
}

/// Draws `chart` into the SVG file `path`: one bar per op and series, its
/// height the fraction of the roofline reached, the roofline drawn at 100%.
pub fn draw_compute(chart: &ComputeChart, path: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(chart.ops.iter().any(|o| !o.runs.is_empty()), "plot: no ops to draw");
    compute_svg(chart, path).map_err(|e| anyhow::anyhow!("plot {}: {e}", path.display()))
}

fn compute_svg(chart: &ComputeChart, path: &Path) -> PlotResult<()> {
    let n = chart.ops.len();
    let width = (180 * n as u32).clamp(900, 1800);
    let root = SVGBackend::new(path, (width, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let body = header(&root, &chart.title, &chart.subtitle)?;
    // Series in the order they first appear, one colour each across ops.
    let mut names: Vec<&str> = Vec::new();
    for op in &chart.ops {
        for (s, _) in &op.runs {
            if !names.contains(&s.as_str()) {
                names.push(s);
            }
        }
    }
    let top = chart.ops.iter().flat_map(|o| o.runs.iter().map(|r| o.fraction(r.1))).fold(1.0f64, f64::max) * 1.2;
    let ops = &chart.ops;
    let mut c = ChartBuilder::on(&body).margin(15).x_label_area_size(55).y_label_area_size(80).build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0.0..top)?;
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .x_desc("op (as `bench compute` prints it)")
        .y_desc("achieved fraction of roofline (floor time / measured time, %)")
        .y_label_formatter(&|y| format!("{:.0}%", y * 100.0))
        .draw()?;
    for (k, name) in names.iter().enumerate() {
        let colour = PALETTE[k % PALETTE.len()];
        let mut bars = Vec::new();
        let mut labels = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            // Bars of one op side by side, centred on its tick.
            let here: Vec<&str> = op.runs.iter().map(|r| r.0.as_str()).collect();
            let Some(j) = here.iter().position(|s| s == name) else { continue };
            let w = 0.8 / here.len() as f64;
            let x0 = i as f64 - 0.4 + j as f64 * w;
            let f = op.fraction(op.runs[j].1);
            bars.push(Rectangle::new([(x0 + 0.02, 0.0), (x0 + w - 0.02, f)], colour.filled()));
            // The measured time too, so the bar reads without the table.
            labels.push(Text::new(format!("{:.0}% ({})", f * 100.0, micros(op.runs[j].1)), (x0 + w / 2.0, f), centred(12, BLACK, VPos::Bottom)));
        }
        c.draw_series(bars)?.label(*name).legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], colour.filled()));
        c.draw_series(labels)?;
    }
    let red = RGBColor(200, 0, 0);
    c.draw_series(DashedLineSeries::new(vec![(-0.5, 1.0), (n as f64 - 0.5, 1.0)], 8, 5, red.stroke_width(2)))?
        .label(chart.roofline.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], red.stroke_width(2)));
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 13))
        .draw()?;
    x_ticks(&body, &c, &ops.iter().map(|o| o.op.clone()).collect::<Vec<_>>())?;
    root.present()?;
    Ok(())
}
