//! Plots with plotters, in the layout of the Tree Attention paper's Figure 3: latency and the
//! ring/tree ratio against context length (one line per strategy and rank count), and against
//! the rank count (one line per strategy and context length).
//!
//! Text needs a TrueType font, loaded at run time (`CANOPY_FONT`, or DejaVu/Liberation Sans
//! where distributions install them), so the binary carries no font and needs no fontconfig.

use crate::scaling::{ring_over_tree, ScalingOutput};
use anyhow::{anyhow, bail, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

const FONT_CANDIDATES: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Registers a sans-serif font with plotters (once per process).
fn load_font() -> Result<()> {
    static LOADED: std::sync::OnceLock<std::result::Result<(), String>> =
        std::sync::OnceLock::new();
    LOADED
        .get_or_init(|| {
            let path = std::env::var("CANOPY_FONT")
                .ok()
                .into_iter()
                .chain(FONT_CANDIDATES.iter().map(|s| s.to_string()))
                .find(|p| Path::new(p).exists())
                .ok_or("no TrueType font found for plot labels; set CANOPY_FONT to a .ttf file (e.g. DejaVuSans.ttf)")?;
            let bytes = std::fs::read(&path).map_err(|e| format!("reading font {path}: {e}"))?;
            plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
                .map_err(|_| format!("{path} is not a usable TrueType font; set CANOPY_FONT"))
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// One line of a panel: a label and its (x, y) points.
type Series = (String, Vec<(f64, f64)>);

/// Draws the four scaling panels to `path`.
pub fn scaling(out: &ScalingOutput, path: &Path) -> Result<()> {
    load_font()?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match ext {
        "svg" => draw(out, SVGBackend::new(path, (1400, 1000)).into_drawing_area()),
        "png" => draw(
            out,
            BitMapBackend::new(path, (1400, 1000)).into_drawing_area(),
        ),
        _ => bail!("--plot {}: use a .png or .svg file name", path.display()),
    }
    .with_context(|| format!("drawing {}", path.display()))
}

fn draw<DB: DrawingBackend>(out: &ScalingOutput, root: DrawingArea<DB, Shift>) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let panels = root.split_evenly((2, 2));
    let rows = &out.rows;
    let series = |x_of: &dyn Fn(&crate::bench::Row) -> f64,
                  y_of: &dyn Fn(&crate::bench::Row) -> Option<f64>,
                  key_of: &dyn Fn(&crate::bench::Row) -> String| {
        let mut out: Vec<Series> = Vec::new();
        for r in rows {
            let Some(y) = y_of(r) else { continue };
            let key = key_of(r);
            match out.iter_mut().find(|(k, _)| *k == key) {
                Some((_, pts)) => pts.push((x_of(r), y)),
                None => out.push((key, vec![(x_of(r), y)])),
            }
        }
        out.iter_mut()
            .for_each(|(_, pts)| pts.sort_by(|a, b| a.0.total_cmp(&b.0)));
        out
    };
    let by_n = |r: &crate::bench::Row| r.seq_len as f64;
    let by_p = |r: &crate::bench::Row| r.ranks as f64;
    let latency = |r: &crate::bench::Row| Some(r.median_ms);
    let ratio = |r: &crate::bench::Row| {
        (r.strategy != "ring")
            .then(|| ring_over_tree(rows, r))
            .flatten()
    };
    let title = format!(
        "{}/{} heads x {}, {}",
        out.q_heads, out.kv_heads, out.head_dim, out.dtype
    );
    // `tree/auto (allgather)`: one line for `auto` whatever it chose at each point.
    let base = |r: &crate::bench::Row| r.strategy.split(" (").next().unwrap_or("").to_string();
    let key_sp = |r: &crate::bench::Row| format!("{} p={}", base(r), r.ranks);
    let key_sn = |r: &crate::bench::Row| format!("{} N={}", base(r), r.seq_len);
    panel(
        &panels[0],
        &format!("latency vs N ({title})"),
        "context N (tokens)",
        "median ms",
        true,
        &series(&by_n, &latency, &key_sp),
    )?;
    panel(
        &panels[1],
        "ring / tree vs N",
        "context N (tokens)",
        "ring time / tree time",
        true,
        &series(&by_n, &ratio, &key_sp),
    )?;
    panel(
        &panels[2],
        "latency vs p",
        "ranks p",
        "median ms",
        false,
        &series(&by_p, &latency, &key_sn),
    )?;
    panel(
        &panels[3],
        "ring / tree vs p",
        "ranks p",
        "ring time / tree time",
        false,
        &series(&by_p, &ratio, &key_sn),
    )?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// One log-y panel; `log_x` for context lengths.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    caption: &str,
    x_label: &str,
    y_label: &str,
    log_x: bool,
    lines: &[Series],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let pts = lines.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        return Ok(()); // nothing to draw (e.g. no ring rows for a ratio)
    }
    let (y0, y1) = (y0.max(1e-6) / 1.5, y1 * 1.5);
    let (x0, x1) = if log_x {
        (x0 / 1.5, x1 * 1.5)
    } else {
        (x0 - 0.5, x1 + 0.5)
    };
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e}");
    let mut b = ChartBuilder::on(area);
    b.caption(caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60);
    let style = |c: usize| Palette99::pick(c).stroke_width(2);
    macro_rules! body {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc(y_label)
                .x_labels(8)
                .x_label_formatter(&|x: &f64| axis_label(*x, log_x))
                .label_style(("sans-serif", 14))
                .draw()
                .map_err(e)?;
            for (i, (name, p)) in lines.iter().enumerate() {
                chart
                    .draw_series(LineSeries::new(p.iter().copied(), style(i)))
                    .map_err(e)?
                    .label(name.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], style(i)));
                chart
                    .draw_series(p.iter().map(|&pt| Circle::new(pt, 3, style(i).filled())))
                    .map_err(e)?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .label_font(("sans-serif", 12))
                .draw()
                .map_err(e)?;
        }};
    }
    if log_x {
        body!(b
            .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
            .map_err(e)?);
    } else {
        body!(b
            .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
            .map_err(e)?);
    }
    Ok(())
}

/// Context lengths as 128K / 1M, rank counts as integers.
fn axis_label(x: f64, tokens: bool) -> String {
    match tokens {
        true if x >= 1048576.0 => format!("{:.3}M", x / 1048576.0)
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string(),
        true => format!("{:.0}K", x / 1024.0),
        false => format!("{x:.0}"),
    }
}
