//! The report's SVG plots (plotters): a line per policy over the swept parameter,
//! distributions where there are enough runs; a figure that could not be measured
//! is said, not drawn.

use super::*;

impl Report {
    /// Draws the plots; returns each figure's title and file, or why there is none.
    pub(super) fn plots(&self, dir: &Path) -> Result<Vec<Figure>> {
        let mut out = Vec::new();
        let points = self.points();
        let axes = &self.scenario.sweep;
        let metric = self.metric();
        let (mname, mfile, mval): (&str, &str, fn(&RunResult) -> f64) = match metric {
            Metric::Time => ("wall time (s)", "time", |r| r.wall_s),
            Metric::Goodput => ("goodput (queries/s)", "goodput", |r| r.goodput_qps),
        };
        type Plot = (&'static str, &'static str, fn(&RunResult) -> f64, bool);
        let metrics: [Plot; 3] = [
            (mname, mfile, mval, false),
            (
                "MB from the nodes",
                "bytes",
                |r| r.bytes_from_nodes as f64 / 1e6,
                true,
            ),
            ("p99 latency (ms)", "p99", |r| r.p99_ms, false),
        ];
        for (ydesc, file, f, log_y) in metrics {
            let name = format!("{file}.svg");
            let mut series = Vec::new();
            let (xdesc, log_x, ticks) = if axes.is_empty() {
                // One point: policies along x.
                let pts = self
                    .at(&vec![])
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (i as f64, f(r)))
                    .collect();
                series.push(("all policies".to_string(), pts));
                let names: Vec<String> = self
                    .scenario
                    .policies
                    .iter()
                    .map(|p| p.to_string())
                    .collect();
                ("policy".to_string(), false, Some(names))
            } else {
                let a0 = &axes[0];
                let seconds: Vec<Option<(String, f64)>> = match axes.get(1) {
                    Some(a1) => a1
                        .values
                        .iter()
                        .map(|v| Some((a1.parameter.clone(), *v)))
                        .collect(),
                    None => vec![None],
                };
                for p in &self.scenario.policies {
                    for sv in &seconds {
                        let pts: Vec<(f64, f64)> = self
                            .runs
                            .iter()
                            .filter(|r| r.policy == *p)
                            .filter(|r| match sv {
                                Some((n, v)) => r.point.iter().any(|(pn, pv)| pn == n && pv == v),
                                None => true,
                            })
                            .filter_map(|r| {
                                let x = r.point.iter().find(|(n, _)| *n == a0.parameter)?.1;
                                Some((x, f(r)))
                            })
                            .collect();
                        let name = match sv {
                            Some((n, v)) => {
                                format!("{p}, {}={v}", n.rsplit('.').next().unwrap_or(n))
                            }
                            None => p.to_string(),
                        };
                        series.push((name, pts));
                    }
                }
                let log_x = a0.values.iter().all(|v| *v > 0.0)
                    && a0.values.iter().cloned().fold(0.0, f64::max)
                        / a0.values.iter().cloned().fold(f64::INFINITY, f64::min)
                        >= 20.0;
                (a0.parameter.clone(), log_x, None)
            };
            let title = format!("{} — {ydesc}", self.scenario.name);
            line_chart(
                &dir.join(&name),
                &title,
                &xdesc,
                ydesc,
                &series,
                log_x,
                log_y,
                ticks.as_deref(),
                axes.get(1).map_or(1, |a| a.values.len()),
            )?;
            out.push(Figure::drawn(ydesc, name));
        }
        for (i, pt) in points.iter().enumerate() {
            let suffix = if points.len() == 1 {
                String::new()
            } else {
                format!("-{i}")
            };
            let runs = self.at(pt);
            let lat: Vec<(String, Vec<(f64, f64)>)> = runs
                .iter()
                .map(|r| {
                    let mut v: Vec<f64> = r
                        .done
                        .iter()
                        .filter(|d| d.ok)
                        .map(|d| d.latency_ms)
                        .collect();
                    v.sort_by(f64::total_cmp);
                    let n = v.len().max(1) as f64;
                    let pts = v
                        .iter()
                        .enumerate()
                        .map(|(k, l)| (*l, (k + 1) as f64 / n))
                        .collect();
                    (r.policy.to_string(), pts)
                })
                .collect();
            let name = format!("latency{suffix}.svg");
            let title = format!("Latency CDF, {}", label(pt));
            if lat.iter().all(|(_, pts)| pts.len() < MIN_DISTRIBUTION) {
                let each: Vec<String> = lat
                    .iter()
                    .map(|(p, pts)| {
                        let ms: Vec<String> =
                            pts.iter().map(|(l, _)| format!("{l:.1} ms")).collect();
                        format!(
                            "{p}: {}",
                            if ms.is_empty() {
                                "none".into()
                            } else {
                                ms.join(", ")
                            }
                        )
                    })
                    .collect();
                out.push(Figure::missing(
                    title,
                    format!(
                        "fewer than {MIN_DISTRIBUTION} completed queries per policy, too few for a distribution ({})",
                        each.join("; ")
                    ),
                ));
            } else {
                line_chart(
                    &dir.join(&name),
                    &format!("Latency distribution ({})", label(pt)),
                    "latency (ms)",
                    "fraction completed within",
                    &lat,
                    false,
                    false,
                    None,
                    1,
                )?;
                out.push(Figure::drawn(title, name));
            }
            let cpu: Vec<(String, Vec<(f64, f64)>)> = runs
                .iter()
                .map(|r| {
                    (
                        r.policy.to_string(),
                        r.cpu
                            .iter()
                            .map(|s| (s.t_s, mean(&s.busy) * 100.0))
                            .collect(),
                    )
                })
                .collect();
            let name = format!("cpu{suffix}.svg");
            let title = format!("Storage CPU over time, {}", label(pt));
            if cpu.iter().all(|(_, pts)| pts.is_empty()) {
                out.push(Figure::missing(
                    title,
                    "no CPU sample was taken: every run ended within the 100 ms sampling interval",
                ));
            } else {
                line_chart(
                    &dir.join(&name),
                    &format!("Storage CPU use ({})", label(pt)),
                    "seconds into the run",
                    "CPU workers busy (%)",
                    &cpu,
                    false,
                    false,
                    None,
                    1,
                )?;
                out.push(Figure::drawn(title, name));
            }
        }
        Ok(out)
    }
}

