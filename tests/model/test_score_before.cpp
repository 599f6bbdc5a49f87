// score_before_experts (y = sum_k expert_k(w_k x)): the gradients of the cross-entropy against finite
// differences on the tiny model, for the routing weights' path (router gate), the experts and the
// layers below; the option changes the function (so it is really applied); and under `moetrain
// launch` with ep 2 (and tp 2 + etp 2) `moetrain grads --score-before-experts` equals one process.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "comm/communicator.h"
#include "core/rng.h"
#include "io/safetensors.h"
#include "model/model_test_util.h"
#include "model/qwen3_moe.h"
#include "parallel/equivalence_util.h"
#include "parallel/launch_test_util.h"

using namespace mt;

namespace {

bool same_routing(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].nbytes() != b[i].nbytes() || std::memcmp(a[i].raw(), b[i].raw(), a[i].nbytes()) != 0) return false;
  return true;
}

}  // namespace

TEST(ScoreBeforeExperts, GradientsMatchFiniteDifferences) {
  ModelConfig c = preset_model_config("tiny");
  c.score_before_experts = true;
  Qwen3MoeModel m(c, Device::CPU, nullptr, Weights::Trainable);
  init_weights(c, m.table(), m.params(), 11);
  const MicroBatch mb = test::random_batch(c, 2, 16, 5, 4, 1);
  m.zero_grads();
  const LossParts lp = m.forward_backward(mb, 1.0, 0.0);
  const Tensor analytic = m.grads().clone();
  const std::vector<Tensor> routing0 = m.last_routing();
  // The option is applied: the plain model's expert gradients differ (SwiGLU is not homogeneous, so
  // expert_k(w x) != w expert_k(x)); at this init scale the loss itself moves only by ~6e-6 relative.
  {
    ModelConfig plain_c = c;
    plain_c.score_before_experts = false;
    Qwen3MoeModel plain(plain_c);
    plain.params().copy_from(m.params());
    plain.zero_grads();
    plain.forward_backward(mb, 1.0, 0.0);
    const ParamEntry& gu = m.table().at("model.layers.1.mlp.experts.gate_up_proj");
    double num = 0, den = 0;
    for (int64_t i = gu.offset; i < gu.offset + gu.numel; ++i) {
      const double d = double(plain.grads().data<float>()[i]) - analytic.data<float>()[i];
      num += d * d;
      den += double(analytic.data<float>()[i]) * analytic.data<float>()[i];
    }
    EXPECT_GT(std::sqrt(num / den), 0.05) << "score_before_experts changed nothing";
    EXPECT_NE(plain.forward(mb, nullptr).ce_sum, lp.ce_sum);
  }
  const ParamTable& t = m.table();
  int checked = 0, skipped = 0;
  double num2 = 0, den2 = 0;
  for (const char* name : {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight",
                           "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
                           "model.layers.0.self_attn.v_proj.weight", "model.layers.0.post_attention_layernorm.weight"}) {
    const ParamEntry* e = t.find(name);
    ASSERT_NE(e, nullptr) << name;
    const int64_t n = std::min<int64_t>(e->numel, 40);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = e->offset + (j * 7919) % e->numel;
      float* p = m.params().data<float>() + i;
      const float orig = *p, eps = 2e-3f;
      *p = orig + eps;
      const double lp_plus = m.forward(mb, nullptr).ce_sum;
      bool flipped = !same_routing(m.last_routing(), routing0);
      *p = orig - eps;
      const double lp_minus = m.forward(mb, nullptr).ce_sum;
      flipped = flipped || !same_routing(m.last_routing(), routing0);
      *p = orig;
      if (flipped) {  // a top-k choice changed: the loss is not differentiable across it
        ++skipped;
        continue;
      }
      const double fd = (lp_plus - lp_minus) / (2.0 * eps), an = analytic.data<float>()[i];
      num2 += (an - fd) * (an - fd);
      den2 += fd * fd;
      ++checked;
    }
  }
  std::printf("score_before_experts vs finite differences: %d elements, %d skipped (routing flip), relative L2 %.2e\n",
              checked, skipped, std::sqrt(num2 / den2));
  EXPECT_GT(checked, 150);
  EXPECT_GT(den2, 0.0);
  EXPECT_LT(std::sqrt(num2 / den2), 5e-3);
}

TEST(ScoreBeforeExperts, ExpertAndTensorParallelEqualOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  // The model is its directory's: a copy of the aux golden whose config.json says score_before_experts.
  const std::string plain_model = std::string(MT_SOURCE_DIR) + "/tests/assets/goldens/aux";
  const std::string model = test::tmp_path("score_before", "model");
  std::filesystem::create_directories(model);
  for (const auto& e : std::filesystem::directory_iterator(plain_model))
    if (e.is_regular_file())
      std::filesystem::copy_file(e.path(), std::filesystem::path(model) / e.path().filename(),
                                 std::filesystem::copy_options::overwrite_existing);
  {
    std::ifstream in(plain_model + "/config.json");
    nlohmann::json j = nlohmann::json::parse(in);
    j["moetrain_score_before_experts"] = true;
    std::ofstream(model + "/config.json") << j.dump(2) << "\n";
  }
  const std::string bpath = test::tmp_path("score_before", "batch.safetensors");
  test::make_batch(model, bpath);
  const std::string& bin = test::kMoetrainBin;
  for (const char* rc : {"none", "full", "selective", "moe"}) {
    const std::string ref = test::tmp_path("score_before", std::string("ref_") + rc + ".safetensors");
    test::ShellRun r = test::sh(bin + " grads --score-before-experts --model " + model + " --batch " + bpath +
                                " --out " + ref + " --recompute " + rc);
    ASSERT_EQ(r.code, 0) << r.out;
    // Against the plain model: the option changes the gradients.
    const std::string plain = test::tmp_path("score_before", std::string("plain_") + rc + ".safetensors");
    ASSERT_EQ(test::sh(bin + " grads --model " + plain_model + " --batch " + bpath + " --out " + plain).code, 0);
    EXPECT_NE(SafetensorsFile(plain).read_f32("loss").data<float>()[0],
              SafetensorsFile(ref).read_f32("loss").data<float>()[0]);
    for (const char* layout : {"--ep 2", "--tp 2 --etp 2"}) {
      const std::string out = test::tmp_path("score_before", std::string("got_") + rc + ".safetensors");
      test::ShellRun p = test::sh(bin + " launch --nproc-per-node 2 -- grads --score-before-experts --model " + model +
                                  " --batch " + bpath + " --out " + out + " --recompute " + rc + " " + layout);
      ASSERT_EQ(p.code, 0) << layout << "\n" << p.out;
      test::expect_same(out, ref, std::string("score_before_experts, ") + layout + ", recompute " + rc);
    }
  }
}
