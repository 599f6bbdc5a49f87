// The CUDA paged KV cache ops against the CPU reference (backend/cpu/paged_attention.cpp, itself tested
// against causal attention in tests/ops): sequences of different lengths (one token, exact block
// multiples, hundreds of tokens) in shuffled blocks; head dims 16, 64, 128, 256 and 24 (the serial
// kernel only); group sizes 1 to 16; decode steps over contexts up to 3,000 positions (several splits
// of the split-K kernel, some empty). Each kernel the launcher can pick is run
// (MOETRAIN_PAGED_ATTENTION). kv_cache_write is a copy, so the caches must be bit-equal; the attention
// output is bf16, so within 1e-2 relative L2 (one bf16 rounding is at most 2^-9 relative per element;
// the softmax runs in f32 on the GPU, in double on the CPU).
#include <gtest/gtest.h>

#ifdef MT_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>
#include <cstdlib>

#include "cuda_test_util.h"

using namespace mt;
using cudatest::rand_bf16_exact;
using cudatest::rel_l2;
using cudatest::to_cuda;
using cudatest::to_host_f32;

namespace {

struct Case {
  int64_t Hd, H, G;
  std::vector<int64_t> lens;
  bool decode;  // query only each sequence's last position (the decode step; few blocks: several splits)
};

// Every kernel the launcher can pick, by MOETRAIN_PAGED_ATTENTION (the split-K one for head dims
// 16..256 powers of two, the serial one for any head dim).
std::vector<std::string> kernels_for(int64_t Hd) {
  std::vector<std::string> k{"serial", "auto"};
  if (Hd == 16 || Hd == 32 || Hd == 64 || Hd == 128 || Hd == 256) k.push_back("split");
  return k;
}

void check_case(const Case& c, uint64_t seed) {
  const int64_t Hd = c.Hd, H = c.H, G = c.G, bs = 16;
  const std::vector<int64_t>& lens = c.lens;
  const int64_t B = int64_t(lens.size());
  int64_t T = 0, M = 0, blocks = 5;
  for (int64_t L : lens) {
    T += L;
    M = std::max(M, (L + bs - 1) / bs);
    blocks += (L + bs - 1) / bs;
  }
  Rng rng(seed);
  Tensor k = rand_bf16_exact({T, G, Hd}, rng), v = rand_bf16_exact({T, G, Hd}, rng);
  std::vector<int32_t> ids(static_cast<size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 0);
  for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[size_t(rng.randint(0, int64_t(i)))]);
  Tensor table = Tensor::zeros({B, M}, DType::I32), seq_all = Tensor::empty({T}, DType::I32),
         pos_all = Tensor::empty({T}, DType::I32), slots = Tensor::empty({T}, DType::I32);
  size_t next = 0;
  int64_t row = 0;
  std::vector<int64_t> last_rows;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < (lens[size_t(b)] + bs - 1) / bs; ++j) table.data<int32_t>()[b * M + j] = ids[next++];
    for (int64_t p = 0; p < lens[size_t(b)]; ++p, ++row) {
      seq_all.data<int32_t>()[row] = int32_t(b);
      pos_all.data<int32_t>()[row] = int32_t(p);
      slots.data<int32_t>()[row] = table.data<int32_t>()[b * M + p / bs] * int32_t(bs) + int32_t(p % bs);
    }
    last_rows.push_back(row - 1);
  }
  // The query tokens: all of them, or each sequence's last.
  const int64_t N = c.decode ? B : T;
  Tensor seq = Tensor::empty({N}, DType::I32), pos = Tensor::empty({N}, DType::I32);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t r = c.decode ? last_rows[size_t(n)] : n;
    seq.data<int32_t>()[n] = seq_all.data<int32_t>()[r];
    pos.data<int32_t>()[n] = pos_all.data<int32_t>()[r];
  }
  Tensor q = rand_bf16_exact({N, H, Hd}, rng);
  Tensor kc = Tensor::zeros({blocks * bs, G, Hd}), vc = Tensor::zeros({blocks * bs, G, Hd});
  cpu::kv_cache_write(k, v, slots, kc, vc);
  Tensor want = Tensor::empty({N, H, Hd});
  cpu::paged_attention_fwd(q, kc, vc, table, bs, seq, pos, want);

  Tensor dkc = to_cuda(Tensor::zeros({blocks * bs, G, Hd}), DType::BF16), dvc = dkc.clone();
  const Tensor dslots = slots.to(Device::CUDA), dtable = table.to(Device::CUDA), dseq = seq.to(Device::CUDA),
               dpos = pos.to(Device::CUDA), dq = to_cuda(q, DType::BF16);
  cuda::kv_cache_write(to_cuda(k, DType::BF16), to_cuda(v, DType::BF16), dslots, dkc, dvc);
  const Tensor hk = to_host_f32(dkc), hv = to_host_f32(dvc);
  EXPECT_EQ(0, std::memcmp(hk.raw(), kc.raw(), size_t(kc.nbytes()))) << "k cache, Hd " << Hd;
  EXPECT_EQ(0, std::memcmp(hv.raw(), vc.raw(), size_t(vc.nbytes()))) << "v cache, Hd " << Hd;
  for (const std::string& kernel : kernels_for(Hd)) {
    setenv("MOETRAIN_PAGED_ATTENTION", kernel.c_str(), 1);
    Tensor nan = Tensor::empty({N, H, Hd});
    nan.fill_(NAN);  // an element the kernel leaves unwritten fails
    Tensor out = to_cuda(nan, DType::BF16);
    cuda::paged_attention_fwd(dq, dkc, dvc, dtable, bs, dseq, dpos, out);
    const double err = rel_l2(out, want);
    EXPECT_LT(err, 1e-2) << kernel << " Hd " << Hd << " H " << H << " G " << G << (c.decode ? " decode" : " all");
    std::printf("paged_attention_fwd %s Hd %lld H %lld G %lld %s: rel L2 %.2e\n", kernel.c_str(), (long long)Hd,
                (long long)H, (long long)G, c.decode ? "decode" : "all", err);
  }
  unsetenv("MOETRAIN_PAGED_ATTENTION");
}

}  // namespace

TEST(CudaPagedAttention, KvWriteIsExactAndAttentionMatchesTheCpu) {
  MT_REQUIRE_GPU();
  const std::vector<int64_t> mixed{37, 1, 300, 128, 16};
  uint64_t seed = 1;
  for (int64_t Hd : {16, 24, 64, 128, 256}) check_case({Hd, 8, 2, mixed, false}, seed++);
  // Group sizes 1, 2, 3 (one head per block), 8 and 16 (two blocks per KV head).
  for (auto [H, G] : std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {4, 2}, {6, 2}, {32, 4}, {32, 2}})
    check_case({128, H, G, mixed, false}, seed++);
}

TEST(CudaPagedAttention, DecodeStepsOverLongContextsSplitThePositions) {
  MT_REQUIRE_GPU();
  // Few query tokens and contexts up to 3,000 positions: the split-K kernel takes several splits,
  // some of them past a short sequence's end (empty partials), and merges them.
  uint64_t seed = 100;
  for (int64_t Hd : {32, 128, 256}) check_case({Hd, 32, 4, {3000, 1, 129, 700}, true}, seed++);
  check_case({128, 8, 8, {2049}, true}, seed++);
  check_case({40, 8, 2, {1500, 3}, true}, seed++);  // serial kernel only
}

#endif  // MT_HAVE_CUDA
