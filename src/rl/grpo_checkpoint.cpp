// A grpo run's checkpoint records (grpo_checkpoint.h).
#include "rl/grpo_checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "train/checkpoint.h"
#include "train/run_dir.h"

namespace mt::rl {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The reference model's files as they were: name, size and modification time of every regular file in
// its directory (cheap at any model size; a file rewritten in place changes its mtime).
json model_fingerprint(const std::string& dir) {
  json files = json::array();
  std::vector<fs::path> paths;
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec))
    if (it->is_regular_file()) paths.push_back(it->path());
  if (ec) MT_THROW("grpo: cannot list the model directory ", dir, ": ", ec.message());
  std::sort(paths.begin(), paths.end());
  for (const fs::path& p : paths) {
    struct stat sb {};
    if (::stat(p.c_str(), &sb) != 0) MT_THROW("grpo: cannot stat ", p.string(), ": ", std::strerror(errno));
    files.push_back({{"name", p.filename().string()},
                     {"size", int64_t(sb.st_size)},
                     {"mtime_ns", int64_t(sb.st_mtim.tv_sec) * 1000000000 + int64_t(sb.st_mtim.tv_nsec)}});
  }
  return files;
}

// "" when `now` equals `saved`, else what changed (the first difference).
std::string fingerprint_change(const json& saved, const json& now) {
  std::map<std::string, json> a, b;
  for (const json& e : saved) a[e.at("name").get<std::string>()] = e;
  for (const json& e : now) b[e.at("name").get<std::string>()] = e;
  for (const auto& [name, e] : a) {
    auto it = b.find(name);
    if (it == b.end()) return name + " is gone";
    if (it->second.at("size") != e.at("size"))
      return str(name, " has ", it->second.at("size").get<int64_t>(), " bytes, it had ", e.at("size").get<int64_t>());
    if (it->second.at("mtime_ns") != e.at("mtime_ns")) return name + " was modified (its mtime changed)";
  }
  for (const auto& [name, e] : b)
    if (!a.count(name)) return name + " is new";
  return "";
}

// The command line a checkpoint records (less the options that may change between a save and its resume:
// the layout too, since the state is resharded on resume).
json recorded_args(const std::vector<std::string>& args) {
  static const std::set<std::string> kFree = {"--max-steps", "--save-every", "--keep-last",     "--device",
                                              "--threads",   "--dp-shard",   "--dp-replicate",  "--ep",
                                              "--tp",        "--sp",         "--comm-timeout-s"};
  json out = json::array();
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const bool inline_value = a.find('=') != std::string::npos;  // --key=value: one argument
    const std::string key = a.substr(0, a.find('='));
    if (kFree.count(key)) {
      if (!inline_value) ++i;
      continue;
    }
    if (key == "--resume") {
      if (!inline_value && i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) ++i;
      continue;
    }
    out.push_back(a);
  }
  return out;
}

GrpoResumePoint find_grpo_resume(const std::string& run_dir, const std::string& resume, const std::string& model_dir,
                                 bool model_given, bool from_file, bool ppo, const nlohmann::json& args) {
  GrpoResumePoint out;
  // Before any session (each process reads the run directory itself): the resume point of this process.
  out.dir = resume_checkpoint(run_dir, resume, nullptr, "grpo: ");
  if (!out.dir.empty()) {
    out.state = read_train_state(out.dir);
    if (out.state.value("format", std::string()) != "moetrain-grpo-state-1")
      MT_THROW("grpo: resume: ", out.dir, " holds a '", out.state.value("format", std::string("?")),
               "' state, not a grpo run's (moetrain-grpo-state-1)");
    const std::string saved_model = out.state.at("model_dir").get<std::string>();
    out.model_dir = saved_model;
    if (model_given && fs::weakly_canonical(model_dir) != fs::weakly_canonical(saved_model))
      MT_THROW("grpo: resume: --model ", model_dir, ", but the run being resumed started from ", saved_model,
               " (its reference model); drop --model or give that directory");
    if (out.state.at("mode").get<std::string>() != (from_file ? "prompts" : "task"))
      MT_THROW("grpo: resume: ", out.dir, " is a ",
               out.state.at("mode").get<std::string>() == "prompts" ? "run on --prompts; give the same --prompts"
                                                                    : "run on the built-in task; drop --prompts");
    if (out.state.contains("critic") != ppo)
      MT_THROW("grpo: resume: ", out.dir,
               ppo ? " has no critic: it was not an --algorithm ppo run"
                   : " holds a critic: resume it with --algorithm ppo");
    // --model is checked above on its own (a resume may leave it out): the other options are compared.
    auto without_model = [](json a) {
      for (size_t k = 0; k + 1 < a.size(); ++k)
        if (a[k] == "--model") a.erase(a.begin() + std::ptrdiff_t(k), a.begin() + std::ptrdiff_t(k) + 2);
      return a;
    };
    if (without_model(out.state.value("args", json::array())) != without_model(args))
      log_info("grpo: resume: warning: the options differ from the saved run's (", out.state["args"].dump(), " -> ",
               args.dump(), ")");
  }
  return out;
}

