// The CUDA paged KV cache ops against the CPU reference (backend/cpu/paged_attention.cpp, itself tested
// against causal attention in tests/ops): sequences of different lengths (one token, exact block
// multiples, hundreds of tokens) in shuffled blocks of several sizes; head dims 16, 64, 128, 256 and 24
// (the serial kernel only); group sizes 1 to 16; decode steps over contexts up to 3,000 positions
// (several splits, some empty); a decode batch padded as the CUDA graphs pad it. Each kernel the
// launcher can pick is run (MOETRAIN_PAGED_ATTENTION), and the tensor-core kernel is also compared with
// the split-K one. The device caches start as NaN, so a kernel that reads a slot no token wrote (past a
// sequence's end, in a tile's tail) fails. kv_cache_write is a copy, so the written rows must be
// bit-equal; the attention output is bf16, so within 1e-2 relative L2 (one bf16 rounding is at most
// 2^-9 relative per element; the softmax runs in f32 on the GPU, in double on the CPU).
#include <gtest/gtest.h>

#ifdef MT_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

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
  bool decode;        // query only each sequence's last position (the decode step; few blocks: several splits)
  int64_t bs = 16;    // block size (the engine's default is 16)
  int64_t pad = 0;    // decode only: rows padded as the CUDA graphs pad a batch (pos 0 in a scratch block)
};

// Every kernel the launcher can pick, by MOETRAIN_PAGED_ATTENTION (the tensor-core one for head dims 64
// and 128, the split-K one for head dims 16..256 powers of two, the serial one for any head dim).
std::vector<std::string> kernels_for(int64_t Hd) {
  std::vector<std::string> k{"serial", "auto"};
  if (Hd == 16 || Hd == 32 || Hd == 64 || Hd == 128 || Hd == 256) k.push_back("split");
  if (Hd == 64 || Hd == 128) k.push_back("mma");
  return k;
}