/// Fewest points a latency CDF is drawn from.
const MIN_DISTRIBUTION: usize = 2;

/// One figure of a report: drawn into `file`, or not drawn for the reason `missing`.
#[derive(Debug)]
pub(super) struct Figure {
    pub(super) title: String,
    pub(super) file: Option<String>,
    pub(super) missing: String,
}

impl Figure {
    fn drawn(title: impl Into<String>, file: String) -> Self {
        Figure {
            title: title.into(),
            file: Some(file),
            missing: String::new(),
        }
    }

    fn missing(title: impl Into<String>, why: impl Into<String>) -> Self {
        Figure {
            title: title.into(),
            file: None,
            missing: why.into(),
        }
    }
}

/// A tick label: `v` to six significant digits, without float noise
/// (`0.060000000000000005` is `0.06`).
pub fn tick(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return if v.is_finite() {
            "0".into()
        } else {
            format!("{v}")
        };
    }
    let digits = 6 - 1 - v.abs().log10().floor() as i32;
    let scale = 10f64.powi(digits.clamp(-300, 300));
    let r = (v * scale).round() / scale;
    let text = format!("{r}");
    if text.len() > 12 {
        format!("{r:.3e}")
    } else {
        text
    }
}

/// An SVG line chart of `series` (name, points). `ticks` labels integer x values
/// (categories). Series come in groups of `shades`: one hue per group (policy),
/// lighter within it (second swept parameter). Empty series are skipped.
#[allow(clippy::too_many_arguments)]
pub fn line_chart(
    path: &Path,
    title: &str,
    xdesc: &str,
    ydesc: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_x: bool,
    log_y: bool,
    ticks: Option<&[String]>,
    shades: usize,
) -> Result<()> {
    draw(
        path,
        title,
        xdesc,
        ydesc,
        series,
        log_x,
        log_y,
        ticks,
        shades.max(1),
    )
    .map_err(|e| Error::report(format!("drawing {}", path.display()), e.to_string()))
}