std::string save_grpo_checkpoint(const std::string& run_dir, int64_t step, TrainSession& session, TrainSession* critic,
                                 const std::string& tokenizer_json, json st, int64_t keep_last) {
  DistContext& dist = session.dist();
  const DeviceMesh& dm = dist.mesh();
  const json layout = {{"world_size", dist.world_size()},
                       {"dp_replicate", dm.size(Axis::DpReplicate)},
                       {"dp_shard", dm.size(Axis::DpShard)},
                       {"ep", dm.size(Axis::Ep)},
                       {"tp", dm.size(Axis::Tp)}};
  AdamW& opt = session.optimizer();
  st["session_steps"] = session.steps_done();
  st["optimizer_steps"] = opt.steps_taken();
  st["skipped_steps"] = opt.steps_skipped();
  LoraAdapters* lora = session.lora();
  st["flat_numel"] = lora ? lora->table().total() : session.table().total();
  if (lora) {
    st["lora"] = json(lora_state_json(lora->spec()));
    // The base, for convert --merge: the initial model, or a preset and the seed of its init.
    if (st.contains("model_dir")) st["lora"]["base"] = st["model_dir"];
    if (st.contains("model_fingerprint") && st["model_fingerprint"].contains("preset"))
      st["lora"]["base_seed"] = st["model_fingerprint"]["seed"];
  }
  st["layout"] = layout;
  if (critic) {
    AdamW& copt = critic->optimizer();
    st["critic"] = {{"dir", "critic"},
                    {"optimizer_steps", copt.steps_taken()},
                    {"skipped_steps", copt.steps_skipped()},
                    {"session_steps", critic->steps_done()}};
  }
  // The run's state, then the critic's in critic/; their train_state.json keep the keys in name order (a json
  // object's), as grpo checkpoints always had them.
  std::vector<CheckpointState> states = {checkpoint_state(session, "", nlohmann::ordered_json(st))};
  if (critic)
    states.push_back(checkpoint_state(
        *critic, "critic",
        nlohmann::ordered_json(
            json{{"format", "moetrain-grpo-critic-1"}, {"flat_numel", critic->table().total()}, {"layout", layout}})));
  CheckpointWeights weights = checkpoint_weights(session);
  weights.tokenizer_json = tokenizer_json;
  if (st.contains("model_dir")) weights.lora_base = st["model_dir"].get<std::string>();
  return save_checkpoint(run_dir, step, weights, states, keep_last, dist, "grpo: ");
}

json initial_model_fingerprint(const std::string& model_dir, const json* saved_state) {
  if (!saved_state) return model_fingerprint(model_dir);
  const json saved = saved_state->at("model_fingerprint");
  const std::string why = fingerprint_change(saved, model_fingerprint(model_dir));
  if (!why.empty())
    MT_THROW("grpo: resume: the initial model ", model_dir, " changed since the run started (", why,
             "); it is the reference and the start of the run, so it must stay as it was");
  return saved;
}

}  // namespace mt::rl
