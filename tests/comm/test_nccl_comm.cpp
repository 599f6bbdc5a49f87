// The NCCL communicator at world size 1 on one GPU (skipped without a GPU): every collective moves
// the right bytes through the communicator's stream and events, completions reach completed_seq(),
// split and abort behave. Several GPUs are exercised across processes by
// `moetrain launch --nproc-per-node 2 -- _selftest comm --device cuda` (docs/comm.md).
#include <gtest/gtest.h>

#include "comm/communicator.h"
#include "test_util.h"

namespace mt::comm {
namespace {

using namespace std::chrono_literals;

#define MT_REQUIRE_GPU()                                                        \
  do {                                                                          \
    if (!::mt::device_mem::cuda_available()) GTEST_SKIP() << "skipped: no GPU"; \
  } while (0)

Tensor iota(DType dt, int64_t n, int offset = 0) {
  Tensor f = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) f.data<float>()[i] = float((i + offset) % 200);
  return f.to(dt);
}

// CPU f32 copy of any tensor, for comparisons.
std::vector<float> host(const Tensor& t) {
  Tensor h = t.to(Device::CPU);
  if (h.dtype() == DType::I64) {
    std::vector<float> v;
    for (int64_t i = 0; i < h.numel(); ++i) v.push_back(float(h.data<int64_t>()[i]));
    return v;
  }
  h = h.to(DType::F32);
  return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
}

TEST(NcclComm, WithoutAGpuTheErrorSaysWhy) {
  if (device_mem::cuda_available()) GTEST_SKIP() << "a GPU is present";
  auto store = make_memory_store();
  std::string e = testutil::error_of([&] { make_world(Device::CUDA, 0, 1, *store, {}); });
  EXPECT_TRUE(e.find("no CUDA device is visible") != std::string::npos ||
              e.find("this build has no CUDA") != std::string::npos)
      << e;
}

TEST(NcclComm, EveryCollectiveAtWorldSizeOne) {
  MT_REQUIRE_GPU();
  auto store = make_memory_store();
  auto c = make_world(Device::CUDA, 0, 1, *store, {});
  EXPECT_STREQ(c->backend(), "nccl");
  EXPECT_EQ(c->device(), Device::CUDA);
  for (DType dt : {DType::F32, DType::BF16, DType::I64}) {
    Tensor in = iota(dt, 1000).to(Device::CUDA);
    Tensor out = Tensor::zeros({1000}, dt, Device::CUDA);
    c->all_gather(in, out)->wait();
    EXPECT_EQ(host(out), host(in)) << dtype_name(dt);
    Tensor rs = Tensor::zeros({1000}, dt, Device::CUDA);
    c->reduce_scatter(in, rs, ReduceOp::Max)->wait();
    EXPECT_EQ(host(rs), host(in)) << dtype_name(dt);
    Tensor t = iota(dt, 77, 5).to(Device::CUDA);
    c->all_reduce(t)->wait();
    EXPECT_EQ(host(t), host(iota(dt, 77, 5))) << dtype_name(dt);
    c->broadcast(t, 0)->wait();
    EXPECT_EQ(host(t), host(iota(dt, 77, 5))) << dtype_name(dt);
    Tensor a2a = Tensor::zeros({1000}, dt, Device::CUDA);
    c->all_to_all_v(in, {1000}, a2a, {1000})->wait();
    EXPECT_EQ(host(a2a), host(in)) << dtype_name(dt);
  }
  c->barrier();
  device_mem::synchronize(Device::CUDA);
  c->poll_completion();
  EXPECT_EQ(c->completed_seq(), c->last_issued().seq);
  EXPECT_EQ(c->last_issued().op, "barrier");
  c->check_schedule();
}

TEST(NcclComm, WorkWaitOrdersTheComputeStreamAfterTheCollective) {
  MT_REQUIRE_GPU();
  auto store = make_memory_store();
  auto c = make_world(Device::CUDA, 0, 1, *store, {});
  // A large gather, then at once a copy of its output: wait() must order the copy after it.
  const int64_t n = int64_t(64) << 20;
  Tensor in = Tensor::empty({n}, DType::BF16, Device::CUDA);
  in.copy_from(iota(DType::BF16, n));
  Tensor out = Tensor::zeros({n}, DType::BF16, Device::CUDA);
  for (int rep = 0; rep < 3; ++rep) {
    out.zero_();
    c->all_gather(in, out)->wait();
    Tensor copy = out.clone();
    std::vector<float> h = host(copy);
    EXPECT_EQ(h[size_t(n - 1)], float((n - 1) % 200));
    EXPECT_EQ(h[size_t(n / 2)], float((n / 2) % 200));
  }
}

TEST(NcclComm, SplitAndAbort) {
  MT_REQUIRE_GPU();
  auto store = make_memory_store();
  auto c = make_world(Device::CUDA, 0, 1, *store, {});
  auto g = c->split(3, 0, "group");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->size(), 1);
  EXPECT_STREQ(g->backend(), "nccl");
  Tensor t = iota(DType::F32, 10).to(Device::CUDA);
  g->all_reduce(t)->wait();
  EXPECT_EQ(host(t), host(iota(DType::F32, 10)));
  EXPECT_EQ(c->split(-1, 0, "none"), nullptr);
  g->abort("test");
  EXPECT_NE(testutil::error_of([&] { g->all_reduce(t); }).find("the communicator was aborted (test)"),
            std::string::npos);
  c->all_reduce(t)->wait();  // the parent is unaffected
}

}  // namespace
}  // namespace mt::comm
