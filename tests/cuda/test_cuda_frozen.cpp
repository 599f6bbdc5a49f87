// A frozen model on CUDA (an RL reference, a generator: Weights::Frozen) keeps its f32 masters in host
// memory and only the bf16 compute copy plus the fp32-read gains and routers on the device
// (LocalParams::host_masters). It must cost the device about 2 bytes a parameter, compute the same
// logits as a trainable model with the same weights bit for bit, and every way of writing its masters
// (init, loading, copying another model's weights, TpGenerator) followed by a refresh must give the
// trainable path's compute copy and fp32 values exactly.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <memory>

#include "comm/communicator.h"
#include "comm/store.h"
#include "core/determinism.h"
#include "cuda_test_util.h"
#include "model/hf_checkpoint.h"
#include "model/model_test_util.h"
#include "model/qwen3_moe.h"
#include "parallel/fsdp.h"
#include "rl/grpo.h"
#include "test_util.h"
#include "train/session.h"

using namespace mt;
using testutil::error_of;
using testutil::same_bits;
namespace fs = std::filesystem;

namespace {

// The tiny model with a larger vocabulary, so the embedding and the head dominate fixed costs.
ModelConfig frozen_config() {
  ModelConfig c = preset_model_config("tiny");
  c.vocab_size = 4096;
  c.tie_word_embeddings = false;
  return c;
}

SessionOptions cuda_options(Weights w, DistContext* shared = nullptr) {
  SessionOptions so;
  so.device = Device::CUDA;
  so.weights = w;
  so.shared_dist = shared;
  return so;
}

// The frozen session's masters, compute copy and fp32_param values equal the trainable one's, bit for bit.
void expect_same_weights(TrainSession& frozen, TrainSession& trainable, const std::string& what) {
  LocalParams& f = frozen.model().local();
  LocalParams& t = trainable.model().local();
  ASSERT_TRUE(f.host_masters()) << what;
  ASSERT_FALSE(t.host_masters()) << what;
  EXPECT_TRUE(same_bits(f.params(), t.params())) << what << ": masters";
  EXPECT_TRUE(same_bits(f.compute(), t.compute())) << what << ": bf16 compute copy";
  int64_t checked = 0;
  for (const ParamEntry& e : frozen.table().entries()) {
    if (!fp32_compute_param(e.name)) continue;
    const Tensor got = f.fp32_param(e);
    ASSERT_EQ(got.device(), Device::CUDA) << what << ": " << e.name;
    EXPECT_TRUE(same_bits(got, t.fp32_param(e))) << what << ": fp32_param(" << e.name << ")";
    EXPECT_TRUE(same_bits(got, f.params().rows(e.offset, e.numel)))
        << what << ": fp32_param(" << e.name << ") vs the host masters";
    ++checked;
  }
  EXPECT_GT(checked, 4) << what;
}

}  // namespace

TEST(CudaFrozen, ForwardEqualsTrainableBitwiseOnAboutTheBf16CopysMemory) {
  MT_REQUIRE_GPU();
  DeterministicScope det(true);
  const ModelConfig c = frozen_config();
  const int64_t P = ParamTable(c).total();
  size_t before = device_mem::cuda_bytes_in_use();
  TrainSession trainable(c, cuda_options(Weights::Trainable));
  trainable.init_weights(5);
  const double trainable_bytes = double(device_mem::cuda_bytes_in_use() - before);
  before = device_mem::cuda_bytes_in_use();
  auto frozen = std::make_unique<TrainSession>(c, cuda_options(Weights::Frozen, &trainable.dist()));
  frozen->init_weights(5);
  const double frozen_bytes = double(device_mem::cuda_bytes_in_use() - before);
  std::printf("[frozen] %lld parameters: device bytes per parameter: trainable %.2f, frozen %.2f\n", (long long)P,
              trainable_bytes / double(P), frozen_bytes / double(P));
  EXPECT_GE(trainable_bytes, 4.0 * double(P)) << "the measure sees the trainable session's f32 masters";
  EXPECT_GE(frozen_bytes, 2.0 * double(P)) << "the bf16 compute copy is on the device";
  EXPECT_LT(frozen_bytes, 0.6 * 4.0 * double(P)) << "no f32 masters on the device";
  EXPECT_EQ(frozen->master().device(), Device::CPU);
  expect_same_weights(*frozen, trainable, "init_weights");

  const MicroBatch mb = test::random_batch(c, 2, 32, 4);
  Tensor lf, lt;
  frozen->model().forward(mb, &lf);
  trainable.model().forward(mb, &lt);
  ASSERT_EQ(lf.device(), Device::CUDA);
  EXPECT_TRUE(same_bits(lf, lt)) << "frozen logits " << lf.desc() << " vs trainable " << lt.desc() << ": rel. L2 "
                                 << cudatest::rel_l2(lf, lt);
  // Freed with its session: nothing of the frozen model stays on the device.
  const size_t with_frozen = device_mem::cuda_bytes_in_use();
  frozen.reset();
  EXPECT_GE(double(with_frozen - device_mem::cuda_bytes_in_use()), 2.0 * double(P));
}

