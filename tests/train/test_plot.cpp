// Tests for `moetrain plot` (train/plot.h): nice tick values, the panels a train and a grpo
// metrics.jsonl give (and the ones they do not), the SVG checked as XML (balanced tags, quoted
// attributes, finite coordinates inside the picture) with one polyline per series holding one point
// per line, the errors for missing, empty and malformed files (with the line number), and the command.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include "parallel/launch_test_util.h"
#include "test_util.h"
#include "train/plot.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

// A metrics.jsonl as `moetrain train` writes it: `steps` step lines (loss from 3.5 down to ~0.02)
// and an evaluation every 10 steps.
std::vector<nlohmann::json> train_rows(int steps) {
  std::vector<nlohmann::json> rows;
  for (int s = 1; s <= steps; ++s) {
    const double loss = 0.02 + 3.48 * std::exp(-0.15 * (s - 1));
    rows.push_back({{"loss", loss},
                    {"ce", loss - 0.01},
                    {"aux", 0.0},
                    {"z_loss", 0.0},
                    {"grad_norm", 1.0 / s},
                    {"skipped", false},
                    {"tokens", 1024},
                    {"time_s", {{"forward", 0.01}, {"backward", 0.02}, {"optimizer", 0.001}, {"step", 0.035}}},
                    {"step", s},
                    {"lr", 1e-3 * s / steps},
                    {"tokens_per_s", 30000 + 10 * s},
                    {"gpu_peak_bytes", 0},
                    {"peak_rss_bytes", 2.5e8},
                    {"experts", {{"imbalance", 1.5}, {"imbalance_per_layer", {1.5, 1.4}}}}});
    if (s % 10 == 0) rows.push_back({{"event", "eval"}, {"step", s}, {"exact_match", 5.0 * s}, {"problems", 200}});
  }
  return rows;
}

// A metrics.jsonl as `moetrain grpo` writes it (no reference model: its KL and times are 0).
std::vector<nlohmann::json> grpo_rows(int steps) {
  std::vector<nlohmann::json> rows;
  for (int s = 1; s <= steps; ++s)
    rows.push_back({{"step", s},
                    {"lr", 1e-4},
                    {"reward_mean", 0.5 + 0.01 * s},
                    {"reward_std", 0.3},
                    {"reward_max", 1.0},
                    {"response_len_mean", 5.5},
                    {"response_len_max", 7},
                    {"loss", -0.01 * s},
                    {"policy_loss", -0.01 * s},
                    {"kl_loss", 0.0},
                    {"grad_norm", 0.2},
                    {"grad_norm_max", 0.3},
                    {"clip_low", 0.0},
                    {"clip_high", 0.01},
                    {"approx_kl", 1e-4 * s},
                    {"ref_kl", 0.0},
                    {"entropy", 0.8},
                    {"logprob_diff_mean", 1e-6},
                    {"logprob_diff_max", 1e-5},
                    {"rollout_tokens_per_s", 900.0},
                    {"train_tokens_per_s", 2000.0},
                    {"time_s",
                     {{"generate", 0.5},
                      {"reward", 0.001},
                      {"logprob", 0.1},
                      {"ref_logprob", 0.0},
                      {"update", 0.2},
                      {"weight_sync", 0.0}}},
                    {"elapsed_s", 1.0 * s}});
  return rows;
}

const PlotPanel* panel(const std::vector<PlotPanel>& ps, const std::string& title) {
  for (const PlotPanel& p : ps)
    if (p.title == title) return &p;
  return nullptr;
}
std::vector<std::string> labels(const PlotPanel& p) {
  std::vector<std::string> v;
  for (const PlotSeries& s : p.series) v.push_back(s.label);
  return v;
}

