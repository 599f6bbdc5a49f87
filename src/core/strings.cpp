// String helpers (strings.h).
#include "core/strings.h"

#include <algorithm>
#include <cctype>
#include <utility>

namespace mt {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::vector<std::string> near_names(const std::string& key, const std::vector<std::string>& names, size_t limit) {
  auto dashes = [](std::string s) {
    std::replace(s.begin(), s.end(), '_', '-');
    return s;
  };
  const std::string k = dashes(key);
  std::vector<std::pair<size_t, std::string>> hits;
  for (const std::string& name : names) {
    const std::string n = dashes(name);
    const size_t d = edit_distance(k, n);
    const bool near = d <= std::max<size_t>(2, n.size() / 4) || (k.size() >= 3 && n.find(k) != std::string::npos) ||
                      (n.size() >= 3 && k.find(n) != std::string::npos) || (k.size() >= 2 && k.rfind(n, 0) == 0);
    if (near) hits.emplace_back(d, name);
  }
  std::stable_sort(hits.begin(), hits.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::string> out;
  for (const auto& h : hits)
    if (std::find(out.begin(), out.end(), h.second) == out.end()) out.push_back(h.second);
  if (out.size() > limit) out.resize(limit);
  return out;
}

std::optional<bool> bool_word(const std::string& v) {
  std::string s = v;
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (s == "on" || s == "true" || s == "yes" || s == "1") return true;
  if (s == "off" || s == "false" || s == "no" || s == "0") return false;
  return std::nullopt;
}

}  // namespace mt
