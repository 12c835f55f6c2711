//! Plots with plotters, in the layout of the Tree Attention paper's Figure 3: latency and the
//! ring/tree ratio against context length, and against the rank count.
//!
//! A run has up to 6 strategies at 3 or 4 rank counts and as many lengths, too many lines for
//! one legend entry each. So a line's colour is its strategy, and its dash and marker are its
//! rank count (top row, against N) or its context length (bottom row, against p); one legend
//! beside the panels keys the colours and the two sets of styles. Both axes are logarithmic
//! with ticks chosen here (plotters' own log ticks label only whole decades, or repeat a label
//! over a narrow range): the x ticks are the measured values, the y ticks 1-2-5 per decade.
//!
//! Text needs a TrueType font, loaded at run time (`CANOPY_FONT`, or DejaVu/Liberation Sans
//! where distributions install them), so the binary carries no font and needs no fontconfig.

mod decode;

pub use decode::decode;

use crate::scaling::{ring_over_tree, ScalingOutput};
use anyhow::{anyhow, bail, Context, Result};
use canopy_engine::RunReport;
use canopy_engine::Strategy;
use plotters::coord::{CoordTranslate, Shift};
use plotters::element::DashedPathElement;
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

/// The image formats `--plot` writes, by the file's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Png,
    Svg,
}

/// Checks that a plot can be written to `path` (a .png or .svg name in an existing, writable
/// directory, and a font to label it), so that `bench scaling` refuses a bad `--plot` before
/// it runs the benchmark rather than after.
pub fn check(path: &Path) -> Result<Format> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let format = match ext.to_ascii_lowercase().as_str() {
        "png" => Format::Png,
        "svg" => Format::Svg,
        _ => bail!(
            "--plot {}: the plot is PNG or SVG by the file's extension; name it .png or .svg",
            path.display()
        ),
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let meta = std::fs::metadata(dir).with_context(|| {
        format!(
            "--plot {}: directory {} does not exist; create it or pick another path",
            path.display(),
            dir.display()
        )
    })?;
    if !meta.is_dir() || meta.permissions().readonly() {
        bail!(
            "--plot {}: {} is not a writable directory; pick another path",
            path.display(),
            dir.display()
        );
    }
    if path.is_dir() {
        bail!(
            "--plot {}: is a directory; give a file name",
            path.display()
        );
    }
    load_font()?;
    Ok(format)
}

/// Draws the four scaling panels and their legend to `path`.
pub fn scaling(out: &ScalingOutput, path: &Path) -> Result<()> {
    let size = (1600, 1000);
    match check(path)? {
        Format::Svg => draw(out, SVGBackend::new(path, size).into_drawing_area()),
        Format::Png => draw(out, BitMapBackend::new(path, size).into_drawing_area()),
    }
    .with_context(|| format!("drawing {}", path.display()))
}

/// Strongly distinct colours (Tableau's, with black for the ring), indexed by the strategy's
/// place in `Strategy::every()`; strategies this build does not know take the spares.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),  // blue: tree/allreduce3
    RGBColor(255, 127, 14),  // orange: tree/allreduce2
    RGBColor(44, 160, 44),   // green: tree/allgather
    RGBColor(148, 103, 189), // purple: tree/hierarchical
    RGBColor(214, 39, 40),   // red (drawn pale, see `UNDER`): tree/auto
    RGBColor(0, 0, 0),       // black: ring
    RGBColor(140, 86, 75),   // brown
    RGBColor(188, 189, 34),  // olive
    RGBColor(23, 190, 207),  // cyan
    RGBColor(127, 127, 127), // grey
];

/// How a line is stroked: a dash pattern (pixels on, pixels off; solid when off is 0) and a
/// marker at each point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LineStyle {
    dash: (u32, u32),
    marker: Marker,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marker {
    Circle,
    Triangle,
    Square,
    Diamond,
    Cross,
}

const SOLID: (u32, u32) = (1, 0);

/// The styles of the first, second, ... rank count (or context length); they repeat after 5.
const STYLES: [LineStyle; 5] = [
    LineStyle {
        dash: SOLID,
        marker: Marker::Circle,
    },
    LineStyle {
        dash: (10, 6),
        marker: Marker::Triangle,
    },
    LineStyle {
        dash: (2, 4),
        marker: Marker::Square,
    },
    LineStyle {
        dash: (20, 5),
        marker: Marker::Diamond,
    },
    LineStyle {
        dash: (5, 3),
        marker: Marker::Cross,
    },
];

