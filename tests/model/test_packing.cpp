// Packed rows (several documents per row, model/micro_batch.h): the plan restarts positions per
// document and cuts the targets at its boundaries; the model's attention keeps each document to itself;
// the router statistics count real tokens only. The proof is equivalence: a packed batch gives the
// per-document losses and the gradients of the documents run one by one, and the aux loss, z-loss,
// expert load and gradients do not depend on how the documents are packed or how much padding the
// rows carry.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/rng.h"
#include "data/batch.h"
#include "model/qwen3_moe.h"
#include "ops/ops.h"
#include "test_util.h"

using namespace mt;

namespace {

struct Doc {
  std::vector<int64_t> ids, labels;
};

// Documents of the given lengths with random ids; a few labels inside each are -100.
std::vector<Doc> make_docs(const ModelConfig& c, const std::vector<int64_t>& lens, uint64_t seed) {
  Rng rng(seed);
  std::vector<Doc> docs;
  for (int64_t n : lens) {
    Doc d;
    for (int64_t i = 0; i < n; ++i) {
      d.ids.push_back(rng.randint(1, c.vocab_size));
      d.labels.push_back(i % 4 == 2 ? -100 : d.ids.back());
    }
    docs.push_back(d);
  }
  return docs;
}

// rows[r] lists the documents of row r, packed back to back in rows of length S, padded (id 0, label
// -100, segment -1).
MicroBatch pack(const std::vector<Doc>& docs, const std::vector<std::vector<int>>& rows, int64_t S) {
  const int64_t B = int64_t(rows.size());
  MicroBatch mb{Tensor::zeros({B, S}, DType::I64), Tensor::empty({B, S}, DType::I64)};
  mb.segments = Tensor::empty({B, S}, DType::I32);
  for (int64_t i = 0; i < B * S; ++i) {
    mb.labels.data<int64_t>()[i] = -100;
    mb.segments.data<int32_t>()[i] = -1;
  }
  for (int64_t b = 0; b < B; ++b) {
    int64_t s = 0;
    int32_t seg = 0;
    for (int d : rows[size_t(b)]) {
      for (size_t i = 0; i < docs[size_t(d)].ids.size(); ++i, ++s) {
        EXPECT_LT(s, S);
        mb.input_ids.data<int64_t>()[b * S + s] = docs[size_t(d)].ids[i];
        mb.labels.data<int64_t>()[b * S + s] = docs[size_t(d)].labels[i];
        mb.segments.data<int32_t>()[b * S + s] = seg;
      }
      ++seg;
    }
  }
  return mb;
}

MicroBatch single(const Doc& d) {
  const int64_t n = int64_t(d.ids.size());
  MicroBatch mb{Tensor::empty({1, n}, DType::I64), Tensor::empty({1, n}, DType::I64)};
  for (int64_t i = 0; i < n; ++i) {
    mb.input_ids.data<int64_t>()[i] = d.ids[size_t(i)];
    mb.labels.data<int64_t>()[i] = d.labels[size_t(i)];
  }
  return mb;
}

double rel_err(const Tensor& a, const Tensor& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.data<float>()[i], y = b.data<float>()[i];
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

ModelConfig tiny(bool aux) {
  ModelConfig c = preset_model_config("tiny");
  c.output_router_logits = aux;
  c.router_aux_loss_coef = 0.1;
  return c;
}

const std::vector<int64_t> kLens = {5, 9, 3, 12, 7, 2};
const std::vector<std::vector<int>> kRows = {{0, 1, 3}, {2, 4, 5}};  // 26 + pad 2, 12 + pad 16

}  // namespace

TEST(Packing, PlanRestartsPositionsAndCutsTargets) {
  const ModelConfig c = tiny(false);
  const std::vector<Doc> docs = make_docs(c, {3, 2}, 7);
  const MicroBatch mb = pack(docs, {{0, 1}}, 7);
  const MicroBatch p = plan_micro_batch(mb);
  const BatchPlan& pl = *p.plan;
  const std::vector<int32_t> pos = {0, 1, 2, 0, 1, 0, 1};
  const std::vector<int32_t> start = {0, 0, 0, 3, 3, 5, 5};
  for (int s = 0; s < 7; ++s) {
    EXPECT_EQ(pl.positions.data<int32_t>()[s], pos[size_t(s)]) << s;
    EXPECT_EQ(pl.doc_start.data<int32_t>()[s], start[size_t(s)]) << s;
  }
  // Targets: doc 0 predicts its tokens 1, 2 (label 2 is -100 by make_docs), not doc 1's first token.
  const std::vector<int64_t> tgt = {docs[0].labels[1], docs[0].labels[2], -100, docs[1].labels[1], -100, -100, -100};
  for (int s = 0; s < 7; ++s) EXPECT_EQ(pl.shifted_labels.data<int64_t>()[s], tgt[size_t(s)]) << s;
  ASSERT_EQ(pl.row_valid.size(), 1u);
  EXPECT_EQ(pl.row_valid[0], 5);
  EXPECT_EQ(pl.real_tokens, 5);
  EXPECT_EQ(count_target_tokens(mb.labels, mb.segments), 2);  // labels[1] (label[2] is -100) and doc 1's labels[1]
  EXPECT_EQ(count_real_tokens(mb.input_ids, mb.segments), 5);

  // Under sp 2 (padded to 8, chunks of 4) rank 1 holds positions 4..7 of the row.
  const MicroBatch p1 = plan_micro_batch(mb, 2, 1);
  EXPECT_EQ(p1.plan->row_valid[0], 1);
  EXPECT_EQ(p1.plan->real_tokens, 5);
  EXPECT_EQ(p1.plan->doc_start.numel(), 8);
  EXPECT_EQ(p1.plan->positions.data<int32_t>()[0], 1);  // position 4 is doc 1's second token
  EXPECT_EQ(p1.plan->doc_start.data<int32_t>()[7], 5);  // the sp padding joins the row's padding
}

TEST(Packing, BadSegmentsAreRefused) {
  const ModelConfig c = tiny(false);
  MicroBatch mb = pack(make_docs(c, {3, 2}, 7), {{0, 1}}, 7);
  mb.segments.data<int32_t>()[3] = 2;  // skips document 1
  std::string e = testutil::error_of([&] { plan_micro_batch(mb); });
  EXPECT_NE(e.find("segments row 0 position 3: 2 after 0"), std::string::npos) << e;
  mb.segments.data<int32_t>()[3] = 1;
  mb.segments.data<int32_t>()[6] = 1;  // a document after the padding started
  e = testutil::error_of([&] { plan_micro_batch(mb); });
  EXPECT_NE(e.find("padding (-1) may only end the row"), std::string::npos) << e;
}

// The test the issue asks for: N documents of different lengths packed into rows vs each alone, in
// fp32 on the CPU: per-document losses and every gradient within 1e-5.
TEST(Packing, PackedEqualsDocumentsOneByOne) {
  const ModelConfig c = tiny(false);
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 11);
  const std::vector<Doc> docs = make_docs(c, kLens, 3);
  const int64_t S = 28;
  const MicroBatch packed = pack(docs, kRows, S);

