// moetrain plot (plot.h): metrics.jsonl -> panels -> SVG text.
#include "train/plot.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/log.h"

namespace mt {

namespace {

namespace fs = std::filesystem;

struct SeriesSpec {
  const char* label;
  const char* field;           // '/'-joined path
  double scale = 1;            // the plotted value is field * scale
  bool drop_all_zero = false;  // leave the series out when its values are all 0 (a term switched off)
};
struct PanelSpec {
  const char* title;
  const char* event;  // "": step rows (no "event"); else the rows with this "event"
  std::vector<SeriesSpec> series;
  bool log_if_wide = false;    // log y when every value is > 0 and max / min > 30
  bool drop_all_zero = false;  // leave out a series whose values are all 0 (fields written but unused)
};

const std::vector<PanelSpec>& panel_specs() {
  // train writes time_s/{step,forward,...} and tokens_per_s; grpo writes time_s/{generate,...},
  // rollout/train tokens per second and the policy statistics (older grpo files: generate_s, ...).
  static const std::vector<PanelSpec> kPanels = {
      {"loss",
       "",
       {{"loss", "loss"}, {"cross-entropy", "ce"}, {"policy loss", "policy_loss"}, {"KL loss", "kl_loss", 1, true}},
       true},
      {"reward", "", {{"mean", "reward_mean"}, {"max", "reward_max"}, {"std", "reward_std"}}},
      {"held-out exact match (%)", "eval", {{"exact match", "exact_match"}}},
      {"throughput (tokens/s)",
       "",
       {{"tokens/s", "tokens_per_s"}, {"rollout", "rollout_tokens_per_s"}, {"train", "train_tokens_per_s"}}},
      {"step time (s)",
       "",
       {{"step", "time_s/step"},
        {"forward", "time_s/forward"},
        {"backward", "time_s/backward"},
        {"optimizer", "time_s/optimizer"},
        {"data", "time_s/data"},
        {"comm wait (max)", "time_s/comm_wait_max"},
        {"generate", "time_s/generate"},
        {"reward", "time_s/reward"},
        {"log-probs", "time_s/logprob"},
        {"reference log-probs", "time_s/ref_logprob"},
        {"update", "time_s/update"},
        {"weight sync", "time_s/weight_sync"},
        {"generate", "generate_s"},
        {"log-probs", "logprob_s"},
        {"update", "update_s"},
        {"weight sync", "weight_sync_s"}},
       false,
       true},
      {"gradient norm", "", {{"grad norm", "grad_norm"}, {"max over updates", "grad_norm_max"}}},
      {"learning rate", "", {{"lr", "lr"}}},
      {"router losses", "", {{"aux", "aux"}, {"z-loss", "z_loss"}}, false, true},
      {"expert load (max / mean)", "", {{"imbalance", "experts/imbalance"}}},
      {"policy",
       "",
       {{"approx KL", "approx_kl"},
        {"KL to reference", "ref_kl"},
        {"clipped low", "clip_low"},
        {"clipped high", "clip_high"}}},
      {"entropy", "", {{"entropy", "entropy"}}},
      {"rollout vs trainer log-prob gap", "", {{"mean", "logprob_diff_mean"}, {"max", "logprob_diff_max"}}},
      {"response length (tokens)", "", {{"mean", "response_len_mean"}, {"max", "response_len_max"}}},
      {"peak memory (GB)",
       "",
       {{"GPU peak", "gpu_peak_bytes", 1e-9}, {"RSS peak", "peak_rss_bytes", 1e-9}},
       false,
       true},
  };
  return kPanels;
}

// The number at a '/'-joined path, or false when absent, not a number or not finite.
bool field_value(const nlohmann::json& row, const std::string& path, double& out) {
  const nlohmann::json* j = &row;
  size_t b = 0;
  while (true) {
    const size_t e = path.find('/', b);
    const std::string key = path.substr(b, e == std::string::npos ? std::string::npos : e - b);
    if (!j->is_object()) return false;
    auto it = j->find(key);
    if (it == j->end()) return false;
    j = &*it;
    if (e == std::string::npos) break;
    b = e + 1;
  }
  if (!j->is_number()) return false;
  out = j->get<double>();
  return std::isfinite(out);
}

bool on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  std::string d;
  while (std::getline(dirs, d, ':'))
    if (!d.empty() && ::access((fs::path(d) / name).c_str(), X_OK) == 0) return true;
  return false;
}

// Runs a program found on PATH (no shell, so paths need no quoting); its exit code, or 128 + signal.
int run_program(const std::vector<std::string>& argv) {
  std::vector<char*> a;
  for (const std::string& s : argv) a.push_back(const_cast<char*>(s.c_str()));
  a.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) MT_THROW("cannot start ", argv[0], ": ", std::strerror(errno));
  if (pid == 0) {
    execvp(a[0], a.data());
    _exit(127);
  }
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char c : s) switch (c) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += c;
    }
  return o;
}