/// The strategy a row's line belongs to: `tree/auto (allgather)` is `tree/auto`, one line for
/// `auto` whatever it chose at each point.
fn strategy(row: &RunReport) -> &str {
    row.strategy.split(" (").next().unwrap_or("")
}

/// The strategies `names` in `Strategy::every()` order, then any others as they come, each
/// with its colour.
fn colours<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<(String, RGBColor)> {
    let names: Vec<&str> = names.into_iter().collect();
    let known: Vec<String> = Strategy::every().iter().map(Strategy::name).collect();
    let mut unknown: Vec<&str> = Vec::new();
    for &s in &names {
        if !known.iter().any(|k| k == s) && !unknown.contains(&s) {
            unknown.push(s);
        }
    }
    let present = |s: &str| names.contains(&s);
    known
        .iter()
        .map(String::as_str)
        .chain(unknown)
        .enumerate()
        .filter(|&(_, s)| present(s))
        .map(|(i, s)| (s.to_string(), PALETTE[i % PALETTE.len()]))
        .collect()
}

/// The distinct values of `key` over `rows`, ascending: a line's style is its value's index.
fn levels<T>(rows: &[T], key: impl Fn(&T) -> f64) -> Vec<f64> {
    let mut v: Vec<f64> = rows.iter().map(key).collect();
    v.sort_by(f64::total_cmp);
    v.dedup();
    v
}

/// The style of the lines at `value`, one of `levels`.
fn style_of(levels: &[f64], value: f64) -> LineStyle {
    let i = levels.iter().position(|&l| l == value).unwrap_or(0);
    STYLES[i % STYLES.len()]
}

/// `auto` runs the collective it picks, so its line would hide that collective's: it is drawn
/// as a wide pale band under the other lines instead, solid, with large pale markers.
const UNDER: &str = "tree/auto";

/// How a strategy's lines are stroked.
fn stroke(strategy: &str, colour: RGBColor) -> ShapeStyle {
    match strategy {
        UNDER => colour.mix(0.3).stroke_width(8),
        _ => colour.stroke_width(2),
    }
}

/// One line of a panel.
struct Line {
    stroke: ShapeStyle,
    style: LineStyle,
    /// A band under the others ([`UNDER`]).
    band: bool,
    points: Vec<(f64, f64)>,
}

/// The lines of one panel: one per strategy and value of `group`, with `y` where it has one.
fn lines(
    rows: &[RunReport],
    colours: &[(String, RGBColor)],
    x: impl Fn(&RunReport) -> f64,
    y: impl Fn(&RunReport) -> Option<f64>,
    group: impl Fn(&RunReport) -> f64,
) -> Vec<Line> {
    let groups = levels(rows, &group);
    let mut out = Vec::new();
    // The band first, so the other lines lie over it.
    let bands_first = colours.iter().filter(|(n, _)| n == UNDER);
    for (name, colour) in bands_first.chain(colours.iter().filter(|(n, _)| n != UNDER)) {
        for &g in &groups {
            let mut points: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| strategy(r) == name && group(r) == g)
                .filter_map(|r| Some((x(r), y(r)?)))
                .filter(|&(_, y)| y > 0.0 && y.is_finite()) // a log axis has no place for 0
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            if !points.is_empty() {
                out.push(Line {
                    stroke: stroke(name, *colour),
                    style: style_of(&groups, g),
                    band: name == UNDER,
                    points,
                });
            }
        }
    }
    out
}

