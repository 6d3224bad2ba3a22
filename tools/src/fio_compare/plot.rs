//! The SVG chart: bandwidth, latency and CPU per GiB of every cell, fio beside kvtier (and,
//! on the CPU panel of store cells, fio with a crc32c of every block as an outlined bar).
use std::path::Path;

use plotters::coord::ranged1d::{SegmentValue, SegmentedCoord};
use plotters::coord::types::{RangedCoordf64, RangedCoordusize};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::CellSummary;
use crate::output::{CliError, CliResult};

const FIO: RGBColor = RGBColor(120, 120, 120);
const FIO_LIGHT: RGBColor = RGBColor(205, 205, 205);
const KVTIER: RGBColor = RGBColor(31, 119, 180);
const KVTIER_LIGHT: RGBColor = RGBColor(166, 206, 227);
const HEIGHT: u32 = 620;
const BAR_GAP_PX: u32 = 3;

pub(super) fn draw(path: &Path, cells: &[CellSummary]) -> CliResult<()> {
    let panel = (220 + 70 * cells.len() as u32).clamp(520, 1600);
    let root = SVGBackend::new(path, (3 * panel, HEIGHT)).into_drawing_area();
    draw_on(&root, cells)
        .map_err(|e| CliError::runtime(format!("drawing the chart {}: {e}", path.display())))?;
    root.present()
        .map_err(|e| CliError::runtime(format!("writing {}: {e}", path.display())))
}

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn draw_on(root: &DrawingArea<SVGBackend<'_>, Shift>, cells: &[CellSummary]) -> Result<()> {
    root.fill(&WHITE)?;
    let third = root.dim_in_pixel().0 / 3;
    let (left, rest) = root.split_horizontally(third);
    let (right, cpu_area) = rest.split_horizontally(third);
    let labels: Vec<String> = cells.iter().map(CellSummary::label).collect();
    // A segmented range over integers holds both ends: 0..n-1 makes n slots.
    let n = cells.len().max(1);

    let bw_max = cells
        .iter()
        .map(|c| c.fio.main.gib_per_s.max(c.kvtier.main.gib_per_s))
        .fold(0.0_f64, f64::max)
        .max(0.1);
    let mut chart = ChartBuilder::on(&left)
        .caption(
            "bandwidth (GiB/s; mixed: the loads; label: kvtier / fio)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(110)
        .y_label_area_size(60)
        .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..bw_max * 1.18)?;
    mesh(&mut chart, "GiB/s", 1)?;
    x_labels(root, &chart, &labels)?;
    chart
        .draw_series(
            cells
                .iter()
                .enumerate()
                .map(|(i, c)| half_bar(i, true, c.fio.main.gib_per_s, FIO)),
        )?
        .label("fio")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], FIO.filled()));
    chart
        .draw_series(
            cells
                .iter()
                .enumerate()
                .map(|(i, c)| half_bar(i, false, c.kvtier.main.gib_per_s, KVTIER)),
        )?
        .label("kvtier")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], KVTIER.filled()));
    let ratio_style =
        TextStyle::from(("sans-serif", 13).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    chart.draw_series(cells.iter().enumerate().map(|(i, c)| {
        let top = c.fio.main.gib_per_s.max(c.kvtier.main.gib_per_s);
        Text::new(
            format!("{:.2}x", c.ratio.median),
            (SegmentValue::CenterOf(i), top + bw_max * 0.02),
            ratio_style.clone(),
        )
    }))?;
    legend(&mut chart)?;

    let lat_max = cells
        .iter()
        .map(|c| c.fio.main.p99_us.max(c.kvtier.main.p99_us))
        .fold(0.0_f64, f64::max)
        .max(1.0);
    let mut chart = ChartBuilder::on(&right)
        .caption(
            "latency (µs; mixed: the loads; light bar: p99, dark bar: p50)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(110)
        .y_label_area_size(70)
        .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..lat_max * 1.3)?;
    mesh(&mut chart, "µs", 1)?;
    x_labels(root, &chart, &labels)?;
    chart
        .draw_series(cells.iter().enumerate().flat_map(|(i, c)| {
            [
                half_bar(i, true, c.fio.main.p99_us, FIO_LIGHT),
                half_bar(i, true, c.fio.main.p50_us, FIO),
            ]
        }))?
        .label("fio")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], FIO.filled()));
    chart
        .draw_series(cells.iter().enumerate().flat_map(|(i, c)| {
            [
                half_bar(i, false, c.kvtier.main.p99_us, KVTIER_LIGHT),
                half_bar(i, false, c.kvtier.main.p50_us, KVTIER),
            ]
        }))?
        .label("kvtier")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], KVTIER.filled()));
    legend(&mut chart)?;
    draw_cpu(root, &cpu_area, cells, &labels)
}

