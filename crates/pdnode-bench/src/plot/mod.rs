//! PNG plots of a sweep: TTFT, TPOT (p50 thick, p99 thin) and output throughput against
//! concurrency, one colour per endpoint. Drawn with plotters' bitmap backend into a buffer;
//! labels use a built-in pixel font, so no system fonts are needed.

mod font;
mod png;

use crate::error::BenchError;
use crate::metrics::Summary;
use crate::sweep::BenchReport;
use plotters::prelude::*;
use std::path::Path;

const W: u32 = 1500;
const H: u32 = 560;
const COLORS: [RGBColor; 2] = [RGBColor(31, 119, 180), RGBColor(230, 120, 20)];

fn plot_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Plot {
        reason: e.to_string(),
    }
}

/// Renders the plot and writes it to `path`.
pub fn write_png(report: &BenchReport, path: &Path) -> Result<(), BenchError> {
    let bytes = render_png(report)?;
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

struct Label {
    text: String,
    x: i32,
    y: i32,
    scale: i32,
    color: RGBColor,
}

/// The PNG bytes of the plot.
pub fn render_png(report: &BenchReport) -> Result<Vec<u8>, BenchError> {
    let levels: Vec<usize> = report.runs_of(0).map(|r| r.concurrency).collect();
    if levels.is_empty() {
        return Err(plot_err("no runs to plot"));
    }
    let n = levels.len();
    let mut buf = vec![255u8; (W * H * 3) as usize];
    let mut labels = Vec::new();
    {
        let root = BitMapBackend::with_buffer(&mut buf, (W, H)).into_drawing_area();
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
            let (ax, ay) = chart.backend_coord(&(x_range.start, y_max));
            labels.push(Label {
                text: panel.title.to_string(),
                x: ax,
                y: ay - 26,
                scale: 2,
                color: BLACK,
            });
            for t in 0..=4 {
                let y = y_max * f64::from(t) / 4.0;
                let (px, py) = chart.backend_coord(&(x_range.start, y));
                let text = short_number(y);
                labels.push(Label {
                    x: px - 6 - font::text_width(&text, 2),
                    y: py - 7,
                    text,
                    scale: 2,
                    color: BLACK,
                });
            }
            for (i, c) in levels.iter().enumerate() {
                let (px, py) = chart.backend_coord(&(i as f64, 0.0));
                let text = c.to_string();
                labels.push(Label {
                    x: px - font::text_width(&text, 2) / 2,
                    y: py + 8,
                    text,
                    scale: 2,
                    color: BLACK,
                });
            }
            if pi == 1 {
                let (px, py) = chart.backend_coord(&((x_range.start + x_range.end) / 2.0, 0.0));
                let text = "concurrency".to_string();
                labels.push(Label {
                    x: px - font::text_width(&text, 2) / 2,
                    y: py + 26,
                    text,
                    scale: 2,
                    color: BLACK,
                });
            }
        }
        // Legend.
        let mut x = 20;
        for (i, e) in report.endpoints.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            top.draw(&Rectangle::new([(x, 16), (x + 24, 30)], color.filled()))
                .map_err(plot_err)?;
            let text: String = format!("{} {} {}", e.label, e.base_url, e.model)
                .chars()
                .take(60)
                .collect();
            labels.push(Label {
                x: x + 32,
                y: 16,
                scale: 2,
                color: BLACK,
                text: text.clone(),
            });
            x += 32 + font::text_width(&text, 2) + 40;
        }
        labels.push(Label {
            text: format!("workload {}", report.workload.name()),
            x: x.max(W as i32 - 360),
            y: 16,
            scale: 2,
            color: RGBColor(90, 90, 90),
        });
        for l in &labels {
            let mut result = Ok(());
            font::draw_text(&l.text, l.x, l.y, l.scale, |px, py| {
                if px >= 0 && py >= 0 && (px as u32) < W && (py as u32) < H && result.is_ok() {
                    result = root.draw_pixel((px, py), &l.color);
                }
            });
            result.map_err(plot_err)?;
        }
        root.present().map_err(plot_err)?;
    }
    png::encode_rgb(W, H, &buf).ok_or_else(|| plot_err("bad image buffer"))
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
