// Device memory (backend/cuda/memory.cu): tensors come from the stream-ordered pool, freed memory is
// reused without growing it, the accounting follows, and an impossible request fails with the sizes
// named instead of crashing.
#include <gtest/gtest.h>

#include <string>

#include "cuda_test_util.h"
#include "test_util.h"

namespace mt {
namespace {

TEST(CudaMemory, FreedMemoryIsReusedAndCounted) {
  MT_REQUIRE_GPU();
  device_mem::synchronize(Device::CUDA);
  const size_t before = device_mem::cuda_bytes_in_use();
  device_mem::cuda_reset_peak();
  const int64_t n = int64_t(256) << 20;  // 1 GiB of f32
  for (int i = 0; i < 4; ++i) {
    Tensor t = Tensor::empty({n}, DType::F32, Device::CUDA);
    EXPECT_EQ(device_mem::cuda_bytes_in_use(), before + size_t(n) * 4);
    t.zero_();
  }
  device_mem::synchronize(Device::CUDA);
  EXPECT_EQ(device_mem::cuda_bytes_in_use(), before);
  EXPECT_EQ(device_mem::cuda_peak_bytes(), before + size_t(n) * 4);
  // Four allocations of 1 GiB, one at a time: the pool holds about one of them, not four.
  EXPECT_GE(device_mem::cuda_reserved_peak_bytes(), size_t(n) * 4);
  EXPECT_LT(device_mem::cuda_reserved_peak_bytes(), size_t(n) * 4 * 2 + before);
}

TEST(CudaMemory, AnImpossibleRequestNamesTheSizes) {
  MT_REQUIRE_GPU();
  const std::string m = testutil::error_of([] { Tensor::empty({int64_t(1) << 42}, DType::F32, Device::CUDA); });  // 16 TiB
  EXPECT_NE(m.find("CUDA out of memory allocating"), std::string::npos) << m;
  EXPECT_NE(m.find("MiB free"), std::string::npos) << m;
  Tensor ok = Tensor::zeros({1024}, DType::F32, Device::CUDA);  // the pool still works afterwards
  device_mem::synchronize(Device::CUDA);
  EXPECT_EQ(ok.to(Device::CPU).data<float>()[1023], 0.0f);
}

// Pinned host tensors and copy_from_async (the rollout engine's per-step staging): a round trip through the
// device in stream order, after kernels queued before it, with the host waiting only at the synchronisation.
TEST(CudaMemory, PinnedAsyncCopiesRoundTripInStreamOrder) {
  MT_REQUIRE_GPU();
  const int64_t n = 1 << 20;
  Tensor h = Tensor::pinned({n}, DType::I64), back = Tensor::pinned({n}, DType::I64);
  for (int64_t i = 0; i < n; ++i) h.data<int64_t>()[i] = i * 7 - 3;
  Tensor d = Tensor::empty({n}, DType::I64, Device::CUDA);
  d.zero_();
  d.copy_from_async(h);
  back.copy_from_async(d);
  device_mem::synchronize(Device::CUDA);
  for (int64_t i = 0; i < n; i += 4097) ASSERT_EQ(back.data<int64_t>()[i], i * 7 - 3) << i;
  EXPECT_EQ(back.data<int64_t>()[n - 1], (n - 1) * 7 - 3);
  // A view's copy lands at its offset only.
  Tensor part = Tensor::pinned({16}, DType::I64);
  for (int64_t i = 0; i < 16; ++i) part.data<int64_t>()[i] = -1;
  d.rows(8, 16).copy_from_async(part);
  back.copy_from_async(d);
  device_mem::synchronize(Device::CUDA);
  EXPECT_EQ(back.data<int64_t>()[7], 7 * 7 - 3);
  EXPECT_EQ(back.data<int64_t>()[8], -1);
  EXPECT_EQ(back.data<int64_t>()[23], -1);
  EXPECT_EQ(back.data<int64_t>()[24], 24 * 7 - 3);
}

}  // namespace
}  // namespace mt