// A small XML check: tags balanced and properly nested, attribute values quoted, '&' only in
// entities, every coordinate attribute a finite number inside [0, width] x [0, height].
// Returns "" when the text passes, else what is wrong.
std::string check_svg(const std::string& svg) {
  std::vector<std::string> stack;
  double width = -1, height = -1;
  size_t i = 0;
  while (true) {
    const size_t lt = svg.find('<', i);
    const std::string text = svg.substr(i, lt == std::string::npos ? std::string::npos : lt - i);
    for (size_t a = text.find('&'); a != std::string::npos; a = text.find('&', a + 1))
      if (!std::regex_search(text.substr(a), std::regex("^&(amp|lt|gt|quot|apos);"))) return "bare & in text";
    if (lt == std::string::npos) break;
    if (svg.compare(lt, 5, "<?xml") == 0) {
      i = svg.find("?>", lt) + 2;
      continue;
    }
    const size_t gt = svg.find('>', lt);
    if (gt == std::string::npos) return "unterminated tag at " + std::to_string(lt);
    const std::string tag = svg.substr(lt + 1, gt - lt - 1);
    i = gt + 1;
    if (std::count(tag.begin(), tag.end(), '"') % 2) return "unbalanced quotes in <" + tag + ">";
    if (tag[0] == '/') {
      if (stack.empty() || stack.back() != tag.substr(1)) return "unexpected </" + tag.substr(1) + ">";
      stack.pop_back();
      continue;
    }
    const std::string name = tag.substr(0, tag.find_first_of(" \n/"));
    const bool self_closing = tag.back() == '/';
    std::map<std::string, std::string> attrs;
    static const std::regex kAttr("([a-zA-Z:-]+)=\"([^\"]*)\"");
    for (auto it = std::sregex_iterator(tag.begin(), tag.end(), kAttr); it != std::sregex_iterator(); ++it)
      attrs[(*it)[1]] = (*it)[2];
    if (name == "svg") width = std::stod(attrs["width"]), height = std::stod(attrs["height"]);
    for (const char* k : {"x", "y", "x1", "y1", "x2", "y2", "cx", "cy", "width", "height", "r"}) {
      auto a = attrs.find(k);
      if (a == attrs.end() || a->second.back() == '%') continue;
      size_t used = 0;
      const double v = std::stod(a->second, &used);
      if (used != a->second.size() || !std::isfinite(v))
        return str("attribute ", k, "=\"", a->second, "\" in <", name, ">");
      const bool is_x = k[0] == 'x' || std::string(k) == "cx" || std::string(k) == "width";
      if (v < 0 || v > (is_x ? width : height)) return str(k, " = ", v, " is outside the picture in <", name, ">");
    }
    if (attrs.count("points")) {
      std::istringstream ps(attrs["points"]);
      std::string pt;
      while (ps >> pt) {
        const size_t comma = pt.find(',');
        if (comma == std::string::npos) return "point without a comma: " + pt;
        const double x = std::stod(pt.substr(0, comma)), y = std::stod(pt.substr(comma + 1));
        if (!std::isfinite(x) || !std::isfinite(y) || x < 0 || x > width || y < 0 || y > height)
          return "point outside the picture: " + pt;
      }
    }
    if (!self_closing) stack.push_back(name);
  }
  if (!stack.empty()) return "unclosed <" + stack.back() + ">";
  return width > 0 && height > 0 ? "" : "no <svg> with a width and a height";
}

// panel title -> series label -> number of points of its polyline.
std::map<std::string, std::map<std::string, size_t>> polylines(const std::string& svg) {
  std::map<std::string, std::map<std::string, size_t>> out;
  static const std::regex kPanel("<g class=\"panel\" data-title=\"([^\"]*)\">");
  static const std::regex kLine("<polyline class=\"series\" data-label=\"([^\"]*)\"[^>]*points=\"([^\"]*)\"");
  std::vector<std::pair<size_t, std::string>> panels;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), kPanel); it != std::sregex_iterator(); ++it)
    panels.emplace_back(size_t(it->position()), (*it)[1]);
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), kLine); it != std::sregex_iterator(); ++it) {
    std::string title;
    for (auto& [pos, t] : panels)
      if (pos < size_t(it->position())) title = t;
    const std::string pts = (*it)[2];
    out[title][(*it)[1]] = pts.empty() ? 0 : size_t(std::count(pts.begin(), pts.end(), ' ')) + 1;
  }
  return out;
}

