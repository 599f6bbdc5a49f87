// The run directory's one checkpoint writer (train/run_dir.h) on one process, in-process: every part of a
// checkpoint-N written where the readers look for it (HF weights, routing bias, tokenizer, each training
// state and its train_state.json as given), committed with a manifest that verifies, read back bit for bit;
// the gathered (FSDP) writer gives the same model as the flat one; keep-last and the leftovers of killed
// saves; the resume point and its errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "io/manifest.h"
#include "model/hf_checkpoint.h"
#include "parallel/launch_test_util.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/load_balance.h"
#include "train/run_dir.h"
#include "train/session.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

std::string fresh_dir(const std::string& name) {
  const std::string d = test::tmp_path("rundir", name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Every file under dir, '/'-separated paths relative to it, sorted.
std::vector<std::string> files_under(const std::string& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) v.push_back(fs::relative(e.path(), dir).generic_string());
  std::sort(v.begin(), v.end());
  return v;
}

// Values that tell every element apart: a + i / n.
void fill_ramp(Tensor& t, float a) {
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = a + float(i) / float(t.numel());
}

// The tiny model on one process with its AdamW, a routing bias and moments that differ from the weights.
struct TinyRun {
  ModelConfig mc = preset_model_config("tiny");
  TrainSession session{mc, SessionOptions{}};
  TinyRun() {
    session.init_weights(3);
    session.model().enable_router_bias();
    fill_ramp(session.model().router_bias(), -0.5f);
    session.make_optimizer(AdamWConfig{}, false);
    fill_ramp(session.optimizer().exp_avg(), 1.0f);
    fill_ramp(session.optimizer().exp_avg_sq(), 2.0f);
  }
  // The checkpoint's own state (train_state.json: keys in the order given, not sorted).
  CheckpointState own(int64_t step) {
    nlohmann::ordered_json st;
    st["step"] = step;
    st["format"] = "test-state";
    st["flat_numel"] = session.table().total();
    return checkpoint_state(session, "", st);
  }
  std::string save(const std::string& run_dir, int64_t step, int64_t keep_last) {
    return save_checkpoint(run_dir, step, checkpoint_weights(session), {own(step)}, keep_last, session.dist());
  }
};

// A second state of 10 elements (as grpo's critic/), held whole by this rank.
CheckpointState extra_state(Tensor& m, Tensor& a, Tensor& s) {
  fill_ramp(m, 10.0f);
  fill_ramp(a, 20.0f);
  fill_ramp(s, 30.0f);
  return {"extra", m, a, s, {{0, 10, 0}}, nlohmann::ordered_json{{"flat_numel", 10}, {"format", "test-extra"}}};
}

}  // namespace

TEST(RunDir, WritesEveryPartAndReadsItBack) {
  TinyRun run;
  const std::string d = fresh_dir("parts");
  const std::string tok = std::string(MT_SOURCE_DIR) + "/tests/assets/tokenizer/trained/tokenizer.json";
  Tensor em = Tensor::empty({10}), ea = Tensor::empty({10}), es = Tensor::empty({10});
  CheckpointWeights w = checkpoint_weights(run.session);
  w.tokenizer_json = tok;
  const CheckpointState own = run.own(5);
  const std::string dir =
      save_checkpoint(d, 5, w, {own, extra_state(em, ea, es)}, /*keep_last=*/2, run.session.dist(), "test: ");

  EXPECT_EQ(dir, checkpoint_dir(d, 5));
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
  EXPECT_EQ(files_under(dir),
            (std::vector<std::string>{"config.json", "extra/train_state.json", "extra/train_state/rank-0.safetensors",
                                      "manifest.json", "model.safetensors", "router_bias.safetensors", "tokenizer.json",
                                      "train_state.json", "train_state/rank-0.safetensors"}));
  EXPECT_EQ(verify_manifest(dir), "");
  EXPECT_EQ(read_bytes(fs::path(dir) / "train_state.json"), own.train_state.dump(2) + "\n");  // as given
  EXPECT_EQ(read_bytes(fs::path(dir) / "tokenizer.json"), read_bytes(tok));

  const ResumePoint rp = find_resume_checkpoint(d, "latest");
  EXPECT_EQ(rp.dir, dir);
  EXPECT_EQ(rp.step, 5);
  // The training states, read into fresh buffers.
  TrainSession& s = run.session;
  const int64_t total = s.table().total();
  Tensor m = Tensor::zeros({total}), a = Tensor::zeros({total}), v = Tensor::zeros({total});
  const ReshardReport rep = load_train_state_shards(dir, total, {{0, total, 0}}, m, a, v);
  EXPECT_EQ(rep.shards, 1);
  EXPECT_EQ(rep.elements, total);
  EXPECT_TRUE(testutil::same_bits(m, s.master()));
  EXPECT_TRUE(testutil::same_bits(a, s.optimizer().exp_avg()));
  EXPECT_TRUE(testutil::same_bits(v, s.optimizer().exp_avg_sq()));
  Tensor xm = Tensor::zeros({10}), xa = Tensor::zeros({10}), xs = Tensor::zeros({10});
  load_train_state_shards(dir + "/extra", 10, {{0, 10, 0}}, xm, xa, xs);
  EXPECT_TRUE(testutil::same_bits(xm, em) && testutil::same_bits(xa, ea) && testutil::same_bits(xs, es));
  // The HF weights and the routing bias: the model as it was.
  Tensor hf = Tensor::zeros({total});
  load_hf_weights(dir, run.mc, s.table(), hf);
  EXPECT_TRUE(testutil::same_bits(hf, s.master()));
  Tensor bias = Tensor::zeros(s.model().router_bias().shape());
  ASSERT_TRUE(load_router_bias(dir, run.mc, bias));
  EXPECT_TRUE(testutil::same_bits(bias, s.model().router_bias()));
  fs::remove_all(d);
}

