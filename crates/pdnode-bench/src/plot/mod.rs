//! SVG plots of a sweep: TTFT, TPOT (p50 thick, p99 thin) and output throughput against
//! concurrency, one colour per endpoint. Drawn with plotters' SVG backend into a string: labels
//! are SVG text (the viewer's sans-serif), so no fonts or image codecs are built in.

use crate::error::BenchError;
use crate::metrics::Summary;
use crate::sweep::BenchReport;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;

const W: u32 = 1500;
const H: u32 = 560;
const COLORS: [RGBColor; 2] = [RGBColor(31, 119, 180), RGBColor(230, 120, 20)];

fn plot_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Plot {
        reason: e.to_string(),
    }
}

/// Renders the plot and writes it to `path` (SVG).
pub fn write_svg(report: &BenchReport, path: &Path) -> Result<(), BenchError> {
    let bytes = render_svg(report)?;
    std::fs::write(path, bytes).map_err(|e| BenchError::Write {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

struct Panel {
    title: &'static str,
    /// (value, is_p99) series extracted from a summary.
    values: fn(&Summary) -> Vec<(f64, bool)>,
}

const PANELS: [Panel; 3] = [
    Panel {
        title: "TTFT ms (thick p50, thin p99)",
        values: |s| vec![(s.ttft.p50_ms, false), (s.ttft.p99_ms, true)],
    },
    Panel {
        title: "TPOT ms (thick p50, thin p99)",
        values: |s| vec![(s.tpot.p50_ms, false), (s.tpot.p99_ms, true)],
    },
    Panel {
        title: "output tokens/s",
        values: |s| vec![(s.output_token_throughput, false)],
    },
];

/// One line of a panel: an endpoint's p50 (thick) or p99 (thin) against the level index.
struct Series {
    endpoint: usize,
    p99: bool,
    points: Vec<(f64, f64)>,
}

/// Label text of size `px`, anchored at its `h` side and `v` edge.
fn label(px: u32, color: RGBColor, h: HPos, v: VPos) -> TextStyle<'static> {
    ("sans-serif", px)
        .into_font()
        .color(&color)
        .pos(Pos::new(h, v))
}

/// The SVG text of the plot.
pub fn render_svg(report: &BenchReport) -> Result<String, BenchError> {
    let levels: Vec<usize> = report.runs_of(0).map(|r| r.concurrency).collect();
    if levels.is_empty() {
        return Err(plot_err("no runs to plot"));
    }
    let n = levels.len();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let (top, body) = root.split_vertically(50);
        let panels = body.split_evenly((1, 3));
        for (pi, (panel, area)) in PANELS.iter().zip(panels.iter()).enumerate() {
            let mut series: Vec<Series> = Vec::new();
            for ep in 0..report.endpoints.len() {
                let runs: Vec<&Summary> = report.runs_of(ep).map(|r| &r.summary).collect();
                let per_run: Vec<Vec<(f64, bool)>> =
                    runs.iter().map(|s| (panel.values)(s)).collect();
                let k = per_run.first().map_or(0, Vec::len);
                for j in 0..k {
                    let pts: Vec<(f64, f64)> = per_run
                        .iter()
                        .enumerate()
                        .filter(|(_, v)| v[j].0.is_finite())
                        .map(|(i, v)| (i as f64, v[j].0))
                        .collect();
                    let p99 = per_run.first().is_some_and(|v| v[j].1);
                    series.push(Series {
                        endpoint: ep,
                        p99,
                        points: pts,
                    });
                }
            }
            let y_max = series
                .iter()
                .flat_map(|s| s.points.iter().map(|(_, y)| *y))
                .fold(0.0f64, f64::max);
            let y_max = if y_max > 0.0 { y_max * 1.12 } else { 1.0 };
            let x_range = -0.3f64..(n as f64 - 0.7).max(0.3);
            let mut chart = ChartBuilder::on(area)
                .margin(18)
                .margin_top(34)
                .x_label_area_size(34)
                .y_label_area_size(72)
                .build_cartesian_2d(x_range.clone(), 0f64..y_max)
                .map_err(plot_err)?;
            let grey = RGBColor(225, 225, 225);
            for t in 1..=4 {
                let y = y_max * f64::from(t) / 4.0;
                chart
                    .draw_series(LineSeries::new(
                        vec![(x_range.start, y), (x_range.end, y)],
                        grey,
                    ))
                    .map_err(plot_err)?;
            }
            chart
                .draw_series(LineSeries::new(
                    vec![(x_range.start, 0.0), (x_range.end, 0.0)],
                    BLACK,
                ))
                .map_err(plot_err)?;
            chart
                .draw_series(LineSeries::new(
                    vec![(x_range.start, 0.0), (x_range.start, y_max)],
                    BLACK,
                ))
                .map_err(plot_err)?;
            for Series {
                endpoint: ep,
                p99,
                points: pts,
            } in &series
            {
                let color = COLORS[*ep % COLORS.len()];
                let style = ShapeStyle {
                    color: color.to_rgba(),
                    filled: true,
                    stroke_width: if *p99 { 1 } else { 3 },
                };
                chart
                    .draw_series(LineSeries::new(pts.clone(), style))
                    .map_err(plot_err)?;
                chart
                    .draw_series(
                        pts.iter()
                            .map(|p| Circle::new(*p, if *p99 { 2 } else { 4 }, style.filled())),
                    )
                    .map_err(plot_err)?;
            }
            // Labels, positioned through the chart's coordinate mapping.
            let text = |t: &str, at: (i32, i32), style: &TextStyle<'_>| {
                root.draw_text(t, style, at).map_err(plot_err)
            };
            let (ax, ay) = chart.backend_coord(&(x_range.start, y_max));
            text(
                panel.title,
                (ax, ay - 12),
                &label(18, BLACK, HPos::Left, VPos::Bottom),
            )?;
            for t in 0..=4 {
                let y = y_max * f64::from(t) / 4.0;
                let (px, py) = chart.backend_coord(&(x_range.start, y));
                text(
                    &short_number(y),
                    (px - 6, py),
                    &label(15, BLACK, HPos::Right, VPos::Center),
                )?;
            }
            for (i, c) in levels.iter().enumerate() {
                let (px, py) = chart.backend_coord(&(i as f64, 0.0));
                text(
                    &c.to_string(),
                    (px, py + 8),
                    &label(15, BLACK, HPos::Center, VPos::Top),
                )?;
            }
            if pi == 1 {
                let (px, py) = chart.backend_coord(&((x_range.start + x_range.end) / 2.0, 0.0));
                text(
                    "concurrency",
                    (px, py + 26),
                    &label(15, BLACK, HPos::Center, VPos::Top),
                )?;
            }
        }
        // Legend.
        let legend = label(16, BLACK, HPos::Left, VPos::Center);
        let mut x = 20;
        for (i, e) in report.endpoints.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            top.draw(&Rectangle::new([(x, 16), (x + 24, 30)], color.filled()))
                .map_err(plot_err)?;
            let t: String = format!("{} {} {}", e.label, e.base_url, e.model)
                .chars()
                .take(60)
                .collect();
            top.draw_text(&t, &legend, (x + 32, 23)).map_err(plot_err)?;
            let (w, _) = top.estimate_text_size(&t, &legend).map_err(plot_err)?;
            x += 32 + w as i32 + 40;
        }
        top.draw_text(
            &format!("workload {}", report.workload.name()),
            &label(16, RGBColor(90, 90, 90), HPos::Left, VPos::Center),
            (x.max(W as i32 - 360), 23),
        )
        .map_err(plot_err)?;
        root.present().map_err(plot_err)?;
    }
    Ok(svg)
}

fn short_number(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.0}K", v / 1000.0)
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}
