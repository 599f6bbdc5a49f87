// What `moetrain plot RUN_DIR [--out FILE.svg|FILE.png]` draws: a run's metrics.jsonl (moetrain train or grpo) as an
// SVG file written by hand (a PNG is converted from it by rsvg-convert when that is on PATH) — one panel per group of
// series (loss, reward, held-out exact match, throughput, step time, gradient norm, learning rate, expert load, ...),
// each with axes, ticks at nice numbers, labels and a legend. Panels whose fields the file lacks are left out. The loss
// panel uses a log scale when its values are positive and span more than 30x.
//
// Errors name the file: missing, empty, a line that is not a JSON object (with its line number), or
// no field that any panel plots. A last line without its newline (a run killed mid-write) is skipped
// with a warning instead.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace mt {

struct MetricsFile {
  std::vector<nlohmann::json> rows;  // one object per non-blank line
  std::string warning;               // "" or what was skipped
};
MetricsFile read_metrics_jsonl(const std::string& path);

struct PlotSeries {
  std::string label;
  std::vector<std::pair<double, double>> points;  // (step, value), finite values only
};
struct PlotPanel {
  std::string title;
  std::vector<PlotSeries> series;  // only series with at least one point
  bool log_y = false;
};

// The panels that have data, in a fixed order. A field is a '/'-joined path into the objects
// ("time_s/forward"); step rows are those without "event", the exact-match panel reads the
// {"event": "eval"} rows. x is each row's "step" (the last one seen when a row has none).
std::vector<PlotPanel> metrics_panels(const std::vector<nlohmann::json>& rows);

// Tick values at 1, 2 or 5 x 10^k covering [lo, hi] (about `target` of them), ascending; lo == hi
// gives a small range around the value.
std::vector<double> nice_ticks(double lo, double hi, int target = 5);

// The whole SVG document: a title line and the panels on a grid of two columns.
std::string render_svg(const std::vector<PlotPanel>& panels, const std::string& title);

struct PlotReport {
  std::string metrics, out, svg;    // the file read, the file written and the SVG (out itself, or beside a PNG)
  size_t lines = 0;                 // metrics rows read
  std::vector<std::string> panels;  // the titles of the panels drawn
};
// `run` is a run directory (its metrics.jsonl) or a metrics file; `out` "" means metrics.svg beside it, and
// a .png is converted from the SVG written beside it (rsvg-convert must be on PATH). Files are written
// whole (a temporary, then a rename). Errors name the file and what is wrong.
PlotReport plot_metrics(const std::string& run, std::string out);

}  // namespace mt
