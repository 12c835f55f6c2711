//! `bench decode --plot`: the decode step against the context, one line per strategy (its
//! colour, as in the scaling plot) and rank count (its dash and marker), and each rank
//! count's floor in grey with that rank count's style.

use super::{
    check, colours, labels, legend, levels, panel, plain, style_of, tokens, Axis, Format, Line,
};
use crate::decode_bench::Report;
use anyhow::{anyhow, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

/// The floor's colour.
const FLOOR: RGBColor = RGBColor(150, 150, 150);

/// Draws `report`'s decode steps to `path` (PNG or SVG, by extension).
pub fn decode(report: &Report, path: &Path) -> Result<()> {
    let size = (1300, 800);
    match check(path)? {
        Format::Svg => draw(report, SVGBackend::new(path, size).into_drawing_area()),
        Format::Png => draw(report, BitMapBackend::new(path, size).into_drawing_area()),
    }
    .with_context(|| format!("drawing {}", path.display()))
}

fn draw<DB: DrawingBackend>(report: &Report, root: DrawingArea<DB, Shift>) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e}");
    root.fill(&WHITE).map_err(e)?;
    let run = &report.run;
    let title = format!(
        "bench decode: {} on {} ({}), median decode step",
        run.model, run.backend, run.dtype
    );
    let root = root.titled(&title, ("sans-serif", 24)).map_err(e)?;
    let (chart, legend_area) = root.split_horizontally(root.dim_in_pixel().0 - 360);
    let rows = &report.rows;
    let colours = colours(rows.iter().map(|r| r.strategy.as_str()));
    let ps = levels(rows, |r| r.ranks as f64);
    let ns = levels(rows, |r| r.context as f64);
    let axis = Axis {
        desc: "context N (tokens)",
        ticks: &ns,
        label: tokens,
    };
    let lines = lines(report, &colours, &ps);
    panel(
        &chart,
        "decode step against context N",
        &axis,
        "ms/token",
        &lines,
    )?;
    let mut entries: Vec<(String, ShapeStyle)> = colours
        .iter()
        .map(|(name, colour)| (name.clone(), colour.stroke_width(2)))
        .collect();
    if rows.iter().any(|r| r.floor_ms.is_some()) {
        let label = "floor: (weights + KV a rank) / copy bw";
        entries.push((label.into(), FLOOR.stroke_width(2)));
    }
    legend(
        &legend_area,
        &entries,
        &[("line: ranks p", "p", labels(&ps, plain))],
    )?;
    root.present().map_err(e)?;
    Ok(())
}

/// A line per strategy and rank count through its ms/token, then one per rank count through
/// its floor, where the floor is known.
fn lines(report: &Report, colours: &[(String, RGBColor)], ps: &[f64]) -> Vec<Line> {
    let rows = &report.rows;
    let mut out = Vec::new();
    let mut push = |stroke: ShapeStyle, p: f64, mut points: Vec<(f64, f64)>| {
        points.retain(|&(_, y)| y > 0.0 && y.is_finite()); // a log axis has no place for 0
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        points.dedup_by(|a, b| a.0 == b.0);
        if !points.is_empty() {
            out.push(Line {
                stroke,
                style: style_of(ps, p),
                band: false,
                points,
            });
        }
    };
    for (name, colour) in colours {
        for &p in ps {
            let points = rows
                .iter()
                .filter(|r| &r.strategy == name && r.ranks as f64 == p)
                .filter_map(|r| Some((r.context as f64, r.decode_ms_per_token?)))
                .collect();
            push(colour.stroke_width(2), p, points);
        }
    }
    for &p in ps {
        let points = rows
            .iter()
            .filter(|r| r.ranks as f64 == p)
            .filter_map(|r| Some((r.context as f64, r.floor_ms?)))
            .collect();
        push(FLOOR.stroke_width(2), p, points);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode_bench::fixtures::{self, row};

    fn report() -> Report {
        let mut rows = Vec::new();
        for (context, ranks) in [(64, 1), (64, 2), (128, 1), (128, 2)] {
            rows.push(row(context, ranks, "tree/auto", 1.0, 1.0));
            rows.push(row(context, ranks, "ring", 2.0, 2.0));
        }
        fixtures::report(rows)
    }

    #[test]
    fn a_line_per_strategy_and_rank_count_and_a_floor_per_rank_count() {
        let r = report();
        let colours = colours(r.rows.iter().map(|r| r.strategy.as_str()));
        let ps = levels(&r.rows, |r| r.ranks as f64);
        let l = lines(&r, &colours, &ps);
        assert_eq!(l.len(), 2 * 2 + 2);
        assert!(l.iter().all(|l| l.points.len() == 2), "two contexts each");
        let floors = &l[4..];
        assert!(floors.iter().all(|l| l.stroke.color == FLOOR.to_rgba()));
        assert_eq!(floors[1].points[0], (64.0, 1.0), "p = 2's floor");
        assert_eq!(
            l[0].style, floors[0].style,
            "a floor keeps its rank count's style"
        );
        assert_ne!(floors[0].style, floors[1].style);
    }

    #[test]
    fn the_plot_is_drawn() {
        if super::super::load_font().is_err() {
            return; // no font to label it on this machine
        }
        let path = std::env::temp_dir().join(format!("canopy-decode-{}.svg", std::process::id()));
        decode(&report(), &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).ok();
        assert!(
            svg.contains("decode step against context N"),
            "{}",
            &svg[..200]
        );
    }
}
