// Rewards (rewards.h): the built-in checkers and the external reward program.
#include "rl/rewards/rewards.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "core/error.h"
#include "core/log.h"

namespace mt::rl {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string squeeze(std::string_view s) {  // without whitespace and $
  std::string out;
  for (char c : s)
    if (!std::isspace(static_cast<unsigned char>(c)) && c != '$') out.push_back(c);
  return out;
}

std::optional<double> parse_plain(const std::string& s) {
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || errno == ERANGE || !std::isfinite(v)) return std::nullopt;
  return v;
}

// A number as a final answer is written: 42, -3.5, +7, 1,234, 3/4, $12$.
std::optional<double> parse_number(std::string_view text) {
  std::string s = squeeze(text);
  if (!s.empty() && s[0] == '+') s.erase(0, 1);
  s.erase(std::remove(s.begin(), s.end(), ','), s.end());
  if (s.empty() || s.find_first_of("0123456789") == std::string::npos) return std::nullopt;
  const size_t slash = s.find('/');
  if (slash != std::string::npos) {
    const auto a = parse_plain(s.substr(0, slash)), b = parse_plain(s.substr(slash + 1));
    if (!a || !b || *b == 0) return std::nullopt;
    return *a / *b;
  }
  return parse_plain(s);
}

}  // namespace

double exact_match_reward(std::string_view response, std::string_view answer) {
  return trim(response) == trim(answer) ? 1.0 : 0.0;
}

std::optional<std::string> extract_final_answer(std::string_view r) {
  const size_t box = r.rfind("\\boxed{");
  if (box != std::string_view::npos) {
    int depth = 1;
    const size_t begin = box + 7;
    for (size_t i = begin; i < r.size(); ++i) {
      if (r[i] == '{') ++depth;
      if (r[i] == '}' && --depth == 0) return std::string(trim(r.substr(begin, i - begin)));
    }
    // An unclosed \boxed{: fall back to the last number.
  }
  // The last run of number characters that holds a digit.
  auto is_num = [](char c) {
    return std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == ',' || c == '/' || c == '-' || c == '+';
  };
  size_t end = r.size();
  while (end > 0) {
    while (end > 0 && !is_num(r[end - 1])) --end;
    size_t begin = end;
    while (begin > 0 && is_num(r[begin - 1])) --begin;
    std::string tok(r.substr(begin, end - begin));
    while (!tok.empty() &&
           (tok.back() == '.' || tok.back() == ',' || tok.back() == '-' || tok.back() == '+' || tok.back() == '/'))
      tok.pop_back();  // the sentence's full stop, a trailing comma
    if (tok.find_first_of("0123456789") != std::string::npos) return tok;
    end = begin;
  }
  return std::nullopt;
}

bool answers_equivalent(std::string_view a, std::string_view b) {
  const auto x = parse_number(a), y = parse_number(b);
  if (x && y) return std::abs(*x - *y) <= 1e-9 * std::max(1.0, std::abs(*y));
  return squeeze(a) == squeeze(b) && !squeeze(a).empty();
}

double math_reward(std::string_view response, std::string_view answer) {
  const auto got = extract_final_answer(response);
  return got && answers_equivalent(*got, answer) ? 1.0 : 0.0;
}

// ---- the external program ----

namespace {

// A program's line as an error quotes it: at most 200 characters.
std::string quoted(const std::string& line) {
  return "'" + (line.size() > 200 ? line.substr(0, 200) + "..." : line) + "'";
}

// How long a batch whose replies are matched by position and held a line that was not JSON waits for one more
// line (which makes that line a stray one, such as a banner, rather than a reply gone wrong).
constexpr double kOrderGraceS = 0.5;

constexpr const char* kReplyForms = "{\"id\": n, \"reward\": number}, or a number or {\"reward\": number} in order";

RewardProgramOptions checked(RewardProgramOptions opt) {
  if (!(opt.timeout_s > 0)) MT_THROW("reward program: the timeout (", opt.timeout_s, " s) must be > 0");
  return opt;
}

}  // namespace

RewardProgram::RewardProgram(RewardProgramOptions opt) : opt_(checked(std::move(opt))) {
  if (!opt_.function) proc_ = std::make_unique<ChildProcess>("reward program", opt_.command);
}