/// The CPU panel: CPU per GiB of fio, fio with a crc32c per block (outlined), and kvtier.
fn draw_cpu(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    cells: &[CellSummary],
    labels: &[String],
) -> Result<()> {
    let n = cells.len().max(1);
    let ratio_style =
        TextStyle::from(("sans-serif", 13).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    let cpu_max = cells
        .iter()
        .map(|c| {
            c.fio_cpu_s_per_gib
                .max(c.kvtier_cpu_s_per_gib)
                .max(c.fio_crc32c_cpu_s_per_gib.unwrap_or(0.0))
        })
        .fold(0.0_f64, f64::max)
        .max(0.001);
    let mut chart = ChartBuilder::on(area)
        .caption(
            "CPU per GiB (s; outline: fio with a crc32c per block; label: kvtier / fio)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(110)
        .y_label_area_size(70)
        .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..cpu_max * 1.18)?;
    mesh(&mut chart, "CPU s/GiB", 3)?;
    x_labels(root, &chart, labels)?;
    chart
        .draw_series(
            cells
                .iter()
                .enumerate()
                .map(|(i, c)| half_bar(i, true, c.fio_cpu_s_per_gib, FIO)),
        )?
        .label("fio")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], FIO.filled()));
    chart
        .draw_series(cells.iter().enumerate().filter_map(|(i, c)| {
            let v = c.fio_crc32c_cpu_s_per_gib?;
            let mut bar = Rectangle::new(
                [
                    (SegmentValue::Exact(i), v),
                    (SegmentValue::CenterOf(i), 0.0),
                ],
                BLACK.stroke_width(2),
            );
            bar.set_margin(0, 0, 3 * BAR_GAP_PX, 0);
            Some(bar)
        }))?
        .label("fio+crc32c")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], BLACK.stroke_width(2)));
    chart
        .draw_series(
            cells
                .iter()
                .enumerate()
                .map(|(i, c)| half_bar(i, false, c.kvtier_cpu_s_per_gib, KVTIER)),
        )?
        .label("kvtier")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], KVTIER.filled()));
    chart.draw_series(cells.iter().enumerate().map(|(i, c)| {
        let top = c
            .fio_cpu_s_per_gib
            .max(c.kvtier_cpu_s_per_gib)
            .max(c.fio_crc32c_cpu_s_per_gib.unwrap_or(0.0));
        Text::new(
            format!("{:.2}x", c.cpu_ratio.median),
            (SegmentValue::CenterOf(i), top + cpu_max * 0.02),
            ratio_style.clone(),
        )
    }))?;
    legend(&mut chart)?;
    Ok(())
}

type Chart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<SegmentedCoord<RangedCoordusize>, RangedCoordf64>>;

/// Axes and grid, y labels with `decimals` below 10; the x labels are drawn by [`x_labels`]
/// (the mesh would center rotated labels on the axis, half hidden behind the bars).
fn mesh(chart: &mut Chart<'_, '_>, y: &str, decimals: usize) -> Result<()> {
    let y_label = |v: &f64| {
        if *v >= 10.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.decimals$}")
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        // Not 0: plotters then searches for key points forever.
        .x_labels(1)
        .x_label_formatter(&|_| String::new())
        .y_labels(8)
        .y_label_formatter(&y_label)
        .y_desc(y)
        .draw()?;
    Ok(())
}

/// Each cell's label, read top to bottom under its pair of bars.
fn x_labels(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    chart: &Chart<'_, '_>,
    labels: &[String],
) -> Result<()> {
    let style = TextStyle::from(("sans-serif", 13).into_font())
        .transform(FontTransform::Rotate90)
        .pos(Pos::new(HPos::Left, VPos::Center));
    for (i, label) in labels.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(SegmentValue::CenterOf(i), 0.0));
        root.draw(&Text::new(label.as_str(), (x, y + 8), style.clone()))?;
    }
    Ok(())
}

fn legend<'b>(chart: &mut Chart<'b, 'b>) -> Result<()> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// The left (fio) or right (kvtier) half of cell `i`'s slot, from 0 to `value`.
fn half_bar(
    i: usize,
    left: bool,
    value: f64,
    color: RGBColor,
) -> Rectangle<(SegmentValue<usize>, f64)> {
    let (from, to) = if left {
        (SegmentValue::Exact(i), SegmentValue::CenterOf(i))
    } else {
        (SegmentValue::CenterOf(i), SegmentValue::Exact(i + 1))
    };
    let mut bar = Rectangle::new([(from, value), (to, 0.0)], color.filled());
    if left {
        bar.set_margin(0, 0, 3 * BAR_GAP_PX, 0);
    } else {
        bar.set_margin(0, 0, 0, 3 * BAR_GAP_PX);
    }
    bar
}
