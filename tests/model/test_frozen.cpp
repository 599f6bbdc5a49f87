// Frozen weights (Weights::Frozen, FsdpOptions::weights): a model that only runs forward (an RL
// reference model, a generator) holds no gradient memory, computes the same logits as a trainable
// model with the same weights, and refuses a backward with an error that says why.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "comm/communicator.h"
#include "comm/store.h"
#include "model/model_test_util.h"
#include "model/qwen3_moe.h"
#include "parallel/fsdp.h"
#include "rl/grpo.h"
#include "test_util.h"
#include "train/session.h"

using namespace mt;
using test::random_batch;
using testutil::error_of;

namespace {

Tensor logits_of(Qwen3MoeModel& m, const MicroBatch& mb) {
  Tensor logits;
  m.forward(mb, &logits);
  return logits;
}

bool same(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::equal(a.data<float>(), a.data<float>() + a.numel(), b.data<float>());
}

}  // namespace

TEST(FrozenWeights, OneDeviceForwardEqualsTrainableAndBackwardIsRefused) {
  const ModelConfig c = preset_model_config("tiny");
  const ParamTable table(c);
  Qwen3MoeModel trainable(c), frozen(c, Device::CPU, nullptr, Weights::Frozen);
  init_weights(c, table, trainable.params(), 3);
  frozen.params().copy_from(trainable.params());
  const MicroBatch mb = random_batch(c, 2, 16, 4);
  EXPECT_TRUE(same(logits_of(frozen, mb), logits_of(trainable, mb)));
  EXPECT_TRUE(trainable.local().trainable());
  EXPECT_FALSE(frozen.local().trainable());
  std::string e = error_of([&] { frozen.forward_backward(mb, 1.0, 0.0); });
  EXPECT_NE(e.find("forward_backward on frozen weights"), std::string::npos) << e;
  e = error_of([&] { frozen.grads(); });
  EXPECT_NE(e.find("these parameters are frozen (Weights::Frozen): they have no gradients"), std::string::npos) << e;
  // The trainable model still trains after the frozen one refused.
  EXPECT_TRUE(std::isfinite(trainable.forward_backward(mb, 1.0 / 32, 0.0).loss));
}

TEST(FrozenWeights, ShardedForwardEqualsTrainableAndBackwardIsRefused) {
  const ModelConfig c = preset_model_config("tiny");
  const ParamTable table(c);
  Tensor host = Tensor::zeros({table.total()});
  init_weights(c, table, host, 5);
  auto store = comm::make_memory_store();
  auto world = comm::make_world(Device::CPU, 0, 1, *store, {});
  FsdpOptions fo;
  fo.weights = Weights::Frozen;
  FsdpParams frozen_src(c, table, Device::CPU, *world, nullptr, fo), trainable_src(c, table, Device::CPU, *world, nullptr);
  for (FsdpParams* p : {&frozen_src, &trainable_src})
    for (const FlatRange& r : p->owned_pieces()) {
      Tensor dst = p->params().rows(r.dst_offset, r.end - r.begin);
      dst.copy_from(host.rows(r.begin, r.end - r.begin));
    }
  Qwen3MoeModel frozen(c, Device::CPU, &frozen_src), trainable(c, Device::CPU, &trainable_src);
  const MicroBatch mb = random_batch(c, 2, 16, 6);
  EXPECT_TRUE(same(logits_of(frozen, mb), logits_of(trainable, mb)));
  EXPECT_FALSE(frozen_src.trainable());
  std::string e = error_of([&] { frozen.forward_backward(mb, 1.0, 0.0); });
  EXPECT_NE(e.find("forward_backward on frozen weights"), std::string::npos) << e;
  e = error_of([&] { frozen_src.global_grad_sq(); });
  EXPECT_NE(e.find("FsdpOptions::weights = Frozen"), std::string::npos) << e;
  // A frozen source cannot be combined with an explicit Weights argument.
  e = error_of([&] { Qwen3MoeModel bad(c, Device::CPU, &frozen_src, Weights::Frozen); });
  EXPECT_NE(e.find("an external source decides for itself"), std::string::npos) << e;
}

// The copies a frozen model's masters get on the host (the CPU here; a frozen CUDA model's masters are host
// memory too, tests/cuda/test_cuda_frozen.cpp): a session's init writes the masters in place with the values
// of the full init_weights, whatever they held, and TpGenerator copies a one-process policy exactly.
TEST(FrozenWeights, SessionInitInPlaceAndTpGeneratorCopyAOneProcessPolicyExactly) {
  const ModelConfig c = preset_model_config("tiny");
  TrainSession policy(c, SessionOptions{});
  Tensor want = Tensor::zeros({policy.table().total()});
  init_weights(c, policy.table(), want, 3);
  policy.master().fill_(7.0f);
  policy.init_weights(3);
  EXPECT_TRUE(testutil::same_bits(policy.master(), want));
  rl::TpGenerator gen(policy);
  EXPECT_FALSE(gen.model().local().trainable());
  EXPECT_TRUE(testutil::same_bits(gen.model().params(), policy.master()));
  const MicroBatch mb = random_batch(c, 2, 16, 4);
  EXPECT_TRUE(same(logits_of(gen.model(), mb), logits_of(policy.model(), mb)));
}