  PassOptions lp_opt;
  lp_opt.token_logprobs = true;
  const LossParts pf = m.forward(packed, lp_opt);
  const Tensor logp = pf.logp.to(Device::CPU);
  PassOptions po;
  po.ce_scale = 1.0;
  po.overwrite_grads = true;
  const LossParts pb = m.forward_backward(packed, po);
  const Tensor g_packed = m.grads().clone();

  m.zero_grads();
  po.overwrite_grads = false;
  double ce_docs = 0;
  int64_t n_docs = 0;
  for (size_t r = 0; r < kRows.size(); ++r) {
    int64_t s0 = 0;
    for (int d : kRows[r]) {
      const MicroBatch one = single(docs[size_t(d)]);
      const LossParts f = m.forward(one, lp_opt);
      const Tensor lp1 = f.logp.to(Device::CPU);
      const int64_t n = int64_t(docs[size_t(d)].ids.size());
      double packed_sum = 0, alone_sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        packed_sum += logp.data<float>()[int64_t(r) * S + s0 + i];
        alone_sum += lp1.data<float>()[i];
        EXPECT_NEAR(logp.data<float>()[int64_t(r) * S + s0 + i], lp1.data<float>()[i], 2e-5)
            << "doc " << d << " i " << i;
      }
      EXPECT_NEAR(packed_sum, alone_sum, 1e-5 * std::max(1.0, std::fabs(alone_sum))) << "doc " << d;
      const LossParts b = m.forward_backward(one, po);
      ce_docs += b.ce_sum;
      n_docs += b.n_valid;
      s0 += n;
    }
  }
  EXPECT_EQ(pb.n_valid, n_docs);
  EXPECT_NEAR(pb.ce_sum, ce_docs, 1e-5 * ce_docs);
  const double e = rel_err(g_packed, m.grads());
  EXPECT_LT(e, 1e-5) << "gradients of the packed batch vs the documents one by one";
  EXPECT_GT(m.grads().numel(), 0);
}