std::string write_jsonl(const std::string& dir, const std::vector<nlohmann::json>& rows) {
  fs::create_directories(dir);
  std::ofstream f(dir + "/metrics.jsonl", std::ios::trunc);
  for (const auto& r : rows) f << r.dump() << "\n";
  return dir + "/metrics.jsonl";
}

}  // namespace

TEST(Plot, NiceTicks) {
  EXPECT_EQ(nice_ticks(0, 1), (std::vector<double>{0, 0.2, 0.4, 0.6, 0.8, 1.0}));
  EXPECT_EQ(nice_ticks(1, 100, 6), (std::vector<double>{0, 20, 40, 60, 80, 100}));
  EXPECT_EQ(nice_ticks(-0.3, 0.25, 5), (std::vector<double>{-0.3, -0.2, -0.1, 0, 0.1, 0.2, 0.3}));
  EXPECT_EQ(nice_ticks(0.3, 0.3), (std::vector<double>{0.27, 0.28, 0.29, 0.3, 0.31, 0.32, 0.33}));
  for (auto [lo, hi] :
       std::vector<std::pair<double, double>>{{0.13, 3.7}, {1e-7, 3e-6}, {12345, 98765}, {5, 5}, {0, 0}}) {
    const std::vector<double> t = nice_ticks(lo, hi);
    ASSERT_GE(t.size(), 2u) << lo << " " << hi;
    EXPECT_LE(t.front(), lo);
    EXPECT_GE(t.back(), hi);
    EXPECT_LE(t.size(), 12u);
    const double step = t[1] - t[0];
    const double mant = step / std::pow(10.0, std::floor(std::log10(step)));
    EXPECT_TRUE(std::fabs(mant - 1) < 1e-9 || std::fabs(mant - 2) < 1e-9 || std::fabs(mant - 5) < 1e-9)
        << "step " << step;
  }
}

TEST(Plot, TrainMetricsGiveTheirPanels) {
  const std::vector<PlotPanel> ps = metrics_panels(train_rows(50));
  const PlotPanel* loss = panel(ps, "loss");
  ASSERT_NE(loss, nullptr);
  EXPECT_EQ(labels(*loss), (std::vector<std::string>{"loss", "cross-entropy"}));
  EXPECT_EQ(loss->series[0].points.size(), 50u);
  EXPECT_TRUE(loss->log_y) << "3.5 -> 0.02 spans > 30x";
  const PlotPanel* ev = panel(ps, "held-out exact match (%)");
  ASSERT_NE(ev, nullptr);
  ASSERT_EQ(ev->series[0].points.size(), 5u);
  EXPECT_EQ(ev->series[0].points[2], std::make_pair(30.0, 150.0));
  ASSERT_NE(panel(ps, "throughput (tokens/s)"), nullptr);
  EXPECT_EQ(labels(*panel(ps, "step time (s)")),
            (std::vector<std::string>{"step", "forward", "backward", "optimizer"}));
  ASSERT_NE(panel(ps, "gradient norm"), nullptr);
  ASSERT_NE(panel(ps, "learning rate"), nullptr);
  ASSERT_NE(panel(ps, "expert load (max / mean)"), nullptr);
  EXPECT_EQ(labels(*panel(ps, "peak memory (GB)")), std::vector<std::string>{"RSS peak"}) << "GPU peak is all 0";
  EXPECT_DOUBLE_EQ(panel(ps, "peak memory (GB)")->series[0].points[0].second, 0.25);
  EXPECT_EQ(panel(ps, "router losses"), nullptr) << "aux and z_loss are all 0";
  EXPECT_EQ(panel(ps, "reward"), nullptr);
  EXPECT_EQ(panel(ps, "policy"), nullptr);
}

