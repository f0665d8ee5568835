//! The macro benchmark's chart (SVG): throughput per router and mode, p50 and p99 one-way
//! latency against the offered load per mode, and the latency distributions with no load
//! and at the highest paced load below saturation.

use plotters::prelude::*;

use crate::results::{Latency, Results};

/// A router's colour, the same in every panel.
fn colour(i: usize) -> RGBColor {
    const C: [RGBColor; 10] = [
        RGBColor(0x55, 0x55, 0x55), // plain
        RGBColor(0xd6, 0x27, 0x28), // nft
        RGBColor(0x1f, 0x77, 0xb4), // kxp
        RGBColor(0xff, 0x7f, 0x0e),
        RGBColor(0x2c, 0xa0, 0x2c),
        RGBColor(0x94, 0x67, 0xbd),
        RGBColor(0x8c, 0x56, 0x4b),
        RGBColor(0x17, 0xbe, 0xcf),
        RGBColor(0xe3, 0x77, 0xc2),
        RGBColor(0xbc, 0xbd, 0x22),
    ];
    C[i % C.len()]
}

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("drawing the chart: {e:?}")
}

/// The "nines" axis of a distribution: 0 at the minimum, 1 at p90, 2 at p99, 3 at p99.9.
fn nines(q: f64) -> f64 {
    (-(1.0 - q).max(1e-4).log10()).min(4.0)
}

fn nines_label(x: f64) -> String {
    match x.round() as i64 {
        0 => "p0".into(),
        1 => "p90".into(),
        2 => "p99".into(),
        3 => "p99.9".into(),
        _ => "max".into(),
    }
}

