// grouped_linear_fwd / grouped_linear_bwd on CUDA against the CPU: the adapters' case (f32 weights, bf16 or
// f32 rows, alpha, +=) on the tiled kernel, and the base's case (bf16 weights and rows, alpha 1, =) on the
// CUTLASS grouped GEMM where this build and GPU have it. Row counts that are not multiples of the 64-row tile,
// experts without rows, and a decode-like shape of many experts with few rows each.
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "ops/ops.h"

using namespace mt;
using namespace mt::cudatest;

namespace {

Tensor offsets_of(const std::vector<int64_t>& counts) {
  Tensor o = Tensor::empty({int64_t(counts.size()) + 1}, DType::I64);
  int64_t* p = o.data<int64_t>();
  p[0] = 0;
  for (size_t i = 0; i < counts.size(); ++i) p[i + 1] = p[i] + counts[i];
  return o;
}

struct Case {
  std::vector<int64_t> counts;
  int64_t N, K;
};

void check(const Case& c, DType xt, DType wt, DType yt, float alpha, bool acc) {
  SCOPED_TRACE(testing::Message() << "E " << c.counts.size() << " N " << c.N << " K " << c.K << " x "
                                  << dtype_name(xt) << " w " << dtype_name(wt) << " y " << dtype_name(yt)
                                  << " alpha " << alpha << (acc ? " +=" : " ="));
  Rng rng(11);
  const int64_t E = int64_t(c.counts.size()), N = c.N, K = c.K;
  const Tensor off = offsets_of(c.counts);
  const int64_t R = off.data<int64_t>()[E];
  const Tensor x = rand_bf16_exact({R, K}, rng), w = rand_bf16_exact({E, N, K}, rng, 0.1f),
               dy = rand_bf16_exact({R, N}, rng), y0 = rand_bf16_exact({R, N}, rng),
               dx0 = rand_bf16_exact({R, K}, rng), dw0 = randn({E, N, K}, rng);
  // CPU reference in f32
  Tensor y = y0.clone(), dx = dx0.clone(), dw = dw0.clone();
  ops::grouped_linear_fwd(x, off, w, alpha, y, acc);
  ops::grouped_linear_bwd(dy, x, off, w, alpha, &dx, acc, dw);
  // CUDA
  const Tensor goff = off.to(Device::CUDA), gx = to_cuda(x, xt), gw = to_cuda(w, wt), gdy = to_cuda(dy, xt);
  Tensor gy = to_cuda(y0, yt), gdx = to_cuda(dx0, yt), gdw = to_cuda(dw0, DType::F32);
  ops::grouped_linear_fwd(gx, goff, gw, alpha, gy, acc);
  ops::grouped_linear_bwd(gdy, gx, goff, gw, alpha, &gdx, acc, gdw);
  const double tol = yt == DType::BF16 ? 1e-2 : 1e-5;
  EXPECT_LE(rel_l2(to_host_f32(gy), y), tol);
  EXPECT_LE(rel_l2(to_host_f32(gdx), dx), tol);
  EXPECT_LE(rel_l2(to_host_f32(gdw), dw), 1e-5);
}

}  // namespace

TEST(CudaGroupedLinear, AdaptersKernelMatchesTheCpu) {
  MT_REQUIRE_GPU();
  const std::vector<Case> cases = {
      {{70, 0, 129, 1, 0, 64}, 8, 96},     // u = s x A^T: N = rank
      {{70, 0, 129, 1, 0, 64}, 200, 16},   // y += u B^T: K = rank
      {std::vector<int64_t>(128, 3), 32, 2048},  // decode: 128 experts, 3 rows each
  };
  for (const Case& c : cases)
    for (DType xt : {DType::BF16, DType::F32})
      for (DType yt : {DType::BF16, DType::F32}) {
        check(c, xt, DType::F32, yt, 0.5f, true);
        check(c, xt, DType::F32, yt, 1.0f, false);
      }
}

TEST(CudaGroupedLinear, BaseWeightsMatchTheCpu) {
  MT_REQUIRE_GPU();
  // bf16 everything, alpha 1, =: CUTLASS where available (multiples of 8), the tiled kernel otherwise
  check({{70, 0, 129, 1, 0, 64}, 96, 64}, DType::BF16, DType::BF16, DType::BF16, 1.0f, false);
  check({{70, 0, 129, 1, 0, 64}, 36, 20}, DType::BF16, DType::BF16, DType::BF16, 1.0f, false);  // not multiples of 8
  check({{70, 0, 129, 1, 0, 64}, 96, 64}, DType::BF16, DType::BF16, DType::F32, 0.5f, true);
}