#[allow(clippy::too_many_arguments)]
fn draw(
    path: &Path,
    title: &str,
    xdesc: &str,
    ydesc: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_x: bool,
    log_y: bool,
    ticks: Option<&[String]>,
    shades: usize,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    const HUES: [RGBColor; 6] = [
        RGBColor(214, 39, 40),
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(255, 127, 14),
        RGBColor(23, 190, 207),
    ];
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.1.iter().copied()).collect();
    let fold = |f: fn(&(f64, f64)) -> f64, lo: bool| {
        all.iter().map(f).fold(
            if lo { f64::INFINITY } else { f64::NEG_INFINITY },
            |a, b| {
                if lo { a.min(b) } else { a.max(b) }
            },
        )
    };
    let (mut x0, mut x1) = (fold(|p| p.0, true), fold(|p| p.0, false));
    let (mut y0, mut y1) = (fold(|p| p.1, true), fold(|p| p.1, false));
    if !x0.is_finite() {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if ticks.is_some() {
        x0 -= 0.5;
        x1 += 0.5;
    }
    let (x0, x1) = if log_x {
        (x0.max(1e-9) / 1.3, x1 * 1.3)
    } else {
        (x0, x1)
    };
    let (y0, y1) = if log_y {
        (y0.max(1e-6) / 2.0, y1.max(1e-6) * 2.0)
    } else {
        (y0.min(0.0), if y1 > 0.0 { y1 * 1.1 } else { 1.0 })
    };
    let root = SVGBackend::new(path, (760, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64);
    macro_rules! finish {
        ($chart:expr) => {{
            let mut chart = $chart;
            let mut mesh = chart.configure_mesh();
            mesh.x_desc(xdesc).y_desc(ydesc);
            let fmt = |x: &f64| match ticks {
                Some(t) if x.fract() == 0.0 && *x >= 0.0 => {
                    t.get(*x as usize).cloned().unwrap_or_default()
                }
                Some(_) => String::new(),
                None => tick(*x),
            };
            let yfmt = |y: &f64| tick(*y);
            mesh.x_label_formatter(&fmt);
            mesh.y_label_formatter(&yfmt);
            mesh.draw()?;
            for (i, (name, pts)) in series.iter().enumerate() {
                if pts.is_empty() {
                    continue;
                }
                let RGBColor(r, g, b) = HUES[(i / shades) % HUES.len()];
                // Lighter for later values of the second parameter.
                let t = (i % shades) as f64 / (shades as f64 + 0.5);
                let mix = |c: u8| (c as f64 + (255.0 - c as f64) * t * 0.8) as u8;
                let color = RGBColor(mix(r), mix(g), mix(b)).to_rgba();
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
                    .label(name.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
                if pts.len() < 64 {
                    chart.draw_series(
                        pts.iter()
                            .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
                    )?;
                }
            }
            chart
                .configure_series_labels()
                .border_style(BLACK)
                .background_style(WHITE.mix(0.8))
                .draw()?;
        }};
    }
    match (log_x, log_y) {
        (false, false) => finish!(builder.build_cartesian_2d(x0..x1, y0..y1)?),
        (true, false) => finish!(builder.build_cartesian_2d((x0..x1).log_scale(), y0..y1)?),
        (false, true) => finish!(builder.build_cartesian_2d(x0..x1, (y0..y1).log_scale())?),
        (true, true) => {
            finish!(builder.build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())?)
        }
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_carry_no_float_noise() {
        assert_eq!(tick(0.060000000000000005), "0.06");
        assert_eq!(tick(0.09999999999), "0.1");
        assert_eq!(tick(1500.0), "1500");
        assert_eq!(tick(0.0), "0");
        assert_eq!(tick(-2.5), "-2.5");
    }
}