fn draw<DB: DrawingBackend>(out: &ScalingOutput, root: DrawingArea<DB, Shift>) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e}");
    root.fill(&WHITE).map_err(e)?;
    let title = format!(
        "bench scaling on {}: {}/{} heads × {}, {}, median of {} steps",
        out.backend, out.q_heads, out.kv_heads, out.head_dim, out.dtype, out.iters
    );
    let root = root.titled(&title, ("sans-serif", 24)).map_err(e)?;
    let (charts, legend_area) = root.split_horizontally(root.dim_in_pixel().0 - 300);
    let panels = charts.split_evenly((2, 2));

    let rows = &out.rows;
    let colours = colours(rows.iter().map(strategy));
    let by_n = |r: &RunReport| r.seq_len as f64;
    let by_p = |r: &RunReport| r.ranks as f64;
    let latency = |r: &RunReport| Some(r.median_ms);
    let ratio = |r: &RunReport| {
        (r.strategy != "ring")
            .then(|| ring_over_tree(rows, r))
            .flatten()
    };
    let ns = levels(rows, by_n);
    let ps = levels(rows, by_p);
    let n_axis = Axis {
        desc: "context N (tokens)",
        ticks: &ns,
        label: tokens,
    };
    let p_axis = Axis {
        desc: "ranks p",
        ticks: &ps,
        label: plain,
    };
    let panels_of = [
        (
            "latency against context N",
            "median ms",
            &n_axis,
            lines(rows, &colours, by_n, latency, by_p),
        ),
        (
            "ring time / tree time against N",
            "ring / tree",
            &n_axis,
            lines(rows, &colours, by_n, ratio, by_p),
        ),
        (
            "latency against ranks p",
            "median ms",
            &p_axis,
            lines(rows, &colours, by_p, latency, by_n),
        ),
        (
            "ring time / tree time against p",
            "ring / tree",
            &p_axis,
            lines(rows, &colours, by_p, ratio, by_n),
        ),
    ];
    for (area, (caption, y_desc, x_axis, lines)) in panels.iter().zip(panels_of) {
        panel(area, caption, x_axis, y_desc, &lines)?;
    }
    let entries: Vec<(String, ShapeStyle)> = colours
        .iter()
        .map(|(name, colour)| {
            let label = match name.as_str() {
                UNDER => format!("{name} (band under its pick)"),
                _ => name.clone(),
            };
            (label, stroke(name, *colour))
        })
        .collect();
    let keys = [
        ("line: ranks p (top row)", "p", labels(&ps, plain)),
        ("line: context N (bottom row)", "N", labels(&ns, tokens)),
    ];
    legend(&legend_area, &entries, &keys)?;
    root.present().map_err(e)?;
    Ok(())
}

/// An x axis: its description, its ticks (the measured values) and how they read.
struct Axis<'a> {
    desc: &'a str,
    ticks: &'a [f64],
    label: fn(f64, usize) -> String,
}

/// At most this many ticks on a y axis, so that their labels stay apart.
const MAX_Y_TICKS: usize = 10;

/// One panel, log-log.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    caption: &str,
    x_axis: &Axis,
    y_desc: &str,
    lines: &[Line],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e}");
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in lines.iter().flat_map(|l| l.points.iter()) {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        // E.g. a ratio panel of a run without the ring.
        let note = format!("{caption}: nothing to draw");
        return area
            .draw(&Text::new(note, (20, 20), ("sans-serif", 18).into_font()))
            .map_err(e);
    }
    let (x0, x1) = (x0 / 1.3, x1 * 1.3);
    let (y0, y1) = (y0.max(1e-9) / 1.25, y1 * 1.25);
    let x_ticks = thin(x_axis.ticks, 8);
    let y_ticks = log_ticks(y0, y1, MAX_Y_TICKS);
    let x_labels = labels(&x_ticks, x_axis.label);
    let y_labels = labels(&y_ticks, plain);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(14)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (x0..x1).log_scale().with_key_points(x_ticks.clone()),
            (y0..y1).log_scale().with_key_points(y_ticks.clone()),
        )
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc(x_axis.desc)
        .y_desc(y_desc)
        .x_label_formatter(&|x| label_at(&x_ticks, &x_labels, *x))
        .y_label_formatter(&|y| label_at(&y_ticks, &y_labels, *y))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .bold_line_style(BLACK.mix(0.12))
        .draw()
        .map_err(e)?;
    let plot = chart.plotting_area();
    for line in lines {
        let (dash, size) = match line.band {
            true => (SOLID, 8),
            false => (line.style.dash, 4),
        };
        path(plot, dash, line.points.clone(), line.stroke)?;
        for &p in &line.points {
            marker(plot, line.style.marker, p, line.stroke.color, size)?;
        }
    }
    Ok(())
}