// Runs every kernel on the case; returns the worst relative L2 error against the CPU.
double check_case(const Case& c, uint64_t seed) {
  const int64_t Hd = c.Hd, H = c.H, G = c.G, bs = c.bs;
  const std::vector<int64_t>& lens = c.lens;
  const int64_t B = int64_t(lens.size()), P = c.decode ? c.pad : 0;
  int64_t T = 0, M = 1, blocks = 5;
  for (int64_t L : lens) {
    T += L;
    M = std::max(M, (L + bs - 1) / bs);
    blocks += (L + bs - 1) / bs;
  }
  const int64_t scratch = blocks;  // the padding rows' block, as the engine's (one past the pool)
  if (P > 0) ++blocks;
  Rng rng(seed);
  Tensor k = rand_bf16_exact({T + P, G, Hd}, rng), v = rand_bf16_exact({T + P, G, Hd}, rng);
  for (int64_t i = 1; i < P; ++i) {  // the padding rows share one slot, so (as in the engine) one key and value
    std::copy_n(k.data<float>() + T * G * Hd, G * Hd, k.data<float>() + (T + i) * G * Hd);
    std::copy_n(v.data<float>() + T * G * Hd, G * Hd, v.data<float>() + (T + i) * G * Hd);
  }
  std::vector<int32_t> ids(static_cast<size_t>(scratch));
  std::iota(ids.begin(), ids.end(), 0);
  for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[size_t(rng.randint(0, int64_t(i)))]);
  Tensor table = Tensor::zeros({B + P, M}, DType::I32), seq_all = Tensor::empty({T + P}, DType::I32),
         pos_all = Tensor::empty({T + P}, DType::I32), slots = Tensor::empty({T + P}, DType::I32);
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
  // Padding rows (engine.cpp, DecodeGraphs): sequence = own row, every table entry the scratch block,
  // position 0, their key and value written to the scratch block's first slot.
  for (int64_t i = 0; i < P; ++i, ++row) {
    std::fill_n(table.data<int32_t>() + (B + i) * M, M, int32_t(scratch));
    seq_all.data<int32_t>()[row] = int32_t(B + i);
    pos_all.data<int32_t>()[row] = 0;
    slots.data<int32_t>()[row] = int32_t(scratch * bs);
    last_rows.push_back(row);
  }
  // The query tokens: all of them, or each sequence's last (and the padding rows).
  const int64_t N = c.decode ? B + P : T;
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

  Tensor nan_cache = Tensor::empty({blocks * bs, G, Hd});
  nan_cache.fill_(NAN);
  Tensor dkc = to_cuda(nan_cache, DType::BF16), dvc = dkc.clone();
  const Tensor dslots = slots.to(Device::CUDA), dtable = table.to(Device::CUDA), dseq = seq.to(Device::CUDA),
               dpos = pos.to(Device::CUDA), dq = to_cuda(q, DType::BF16);
  cuda::kv_cache_write(to_cuda(k, DType::BF16), to_cuda(v, DType::BF16), dslots, dkc, dvc);
  const Tensor hk = to_host_f32(dkc), hv = to_host_f32(dvc);
  const size_t row_bytes = size_t(G * Hd) * sizeof(float);
  int64_t bad_rows = 0;
  for (int64_t r = 0; r < T + P; ++r) {
    const int64_t s = slots.data<int32_t>()[r];
    bad_rows += std::memcmp(hk.data<float>() + s * G * Hd, kc.data<float>() + s * G * Hd, row_bytes) != 0;
    bad_rows += std::memcmp(hv.data<float>() + s * G * Hd, vc.data<float>() + s * G * Hd, row_bytes) != 0;
  }
  EXPECT_EQ(bad_rows, 0) << "k/v cache rows differ from the CPU's, Hd " << Hd;
  double worst = 0;
  std::map<std::string, Tensor> outs;
  for (const std::string& kernel : kernels_for(Hd)) {
    setenv("MOETRAIN_PAGED_ATTENTION", kernel.c_str(), 1);
    Tensor nan = Tensor::empty({N, H, Hd});
    nan.fill_(NAN);  // an element the kernel leaves unwritten fails
    Tensor out = to_cuda(nan, DType::BF16);
    cuda::paged_attention_fwd(dq, dkc, dvc, dtable, bs, dseq, dpos, out);
    const double err = rel_l2(out, want);
    worst = std::max(worst, err);
    EXPECT_LT(err, 1e-2) << kernel << " Hd " << Hd << " H " << H << " G " << G << " block " << bs
                         << (c.decode ? " decode" : " all") << " pad " << P;
    std::printf("paged_attention_fwd %s Hd %lld H %lld G %lld block %lld %s pad %lld: rel L2 %.2e\n", kernel.c_str(),
                (long long)Hd, (long long)H, (long long)G, (long long)bs, c.decode ? "decode" : "all", (long long)P,
                err);
    outs[kernel] = out;
  }
  unsetenv("MOETRAIN_PAGED_ATTENTION");
  if (outs.count("mma") && outs.count("split")) {  // new == old, both bf16
    const double d = rel_l2(outs["mma"], outs["split"]);
    EXPECT_LT(d, 1e-2) << "mma vs split, Hd " << Hd << " H " << H << " G " << G;
    std::printf("  mma vs split: rel L2 %.2e\n", d);
  }
  return worst;
}

// Lengths that start, end and cross block and tile boundaries (tiles of 16 positions, 64 per block of
// warps), plus random ones up to `max_len`.
std::vector<int64_t> boundary_lens(int64_t extra, int64_t max_len, Rng& rng) {
  std::vector<int64_t> lens{1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 383, 384, 385, 640, 641};
  for (int64_t i = 0; i < extra; ++i) lens.push_back(1 + rng.randint(0, max_len));
  return lens;
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
  // Few query tokens and contexts up to 3,000 positions: the split-K and tensor-core kernels take
  // several splits, some of them past a short sequence's end (empty partials), and merge them.
  uint64_t seed = 100;
  for (int64_t Hd : {32, 64, 128, 256}) check_case({Hd, 32, 4, {3000, 1, 129, 700}, true}, seed++);
  check_case({128, 8, 8, {2049}, true}, seed++);
  check_case({128, 32, 4, {1}, true}, seed++);  // one position: one warp of one block has work
  check_case({40, 8, 2, {1500, 3}, true}, seed++);  // serial kernel only
}