TEST(Plot, GrpoMetricsGiveTheirPanels) {
  const std::vector<PlotPanel> ps = metrics_panels(grpo_rows(12));
  ASSERT_NE(panel(ps, "reward"), nullptr);
  EXPECT_EQ(labels(*panel(ps, "reward")), (std::vector<std::string>{"mean", "max", "std"}));
  EXPECT_EQ(panel(ps, "reward")->series[0].points.size(), 12u);
  ASSERT_NE(panel(ps, "loss"), nullptr);
  EXPECT_FALSE(panel(ps, "loss")->log_y) << "negative values";
  EXPECT_EQ(labels(*panel(ps, "loss")), (std::vector<std::string>{"loss", "policy loss"})) << "KL loss is all 0";
  EXPECT_EQ(labels(*panel(ps, "step time (s)")),
            (std::vector<std::string>{"generate", "reward", "log-probs", "update"}));
  EXPECT_EQ(labels(*panel(ps, "throughput (tokens/s)")), (std::vector<std::string>{"rollout", "train"}));
  EXPECT_EQ(labels(*panel(ps, "gradient norm")), (std::vector<std::string>{"grad norm", "max over updates"}));
  ASSERT_NE(panel(ps, "entropy"), nullptr);
  ASSERT_NE(panel(ps, "policy"), nullptr);
  ASSERT_NE(panel(ps, "rollout vs trainer log-prob gap"), nullptr);
  ASSERT_NE(panel(ps, "response length (tokens)"), nullptr);
  EXPECT_EQ(panel(ps, "held-out exact match (%)"), nullptr);
  EXPECT_EQ(panel(ps, "expert load (max / mean)"), nullptr);
  // The first grpo files wrote flat times.
  const std::vector<PlotPanel> old = metrics_panels({{{"step", 1}, {"generate_s", 0.5}, {"update_s", 0.25}}});
  ASSERT_EQ(old.size(), 1u);
  EXPECT_EQ(labels(old[0]), (std::vector<std::string>{"generate", "update"}));
  // A loss that is all 0 (no informative group yet) is still drawn; the KL term switched off is not.
  std::vector<nlohmann::json> flat = grpo_rows(3);
  for (auto& r : flat) r["loss"] = r["policy_loss"] = 0.0;
  EXPECT_EQ(labels(*panel(metrics_panels(flat), "loss")), (std::vector<std::string>{"loss", "policy loss"}));
}

TEST(Plot, SvgIsWellFormedWithOnePolylinePerSeries) {
  for (const auto& rows : {train_rows(50), grpo_rows(12), train_rows(1)}) {
    const std::vector<PlotPanel> ps = metrics_panels(rows);
    const std::string svg = render_svg(ps, "run <a & b>");
    EXPECT_EQ(check_svg(svg), "");
    EXPECT_NE(svg.find("run &lt;a &amp; b&gt;"), std::string::npos);
    const auto lines = polylines(svg);
    size_t n_series = 0;
    for (const PlotPanel& p : ps) {
      ASSERT_TRUE(lines.count(p.title)) << p.title;
      for (const PlotSeries& s : p.series) {
        ++n_series;
        ASSERT_TRUE(lines.at(p.title).count(s.label)) << p.title << " / " << s.label;
        EXPECT_EQ(lines.at(p.title).at(s.label), s.points.size()) << p.title << " / " << s.label;
      }
      EXPECT_EQ(lines.at(p.title).size(), p.series.size());
      EXPECT_NE(svg.find(">" + p.title), std::string::npos) << "panel title " << p.title;
    }
    EXPECT_GT(n_series, 5u);
  }
  // A damaged document fails the check (the check can fail).
  const std::string svg = render_svg(metrics_panels(grpo_rows(3)), "x");
  EXPECT_NE(check_svg(svg.substr(0, svg.size() - 8)), "");
  EXPECT_NE(check_svg(std::regex_replace(svg, std::regex("points=\"[0-9.]+"), "points=\"nan")), "");
}

TEST(Plot, NonNumbersAndMissingStepsAreHandled) {
  std::vector<nlohmann::json> rows = train_rows(4);
  rows[1]["loss"] = nullptr;  // a NaN loss is written as null
  rows[2]["grad_norm"] = "inf";
  rows[3].erase("step");  // the last step seen (3) is used
  const std::vector<PlotPanel> ps = metrics_panels(rows);
  EXPECT_EQ(panel(ps, "loss")->series[0].points.size(), 3u);
  EXPECT_EQ(panel(ps, "gradient norm")->series[0].points.size(), 3u);
  EXPECT_EQ(panel(ps, "loss")->series[0].points.back().first, 3.0);
  EXPECT_EQ(check_svg(render_svg(ps, "t")), "");
}

