// RoutingRecord: ids round-trip through the compact form (one byte per id up to 256 experts, two up to
// 65,536), appended in pieces and read back in any token range; bad ids and shapes are errors.
#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "rollout/routing_record.h"

using namespace mt;

TEST(RoutingRecord, RoundTripsOneAndTwoBytesPerId) {
  for (int64_t E : {8, 256, 300, 65536}) {
    const int64_t L = 3, K = 4, T = 10;
    Rng rng{uint64_t(E)};
    std::vector<Tensor> ids;
    for (int64_t l = 0; l < L; ++l) {
      Tensor t = Tensor::empty({T, K}, DType::I32);
      for (int64_t i = 0; i < T * K; ++i) t.data<int32_t>()[i] = int32_t(rng.randint(0, E));
      t.data<int32_t>()[0] = int32_t(E - 1);  // the largest id
      ids.push_back(t);
    }
    RoutingRecord r(L, K, E);
    r.append(ids, 0, 4);
    r.append(ids, 4, 6);
    EXPECT_EQ(r.tokens(), T);
    EXPECT_EQ(r.bytes_per_id(), E <= 256 ? 1 : 2);
    EXPECT_EQ(r.bytes(), L * T * K * r.bytes_per_id());
    const std::vector<Tensor> all = r.tensors(), part = r.tensors(3, 5);
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t i = 0; i < T * K; ++i) ASSERT_EQ(all[size_t(l)].data<int32_t>()[i], ids[size_t(l)].data<int32_t>()[i]);
      for (int64_t i = 0; i < 5 * K; ++i)
        ASSERT_EQ(part[size_t(l)].data<int32_t>()[i], ids[size_t(l)].data<int32_t>()[3 * K + i]);
    }
  }
}

TEST(RoutingRecord, BadIdsAndShapesAreErrors) {
  RoutingRecord r(1, 2, 8);
  Tensor t = Tensor::zeros({2, 2}, DType::I32);
  t.data<int32_t>()[3] = 8;
  try {
    r.append({t}, 0, 2);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert id 8 outside [0, 8)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(r.append({t, t}, 0, 1), Error);
  EXPECT_THROW(r.tensors(0, 5), Error);
  EXPECT_THROW(RoutingRecord(1, 2, 70000), Error);
}
