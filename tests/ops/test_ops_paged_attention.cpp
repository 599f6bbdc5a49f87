// The paged KV cache ops on the CPU against plain causal attention: sequences of different lengths whose
// keys and values sit in shuffled, non-contiguous blocks give, through kv_cache_write and
// paged_attention_fwd, the output attention_fwd computes for each sequence alone (prefill: every token
// queries; decode: only the last one), with grouped-query heads; and bad arguments are errors naming
// the value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <numeric>

#include "core/rng.h"
#include "ops/ops.h"

using namespace mt;

namespace {

struct Paged {
  int64_t H = 4, G = 2, Hd = 16, block_size = 4;
  std::vector<int64_t> lens{9, 1, 4, 13};
  Tensor q, k, v;            // [N, ., Hd] every token of every sequence, in sequence order
  Tensor kc, vc, table;      // the cache and the block table
  Tensor seq, pos, slots;    // per token
  std::vector<int64_t> first;  // each sequence's first token row

  explicit Paged(uint64_t seed) {
    const int64_t N = std::accumulate(lens.begin(), lens.end(), int64_t(0));
    const int64_t B = int64_t(lens.size());
    int64_t M = 0, blocks = 0;
    for (int64_t L : lens) {
      M = std::max(M, (L + block_size - 1) / block_size);
      blocks += (L + block_size - 1) / block_size;
    }
    blocks += 3;  // unused blocks
    Rng rng(seed);
    q = Tensor::empty({N, H, Hd});
    k = Tensor::empty({N, G, Hd});
    v = Tensor::empty({N, G, Hd});
    rng.fill_normal(q, 0, 1);
    rng.fill_normal(k, 0, 1);
    rng.fill_normal(v, 0, 1);
    std::vector<int32_t> ids(static_cast<size_t>(blocks));
    std::iota(ids.begin(), ids.end(), 0);
    for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[size_t(rng.randint(0, int64_t(i)))]);
    kc = Tensor::zeros({blocks * block_size, G, Hd});
    vc = Tensor::zeros({blocks * block_size, G, Hd});
    table = Tensor::zeros({B, M}, DType::I32);
    seq = Tensor::empty({N}, DType::I32);
    pos = Tensor::empty({N}, DType::I32);
    slots = Tensor::empty({N}, DType::I32);
    size_t next = 0;
    int64_t row = 0;
    for (int64_t b = 0; b < B; ++b) {
      first.push_back(row);
      for (int64_t j = 0; j < (lens[size_t(b)] + block_size - 1) / block_size; ++j)
        table.data<int32_t>()[b * M + j] = ids[next++];
      for (int64_t p = 0; p < lens[size_t(b)]; ++p, ++row) {
        seq.data<int32_t>()[row] = int32_t(b);
        pos.data<int32_t>()[row] = int32_t(p);
        slots.data<int32_t>()[row] = table.data<int32_t>()[b * M + p / block_size] * int32_t(block_size) +
                                     int32_t(p % block_size);
      }
    }
  }

  // attention_fwd over sequence b alone: [L, H, Hd].
  Tensor reference(int64_t b) const {
    const int64_t L = lens[size_t(b)], r = first[size_t(b)];
    Tensor out = Tensor::empty({L, H, Hd}), lse = Tensor::empty({L, H});
    ops::attention_fwd(q.rows(r, L), k.rows(r, L), v.rows(r, L), 1, L, out, lse);
    return out;
  }
};

double max_abs(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    m = std::max(m, std::abs(double(a.data<float>()[i]) - double(b.data<float>()[i])));
  return m;
}

}  // namespace

TEST(OpsPagedAttention, PrefillEqualsCausalAttentionPerSequence) {
  Paged P(1);
  ops::kv_cache_write(P.k, P.v, P.slots, P.kc, P.vc);
  Tensor out = Tensor::empty({P.q.size(0), P.H, P.Hd});
  out.fill_(NAN);
  ops::paged_attention_fwd(P.q, P.kc, P.vc, P.table, P.block_size, P.seq, P.pos, out);
  for (size_t b = 0; b < P.lens.size(); ++b) {
    const Tensor want = P.reference(int64_t(b));
    EXPECT_LT(max_abs(out.rows(P.first[b], P.lens[b]), want), 1e-6) << "sequence " << b;
  }
}

TEST(OpsPagedAttention, DecodeOfLastTokensEqualsTheirRowsOfCausalAttention) {
  Paged P(2);
  ops::kv_cache_write(P.k, P.v, P.slots, P.kc, P.vc);
  const int64_t B = int64_t(P.lens.size());
  Tensor q = Tensor::empty({B, P.H, P.Hd}), seq = Tensor::empty({B}, DType::I32), pos = Tensor::empty({B}, DType::I32);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t last = P.first[size_t(b)] + P.lens[size_t(b)] - 1;
    q.rows(b, 1).copy_from(P.q.rows(last, 1));
    seq.data<int32_t>()[b] = int32_t(b);
    pos.data<int32_t>()[b] = int32_t(P.lens[size_t(b)] - 1);
  }
  Tensor out = Tensor::empty({B, P.H, P.Hd});
  out.fill_(NAN);
  ops::paged_attention_fwd(q, P.kc, P.vc, P.table, P.block_size, seq, pos, out);
  for (int64_t b = 0; b < B; ++b) {
    const Tensor want = P.reference(b).rows(P.lens[size_t(b)] - 1, 1);
    EXPECT_LT(max_abs(out.rows(b, 1), want), 1e-6) << "sequence " << b;
  }
}

TEST(OpsPagedAttention, BadArgumentsAreErrorsNamingTheValue) {
  Paged P(3);
  Tensor out = Tensor::empty({P.q.size(0), P.H, P.Hd});
  auto expect_error = [](const std::function<void()>& f, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one mentioning '" << what << "'";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  // A slot outside the cache.
  Tensor bad_slots = P.slots.clone();
  bad_slots.data<int32_t>()[2] = int32_t(P.kc.size(0));
  expect_error([&] { ops::kv_cache_write(P.k, P.v, bad_slots, P.kc, P.vc); }, std::to_string(P.kc.size(0)));
  // H not a multiple of G.
  Tensor q3 = Tensor::empty({P.q.size(0), 3, P.Hd});
  Tensor out3 = Tensor::empty({P.q.size(0), 3, P.Hd});
  expect_error([&] { ops::paged_attention_fwd(q3, P.kc, P.vc, P.table, P.block_size, P.seq, P.pos, out3); }, "3");
  // A position beyond the block table's reach.
  Tensor bad_pos = P.pos.clone();
  bad_pos.data<int32_t>()[0] = int32_t(P.table.size(1) * P.block_size);
  expect_error([&] { ops::paged_attention_fwd(P.q, P.kc, P.vc, P.table, P.block_size, P.seq, bad_pos, out); },
               std::to_string(P.table.size(1) * P.block_size));
}