TEST(Plot, FileErrorsNameTheFileAndLine) {
  const std::string dir = test::tmp_path("plot", "errors");
  fs::create_directories(dir);
  const std::string path = dir + "/metrics.jsonl";
  fs::remove(path);
  EXPECT_NE(testutil::error_of([&] { read_metrics_jsonl(path); }).find(path + " does not exist"), std::string::npos);
  { std::ofstream(path, std::ios::trunc); }
  EXPECT_NE(testutil::error_of([&] { read_metrics_jsonl(path); }).find("has no metrics lines (the file is empty)"),
            std::string::npos);
  {
    std::ofstream f(path, std::ios::trunc);
    f << "{\"step\": 1, \"loss\": 2}\n\n{\"step\": 2, \"loss\": }\n{\"step\": 3}\n";
  }
  std::string msg = testutil::error_of([&] { read_metrics_jsonl(path); });
  EXPECT_NE(msg.find(path + ":3: not a JSON object"), std::string::npos) << msg;
  {
    std::ofstream f(path, std::ios::trunc);
    f << "{\"step\": 1, \"loss\": 2}\n[1, 2]\n";
  }
  msg = testutil::error_of([&] { read_metrics_jsonl(path); });
  EXPECT_NE(msg.find(path + ":2: not a JSON object (a JSON array, not an object)"), std::string::npos) << msg;
  // A run killed mid-line: the cut last line is skipped with a warning.
  {
    std::ofstream f(path, std::ios::trunc);
    f << "{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\": 1}\n{\"step\": 3, \"lo";
  }
  const MetricsFile mf = read_metrics_jsonl(path);
  EXPECT_EQ(mf.rows.size(), 2u);
  EXPECT_NE(mf.warning.find(path + ":3: the last line is incomplete"), std::string::npos) << mf.warning;
  fs::remove_all(dir);
}

TEST(Plot, CommandWritesTheSvg) {
  const std::string dir = test::tmp_path("plot", "run");
  write_jsonl(dir, train_rows(30));
  fs::remove(dir + "/metrics.svg");
  test::ShellRun r = test::sh(test::kMoetrainBin + " plot " + dir);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("plot: 8 panels (loss, held-out exact match (%), throughput"), std::string::npos) << r.out;
  std::ifstream f(dir + "/metrics.svg");
  const std::string svg((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(check_svg(svg), "");
  EXPECT_EQ(polylines(svg)["loss"]["loss"], 30u);

  r = test::sh(test::kMoetrainBin + " plot " + dir + "/metrics.jsonl --out " + dir + "/sub/curves.svg");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(dir + "/sub/curves.svg"));
  // PNG through rsvg-convert when it is installed, else an error that says what to install.
  r = test::sh(test::kMoetrainBin + " plot " + dir + " --out " + dir + "/curves.png");
  if (test::sh("command -v rsvg-convert").code == 0) {
    ASSERT_EQ(r.code, 0) << r.out;
    std::ifstream png(dir + "/curves.png", std::ios::binary);
    char sig[8] = {};
    png.read(sig, 8);
    EXPECT_EQ(std::string(sig, 8), std::string("\x89PNG\r\n\x1a\n", 8));
    EXPECT_TRUE(fs::exists(dir + "/curves.svg"));
  } else {
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.out.find("rsvg-convert, which is not on PATH"), std::string::npos) << r.out;
  }
  r = test::sh(test::kMoetrainBin + " plot " + dir + " --out " + dir + "/curves.pdf");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("curves.pdf: the file must end in .svg or .png"), std::string::npos) << r.out;
  r = test::sh(test::kMoetrainBin + " plot /no/such/run");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("/no/such/run is neither a run directory nor a metrics file"), std::string::npos) << r.out;
  write_jsonl(dir, {{{"step", 1}, {"unrelated", 2}}});
  r = test::sh(test::kMoetrainBin + " plot " + dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("has 1 line but none of the fields plotted"), std::string::npos) << r.out;
  fs::remove_all(dir);
}