std::string num(double v, int decimals = 2) {
  char b[48];
  std::snprintf(b, sizeof b, "%.*f", decimals, v);
  return b;
}

// The 1, 2 or 5 x 10^k nearest x (Heckbert's "nice numbers").
double nice_num(double x) {
  const double e = std::floor(std::log10(x)), f = x / std::pow(10.0, e);
  const double nf = f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10;
  return nf * std::pow(10.0, e);
}

// Powers of ten (with 2 and 5 between them when the range is narrow) covering [lo, hi], lo > 0.
std::vector<double> log_ticks(double lo, double hi) {
  const int k0 = int(std::floor(std::log10(lo))), k1 = int(std::ceil(std::log10(hi)));
  const bool fine = k1 - k0 <= 2;
  std::vector<double> all;
  for (int k = k0; k <= k1; ++k)
    for (double m : fine ? std::vector<double>{1, 2, 5} : std::vector<double>{1}) all.push_back(m * std::pow(10.0, k));
  // Keep the candidates between the largest one <= lo and the smallest one >= hi.
  size_t a = 0, b = all.size() - 1;
  while (a + 1 < all.size() && all[a + 1] <= lo * (1 + 1e-12)) ++a;
  while (b > 0 && all[b - 1] >= hi * (1 - 1e-12)) --b;
  return std::vector<double>(all.begin() + long(a), all.begin() + long(b) + 1);
}

std::string tick_label(double v, double step, bool log_scale) {
  char b[48];
  if (v == 0) return "0";
  if (log_scale || std::fabs(v) >= 1e6 || step < 1e-4) {
    std::snprintf(b, sizeof b, "%g", v);
    return b;
  }
  const int decimals = std::max(0, int(-std::floor(std::log10(step) + 1e-9)));
  std::snprintf(b, sizeof b, "%.*f", decimals, v);
  return b;
}

const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                         "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

constexpr double kPanelW = 600, kPanelH = 330, kHeaderH = 48;
constexpr double kLeft = 76, kRight = 24, kTop = 36, kBottom = 50;