// Without the document mask the packed batch would differ: the test above can fail.
TEST(Packing, WithoutSegmentsTheDocumentsSeeEachOther) {
  const ModelConfig c = tiny(false);
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 11);
  const std::vector<Doc> docs = make_docs(c, kLens, 3);
  MicroBatch packed = pack(docs, kRows, 28);
  PassOptions o;
  o.token_logprobs = true;
  const Tensor a = m.forward(packed, o).logp.to(Device::CPU);
  packed.segments = Tensor();
  const Tensor b = m.forward(packed, o).logp.to(Device::CPU);
  // Row 0's second document (positions 5..13) sees the first one without segments.
  double diff = 0;
  for (int64_t i = 5; i < 13; ++i) diff += std::fabs(a.data<float>()[i] - b.data<float>()[i]);
  EXPECT_GT(diff, 1e-3);
}

// Router statistics count real tokens only: the same documents packed differently, with more or less
// padding, give the same aux loss, z-loss, expert load and gradients (aux and z-loss on).
TEST(Packing, RouterStatisticsIgnorePadding) {
  const ModelConfig c = tiny(true);
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 13);
  const std::vector<Doc> docs = make_docs(c, kLens, 5);
  struct Run {
    LossParts lp;
    Tensor grads, load;
  };
  auto run = [&](const MicroBatch& mb) {
    PassOptions po;
    po.ce_scale = 1.0;
    po.aux_scale = 0.1;
    po.z_loss_scale = 0.01;
    po.overwrite_grads = true;
    m.reset_expert_load();
    Run r;
    r.lp = m.forward_backward(mb, po);
    r.grads = m.grads().clone();
    r.load = m.expert_load().clone();
    return r;
  };
  const Run a = run(pack(docs, kRows, 28));
  const Run b = run(pack(docs, kRows, 40));                           // more padding
  const Run d = run(pack(docs, {{0}, {1}, {2}, {3}, {4}, {5}}, 12));  // one document per row
  const Run e = run(pack(docs, {{5, 4, 3, 2, 1, 0}}, 38));            // one row, another order
  for (const Run* r : {&b, &d, &e}) {
    EXPECT_NEAR(r->lp.aux, a.lp.aux, 1e-6 * a.lp.aux);
    EXPECT_NEAR(r->lp.z, a.lp.z, 1e-5 * a.lp.z);
    EXPECT_NEAR(r->lp.ce_sum, a.lp.ce_sum, 1e-5 * a.lp.ce_sum);
    EXPECT_TRUE(testutil::same_bits(r->load, a.load));
    EXPECT_LT(rel_err(r->grads, a.grads), 1e-5);
  }
  int64_t routed = 0;
  const Tensor load = a.load.to(Device::CPU);
  for (int64_t i = 0; i < load.numel(); ++i) routed += load.data<int64_t>()[i];
  int64_t real = 0;
  for (int64_t n : kLens) real += n;
  EXPECT_EQ(routed, real * c.num_sparse_layers() * c.num_experts_per_tok);  // padding routed nowhere
}