/// The key beside the panels: each colour's label and stroke (`entries`), then, for each of
/// `keys` (a heading, the name of the value, and the values' labels), the line style of each
/// value.
fn legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    entries: &[(String, ShapeStyle)],
    keys: &[(&str, &str, Vec<String>)],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e}");
    let heading = ("sans-serif", 17).into_font();
    let text = ("sans-serif", 15).into_font();
    let (x, mut y) = (12, 40);
    let entry = |label: &str, stroke: ShapeStyle, style: Option<LineStyle>, y: i32| -> Result<()> {
        let dash = style.map_or(SOLID, |s| s.dash);
        path(area, dash, vec![(x, y), (x + 44, y)], stroke)?;
        if let Some(s) = style {
            marker(area, s.marker, (x + 22, y), stroke.color, 4)?;
        }
        area.draw(&Text::new(label, (x + 56, y - 8), text.clone()))
            .map_err(e)
    };
    area.draw(&Text::new("colour: strategy", (x, y), heading.clone()))
        .map_err(e)?;
    y += 34;
    for (label, style) in entries {
        entry(label, *style, None, y)?;
        y += 24;
    }
    let grey = RGBColor(60, 60, 60).stroke_width(2);
    for (head, name, labels) in keys {
        y += 24;
        area.draw(&Text::new(*head, (x, y), heading.clone()))
            .map_err(e)?;
        y += 34;
        for (i, label) in labels.iter().enumerate() {
            entry(
                &format!("{name} = {label}"),
                grey,
                Some(STYLES[i % STYLES.len()]),
                y,
            )?;
            y += 24;
        }
    }
    Ok(())
}

/// Strokes `points` with the dash pattern `dash` (on, off pixels; solid when off is 0).
fn path<DB: DrawingBackend, CT: CoordTranslate>(
    area: &DrawingArea<DB, CT>,
    dash: (u32, u32),
    points: Vec<CT::From>,
    stroke: ShapeStyle,
) -> Result<()>
where
    DB::ErrorType: 'static,
    CT::From: Clone,
{
    match dash {
        (_, 0) => area.draw(&PathElement::new(points, stroke)),
        (on, off) => area.draw(&DashedPathElement::new(points, on, off, stroke)),
    }
    .map_err(|e| anyhow!("{e}"))
}

/// Draws `shape` centred on `at`, about `size` pixels from its centre to its edge.
fn marker<DB: DrawingBackend, CT: CoordTranslate>(
    area: &DrawingArea<DB, CT>,
    shape: Marker,
    at: CT::From,
    colour: RGBAColor,
    size: i32,
) -> Result<()>
where
    DB::ErrorType: 'static,
    CT::From: Clone,
{
    let fill = colour.filled();
    // Pointed shapes a little larger, to look as large as the circle and the square.
    let d = size * 3 / 2;
    let at = EmptyElement::at(at);
    match shape {
        Marker::Circle => area.draw(&(at + Circle::new((0, 0), size, fill))),
        Marker::Triangle => area.draw(&(at + TriangleMarker::new((0, 0), d, fill))),
        Marker::Square => area.draw(&(at + Rectangle::new([(-size, -size), (size, size)], fill))),
        Marker::Diamond => {
            area.draw(&(at + Polygon::new(vec![(0, -d), (d, 0), (0, d), (-d, 0)], fill)))
        }
        Marker::Cross => area.draw(&(at + Cross::new((0, 0), d, colour.stroke_width(2)))),
    }
    .map_err(|e| anyhow!("{e}"))
}

/// At most `max` of `values`, evenly picked, keeping the first and the last.
fn thin(values: &[f64], max: usize) -> Vec<f64> {
    if values.len() <= max {
        return values.to_vec();
    }
    let last = values.len() - 1;
    let mut v: Vec<f64> = (0..max).map(|i| values[i * last / (max - 1)]).collect();
    v.dedup();
    v
}

/// Ticks for a logarithmic axis over `lo..hi` (0 < lo < hi): 1, 2 and 5 times each power of
/// ten; whole decades, or every k-th, when those are more than `max`; more round values per
/// decade when they are fewer than four; evenly spaced round values when the range is too
/// narrow for even those.
fn log_ticks(lo: f64, hi: f64, max: usize) -> Vec<f64> {
    let decades = lo.log10().floor() as i32..=hi.log10().ceil() as i32;
    let per_decade = |mantissas: &[f64]| -> Vec<f64> {
        decades
            .clone()
            .flat_map(|d| mantissas.iter().map(move |m| m * 10f64.powi(d)))
            .filter(|v| *v >= lo * (1.0 - 1e-9) && *v <= hi * (1.0 + 1e-9))
            .collect()
    };
    let one_two_five = per_decade(&[1.0, 2.0, 5.0]);
    if one_two_five.len() > max {
        let whole = per_decade(&[1.0]);
        let every = whole.len().div_ceil(max);
        return whole.into_iter().step_by(every).collect();
    }
    if one_two_five.len() >= 4 {
        return one_two_five;
    }
    let dense = per_decade(&[1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0]);
    if (3..=max).contains(&dense.len()) {
        return dense;
    }
    linear_ticks(lo, hi, 5)
}

