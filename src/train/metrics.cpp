// MetricsWriter and step_json (metrics.h).
#include "train/metrics.h"

#include <filesystem>

#include "core/error.h"
#include "core/log.h"
#include "io/tensorboard.h"

namespace mt {

MetricsWriter::MetricsWriter(const std::string& path, bool lead, bool tensorboard, int64_t resume_step)
    : path_(path) {
  if (!lead) return;
  namespace fs = std::filesystem;
  if (fs::path(path).has_parent_path()) fs::create_directories(fs::path(path).parent_path());
  std::string kept;
  if (resume_step >= 0) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) continue;  // a line cut when the earlier run died
      const bool later = j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
                         j["step"].get<int64_t>() > resume_step;
      if (later) continue;
      kept += line + "\n";
    }
    last_step_ = resume_step;
  }
  f_.open(path, std::ios::trunc);
  f_ << kept;
  if (!f_) MT_THROW("cannot open metrics file ", path);
  if (tensorboard) tb_ = std::make_unique<TensorBoardWriter>(fs::path(path).parent_path().string());
}

MetricsWriter::~MetricsWriter() = default;

std::string MetricsWriter::tensorboard_path() const {
  return tb_ ? tb_->path() : std::string();
}

void MetricsWriter::write(const nlohmann::json& j) {
  if (!f_.is_open()) return;
  f_ << j.dump() << "\n" << std::flush;
  if (!tb_) return;
  if (j.contains("step") && j["step"].is_number_integer()) last_step_ = j["step"].get<int64_t>();
  std::string prefix;
  nlohmann::json rest = j;
  if (rest.is_object()) {
    rest.erase("step");
    if (rest.contains("event") && rest["event"].is_string()) prefix = rest["event"].get<std::string>();
  }
  try {
    tb_->add_scalars(last_step_, json_scalars(rest, prefix));
  } catch (const Error& e) {
    log_info("warning: ", e.what(), "; TensorBoard logging stops here (", path_, " goes on)");
    tb_.reset();
  }
}

nlohmann::json step_json(const StepResult& r, const DistContext& dist) {
  nlohmann::json j{{"loss", r.loss},
                   {"ce", r.ce},
                   {"aux", r.aux},
                   {"z_loss", r.z},
                   {"grad_norm", r.opt.grad_norm},
                   {"clip_scale", r.opt.clip_scale},
                   {"skipped", r.opt.skipped},
                   {"tokens", r.tokens},
                   {"target_tokens", r.targets},
                   {"time_s", {{"forward", r.forward_s}, {"backward", r.backward_s}, {"optimizer", r.optimizer_s}}},
                   {"moe_dropped_rank0", r.dropped_rank0}};
  if (r.has_load)
    j["experts"] = {{"min", r.load.min},
                    {"max", r.load.max},
                    {"mean", r.load.mean},
                    {"imbalance", r.load.imbalance},
                    {"unused", r.load.unused},
                    {"layers", r.load.layers},
                    {"imbalance_per_layer", r.load.imbalance_per_layer}};
  if (dist.distributed()) {
    j["world_size"] = dist.world_size();
    j["dp_size"] = dist.dp_size();
    j["time_s"]["comm_wait_rank0"] = r.comm_wait_s;
    j["time_s"]["comm_wait_max"] = r.comm_wait_max_s;
    j["time_s"]["compute_rank0"] = r.forward_s + r.backward_s - r.comm_wait_s;
    j["peak_bytes_max_rank"] = r.peak_bytes_max_rank;
  }
  return j;
}

}  // namespace mt
