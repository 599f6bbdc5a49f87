// The CUDA paged KV cache ops against the CPU reference (backend/cpu/paged_attention.cpp, itself tested
// against causal attention in tests/ops): sequences of different lengths (one token, exact block
// multiples, hundreds of tokens) in shuffled blocks, grouped-query heads, head dims 16 (lanes idle),
// 64 and 128. kv_cache_write is a copy, so the caches must be bit-equal; the attention output is
// bf16, so within 1e-2 relative L2 (one bf16 rounding is at most 2^-9 relative per element; the
// softmax runs in f32 on the GPU, in double on the CPU).
#include <gtest/gtest.h>

#ifdef MT_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "cuda_test_util.h"

using namespace mt;
using cudatest::rand_bf16_exact;
using cudatest::rel_l2;
using cudatest::to_cuda;
using cudatest::to_host_f32;

namespace {

void check_case(int64_t Hd, uint64_t seed) {
  const int64_t H = 8, G = 2, bs = 16;
  const std::vector<int64_t> lens{37, 1, 300, 128, 16};
  const int64_t B = int64_t(lens.size());
  int64_t N = 0, M = 0, blocks = 5;
  for (int64_t L : lens) {
    N += L;
    M = std::max(M, (L + bs - 1) / bs);
    blocks += (L + bs - 1) / bs;
  }
  Rng rng(seed);
  Tensor q = rand_bf16_exact({N, H, Hd}, rng), k = rand_bf16_exact({N, G, Hd}, rng), v = rand_bf16_exact({N, G, Hd}, rng);
  std::vector<int32_t> ids(static_cast<size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 0);
  for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[size_t(rng.randint(0, int64_t(i)))]);
  Tensor table = Tensor::zeros({B, M}, DType::I32), seq = Tensor::empty({N}, DType::I32),
         pos = Tensor::empty({N}, DType::I32), slots = Tensor::empty({N}, DType::I32);
  size_t next = 0;
  int64_t row = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < (lens[size_t(b)] + bs - 1) / bs; ++j) table.data<int32_t>()[b * M + j] = ids[next++];
    for (int64_t p = 0; p < lens[size_t(b)]; ++p, ++row) {
      seq.data<int32_t>()[row] = int32_t(b);
      pos.data<int32_t>()[row] = int32_t(p);
      slots.data<int32_t>()[row] = table.data<int32_t>()[b * M + p / bs] * int32_t(bs) + int32_t(p % bs);
    }
  }
  Tensor kc = Tensor::zeros({blocks * bs, G, Hd}), vc = Tensor::zeros({blocks * bs, G, Hd});
  cpu::kv_cache_write(k, v, slots, kc, vc);
  Tensor want = Tensor::empty({N, H, Hd});
  cpu::paged_attention_fwd(q, kc, vc, table, bs, seq, pos, want);

  Tensor dkc = to_cuda(Tensor::zeros({blocks * bs, G, Hd}), DType::BF16), dvc = dkc.clone();
  const Tensor dslots = slots.to(Device::CUDA), dtable = table.to(Device::CUDA), dseq = seq.to(Device::CUDA),
               dpos = pos.to(Device::CUDA);
  cuda::kv_cache_write(to_cuda(k, DType::BF16), to_cuda(v, DType::BF16), dslots, dkc, dvc);
  const Tensor hk = to_host_f32(dkc), hv = to_host_f32(dvc);
  EXPECT_EQ(0, std::memcmp(hk.raw(), kc.raw(), size_t(kc.nbytes()))) << "k cache, Hd " << Hd;
  EXPECT_EQ(0, std::memcmp(hv.raw(), vc.raw(), size_t(vc.nbytes()))) << "v cache, Hd " << Hd;
  Tensor nan = Tensor::empty({N, H, Hd});
  nan.fill_(NAN);  // an element the kernel leaves unwritten fails
  Tensor out = to_cuda(nan, DType::BF16);
  cuda::paged_attention_fwd(to_cuda(q, DType::BF16), dkc, dvc, dtable, bs, dseq, dpos, out);
  const double err = rel_l2(out, want);
  EXPECT_LT(err, 1e-2) << "Hd " << Hd;
  std::printf("paged_attention_fwd Hd %lld: rel L2 %.2e\n", (long long)Hd, err);
}

}  // namespace

TEST(CudaPagedAttention, KvWriteIsExactAndAttentionMatchesTheCpu) {
  MT_REQUIRE_GPU();
  check_case(16, 1);
  check_case(64, 2);
  check_case(128, 3);
}

#endif  // MT_HAVE_CUDA