RewardBatch RewardProgram::score_function(const std::vector<RewardRequest>& batch) {
  const size_t n = batch.size();
  RewardBatch out{std::vector<double>(n, 0.0), std::vector<std::string>(n), 0, {}};
  try {
    const std::vector<double> r = opt_.function(batch);
    if (r.size() != n) {
      for (std::string& e : out.errors) e = str("the function returned ", r.size(), " rewards for ", n, " samples");
    } else {
      for (size_t i = 0; i < n; ++i) {
        if (std::isfinite(r[i]))
          out.rewards[i] = r[i];
        else
          out.errors[i] = str("reward ", r[i], " is not finite");
      }
    }
  } catch (const std::exception& e) {
    for (std::string& err : out.errors) err = str("the function raised: ", e.what());
  }
  account(batch, out);
  return out;
}

RewardProgram::~RewardProgram() = default;

RewardBatch RewardProgram::score(const std::vector<RewardRequest>& batch) {
  const size_t n = batch.size();
  RewardBatch out{std::vector<double>(n, 0.0), std::vector<std::string>(n), 0, {}};
  if (n == 0) return out;
  if (!proc_) return score_function(batch);
  ChildProcess& proc = *proc_;
  // Lines written after the last batch was complete answer nothing here.
  auto stray = [&](const std::string& why) { out.stray.push_back(why); };
  {
    std::istringstream left(proc.take_leftover());
    for (std::string line; std::getline(left, line);)
      if (line.find_first_not_of(" \t\r") != std::string::npos)
        stray(str("line ", quoted(line), " came after the previous batch was answered"));
  }
  std::string send;
  for (size_t i = 0; i < n; ++i)
    // The id is the index in the batch: the same batch is the same lines, whatever the program's past (a resumed
    // run asks exactly what the run that never stopped asked).
    send += nlohmann::json{{"id", int64_t(i)},
                           {"prompt", batch[i].prompt},
                           {"response", batch[i].response},
                           {"metadata", batch[i].metadata}}
                .dump() +
            "\n";

  // A sample is answered by the reply with its id (any order), or by position among the replies without an
  // id. A line that is no reply (not JSON, or JSON that is neither a number nor an object with "reward") is
  // no reply once the program has answered by id; before that it may be a reply gone wrong (its sample fails,
  // quoting it) or a stray line such as a banner (every later reply would be one off): the batch tells them
  // apart by counting lines, waiting briefly for one more line when the count is full.
  auto reward_of = [](const nlohmann::json& v) -> std::optional<double> {
    if (!v.is_number() || !std::isfinite(v.get<double>())) return std::nullopt;
    return v.get<double>();
  };
  std::vector<char> by_id(n, 0);  // answered by a reply with its id
  size_t id_count = 0;
  bool ids_seen = false;
  struct Line {
    std::string text;
    nlohmann::json value;  // discarded: not JSON
    bool reply_like;       // a number, or an object with "reward"
  };
  auto line_of = [](const std::string& text) {
    Line l{text, nlohmann::json::parse(text, nullptr, false), false};
    l.reply_like = l.value.is_number() || (l.value.is_object() && l.value.contains("reward"));
    return l;
  };
  auto not_a_reply = [](const Line& l) {
    return str(quoted(l.text), l.value.is_discarded() ? " is not JSON" : " is not a reply", " (expected ", kReplyForms,
               "; logs belong on stderr)");
  };
  std::vector<Line> seq;  // lines matched by position, in arrival order
  auto ordered_count = [&] {
    size_t c = 0;
    for (const Line& l : seq) c += ids_seen && !l.reply_like ? 0 : 1;
    return c;
  };
  auto on_line = [&](const std::string& line) {
    Line l = line_of(line);
    const nlohmann::json& j = l.value;
    if (j.is_object() && j.contains("id")) {
      ids_seen = true;
      const nlohmann::json& id = j["id"];
      const int64_t k = id.is_number_integer() ? id.get<int64_t>() : -1;
      if (k < 0 || k >= int64_t(n)) {
        stray(str("reply ", quoted(line), " has id ", id.dump(), ", which is no request of this batch (ids 0..", n - 1,
                  ")"));
      } else if (by_id[size_t(k)]) {
        out.errors[size_t(k)] = str("a second reply ", quoted(line), " for request id ", k, ", already answered");
      } else {
        const size_t i = size_t(k);
        by_id[i] = 1;
        ++id_count;
        const auto r = j.contains("reward") ? reward_of(j["reward"]) : std::nullopt;
        if (r)
          out.rewards[i] = *r;
        else
          out.errors[i] = str("malformed reply ", quoted(line), " (expected ", kReplyForms, ")");
      }
    } else {
      seq.push_back(std::move(l));
    }
    return id_count + ordered_count() >= n;
  };
  const std::string failure = proc.exchange(send, opt_.timeout_s, on_line);
  auto has_text_line = [&] {
    for (const Line& l : seq)
      if (!l.reply_like) return true;
    return false;
  };
  const bool in_doubt = !ids_seen && has_text_line();
  if (in_doubt && failure.empty()) {
    // One more line within the grace means a line that was no reply was extra (a banner), not a reply gone wrong.
    proc.exchange("", std::min(opt_.timeout_s, kOrderGraceS), [&](const std::string& line) {
      seq.push_back(line_of(line));
      return true;
    });
  }
  // The lines matched by position: the samples without a reply by id, in order. Lines that are no reply are
  // stray when the program answers by id, and the first ones are extra when there are more lines than samples.
  std::vector<size_t> slots;
  for (size_t i = 0; i < n; ++i)
    if (!by_id[i]) slots.push_back(i);
  size_t extra = seq.size() > slots.size() ? seq.size() - slots.size() : 0;
  std::vector<const Line*> matched;
  bool took_place = false;
  for (const Line& l : seq) {
    if (!l.reply_like && (ids_seen || extra > 0)) {
      stray("line " + not_a_reply(l));
      if (!ids_seen) --extra;
      continue;
    }
    took_place = took_place || !l.reply_like;
    matched.push_back(&l);
  }
  for (size_t k = 0; k < slots.size(); ++k) {
    const size_t i = slots[k];
    if (k >= matched.size()) {
      out.errors[i] = failure.empty()     ? str("no reply (", kReplyForms, ")")
                      : out.stray.empty() ? failure
                                          : str(failure, "; before that it wrote ", out.stray.size(),
                                                " line(s) that were no reply: ", out.stray.front());
      continue;
    }
    const Line& l = *matched[k];
    const auto r = reward_of(l.value.is_object() && l.value.contains("reward") ? l.value["reward"] : l.value);
    if (r)
      out.rewards[i] = *r;
    else if (!l.reply_like)
      out.errors[i] = str("malformed reply ", quoted(l.text), " where the reply for request id ", i,
                          " was due: ", l.value.is_discarded() ? "not JSON" : "not a reply", " (expected ", kReplyForms,
                          "; logs belong on stderr)");
    else
      out.errors[i] = str("malformed reply ", quoted(l.text), " (expected ", kReplyForms, ")");
  }
  for (size_t k = slots.size(); k < matched.size(); ++k)
    stray(str("reply ", quoted(matched[k]->text), " has no id and every request of the batch was answered"));
  // A line that was no reply took a sample's place: had it been a stray line after all, the reply it displaced
  // would come later and be read as the next batch's first; start the program afresh instead.
  if (took_place) proc.stop();
  account(batch, out);
  return out;
}

void RewardProgram::account(const std::vector<RewardRequest>& batch, RewardBatch& out) {
  const size_t n = batch.size();
  const char* what = opt_.function ? "reward function" : "reward program";
  for (size_t i = 0; i < n; ++i)
    if (!out.errors[i].empty()) {
      out.rewards[i] = 0;
      ++out.failures;
    }
  ++tally_.calls;
  tally_.items += int64_t(n);
  tally_.failures += out.failures;
  tally_.stray_lines += int64_t(out.stray.size());
  if (out.failures > 0 || !out.stray.empty()) {
    size_t first = 0;
    while (first < n && out.errors[first].empty()) ++first;
    std::string msg =
        first < n ? str(what, ": ", out.failures, " of ", n, " samples without a reward; sample ", first, ": ",
                        out.errors[first], " (response: '", batch[first].response.substr(0, 80), "')")
                  : str(what, ": ", out.stray.front());
    if (first < n && !out.stray.empty()) msg += str("; and ", out.stray.size(), " stray line(s): ", out.stray.front());
    tally_.note(msg);
    if (opt_.stop_on_error) MT_THROW(msg);
    log_info("warning: ", msg, first < n ? "; they get reward 0" : "");
  }
}

}  // namespace mt::rl