/// Writes the chart of `r` to `path` (SVG).
///
/// # Errors
/// The file cannot be written.
pub fn render(r: &Results, path: &std::path::Path) -> Result<(), String> {
    let modes = r.modes();
    let rows = 1 + usize::from(!modes.is_empty()) * 2;
    let root = SVGBackend::new(path, (1200, 60 + 380 * rows as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (head, body) = root.split_vertically(60);
    head.draw_text(
        &format!(
            "kxp macro-bench, {} — {} generator, {} CPUs, kernel {}",
            r.date, r.generator, r.machine.cpus, r.machine.kernel
        ),
        &("sans-serif", 20).into_font().color(&BLACK),
        (20, 10),
    )
    .map_err(err)?;
    head.draw_text(
        &format!(
            "{} run(s) × {:.0} s per cell; 64-byte UDP through a ClusterIP; {} probes/s",
            r.runs, r.secs, r.probe_rate
        ),
        &("sans-serif", 14).into_font().color(&BLACK),
        (20, 36),
    )
    .map_err(err)?;
    let panels = body.split_evenly((rows, 2));
    throughput(r, &modes, &panels[0])?;
    let idle: Vec<(usize, &str, &Latency)> = r
        .cases
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.idle.as_ref().map(|l| (i, c.name.as_str(), l)))
        .collect();
    distribution(&panels[1], "latency, no load", &idle)?;
    for (k, m) in modes.iter().take(2).enumerate() {
        versus_load(r, m, &panels[2 + k])?;
        // The highest paced load that saturated no router, else the highest paced one.
        let loads: Vec<String> = r.loads().into_iter().filter(|l| l != "max").collect();
        let pick = loads
            .iter()
            .rev()
            .find(|l| {
                r.cases
                    .iter()
                    .filter_map(|c| c.at(m, l))
                    .all(|p| !p.saturated)
            })
            .or(loads.last())
            .cloned();
        if let Some(l) = pick {
            let at: Vec<(usize, &str, &Latency)> = r
                .cases
                .iter()
                .enumerate()
                .filter_map(|(i, c)| c.at(m, &l).map(|p| (i, c.name.as_str(), &p.latency)))
                .collect();
            let target = r
                .cases
                .iter()
                .find_map(|c| c.at(m, &l).and_then(|p| p.target_pps));
            let title = format!(
                "latency under {m} load {l}{}",
                target.map_or(String::new(), |t| format!(" ({:.3} Mpps)", t / 1e6))
            );
            distribution(&panels[4 + k], &title, &at)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// Grouped bars: per mode, one bar per router (median), with the runs' min–max.
fn throughput(r: &Results, modes: &[String], area: &Area<'_>) -> Result<(), String> {
    let n = r.cases.len().max(1) as f64;
    let mut ymax: f64 = 0.1;
    for c in &r.cases {
        for m in &c.modes {
            for run in &m.runs {
                ymax = ymax.max(run.pps / 1e6);
            }
        }
    }
    let groups = modes.len().max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(
            "throughput (Mpps at the backend; median, min–max)",
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(45)
        .build_cartesian_2d(0f64..groups, 0f64..ymax * 1.15)
        .map_err(err)?;
    let mode_names = modes.to_vec();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(modes.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 0.01 {
                mode_names.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("Mpps")
        .draw()
        .map_err(err)?;
    let width = 0.8 / n;
    for (i, c) in r.cases.iter().enumerate() {
        let col = colour(i);
        let mut bars = Vec::new();
        let mut whiskers = Vec::new();
        for (g, m) in modes.iter().enumerate() {
            let Some(mr) = c.modes.iter().find(|x| &x.mode == m) else {
                continue;
            };
            let Some(med) = mr.median_pps else { continue };
            let x0 = g as f64 + 0.1 + width * i as f64;
            bars.push(Rectangle::new(
                [(x0, 0.0), (x0 + width * 0.9, med / 1e6)],
                col.filled(),
            ));
            let lo = mr.runs.iter().map(|x| x.pps).fold(f64::MAX, f64::min) / 1e6;
            let hi = mr.runs.iter().map(|x| x.pps).fold(0.0, f64::max) / 1e6;
            let xm = x0 + width * 0.45;
            whiskers.push(PathElement::new(
                vec![(xm, lo), (xm, hi)],
                BLACK.stroke_width(1),
            ));
        }
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(c.name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], col.filled()));
        chart.draw_series(whiskers).map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// p50 (dashed) and p99 (solid) against the load each router delivered, in one mode.
fn versus_load(r: &Results, mode: &str, area: &Area<'_>) -> Result<(), String> {
    let mut xmax: f64 = 0.1;
    let (mut ylo, mut yhi): (f64, f64) = (f64::MAX, 1.0);
    for p in r
        .cases
        .iter()
        .flat_map(|c| c.loaded.iter())
        .filter(|p| p.mode == mode)
    {
        xmax = xmax.max(p.delivered_pps / 1e6);
        ylo = ylo.min(p.latency.p50_us.max(1.0));
        yhi = yhi.max(p.latency.p99_us);
    }
    if ylo > yhi {
        ylo = 1.0;
    }
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("{mode}: one-way latency vs load (p99 solid, p50 dashed; ○ saturated)"),
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(55)
        .build_cartesian_2d(
            0f64..xmax * 1.1,
            ((ylo * 0.7).max(1.0)..yhi * 1.5).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("delivered Mpps")
        .y_desc("µs")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(err)?;
    for (i, c) in r.cases.iter().enumerate() {
        let col = colour(i);
        let mut pts: Vec<_> = c.loaded.iter().filter(|p| p.mode == mode).collect();
        if pts.is_empty() {
            continue;
        }
        pts.sort_by(|a, b| a.delivered_pps.total_cmp(&b.delivered_pps));
        let p99: Vec<(f64, f64)> = pts
            .iter()
            .map(|p| (p.delivered_pps / 1e6, p.latency.p99_us.max(1.0)))
            .collect();
        let p50: Vec<(f64, f64)> = pts
            .iter()
            .map(|p| (p.delivered_pps / 1e6, p.latency.p50_us.max(1.0)))
            .collect();
        chart
            .draw_series(LineSeries::new(p99.clone(), col.stroke_width(2)))
            .map_err(err)?
            .label(c.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], col.stroke_width(2)));
        chart
            .draw_series(DashedLineSeries::new(
                p50.clone(),
                4,
                3,
                col.stroke_width(1),
            ))
            .map_err(err)?;
        chart
            .draw_series(pts.iter().zip(&p99).map(|(p, &xy)| {
                if p.saturated {
                    Circle::new(xy, 5, col.stroke_width(2))
                } else {
                    Circle::new(xy, 3, col.filled())
                }
            }))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// Quantile curves (x: p0, p90, p99, p99.9, max on a "nines" scale; y: µs, log).
fn distribution(
    area: &Area<'_>,
    title: &str,
    ls: &[(usize, &str, &Latency)],
) -> Result<(), String> {
    let (mut ylo, mut yhi): (f64, f64) = (f64::MAX, 1.0);
    for (_, _, l) in ls {
        for &(_, us) in &l.quantiles {
            ylo = ylo.min(us.max(1.0));
            yhi = yhi.max(us);
        }
    }
    if ylo > yhi {
        ylo = 1.0;
    }
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(55)
        .build_cartesian_2d(0f64..4.0, ((ylo * 0.7).max(1.0)..yhi * 1.5).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_labels(5)
        .x_label_formatter(&|x| nines_label(*x))
        .y_desc("µs")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(err)?;
    for &(i, name, l) in ls {
        let col = colour(i);
        let pts: Vec<(f64, f64)> = l
            .quantiles
            .iter()
            .map(|&(q, us)| (nines(q), us.max(1.0)))
            .collect();
        chart
            .draw_series(LineSeries::new(pts, col.stroke_width(2)))
            .map_err(err)?
            .label(format!("{name} ({:.1}% lost)", l.loss_pct))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], col.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nines_axis_puts_p90_p99_and_p999_on_whole_numbers() {
        assert!((nines(0.9) - 1.0).abs() < 1e-9);
        assert!((nines(0.99) - 2.0).abs() < 1e-9);
        assert!((nines(0.999) - 3.0).abs() < 1e-9);
        assert_eq!(nines(1.0), 4.0);
        assert_eq!(nines(0.0), 0.0);
        assert_eq!(nines_label(2.0), "p99");
    }
}