TEST(CudaPagedAttention, TensorCoreKernelAtTheBench4LShape) {
  MT_REQUIRE_GPU();
  // bench-4L's attention (32 query heads, 4 KV heads, head dim 128) decoding 64 sequences whose
  // lengths sit on every boundary, in the engine's 16-position blocks and in odd ones (5: a tile spans
  // four blocks; 1; 64: a block spans a warp block's four tiles).
  uint64_t seed = 200;
  Rng rng(7);
  const std::vector<int64_t> lens = boundary_lens(45, 700, rng);
  for (int64_t bs : {16, 5, 1, 64}) check_case({128, 32, 4, lens, true, bs}, seed++);
  // Five splits forced (MOETRAIN_PAGED_SPLITS; by itself this batch takes 1 to 3 by the GPU's size):
  // every token's partials merged, the short sequences' later splits empty.
  setenv("MOETRAIN_PAGED_SPLITS", "5", 1);
  check_case({128, 32, 4, lens, true}, seed++);
  unsetenv("MOETRAIN_PAGED_SPLITS");
  // Prefill (every position a query) at the same shape, and head dim 64.
  check_case({128, 32, 4, {200, 1, 77, 16}, false}, seed++);
  check_case({64, 32, 4, lens, true}, seed++);
}

TEST(CudaPagedAttention, TensorCoreKernelTakesEveryGroupSize) {
  MT_REQUIRE_GPU();
  // Group sizes below 8 leave the MMA's head columns partly empty, above 8 take several blocks per KV
  // head (12: the second block has 4 heads).
  uint64_t seed = 300;
  Rng rng(8);
  const std::vector<int64_t> lens = boundary_lens(5, 400, rng);
  for (auto [H, G] : std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {4, 2}, {6, 2}, {8, 2}, {24, 4}, {12, 1}, {32, 2}})
    for (int64_t Hd : {64, 128}) check_case({Hd, H, G, lens, true}, seed++);
}

TEST(CudaPagedAttention, PaddedDecodeBatchAsTheCudaGraphsPadIt) {
  MT_REQUIRE_GPU();
  // 37 real rows padded to the bucket of 64: the padding rows read only their own key, just written;
  // the rest of the scratch block is NaN.
  Rng rng(9);
  std::vector<int64_t> lens;
  for (int i = 0; i < 37; ++i) lens.push_back(1 + rng.randint(0, 600));
  check_case({128, 32, 4, lens, true, 16, 27}, 400);
  check_case({128, 32, 4, {1}, true, 16, 7}, 401);
}

TEST(CudaPagedAttention, KernelChoiceErrorsNameTheValue) {
  MT_REQUIRE_GPU();
  Tensor q = Tensor::zeros({1, 2, 256}, DType::BF16, Device::CUDA), kc = Tensor::zeros({16, 1, 256}, DType::BF16, Device::CUDA);
  Tensor vc = kc.clone(), out = q.clone();
  const Tensor table = Tensor::zeros({1, 1}, DType::I32, Device::CUDA), seq = Tensor::zeros({1}, DType::I32, Device::CUDA),
               pos = seq.clone();
  setenv("MOETRAIN_PAGED_ATTENTION", "mma", 1);
  try {
    cuda::paged_attention_fwd(q, kc, vc, table, 16, seq, pos, out);
    ADD_FAILURE() << "mma at head_dim 256 did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("MOETRAIN_PAGED_ATTENTION=mma but head_dim 256 is not 64 or 128"),
              std::string::npos)
        << e.what();
  }
  setenv("MOETRAIN_PAGED_ATTENTION", "tensor", 1);
  try {
    cuda::paged_attention_fwd(q, kc, vc, table, 16, seq, pos, out);
    ADD_FAILURE() << "an unknown kernel name did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("MOETRAIN_PAGED_ATTENTION (tensor) must be one of auto, serial, split, mma"),
              std::string::npos)
        << e.what();
  }
  unsetenv("MOETRAIN_PAGED_ATTENTION");
  setenv("MOETRAIN_PAGED_SPLITS", "0", 1);
  try {
    cuda::paged_attention_fwd(q, kc, vc, table, 16, seq, pos, out);
    ADD_FAILURE() << "MOETRAIN_PAGED_SPLITS=0 did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("MOETRAIN_PAGED_SPLITS (0) must be an integer from 1 to 64"),
              std::string::npos)
        << e.what();
  }
  unsetenv("MOETRAIN_PAGED_SPLITS");
}

#endif  // MT_HAVE_CUDA