/// Multiples of a round step (1, 2 or 5 times a power of ten) in `lo..=hi`, about `target`
/// of them.
fn linear_ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    let raw = (hi - lo) / target as f64;
    let power = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * power);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|k| k as f64 * step).collect()
}

/// A tick value with the fewest decimals that show it exactly, or rounded to `digits`
/// significant digits.
fn plain(v: f64, digits: usize) -> String {
    let max = ((digits as f64 - 1.0) - v.abs().log10().floor()).clamp(0.0, 12.0) as usize;
    (0..=max)
        .map(|d| format!("{v:.d$}"))
        .find(|s| {
            s.parse::<f64>()
                .is_ok_and(|p| (p - v).abs() <= 1e-9 * v.abs())
        })
        .unwrap_or_else(|| format!("{v:.max$}"))
}

/// A token count in binary units, as in the tables: 4K, 128K, 1M, 1.5M.
fn tokens(v: f64, digits: usize) -> String {
    const K: f64 = 1024.0;
    match v {
        v if v >= K * K => format!("{}M", plain(v / (K * K), digits)),
        v if v >= K => format!("{}K", plain(v / K, digits)),
        v => plain(v, digits),
    }
}

/// Labels for `ticks`, to 3 significant digits or as many more as keep them apart (two ticks
/// never read the same).
fn labels(ticks: &[f64], label: fn(f64, usize) -> String) -> Vec<String> {
    let mut out = Vec::new();
    for digits in 3..=12 {
        out = ticks.iter().map(|&t| label(t, digits)).collect();
        let mut sorted = out.clone();
        sorted.sort();
        sorted.dedup();
        if sorted.len() == out.len() {
            break;
        }
    }
    out
}