void render_panel(std::ostringstream& s, const PlotPanel& p, double px, double py) {
  double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
  for (const PlotSeries& se : p.series)
    for (auto [x, y] : se.points) {
      xmin = std::min(xmin, x), xmax = std::max(xmax, x);
      ymin = std::min(ymin, y), ymax = std::max(ymax, y);
    }
  // x spans the steps exactly (ticks inside it); y is widened to the ticks around the values.
  std::vector<double> xt = nice_ticks(xmin, xmax, 6);
  double xa = xt.front(), xb = xt.back();
  if (xmax > xmin) {
    xa = xmin >= 0 && xmin <= 0.05 * (xmax - xmin) ? 0.0 : xmin, xb = xmax;  // steps from 1: the axis from 0
    std::erase_if(xt, [&](double v) { return v < xa - 1e-9 * (xb - xa) || v > xb + 1e-9 * (xb - xa); });
  }
  const std::vector<double> yt = p.log_y ? log_ticks(ymin, ymax) : nice_ticks(ymin, ymax, 6);
  const double x0 = px + kLeft, x1 = px + kPanelW - kRight, y0 = py + kTop, y1 = py + kPanelH - kBottom;
  const double ya = yt.front(), yb = yt.back();
  auto sx = [&](double x) { return x0 + (x - xa) / (xb - xa) * (x1 - x0); };
  auto sy = [&](double y) {
    const double t =
        p.log_y ? (std::log10(y) - std::log10(ya)) / (std::log10(yb) - std::log10(ya)) : (y - ya) / (yb - ya);
    return y1 - t * (y1 - y0);
  };
  s << "<g class=\"panel\" data-title=\"" << xml_escape(p.title) << "\">\n";
  s << "<text x=\"" << num(x0) << "\" y=\"" << num(py + 22) << "\" font-size=\"14\" font-weight=\"bold\">"
    << xml_escape(p.title) << (p.log_y ? " (log scale)" : "") << "</text>\n";
  // Grid, ticks and their labels.
  const double xstep = xt.size() > 1 ? xt[1] - xt[0] : 1, ystep = yt.size() > 1 ? yt[1] - yt[0] : 1;
  for (double v : xt) {
    const double x = sx(v);
    s << "<line x1=\"" << num(x) << "\" y1=\"" << num(y0) << "\" x2=\"" << num(x) << "\" y2=\"" << num(y1)
      << "\" stroke=\"#e6e6e6\"/>\n";
    s << "<line x1=\"" << num(x) << "\" y1=\"" << num(y1) << "\" x2=\"" << num(x) << "\" y2=\"" << num(y1 + 5)
      << "\" stroke=\"#333\"/>\n";
    s << "<text x=\"" << num(x) << "\" y=\"" << num(y1 + 18) << "\" font-size=\"11\" text-anchor=\"middle\">"
      << tick_label(v, xstep, false) << "</text>\n";
  }
  for (double v : yt) {
    const double y = sy(v);
    s << "<line x1=\"" << num(x0) << "\" y1=\"" << num(y) << "\" x2=\"" << num(x1) << "\" y2=\"" << num(y)
      << "\" stroke=\"#e6e6e6\"/>\n";
    s << "<line x1=\"" << num(x0 - 5) << "\" y1=\"" << num(y) << "\" x2=\"" << num(x0) << "\" y2=\"" << num(y)
      << "\" stroke=\"#333\"/>\n";
    s << "<text x=\"" << num(x0 - 8) << "\" y=\"" << num(y + 4) << "\" font-size=\"11\" text-anchor=\"end\">"
      << tick_label(v, ystep, p.log_y) << "</text>\n";
  }
  s << "<rect x=\"" << num(x0) << "\" y=\"" << num(y0) << "\" width=\"" << num(x1 - x0) << "\" height=\""
    << num(y1 - y0) << "\" fill=\"none\" stroke=\"#333\"/>\n";
  s << "<text x=\"" << num((x0 + x1) / 2) << "\" y=\"" << num(y1 + 36)
    << "\" font-size=\"12\" text-anchor=\"middle\">step</text>\n";
  // The curves; a few points also get markers, so that one evaluation is visible.
  for (size_t i = 0; i < p.series.size(); ++i) {
    const PlotSeries& se = p.series[i];
    const char* color = kColors[i % std::size(kColors)];
    s << "<polyline class=\"series\" data-label=\"" << xml_escape(se.label) << "\" fill=\"none\" stroke=\"" << color
      << "\" stroke-width=\"1.5\" points=\"";
    for (size_t k = 0; k < se.points.size(); ++k)
      s << (k ? " " : "") << num(sx(se.points[k].first)) << "," << num(sy(se.points[k].second));
    s << "\"/>\n";
    if (se.points.size() <= 40)
      for (auto [x, y] : se.points)
        s << "<circle cx=\"" << num(sx(x)) << "\" cy=\"" << num(sy(y)) << "\" r=\"2.5\" fill=\"" << color << "\"/>\n";
  }
  // Legend, top right inside the plot.
  size_t longest = 0;
  for (const PlotSeries& se : p.series) longest = std::max(longest, se.label.size());
  const double lw = 34 + 6.6 * double(longest), lh = 8 + 16 * double(p.series.size());
  // In the corner that covers the fewest points.
  double lx = x1 - lw - 6, ly = y0 + 6;
  size_t best = SIZE_MAX;
  for (int corner = 0; corner < 4; ++corner) {
    const double cx = corner % 2 ? x0 + 6 : x1 - lw - 6, cy = corner < 2 ? y0 + 6 : y1 - lh - 6;
    size_t covered = 0;
    for (const PlotSeries& se : p.series)
      for (auto [x, y] : se.points) {
        const double u = sx(x), v = sy(y);
        covered += u >= cx - 4 && u <= cx + lw + 4 && v >= cy - 4 && v <= cy + lh + 4;
      }
    if (covered < best) best = covered, lx = cx, ly = cy;
  }
  s << "<g class=\"legend\"><rect x=\"" << num(lx) << "\" y=\"" << num(ly) << "\" width=\"" << num(lw) << "\" height=\""
    << num(lh) << "\" fill=\"white\" fill-opacity=\"0.85\" stroke=\"#bbb\"/>\n";
  for (size_t i = 0; i < p.series.size(); ++i) {
    const double y = ly + 13 + 16 * double(i);
    s << "<line x1=\"" << num(lx + 6) << "\" y1=\"" << num(y - 4) << "\" x2=\"" << num(lx + 24) << "\" y2=\""
      << num(y - 4) << "\" stroke=\"" << kColors[i % std::size(kColors)] << "\" stroke-width=\"2\"/>\n";
    s << "<text x=\"" << num(lx + 29) << "\" y=\"" << num(y) << "\" font-size=\"11\">" << xml_escape(p.series[i].label)
      << "</text>\n";
  }
  s << "</g>\n</g>\n";
}

}  // namespace

