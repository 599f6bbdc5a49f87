// Training checkpoints: shards of the training state, commit by manifest and rename, the search for the
// newest good checkpoint, keep-last-N and weights-only older checkpoints, resharding on load (checkpoint.h).
#include "train/checkpoint.h"

#include <algorithm>
#include <array>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "core/error.h"
#include "core/log.h"
#include "io/manifest.h"
#include "io/safetensors.h"

namespace mt {

namespace fs = std::filesystem;

namespace {

// "checkpoint-N" -> N; -1 for any other name (checkpoint-N.tmp included).
int64_t step_of(const std::string& name) {
  const std::string prefix = "checkpoint-";
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return -1;
  int64_t v = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (INT64_MAX - 9) / 10) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

std::string shard_name(int rank) {
  return str("rank-", rank, ".safetensors");
}

constexpr const char* kWeightsOnlyWhy = "holds weights only (its training state was dropped as an older checkpoint)";

// Why `dir` cannot be resumed from ("" when it can): its manifest, then the training state in it.
std::string unusable(const std::string& dir) {
  std::string why = verify_manifest(dir, /*check_hashes=*/true);
  if (!why.empty()) return why;
  if (is_weights_only(dir)) return kWeightsOnlyWhy;
  if (!fs::is_regular_file(fs::path(dir) / kTrainStateFile))
    return str("no ", kTrainStateFile, " (a weights-only checkpoint: use --init-from to start from it)");
  if (!fs::is_directory(fs::path(dir) / kTrainStateDir)) return str("no ", kTrainStateDir, "/ directory");
  return "";
}

// The files reduce_to_weights drops (paths relative to the checkpoint, '/'-separated): the training state's
// file and everything below a subdirectory (train_state/, a grpo run's critic/).
// A LoRA run's weights: its adapters, a PEFT directory (train/run_dir.h), which a reduced checkpoint keeps.
constexpr const char* kAdapterDir = "adapter";

bool training_file(const std::string& rel) {
  if (rel.rfind(std::string(kAdapterDir) + "/", 0) == 0) return false;
  return rel == kTrainStateFile || rel.find('/') != std::string::npos;
}

// Whether a checkpoint still holds any file reduce_to_weights drops.
bool has_training_files(const std::string& dir) {
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec))
    if ((it->is_directory() && it->path().filename() != kAdapterDir) || it->path().filename() == kTrainStateFile)
      return true;
  return false;
}

nlohmann::ordered_json read_manifest_json(const std::string& dir) {
  const fs::path p = fs::path(dir) / kManifestFile;
  std::ifstream f(p);
  if (!f) MT_THROW("cannot open '", p.string(), "'");
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return nlohmann::ordered_json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    MT_THROW(p.string(), ": not valid JSON (", e.what(), ")");
  }
}

}  // namespace

std::string checkpoint_dir(const std::string& run_dir, int64_t step) {
  return (fs::path(run_dir) / str("checkpoint-", step)).string();
}

void begin_checkpoint(const std::string& tmp_dir) {
  std::error_code ec;
  fs::remove_all(tmp_dir, ec);
  if (ec) MT_THROW("cannot remove the unfinished checkpoint '", tmp_dir, "': ", ec.message());
  fs::create_directories(fs::path(tmp_dir) / kTrainStateDir, ec);
  if (ec) MT_THROW("cannot create checkpoint directory '", tmp_dir, "': ", ec.message());
}

void save_train_state_shard(const std::string& tmp_dir, int rank, const Tensor& master, const Tensor& exp_avg,
                            const Tensor& exp_avg_sq, const std::vector<FlatRange>& pieces) {
  MT_CHECK(master.numel() == exp_avg.numel() && master.numel() == exp_avg_sq.numel(), "save_train_state_shard: master ",
           master.desc(), ", exp_avg ", exp_avg.desc(), ", exp_avg_sq ", exp_avg_sq.desc(), " must have the same size");
  Tensor p = Tensor::empty({int64_t(pieces.size()), 3}, DType::I64);
  for (size_t i = 0; i < pieces.size(); ++i) {
    p.data<int64_t>()[3 * i] = pieces[i].begin;
    p.data<int64_t>()[3 * i + 1] = pieces[i].end;
    p.data<int64_t>()[3 * i + 2] = pieces[i].dst_offset;
  }
  const fs::path dir = fs::path(tmp_dir) / kTrainStateDir;
  std::error_code ec;
  fs::create_directories(dir, ec);  // ranks that do not create the checkpoint itself
  if (ec) MT_THROW("cannot create '", dir.string(), "': ", ec.message());
  write_safetensors((dir / shard_name(rank)).string(),
                    {{"master", master.view({-1})},
                     {"exp_avg", exp_avg.view({-1})},
                     {"exp_avg_sq", exp_avg_sq.view({-1})},
                     {"pieces", p}},
                    {{"rank", std::to_string(rank)}});
}

