// `moetrain sft` on packed chat data under the parallel layouts, through the real launcher on the CPU:
// every layout's loss curve (cross-entropy + aux loss, whose statistics count real tokens only and whose
// N sums data-parallel ranks that hold different numbers of real tokens), z-loss, grad norm, expert
// load and final weights equal one process's. The packed rows cross the sp chunks, so the document
// boundaries must travel with the sequence split.
#include <gtest/gtest.h>

#include <filesystem>

#include "model/hf_checkpoint.h"
#include "model/params.h"
#include "parallel/equivalence_util.h"
#include "parallel/launch_test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

const std::string& kBin = test::kMoetrainBin;
using test::sh;
using test::ShellRun;

// A tiny model directory for the trained test tokenizer (vocabulary 3,008), aux loss on.
std::string make_model_dir() {
  const std::string dir = test::tmp_path("sft_layouts", "model");
  fs::create_directories(dir);
  ModelConfig c = preset_model_config("tiny");
  c.vocab_size = 3008;
  c.output_router_logits = true;
  c.router_aux_loss_coef = 0.02;
  c.eos_token_id = 2;
  ParamTable t(c);
  Tensor flat = Tensor::zeros({t.total()});
  init_weights(c, t, flat, 17);
  save_hf_checkpoint(dir, c, t, flat);
  fs::copy_file(std::string(MT_SOURCE_DIR) + "/tests/assets/tokenizer/trained/tokenizer.json", dir + "/tokenizer.json",
                fs::copy_options::overwrite_existing);
  return dir;
}

std::string sft_cmd(const std::string& model, const std::string& out_dir) {
  return " sft --device cpu --model " + model + " --data " + std::string(MT_SOURCE_DIR) +
         "/examples/chat_small.jsonl --steps 8 --micro-batch-size 4 --grad-accum 2 --seq-len 64 --lr 3e-3"
         " --min-lr 3e-4 --warmup-steps 2 --log-every 4 --tensorboard 0 --router-z-loss-coef 1e-3 --out-dir " +
         out_dir;
}

}  // namespace

TEST(SftLayouts, PackedCurveIsTheSameAsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string model = make_model_dir();
  const std::string ref_dir = test::tmp_path("sft_layouts", "ref");
  ShellRun r = sh(kBin + sft_cmd(model, ref_dir));
  ASSERT_EQ(r.code, 0) << r.out;
  auto ref = test::read_step_metrics(ref_dir + "/metrics.jsonl");
  ASSERT_EQ(ref.size(), 8u);
  for (auto [n, flags] : std::vector<std::pair<int, std::string>>{
           {2, " --dp-shard 2"}, {2, " --sp 2"}, {4, " --sp 2 --ep 2 --recompute full"}, {4, " --tp 2 --sp 2"}}) {
    const std::string dir =
        test::tmp_path("sft_layouts", "run_" + std::to_string(n) + std::to_string(std::hash<std::string>{}(flags)));
    ShellRun p = sh(kBin + " launch --nproc-per-node " + std::to_string(n) + " --" + sft_cmd(model, dir) + flags);
    ASSERT_EQ(p.code, 0) << flags << "\n" << p.out;
    auto got = test::read_step_metrics(dir + "/metrics.jsonl");
    ASSERT_EQ(got.size(), 8u) << flags;
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      SCOPED_TRACE(flags + ", step " + std::to_string(i + 1));
      const double a = got[i]["loss"].get<double>(), b = ref[i]["loss"].get<double>();
      EXPECT_NEAR(a, b, 1e-6 * std::abs(b));
      worst = std::max(worst, std::abs(a - b) / std::abs(b));
      EXPECT_GT(ref[i]["aux"].get<double>(), 0.0);
      EXPECT_NEAR(got[i]["aux"].get<double>(), ref[i]["aux"].get<double>(), 1e-6 * ref[i]["aux"].get<double>());
      EXPECT_NEAR(got[i]["z_loss"].get<double>(), ref[i]["z_loss"].get<double>(),
                  1e-6 * ref[i]["z_loss"].get<double>());
      EXPECT_NEAR(got[i]["grad_norm"].get<double>(), ref[i]["grad_norm"].get<double>(),
                  1e-5 * ref[i]["grad_norm"].get<double>());
      EXPECT_EQ(got[i]["experts"]["max"], ref[i]["experts"]["max"]);
      EXPECT_EQ(got[i]["experts"]["min"], ref[i]["experts"]["min"]);
    }
    std::printf("[ measured ] sft packed curve%s: worst step loss relative difference %.3g\n", flags.c_str(), worst);
    test::expect_same_checkpoint(dir + "/checkpoint-8", ref_dir + "/checkpoint-8", flags);
  }
}