TEST(RunDir, TheGatheringWriterWritesTheSameModel) {
  TinyRun run;
  const std::string d = fresh_dir("gather");
  CheckpointWeights flat = checkpoint_weights(run.session);
  ASSERT_FALSE(flat.gather);  // one process: the flat buffer
  CheckpointWeights gathered = flat;
  const Tensor params = flat.flat;
  gathered.flat = Tensor();
  gathered.gather = [&params](const ParamEntry& e) { return params.rows(e.offset, e.numel).view(e.shape).clone(); };
  const std::string a = save_checkpoint(d, 1, flat, {run.own(1)}, 0, run.session.dist());
  const std::string b = save_checkpoint(d, 2, gathered, {run.own(1)}, 0, run.session.dist());
  for (const char* f : {"config.json", "model.safetensors", "router_bias.safetensors", "train_state.json",
                        "train_state/rank-0.safetensors"})
    EXPECT_TRUE(read_bytes(fs::path(a) / f) == read_bytes(fs::path(b) / f)) << f;
  fs::remove_all(d);
}

TEST(RunDir, KeepsTheNewestAndClearsLeftovers) {
  TinyRun run;
  const std::string d = fresh_dir("keep");
  // A save killed earlier (its .tmp) and one of the same step from an earlier run in this directory.
  fs::create_directories(d + "/checkpoint-9.tmp/train_state");
  std::ofstream(d + "/checkpoint-9.tmp/model.safetensors") << "half";
  for (int64_t step = 1; step <= 4; ++step) run.save(d, step, /*keep_last=*/2);
  EXPECT_EQ(list_checkpoints(d), (std::vector<int64_t>{4, 3}));
  EXPECT_FALSE(fs::exists(d + "/checkpoint-9.tmp"));
  const std::string again = run.save(d, 4, 2);  // the same step again: replaced whole
  EXPECT_EQ(verify_manifest(again), "");
  EXPECT_EQ(list_checkpoints(d), (std::vector<int64_t>{4, 3}));
  EXPECT_FALSE(fs::exists(again + ".replaced"));

  // keep_last 0: every checkpoint stays, the older than the newest two as weights only.
  const std::string k = fresh_dir("keep0");
  for (int64_t step = 1; step <= 4; ++step) run.save(k, step, /*keep_last=*/0);
  EXPECT_EQ(list_checkpoints(k), (std::vector<int64_t>{4, 3, 2, 1}));
  for (int64_t step : {1, 2}) {
    const std::string c = checkpoint_dir(k, step);
    EXPECT_TRUE(is_weights_only(c)) << c;
    EXPECT_EQ(verify_manifest(c), "") << c;
    EXPECT_FALSE(fs::exists(c + "/train_state")) << c;
  }
  for (int64_t step : {3, 4}) EXPECT_FALSE(is_weights_only(checkpoint_dir(k, step)));
  EXPECT_EQ(find_resume_checkpoint(k, "latest").step, 4);
  fs::remove_all(d);
  fs::remove_all(k);
}

TEST(RunDir, TheResumePointAndItsErrors) {
  TinyRun run;
  const std::string d = fresh_dir("resume");
  DistContext& dist = run.session.dist();
  EXPECT_EQ(resume_checkpoint(d + "/none", "latest", nullptr), "");  // a fresh run
  EXPECT_EQ(resume_checkpoint(d, "latest", &dist), "");
  run.save(d, 2, 0);
  const std::string newest = run.save(d, 3, 0);
  EXPECT_EQ(resume_checkpoint(d, "latest", nullptr), newest);
  EXPECT_EQ(resume_checkpoint(d, "latest", &dist), newest);
  EXPECT_EQ(resume_checkpoint(d, checkpoint_dir(d, 2), &dist), checkpoint_dir(d, 2));
  // Every checkpoint unusable: an error naming each and why, after the caller's prefix.
  for (int64_t step : {2, 3}) fs::remove(fs::path(checkpoint_dir(d, step)) / "model.safetensors");
  EXPECT_EQ(testutil::error_of([&] { resume_checkpoint(d, "latest", &dist, "grpo: "); }),
            "grpo: resume: no checkpoint in " + d +
                " can be resumed from; checkpoint-3: model.safetensors is missing; checkpoint-2: model.safetensors "
                "is missing (remove them or drop --resume to start over)");
  fs::remove_all(d);
}

TEST(RunDir, TheCheckpointsOwnStateComesFirst) {
  TinyRun run;
  const std::string d = fresh_dir("order");
  Tensor em = Tensor::empty({10}), ea = Tensor::empty({10}), es = Tensor::empty({10});
  const std::string e = testutil::error_of([&] {
    save_checkpoint(d, 1, checkpoint_weights(run.session), {extra_state(em, ea, es)}, 2, run.session.dist());
  });
  EXPECT_NE(e.find("the first training state must be the checkpoint's own (subdir \"\"), got 'extra'"),
            std::string::npos)
      << e;
  EXPECT_TRUE(list_checkpoints(d).empty());
  fs::remove_all(d);
}