void commit_checkpoint(const std::string& tmp_dir, const std::string& final_dir) {
  write_manifest(tmp_dir);
  std::error_code ec;
  std::string aside;
  if (fs::exists(final_dir, ec)) {
    // An older checkpoint of the same step (an earlier run in this directory): moved aside, replaced,
    // then deleted, so that some complete checkpoint-N exists at every moment.
    aside = final_dir + ".replaced";
    fs::remove_all(aside, ec);
    rename_durable(final_dir, aside);
  }
  rename_durable(tmp_dir, final_dir);
  if (!aside.empty()) fs::remove_all(aside, ec);
}

ReshardReport load_train_state_shards(const std::string& ckpt_dir, int64_t table_total,
                                      const std::vector<FlatRange>& pieces, Tensor& master, Tensor& exp_avg,
                                      Tensor& exp_avg_sq) {
  const nlohmann::json st = read_train_state(ckpt_dir);
  ReshardReport rep;
  rep.saved_layout = st.contains("layout") ? st["layout"].dump() : std::string("?");
  const int64_t saved_total = st.value("flat_numel", int64_t(-1));
  if (saved_total != table_total)
    MT_THROW("checkpoint ", ckpt_dir, " holds a training state of ", saved_total, " parameters, this model has ",
             table_total, ": it was saved from another model");
  // Every saved piece, as (global begin, end, file, offset in the file's buffers), trimmed to a disjoint
  // cover of the flat layout (HSDP replicas and replicated parts hold the same elements twice).
  struct Src {
    int64_t begin, end;
    size_t file;
    int64_t offset;
  };
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::vector<Src> all;
  const fs::path sdir = fs::path(ckpt_dir) / kTrainStateDir;
  std::error_code ec;
  for (auto it = fs::directory_iterator(sdir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("rank-", 0) != 0 || !name.ends_with(".safetensors")) continue;
    files.push_back(std::make_unique<SafetensorsFile>(it->path().string()));
    const SafetensorsFile& f = *files.back();
    for (const char* t : {"master", "exp_avg", "exp_avg_sq", "pieces"})
      if (!f.has(t)) MT_THROW(f.path(), " lacks tensor '", t, "'; not a moetrain training-state shard");
    const int64_t n = shape_numel(f.info("master").shape);
    Tensor p = f.view("pieces");
    if (p.dtype() != DType::I64 || p.shape().size() != 2 || p.size(1) != 3)
      MT_THROW(f.path(), ": 'pieces' must be i64 [n, 3], got ", p.desc());
    for (int64_t i = 0; i < p.size(0); ++i) {
      const int64_t* r = p.data<int64_t>() + 3 * i;
      if (r[0] < 0 || r[1] > table_total || r[0] > r[1] || r[2] < 0 || r[2] + (r[1] - r[0]) > n)
        MT_THROW(f.path(), ": piece ", i, " [", r[0], ", ", r[1], ") at ", r[2], " is out of range (flat ", table_total,
                 ", shard ", n, ")");
      if (r[1] > r[0]) all.push_back({r[0], r[1], files.size() - 1, r[2]});
    }
  }
  if (ec) MT_THROW("cannot list '", sdir.string(), "': ", ec.message());
  if (files.empty()) MT_THROW("checkpoint ", ckpt_dir, " has no training-state shards in ", sdir.string());
  rep.shards = int(files.size());
  std::sort(all.begin(), all.end(), [](const Src& a, const Src& b) { return a.begin < b.begin; });
  std::vector<Src> cover;
  int64_t covered = 0;
  for (Src s : all) {
    if (s.end <= covered) continue;
    if (s.begin < covered) {
      s.offset += covered - s.begin;
      s.begin = covered;
    }
    cover.push_back(s);
    covered = s.end;
  }
  // Host staging on a device; on the CPU the buffers are filled in place.
  Tensor* dst[3] = {&master, &exp_avg, &exp_avg_sq};
  const char* names[3] = {"master", "exp_avg", "exp_avg_sq"};
  Tensor host[3];
  for (int k = 0; k < 3; ++k) {
    MT_CHECK(dst[k]->dtype() == DType::F32, "load_train_state_shards: ", names[k], " must be f32, got ",
             dst[k]->desc());
    host[k] = dst[k]->is_cpu() ? dst[k]->view({-1}) : dst[k]->to(Device::CPU).view({-1});
  }
  std::vector<std::array<Tensor, 3>> views(files.size());
  for (size_t f = 0; f < files.size(); ++f)
    for (int k = 0; k < 3; ++k) views[f][size_t(k)] = files[f]->view(names[k]).view({-1});
  for (const FlatRange& want : pieces) {
    int64_t at = want.begin;
    auto it = std::partition_point(cover.begin(), cover.end(), [&](const Src& s) { return s.end <= at; });
    while (at < want.end) {
      if (it == cover.end() || it->begin > at)
        MT_THROW("checkpoint ", ckpt_dir, ": no saved shard holds flat elements from ", at, " (this rank needs [",
                 want.begin, ", ", want.end, "))");
      const int64_t e = std::min(want.end, it->end), n = e - at;
      for (int k = 0; k < 3; ++k)
        host[k]
            .rows(want.dst_offset + (at - want.begin), n)
            .copy_from(views[it->file][size_t(k)].rows(it->offset + (at - it->begin), n));
      rep.elements += n;
      at = e;
      ++it;
    }
  }
  for (int k = 0; k < 3; ++k)
    if (!dst[k]->is_cpu()) dst[k]->copy_from(host[k].view(dst[k]->shape()));
  return rep;
}

