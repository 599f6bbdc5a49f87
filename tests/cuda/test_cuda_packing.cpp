// Packed rows on CUDA (several documents per row, model/micro_batch.h): the attention op with
// doc_start_T (the reference kernels with the document mask) against the CPU's, and the whole model on
// a packed micro-batch (bf16) against the fp32 CPU model, within docs/design.md's bf16 tolerance
// (relative L2 <= 2e-2). Skipped without a GPU.
#include <gtest/gtest.h>

#include <vector>

#include "cuda_test_util.h"
#include "model/qwen3_moe.h"
#include "ops/ops.h"

using namespace mt;
using cudatest::rel_l2;

namespace {

// Rows of S tokens holding documents of the given lengths back to back, then padding: the document
// start of every token (padding: where it starts), i32 [B S].
Tensor doc_starts(const std::vector<std::vector<int64_t>>& rows, int64_t S) {
  Tensor ds = Tensor::empty({int64_t(rows.size()) * S}, DType::I32);
  for (size_t b = 0; b < rows.size(); ++b) {
    int64_t s = 0;
    for (int64_t n : rows[b])
      for (int64_t i = 0; i < n; ++i, ++s) ds.data<int32_t>()[int64_t(b) * S + s] = int32_t(s - i);
    const int64_t pad = s;
    for (; s < S; ++s) ds.data<int32_t>()[int64_t(b) * S + s] = int32_t(pad);
  }
  return ds;
}

}  // namespace

TEST(CudaPacking, AttentionMatchesCpuWithDocumentMask) {
  MT_REQUIRE_GPU();
  const int64_t B = 2, S = 150, H = 4, G = 2, Hd = 64, T = B * S;
  // Documents longer than a kernel tile (64) and shorter, one of length 1, and row padding.
  const Tensor ds = doc_starts({{70, 1, 40, 30}, {9, 100}}, S);
  Rng rng(21);
  const Tensor q = cudatest::rand_bf16_exact({T, H, Hd}, rng), k = cudatest::rand_bf16_exact({T, G, Hd}, rng),
               v = cudatest::rand_bf16_exact({T, G, Hd}, rng), dout = cudatest::rand_bf16_exact({T, H, Hd}, rng);
  Tensor out = Tensor::empty({T, H, Hd}), lse = Tensor::empty({T, H}), dq = Tensor::empty({T, H, Hd}),
         dk = Tensor::empty({T, G, Hd}), dv = Tensor::empty({T, G, Hd});
  ops::attention_fwd(q, k, v, B, S, out, lse, &ds);
  ops::attention_bwd(dout, q, k, v, out, lse, B, S, dq, dk, dv, &ds);

  const Tensor qg = cudatest::to_cuda(q, DType::BF16), kg = cudatest::to_cuda(k, DType::BF16),
               vg = cudatest::to_cuda(v, DType::BF16), dog = cudatest::to_cuda(dout, DType::BF16);
  const Tensor dsg = ds.to(Device::CUDA);
  Tensor og = Tensor::empty({T, H, Hd}, DType::BF16, Device::CUDA),
         lg = Tensor::empty({T, H}, DType::F32, Device::CUDA);
  Tensor dqg = Tensor::empty({T, H, Hd}, DType::BF16, Device::CUDA),
         dkg = Tensor::empty({T, G, Hd}, DType::BF16, Device::CUDA),
         dvg = Tensor::empty({T, G, Hd}, DType::BF16, Device::CUDA);
  ops::attention_fwd(qg, kg, vg, B, S, og, lg, &dsg);
  ops::attention_bwd(dog, qg, kg, vg, og, lg, B, S, dqg, dkg, dvg, &dsg);
  EXPECT_LE(rel_l2(og, out), 1e-2);
  EXPECT_LE(rel_l2(lg, lse), 1e-3);  // [T, H] statistics on the packed path
  EXPECT_LE(rel_l2(dqg, dq), 2e-2);
  EXPECT_LE(rel_l2(dkg, dk), 2e-2);
  EXPECT_LE(rel_l2(dvg, dv), 2e-2);
}

// The whole tiny model on a packed micro-batch: CUDA (bf16) vs CPU (fp32), routing replayed from the
// CPU (as tests/cuda/test_cuda_model.cpp does, so near-tie top-k flips do not decide the result).
TEST(CudaPacking, ModelMatchesCpuOnPackedRows) {
  MT_REQUIRE_GPU();
  ModelConfig c = preset_model_config("tiny");
  c.output_router_logits = true;
  const int64_t B = 2, S = 24;
  const std::vector<std::vector<int64_t>> rows = {{5, 9, 7}, {12, 2}};
  MicroBatch mb{Tensor::zeros({B, S}, DType::I64), Tensor::empty({B, S}, DType::I64)};
  mb.segments = Tensor::empty({B, S}, DType::I32);
  Rng rng(4);
  for (int64_t b = 0; b < B; ++b) {
    int64_t s = 0;
    int32_t seg = 0;
    for (int64_t n : rows[size_t(b)]) {
      for (int64_t i = 0; i < n; ++i, ++s) {
        mb.input_ids.data<int64_t>()[b * S + s] = rng.randint(1, c.vocab_size);
        mb.labels.data<int64_t>()[b * S + s] = mb.input_ids.data<int64_t>()[b * S + s];
        mb.segments.data<int32_t>()[b * S + s] = seg;
      }
      ++seg;
    }
    for (; s < S; ++s) {
      mb.labels.data<int64_t>()[b * S + s] = -100;
      mb.segments.data<int32_t>()[b * S + s] = -1;
    }
  }
  Qwen3MoeModel cpu(c);
  init_weights(c, cpu.table(), cpu.params(), 8);
  PassOptions po;
  po.ce_scale = 1.0 / 30;
  po.aux_scale = 0.01;
  po.overwrite_grads = true;
  const LossParts lc = cpu.forward_backward(mb, po);
  MicroBatch replayed = mb;
  replayed.routing = cpu.last_routing();
  for (Recompute rc : {Recompute::None, Recompute::Full}) {
    Qwen3MoeModel g(c, Device::CUDA);
    g.params().copy_from(cpu.params().to(Device::CUDA));
    g.refresh_compute_weights();
    po.recompute = rc;
    const LossParts lg = g.forward_backward(replayed, po);
    EXPECT_NEAR(lg.loss, lc.loss, 2e-2 * lc.loss) << recompute_name(rc);
    EXPECT_LE(rel_l2(g.grads(), cpu.grads()), 2e-2) << recompute_name(rc);
  }
}