/// The label of the tick at `v` (plotters hands the tick values back to the formatter).
fn label_at(ticks: &[f64], labels: &[String], v: f64) -> String {
    ticks
        .iter()
        .position(|&t| (t - v).abs() <= 1e-9 * t.abs())
        .map_or_else(|| plain(v, 3), |i| labels[i].clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(strategy: &str, ranks: usize, seq_len: u32, median_ms: f64) -> RunReport {
        RunReport {
            strategy: strategy.into(),
            ranks,
            seq_len,
            batch: 1,
            median_ms,
            p10_ms: median_ms,
            p90_ms: median_ms,
            kv_bytes_per_rank: 0,
            comm_bytes_per_rank: 0,
            paper_comm_bytes: 0,
            peak_mem_bytes: None,
            paper_mem_bytes: 0,
            link_gbps: None,
            rel_error: None,
            rank_spread: None,
            output: None,
        }
    }

    fn distinct(labels: &[String]) -> bool {
        let mut v = labels.to_vec();
        v.sort();
        v.dedup();
        v.len() == labels.len()
    }

    #[test]
    fn latency_ticks_are_one_two_five_per_decade() {
        let t = log_ticks(18.0, 1200.0, MAX_Y_TICKS);
        assert_eq!(labels(&t, plain), ["20", "50", "100", "200", "500", "1000"]);
        let t = log_ticks(0.08, 2.5, MAX_Y_TICKS);
        assert_eq!(labels(&t, plain), ["0.1", "0.2", "0.5", "1", "2"]);
    }

    #[test]
    fn wide_ranges_get_decades_and_narrow_ones_round_steps() {
        let t = log_ticks(1e-3, 2e4, MAX_Y_TICKS);
        assert_eq!(labels(&t, plain)[..3], ["0.001", "0.01", "0.1"]);
        assert!(t.len() <= MAX_Y_TICKS);
        // Ring/tree ratios between 2.7 and 12, then between 9 and 11: more than "5" and "10",
        // or than the single tick "10".
        let t = log_ticks(2.7 / 1.25, 12.0 * 1.25, MAX_Y_TICKS);
        assert_eq!(labels(&t, plain), ["3", "4", "5", "6", "8", "10", "15"]);
        let t = log_ticks(9.0 / 1.25, 11.0 * 1.25, MAX_Y_TICKS);
        assert_eq!(labels(&t, plain), ["8", "10", "12"]);
    }

    #[test]
    fn tick_labels_never_repeat() {
        for lo in [1e-4, 0.03, 0.7, 1.0, 9.5, 18.0, 123.0] {
            for ratio in [1.01, 1.1, 1.5, 2.0, 3.0, 8.0, 30.0, 1e3, 1e6, 1e9] {
                let t = log_ticks(lo, lo * ratio, MAX_Y_TICKS);
                let l = labels(&t, plain);
                assert!(
                    t.len() >= 2 && t.len() <= MAX_Y_TICKS,
                    "{lo} x{ratio}: {l:?}"
                );
                assert!(distinct(&l), "{lo} x{ratio}: {l:?}");
                assert!(t.iter().all(|&v| v >= lo && v <= lo * ratio), "{l:?}");
            }
        }
    }

    #[test]
    fn context_lengths_read_in_binary_units() {
        let n = [4096.0, 131072.0, 1048576.0, 1572864.0, 4194304.0];
        assert_eq!(labels(&n, tokens), ["4K", "128K", "1M", "1.5M", "4M"]);
        let close = [100_000.0, 100_100.0];
        assert!(
            distinct(&labels(&close, tokens)),
            "{:?}",
            labels(&close, tokens)
        );
        assert_eq!(thin(&[1.0, 2.0, 3.0, 4.0, 5.0], 3), [1.0, 3.0, 5.0]);
    }

    #[test]
    fn colour_is_the_strategy_and_style_the_rank_count() {
        let mut rows = Vec::new();
        for (p, n) in [(1, 4096), (1, 16384), (2, 4096), (2, 16384)] {
            rows.push(row("ring", p, n, 10.0 * p as f64));
            rows.push(row("tree/allgather", p, n, 1.0 / p as f64));
            rows.push(row("tree/auto (allreduce2)", p, n, 1.0 / p as f64));
            rows.push(row("tree/new", p, n, 2.0));
        }
        rows[2].strategy = "tree/auto (allgather)".into();
        let c = colours(rows.iter().map(strategy));
        let names: Vec<&str> = c.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["tree/allgather", "tree/auto", "ring", "tree/new"]);
        assert_eq!(c[2].1, BLACK, "the ring is black");
        let mut rgb: Vec<_> = c.iter().map(|(_, c)| c.rgb()).collect();
        rgb.dedup();
        assert_eq!(rgb.len(), 4, "one colour per strategy");

        let by_n = |r: &RunReport| r.seq_len as f64;
        let by_p = |r: &RunReport| r.ranks as f64;
        let l = lines(&rows, &c, by_n, |r| Some(r.median_ms), by_p);
        assert_eq!(l.len(), 4 * 2, "one line per strategy and p");
        assert!(l.iter().all(|l| l.points.len() == 2));
        assert!(l[0].band && l[1].band, "auto first, under the others");
        for (a, b) in l.iter().zip(&l[1..]).step_by(2) {
            assert_eq!(a.stroke.color, b.stroke.color, "same strategy, same colour");
            assert_ne!(a.style, b.style, "p = 1 and p = 2 differ in style");
        }
        assert_eq!(
            l[0].style, l[2].style,
            "same p, same style across strategies"
        );
        assert_ne!(l[2].stroke.color, l[4].stroke.color);
    }

    #[test]
    fn only_png_and_svg_in_an_existing_directory_are_accepted() {
        let err = check(Path::new("scaling.jpg")).unwrap_err().to_string();
        assert!(err.contains("name it .png or .svg"), "{err}");
        assert!(check(Path::new("scaling")).is_err());
        let missing = std::env::temp_dir().join(format!("canopy-no-dir-{}", std::process::id()));
        let err = check(&missing.join("p.png")).unwrap_err().to_string();
        assert!(err.contains("does not exist"), "{err}");
        if load_font().is_ok() {
            let dir = std::env::temp_dir();
            assert_eq!(check(&dir.join("p.PNG")).unwrap(), Format::Png);
            assert_eq!(check(&dir.join("p.svg")).unwrap(), Format::Svg);
            assert!(check(&dir).is_err(), "a directory is not a file name");
        }
    }
}