MetricsFile read_metrics_jsonl(const std::string& path) {
  if (!fs::exists(path))
    MT_THROW(path, " does not exist (moetrain train and moetrain grpo write metrics.jsonl in their output directory)");
  std::ifstream f(path, std::ios::binary);
  if (!f) MT_THROW("cannot open ", path);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  MetricsFile out;
  size_t b = 0;
  for (int64_t line_no = 1; b < text.size(); ++line_no) {
    size_t e = text.find('\n', b);
    const bool complete = e != std::string::npos;
    if (!complete) e = text.size();
    const std::string line = text.substr(b, e - b);
    b = e + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    std::string detail;
    try {
      j = nlohmann::json::parse(line);
      if (!j.is_object()) detail = str("a JSON ", j.type_name(), ", not an object");
    } catch (const nlohmann::json::parse_error& ex) {
      detail = ex.what();
    }
    if (!detail.empty()) {
      if (!complete) {
        out.warning =
            str(path, ":", line_no, ": the last line is incomplete (no newline; a run stopped mid-write?): skipped");
        break;
      }
      MT_THROW(path, ":", line_no, ": not a JSON object (", detail,
               "): ", line.size() > 80 ? line.substr(0, 80) + "..." : line);
    }
    out.rows.push_back(std::move(j));
  }
  if (out.rows.empty())
    MT_THROW(path, " has no metrics lines (", text.empty() ? "the file is empty" : "only blank lines", ")");
  return out;
}

std::vector<PlotPanel> metrics_panels(const std::vector<nlohmann::json>& rows) {
  // Each row's x: its "step", or the last step seen.
  std::vector<double> xs(rows.size());
  double last = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    double st;
    if (field_value(rows[i], "step", st)) last = st;
    xs[i] = last;
  }
  std::vector<PlotPanel> panels;
  for (const PanelSpec& spec : panel_specs()) {
    PlotPanel p;
    p.title = spec.title;
    for (const SeriesSpec& ss : spec.series) {
      PlotSeries se;
      se.label = ss.label;
      bool nonzero = false;
      for (size_t i = 0; i < rows.size(); ++i) {
        const nlohmann::json& r = rows[i];
        const bool is_event = r.contains("event") && r["event"].is_string();
        if (spec.event[0] ? !(is_event && r["event"] == spec.event) : is_event) continue;
        double v;
        if (!field_value(r, ss.field, v)) continue;
        v *= ss.scale;
        nonzero |= v != 0;
        se.points.emplace_back(xs[i], v);
      }
      if (se.points.empty() || ((spec.drop_all_zero || ss.drop_all_zero) && !nonzero)) continue;
      p.series.push_back(std::move(se));
    }
    if (p.series.empty()) continue;
    if (spec.log_if_wide) {
      double lo = INFINITY, hi = -INFINITY;
      for (const PlotSeries& se : p.series)
        for (auto pt : se.points) lo = std::min(lo, pt.second), hi = std::max(hi, pt.second);
      p.log_y = lo > 0 && hi / lo > 30;
    }
    panels.push_back(std::move(p));
  }
  return panels;
}

