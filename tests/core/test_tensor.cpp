#include <gtest/gtest.h>

#include "core/arena.h"
#include "core/rng.h"
#include "core/tensor.h"

using namespace mt;

TEST(Tensor, ViewRowsAndClone) {
  Tensor t = Tensor::zeros({4, 3});
  float* p = t.data<float>();
  for (int i = 0; i < 12; ++i) p[i] = float(i);
  Tensor r = t.rows(1, 2);
  EXPECT_EQ(r.shape(), (Shape{2, 3}));
  EXPECT_EQ(r.data<float>()[0], 3.0f);
  Tensor v = t.view({-1, 6});
  EXPECT_EQ(v.shape(), (Shape{2, 6}));
  Tensor c = t.clone();
  c.data<float>()[0] = 42;
  EXPECT_EQ(p[0], 0.0f);
  EXPECT_THROW(t.view({5, -1}), Error);
  EXPECT_THROW(t.rows(3, 2), Error);
  EXPECT_THROW(t.data<int32_t>(), Error);
}

TEST(Tensor, DtypeRoundTrip) {
  Tensor t = Tensor::empty({5});
  float vals[5] = {1.0f, -2.5f, 3.140625f, 0.0f, 65504.0f};
  for (int i = 0; i < 5; ++i) t.data<float>()[i] = vals[i];
  Tensor b = t.to(DType::BF16).to(DType::F32);
  Tensor h = t.to(DType::F16).to(DType::F32);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(h.data<float>()[i], vals[i]);
    EXPECT_NEAR(b.data<float>()[i], vals[i], std::abs(vals[i]) / 128);
  }
  EXPECT_EQ(f32_to_bf16(1.00390625f), f32_to_bf16(1.0f));  // ties to even
  EXPECT_EQ(f16_to_f32(f32_to_f16(1e-7f)), f16_to_f32(2));  // subnormal rounds to nearest
}

TEST(Arena, AlignsGrowsAndSettlesAtPeak) {
  Arena a(1024);
  Tensor x = a.alloc({3});
  Tensor y = a.alloc({3});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(y.raw()) % 256, 0u);
  EXPECT_NE(x.raw(), y.raw());
  Tensor big = a.alloc({1000});  // does not fit: a second block is chained
  big.fill_(1.0f);
  EXPECT_EQ(x.numel(), 3);
  EXPECT_GE(a.capacity(), 1024u + 4000u);
  size_t peak = a.peak();
  EXPECT_GE(peak, 256u + 12u + 4000u);
  a.reset();  // one block of the peak size from now on
  EXPECT_EQ(a.used(), 0u);
  EXPECT_GE(a.capacity(), peak);
  void* first = a.alloc({3}).raw();
  a.alloc({3});
  a.alloc({1000});
  a.reset();
  EXPECT_EQ(a.alloc({3}).raw(), first);  // no new block was needed
}

TEST(Arena, MergeReportsBlocksStillHeldByTensors) {
  Arena a(1024);
  a.alloc({3});
  a.alloc({1000});  // a second block of 4,000 bytes (rounded to 4,096)
  a.reset();        // no tensor holds them: freed at the merge
  EXPECT_EQ(a.held_at_merge(), 0u);
  Tensor kept = a.alloc({3});
  Tensor big = a.alloc({5000});  // chains again (20,000 bytes do not fit the merged block)
  const size_t chain = a.capacity();
  a.reset();  // `kept` and `big` still hold both blocks: the merge's new block sits beside them
  EXPECT_EQ(a.held_at_merge(), chain);
  EXPECT_GE(chain, 20000u);
}

TEST(Rng, DeterministicAndRoughlyNormal) {
  Rng a(7), b(7);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(a.next_u64(), b.next_u64());
  Rng r(1);
  double s = 0, s2 = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    double z = r.normal();
    s += z;
    s2 += z * z;
  }
  EXPECT_NEAR(s / n, 0.0, 0.03);
  EXPECT_NEAR(s2 / n, 1.0, 0.05);
}

// Tensor::pinned is a CPU tensor (page-locked only when a GPU is usable); copy_from_async between CPU tensors
// copies at once.
TEST(Tensor, PinnedIsAHostTensorAndAsyncCopiesBetweenHostTensors) {
  Tensor p = Tensor::pinned({5, 3}, DType::I32);
  EXPECT_EQ(p.device(), Device::CPU);
  EXPECT_EQ(p.shape(), (Shape{5, 3}));
  for (int i = 0; i < 15; ++i) p.data<int32_t>()[i] = i * i;
  Tensor q = Tensor::empty({5, 3}, DType::I32);
  q.copy_from_async(p);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(q.data<int32_t>()[i], i * i);
  Tensor bad = Tensor::empty({15}, DType::I32);
  EXPECT_THROW(bad.copy_from_async(p), std::exception);
  Tensor none = Tensor::pinned({0}, DType::F32);  // an empty pinned tensor is valid
  EXPECT_EQ(none.numel(), 0);
}