std::vector<int64_t> list_checkpoints(const std::string& run_dir) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (auto it = fs::directory_iterator(run_dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const int64_t s = step_of(it->path().filename().string());
    if (s >= 0 && it->is_directory()) steps.push_back(s);
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

ResumePoint find_resume_checkpoint(const std::string& run_dir, const std::string& spec) {
  ResumePoint rp;
  if (spec != "latest") {
    const std::string why = fs::is_directory(spec) ? unusable(spec) : std::string("is not a directory");
    if (why == kWeightsOnlyWhy) {
      // Its run directory may hold a newer checkpoint that still has its training state.
      fs::path run = fs::path(spec).lexically_normal();
      if (run.filename().empty()) run = run.parent_path();
      const ResumePoint newest = find_resume_checkpoint(run.parent_path().string(), "latest");
      MT_THROW(spec, " ", kWeightsOnlyWhy, "; ", newest.dir.empty() ? "" : "resume from " + newest.dir + " or ",
               "start a new run with --init-from ", spec);
    }
    if (!why.empty()) MT_THROW("cannot resume from '", spec, "': ", why);
    rp.dir = spec;
    rp.step = read_train_state(spec).value("step", int64_t(0));
    return rp;
  }
  for (int64_t s : list_checkpoints(run_dir)) {
    const std::string dir = checkpoint_dir(run_dir, s);
    const std::string why = unusable(dir);
    if (why.empty()) {
      rp.dir = dir;
      rp.step = s;
      return rp;
    }
    rp.rejected.push_back(str("checkpoint-", s, ": ", why));
  }
  return rp;
}

std::vector<std::string> prune_checkpoints(const std::string& run_dir, int64_t keep_last) {
  std::vector<std::string> removed;
  std::error_code ec;
  if (keep_last > 0) {
    int64_t kept = 0;
    for (int64_t s : list_checkpoints(run_dir)) {
      const std::string dir = checkpoint_dir(run_dir, s);
      // Only complete checkpoints count as kept; broken ones older than the kept ones go too.
      if (kept < keep_last) {
        if (verify_manifest(dir, /*check_hashes=*/false).empty()) ++kept;
        continue;
      }
      fs::remove_all(dir, ec);
      if (ec) MT_THROW("keep_last: cannot remove '", dir, "': ", ec.message());
      removed.push_back(dir);
    }
  }
  // Leftovers of saves that were killed (checkpoint-N.tmp) or interrupted while replacing (.replaced).
  for (auto it = fs::directory_iterator(run_dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    for (const char* suffix : {".tmp", ".replaced"})
      if (name.rfind("checkpoint-", 0) == 0 && name.ends_with(suffix) &&
          step_of(name.substr(0, name.size() - std::string(suffix).size())) >= 0 && it->is_directory()) {
        removed.push_back(it->path().string());
      }
  }
  for (size_t i = 0; i < removed.size(); ++i)
    if (removed[i].ends_with(".tmp") || removed[i].ends_with(".replaced")) fs::remove_all(removed[i], ec);
  return removed;
}

std::vector<std::string> retain_checkpoints(const std::string& run_dir, int64_t keep_last, int64_t keep_full) {
  std::vector<std::string> done;
  if (keep_last <= 0) {
    int64_t full = 0;
    for (int64_t s : list_checkpoints(run_dir)) {
      const std::string dir = checkpoint_dir(run_dir, s);
      if (!verify_manifest(dir, /*check_hashes=*/false).empty()) continue;  // incomplete: not ours to judge
      if (is_weights_only(dir)) {
        if (has_training_files(dir)) reduce_to_weights(dir);  // a reduction that was cut short
        continue;
      }
      if (full < keep_full) {
        ++full;
        continue;
      }
      reduce_to_weights(dir);
      done.push_back(str("reduced ", dir, " to its weights (training state dropped)"));
    }
  }
  // keep_last > 0 deletes the older checkpoints; either way the leftovers of killed saves go.
  for (const std::string& r : prune_checkpoints(run_dir, keep_last)) done.push_back("removed " + r);
  return done;
}

void reduce_to_weights(const std::string& ckpt_dir) {
  nlohmann::ordered_json m = read_manifest_json(ckpt_dir);
  if (!m.is_object() || !m.contains("files") || !m["files"].is_array())
    MT_THROW(ckpt_dir, "/", kManifestFile, " lists no files; not a committed checkpoint");
  if (!(m.contains("weights_only") && m["weights_only"] == true)) {
    // The manifest first: should the process die before the files go, it already vouches only for the
    // weights, and the next call deletes the rest.
    nlohmann::ordered_json kept = nlohmann::ordered_json::array();
    for (const auto& f : m["files"])
      if (!f.is_object() || !f.contains("path") || !f["path"].is_string() ||
          !training_file(f["path"].get<std::string>()))
        kept.push_back(f);
    m["files"] = kept;
    m["weights_only"] = true;
    write_file_atomic((fs::path(ckpt_dir) / kManifestFile).string(), m.dump(1) + "\n");
    fsync_path(ckpt_dir, true);
  }
  std::vector<fs::path> drop;
  std::error_code ec;
  for (auto it = fs::directory_iterator(ckpt_dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec))
    if ((it->is_directory() && it->path().filename() != kAdapterDir) || it->path().filename() == kTrainStateFile)
      drop.push_back(it->path());
  if (ec) MT_THROW("cannot list '", ckpt_dir, "': ", ec.message());
  for (const fs::path& p : drop) {
    fs::remove_all(p, ec);
    if (ec) MT_THROW("keep_last: cannot remove '", p.string(), "': ", ec.message());
  }
}

bool is_weights_only(const std::string& ckpt_dir) {
  std::error_code ec;
  if (!fs::is_regular_file(fs::path(ckpt_dir) / kManifestFile, ec)) return false;
  try {
    const nlohmann::ordered_json m = read_manifest_json(ckpt_dir);
    return m.is_object() && m.contains("weights_only") && m["weights_only"] == true;
  } catch (const std::exception&) {
    return false;  // an unreadable manifest is verify_manifest's to report
  }
}

nlohmann::json read_train_state(const std::string& ckpt_dir) {
  const fs::path p = fs::path(ckpt_dir) / kTrainStateFile;
  std::ifstream f(p);
  if (!f) MT_THROW("cannot open '", p.string(), "'");
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    nlohmann::json j = nlohmann::json::parse(ss.str());
    if (!j.is_object()) MT_THROW(p.string(), ": expected a JSON object");
    return j;
  } catch (const nlohmann::json::exception& e) {
    MT_THROW(p.string(), ": not valid JSON (", e.what(), ")");
  }
}

void debug_kill_while_saving(int64_t step) {
  const char* v = std::getenv("MOETRAIN_DEBUG_SAVE_KILL");
  if (v && std::atoll(v) == step) {
    log_info("MOETRAIN_DEBUG_SAVE_KILL=", v, ": killing this process while it saves checkpoint ", step);
    std::raise(SIGKILL);
  }
}

}  // namespace mt