std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!(std::isfinite(lo) && std::isfinite(hi))) MT_THROW("nice_ticks: range [", lo, ", ", hi, "] is not finite");
  if (lo > hi) std::swap(lo, hi);
  if (hi - lo <= 1e-12 * std::max(1.0, std::fabs(lo))) {
    const double d = lo != 0 ? std::fabs(lo) * 0.1 : 1.0;
    lo -= d, hi += d;
  }
  const double d = nice_num((hi - lo) / double(std::max(2, target) - 1));
  // Tick k is k * m * 10^e with an integer m (1, 2 or 5); dividing by 10^-e for e < 0 gives the
  // double nearest 0.6, where multiplying by 0.1 gives 0.6000000000000001.
  const int e = int(std::floor(std::log10(d) + 1e-9));
  const double m = std::round(d / std::pow(10.0, e));
  auto tick = [&](double k) { return e < 0 ? k * m / std::pow(10.0, -e) : k * m * std::pow(10.0, e); };
  const double k0 = std::floor(lo / d + 1e-9), k1 = std::ceil(hi / d - 1e-9);
  std::vector<double> t;
  for (double k = k0; k <= k1; ++k) t.push_back(k == 0 ? 0.0 : tick(k));
  return t;
}

std::string render_svg(const std::vector<PlotPanel>& panels, const std::string& title) {
  const int cols = panels.size() > 1 ? 2 : 1;
  const int rows = int((panels.size() + size_t(cols) - 1) / size_t(cols));
  const double w = kPanelW * cols, h = kHeaderH + kPanelH * rows;
  std::ostringstream s;
  s << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << num(w, 0) << "\" height=\"" << num(h, 0)
    << "\" viewBox=\"0 0 " << num(w, 0) << " " << num(h, 0) << "\" font-family=\"Helvetica, Arial, sans-serif\">\n";
  s << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"" << num(w / 2) << "\" y=\"30\" font-size=\"17\" text-anchor=\"middle\">" << xml_escape(title)
    << "</text>\n";
  for (size_t i = 0; i < panels.size(); ++i)
    render_panel(s, panels[i], kPanelW * double(i % size_t(cols)), kHeaderH + kPanelH * double(i / size_t(cols)));
  s << "</svg>\n";
  return s.str();
}

PlotReport plot_metrics(const std::string& run, std::string out) {
  const bool is_file = fs::is_regular_file(run);
  if (!is_file && !fs::is_directory(run)) MT_THROW(run, " is neither a run directory nor a metrics file");
  PlotReport rep;
  rep.metrics = is_file ? run : (fs::path(run) / "metrics.jsonl").string();
  if (out.empty()) out = (fs::path(rep.metrics).parent_path() / "metrics.svg").string();
  const std::string ext = fs::path(out).extension().string();
  if (ext != ".svg" && ext != ".png") MT_THROW("--out ", out, ": the file must end in .svg or .png");
  const bool png = ext == ".png";
  if (png && !on_path("rsvg-convert"))
    MT_THROW("--out ", out,
             ": a PNG is converted from the SVG by rsvg-convert, which is not on PATH (Debian: apt-get "
             "install librsvg2-bin); or name the file .svg");
  const MetricsFile mf = read_metrics_jsonl(rep.metrics);
  if (!mf.warning.empty()) log_info("plot: warning: ", mf.warning);
  const std::vector<PlotPanel> panels = metrics_panels(mf.rows);
  if (panels.empty())
    MT_THROW(rep.metrics, " has ", mf.rows.size(), mf.rows.size() == 1 ? " line" : " lines",
             " but none of the fields plotted (loss, ce, reward_mean, exact_match, tokens_per_s, grad_norm, lr, ...)");
  std::string title = fs::path(rep.metrics).parent_path().filename().string();
  if (title.empty()) title = fs::path(rep.metrics).filename().string();
  const std::string svg = render_svg(panels, title + " — " + fs::path(rep.metrics).filename().string());
  if (fs::path(out).has_parent_path()) fs::create_directories(fs::path(out).parent_path());
  rep.svg = png ? fs::path(out).replace_extension(".svg").string() : out;
  const std::string tmp = rep.svg + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << svg;
    if (!f.flush()) MT_THROW("cannot write ", tmp);
  }
  fs::rename(tmp, rep.svg);
  if (png) {
    const int code = run_program({"rsvg-convert", "-b", "white", "-o", out + ".tmp", rep.svg});
    if (code != 0) MT_THROW("rsvg-convert -o ", out, ".tmp ", rep.svg, " failed (exit code ", code, ")");
    fs::rename(out + ".tmp", out);
  }
  rep.out = out;
  rep.lines = mf.rows.size();
  for (const PlotPanel& p : panels) rep.panels.push_back(p.title);
  return rep;
}

}  // namespace mt