TEST(CudaFrozen, LoadCopyAndTpGeneratorThenRefreshGiveTheTrainableComputeCopy) {
  MT_REQUIRE_GPU();
  const ModelConfig c = frozen_config();
  const ParamTable table(c);
  const fs::path dir = fs::temp_directory_path() / ("moetrain_cuda_frozen_" + std::to_string(getpid()));
  Tensor host = Tensor::zeros({table.total()});
  init_weights(c, table, host, 7);
  save_hf_checkpoint(dir.string(), c, table, host);

  TrainSession trainable(c, cuda_options(Weights::Trainable));
  TrainSession frozen(c, cuda_options(Weights::Frozen, &trainable.dist()));
  trainable.load(dir.string());
  frozen.load(dir.string());
  expect_same_weights(frozen, trainable, "load");
  fs::remove_all(dir);

  // Another model's weights copied into the masters (device to host), as grpo's reference could be made.
  trainable.init_weights(9);
  frozen.master().copy_from(trainable.master());
  frozen.refresh_compute_weights();
  expect_same_weights(frozen, trainable, "copy_from + refresh");

  // Small staging chunks that do not divide the model: every chunk and the tail land where they belong.
  frozen.model().local().compute().zero_();
  frozen.model().local().refresh_compute_weights(1000 + 3);
  expect_same_weights(frozen, trainable, "refresh in chunks of 1003");

  // TpGenerator's frozen copy of the policy (the same holder of params()).
  rl::TpGenerator gen(trainable);
  LocalParams& g = gen.model().local();
  EXPECT_TRUE(g.host_masters());
  EXPECT_TRUE(same_bits(g.params(), trainable.master()));
  EXPECT_TRUE(same_bits(g.compute(), *trainable.compute()));

  // Errors name the value and what is allowed.
  std::string e = error_of([&] { frozen.model().local().refresh_compute_weights(0); });
  EXPECT_NE(e.find("staging_elements = 0; need >= 1"), std::string::npos) << e;
  e = error_of([&] { frozen.model().local().fp32_param(table.at("model.embed_tokens.weight")); });
  EXPECT_NE(e.find("model.embed_tokens.weight is not one of them"), std::string::npos) << e;
}

// The sharded source's frozen path (FsdpOptions::weights = Frozen) on a one-rank CUDA world: host masters,
// about the bf16 shard on the device, and the trainable source's logits bit for bit.
TEST(CudaFrozen, ShardedSourceKeepsItsMastersOnTheHost) {
  MT_REQUIRE_GPU();
  DeterministicScope det(true);
  const ModelConfig c = frozen_config();
  const ParamTable table(c);
  const int64_t P = table.total();
  Tensor host = Tensor::zeros({P});
  init_weights(c, table, host, 11);
  auto store = comm::make_memory_store();
  auto world = comm::make_world(Device::CUDA, 0, 1, *store, {});
  auto load = [&](FsdpParams& f) {
    for (const FlatRange& p : f.owned_pieces()) {
      Tensor dst = f.params().rows(p.dst_offset, p.end - p.begin);
      dst.copy_from(host.rows(p.begin, p.end - p.begin));
    }
    f.refresh_compute_weights();
  };
  FsdpParams trainable_src(c, table, Device::CUDA, *world, nullptr);
  load(trainable_src);
  FsdpOptions fo;
  fo.weights = Weights::Frozen;
  const size_t before = device_mem::cuda_bytes_in_use();
  FsdpParams frozen_src(c, table, Device::CUDA, *world, nullptr, fo);
  load(frozen_src);
  const double frozen_bytes = double(device_mem::cuda_bytes_in_use() - before);
  std::printf("[frozen fsdp] %lld parameters: %.2f device bytes per parameter\n", (long long)P,
              frozen_bytes / double(P));
  EXPECT_EQ(frozen_src.params().device(), Device::CPU);
  EXPECT_GE(frozen_bytes, 2.0 * double(P));
  EXPECT_LT(frozen_bytes, 0.6 * 4.0 * double(P));
  EXPECT_TRUE(same_bits(*frozen_src.compute_params(), *trainable_src.compute_params()));
  Qwen3MoeModel frozen(c, Device::CUDA, &frozen_src), trainable(c, Device::CUDA, &trainable_src);
  const MicroBatch mb = test::random_batch(c, 2, 32, 12);
  Tensor lf, lt;
  frozen.forward(mb, &lf);
  trainable.forward(mb, &lt);
  EXPECT_TRUE(same_bits(lf, lt)) << "rel. L2 " << cudatest::rel_l2(lf, lt);
  for (const ParamEntry& e : table.entries()) {
    if (fp32_compute_param(e.name)) {
      EXPECT_TRUE(same_bits(frozen_src.fp32_param(e), host.rows(e.offset, e.numel))) << e.name;
    }
  }
}
