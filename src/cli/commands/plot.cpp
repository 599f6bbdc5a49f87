// moetrain plot RUN_DIR|METRICS.jsonl [--out FILE.svg|FILE.png]: a run's metrics drawn as one SVG
// (train/plot.h); prints one line naming the panels and the file written.
#include "train/plot.h"

#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/options.h"

namespace mt {

int plot_main(const std::vector<std::string>& args) {
  std::string out;
  cli::Options opt("plot", "RUN_DIR|METRICS.jsonl [--out FILE.svg|FILE.png]",
                   "Draws RUN_DIR/metrics.jsonl (moetrain train or grpo) as an SVG: loss, reward, held-out exact "
                   "match,\nthroughput, step time, gradient norm, learning rate, expert load, ... (panels without "
                   "data are left out).");
  opt.allow_positional("RUN_DIR");
  opt.custom(
         "out", cli::Kind::Text, "the picture; a .png is converted from the SVG (written beside it) by rsvg-convert",
         [&](const std::string& v) { out = v; }, [] { return std::string("RUN_DIR/metrics.svg"); })
      .var("FILE.svg|FILE.png");
  opt.rule([&] {
    const std::vector<std::string>& runs = opt.positional();
    if (runs.empty()) MT_THROW("plot: give a run directory (or its metrics.jsonl)\n", opt.usage());
    if (runs.size() > 1)
      MT_THROW("plot: one run directory, got ", runs.size(), " ('", runs[0], "', '", runs[1], "'",
               runs.size() > 2 ? ", ..." : "", ")\n", opt.usage());
  });
  if (!opt.parse(args)) {
    std::printf("%s", opt.help().c_str());
    return 0;
  }
  opt.check();
  const PlotReport r = plot_metrics(opt.positional()[0], out);
  std::string names;
  for (const std::string& p : r.panels) names += (names.empty() ? "" : ", ") + p;
  std::printf("plot: %zu panels (%s) from %zu lines of %s -> %s%s\n", r.panels.size(), names.c_str(), r.lines,
              r.metrics.c_str(), r.out.c_str(), r.svg != r.out ? (" (from " + r.svg + ")").c_str() : "");
  return 0;
}

}  // namespace mt