// The op itself: attention over a packed row equals attention over each document alone (forward and
// backward, CPU fp32), and a document start that is not one is refused with the row and position.
TEST(Packing, AttentionOpEqualsEachDocumentAlone) {
  const int64_t S = 11, H = 4, G = 2, Hd = 8;
  const std::vector<int64_t> lens = {4, 1, 6};
  Tensor ds = Tensor::empty({S}, DType::I32);
  for (int64_t s = 0, d = 0, start = 0; d < int64_t(lens.size()); start += lens[size_t(d)], ++d)
    for (int64_t i = 0; i < lens[size_t(d)]; ++i, ++s) ds.data<int32_t>()[s] = int32_t(start);
  Rng rng(3);
  Tensor q = Tensor::empty({S, H, Hd}), k = Tensor::empty({S, G, Hd}), v = Tensor::empty({S, G, Hd}),
         dout = Tensor::empty({S, H, Hd});
  for (Tensor* t : {&q, &k, &v, &dout}) rng.fill_normal(*t, 0.0f, 1.0f);
  Tensor out = Tensor::empty({S, H, Hd}), lse = Tensor::empty({S, H}), dq = Tensor::empty({S, H, Hd}),
         dk = Tensor::empty({S, G, Hd}), dv = Tensor::empty({S, G, Hd});
  ops::attention_fwd(q, k, v, 1, S, out, lse, &ds);
  ops::attention_bwd(dout, q, k, v, out, lse, 1, S, dq, dk, dv, &ds);
  int64_t s0 = 0;
  for (int64_t n : lens) {
    Tensor o1 = Tensor::empty({n, H, Hd}), l1 = Tensor::empty({n, H}), dq1 = Tensor::empty({n, H, Hd}),
           dk1 = Tensor::empty({n, G, Hd}), dv1 = Tensor::empty({n, G, Hd});
    const Tensor q1 = q.rows(s0, n).clone(), k1 = k.rows(s0, n).clone(), v1 = v.rows(s0, n).clone(),
                 do1 = dout.rows(s0, n).clone();
    ops::attention_fwd(q1, k1, v1, 1, n, o1, l1);
    ops::attention_bwd(do1, q1, k1, v1, o1, l1, 1, n, dq1, dk1, dv1);
    // Relative to the whole tensor's norm: a one-token document's dq and dk are zero up to rounding
    // (its only probability is 1, so dS = dO.V - dO.O = 0).
    auto close = [&](const Tensor& whole, const Tensor& alone, const char* what) {
      const Tensor a = whole.rows(s0, n).clone();
      double num = 0, den = 0;
      for (int64_t i = 0; i < a.numel(); ++i) num += std::pow(a.data<float>()[i] - alone.data<float>()[i], 2);
      for (int64_t i = 0; i < whole.numel(); ++i) den += std::pow(whole.data<float>()[i], 2);
      EXPECT_LT(std::sqrt(num / den), 1e-6) << what << ", document at " << s0;
    };
    close(out, o1, "out");
    close(lse, l1, "lse");
    close(dq, dq1, "dq");
    close(dk, dk1, "dk");
    close(dv, dv1, "dv");
    s0 += n;
  }
  ds.data<int32_t>()[6] = 4;  // position 6 claims the one-token document at 4 as its own
  const std::string e = testutil::error_of([&] { ops::attention_fwd(q, k, v, 1, S, out, lse, &ds); });
  EXPECT_NE(e.find("doc_start_T row 0 position 6 is 4"), std::string::npos) << e;
}
