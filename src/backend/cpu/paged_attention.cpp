// CPU paged KV cache: the reference for the CUDA kernels and the CPU engine. Each query row through attend_row
// (attention_row.h): scores and the softmax in double, the output rounded once to f32.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "backend/cpu/attention_row.h"
#include "backend/cpu/cpu_ops.h"

namespace mt::cpu {

void kv_cache_write(const Tensor& k_NGD, const Tensor& v_NGD, const Tensor& slot_N, Tensor& k_cache_SGD,
                    Tensor& v_cache_SGD) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&k_NGD, &v_NGD, &k_cache_SGD, &v_cache_SGD}) check_dtype(*t, DType::F32, "kv_cache_write");
  check_dtype(slot_N, DType::I32, "kv_cache_write slot_N");
  const int64_t N = k_NGD.size(0), row = k_NGD.size(1) * k_NGD.size(2), S = k_cache_SGD.size(0);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t s = slot_N.data<int32_t>()[n];
    if (s < 0 || s >= S) MT_THROW("kv_cache_write: slot ", s, " of row ", n, " is outside the cache's [0, ", S, ")");
    std::copy_n(k_NGD.data<float>() + n * row, row, k_cache_SGD.data<float>() + s * row);
    std::copy_n(v_NGD.data<float>() + n * row, row, v_cache_SGD.data<float>() + s * row);
  }
}

void paged_attention_fwd(const Tensor& q_NHD, const Tensor& k_cache_SGD, const Tensor& v_cache_SGD,
                         const Tensor& block_table_BM, int64_t block_size, const Tensor& seq_N, const Tensor& pos_N,
                         Tensor& out_NHD) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&q_NHD, &k_cache_SGD, &v_cache_SGD, &out_NHD})
    check_dtype(*t, DType::F32, "paged_attention_fwd");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&block_table_BM, &seq_N, &pos_N}) check_dtype(*t, DType::I32, "paged_attention_fwd");
  const int64_t N = q_NHD.size(0), H = q_NHD.size(1), Hd = q_NHD.size(2), G = k_cache_SGD.size(1);
  const int64_t S = k_cache_SGD.size(0), B = block_table_BM.size(0), M = block_table_BM.size(1), group = H / G;
  const float* q = q_NHD.data<float>();
  const float* kc = k_cache_SGD.data<float>();
  const float* vc = v_cache_SGD.data<float>();
  float* out = out_NHD.data<float>();
  std::vector<double> w, acc;
  std::vector<int64_t> slots;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = seq_N.data<int32_t>()[n], pos = pos_N.data<int32_t>()[n];
    if (b < 0 || b >= B) MT_THROW("paged_attention_fwd: sequence ", b, " of token ", n, " is outside [0, ", B, ")");
    if (pos < 0 || pos / block_size >= M)
      MT_THROW("paged_attention_fwd: position ", pos, " of token ", n, " is outside its block table (", M, " blocks of ",
               block_size, ")");
    slots.resize(size_t(pos + 1));
    for (int64_t p = 0; p <= pos; ++p) {
      const int64_t blk = block_table_BM.data<int32_t>()[b * M + p / block_size];
      const int64_t s = blk * block_size + p % block_size;
      if (blk < 0 || s >= S)
        MT_THROW("paged_attention_fwd: block ", blk, " (position ", p, " of sequence ", b, ") is outside the cache");
      slots[size_t(p)] = s;
    }
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      attend_row(
          q + (n * H + h) * Hd, pos + 1, Hd, [&](int64_t p) { return kc + (slots[size_t(p)] * G + g) * Hd; },
          [&](int64_t p) { return vc + (slots[size_t(p)] * G + g) * Hd; }, w, acc, out + (n * H + h) * Hd);
    }
  }
}

}  // namespace mt::cpu
