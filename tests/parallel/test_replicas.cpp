// Every replicated gradient is identical on every rank that holds it. Under HSDP the ranks that hold
// the same gradient elements are the dp_replicate replicas of a shard; `moetrain grads` compares the
// 64-bit digests of every unit's shard across them after the backward and logs one line. Tested under
// `moetrain launch` for dp_replicate 2 alone, × dp_shard 2 and × tp 2 (which also write the same
// results as one process), and the failure path through fault injection (MOETRAIN_DEBUG_PERTURB_GRAD:
// one rank adds one ulp to one element of its shard), whose error must name the unit, the ranks and
// stop the run. The digest itself is tested in-process: it sees a one-ulp change anywhere. The trainer
// compares the replicas' master weights at the schedule check's cadence.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>
#include <string>

#include "comm/communicator.h"
#include "parallel/equivalence_util.h"
#include "parallel/fsdp.h"
#include "parallel/launch_test_util.h"

using namespace mt;

namespace {

const std::string kModel = test::kGoldens + "/aux";
std::string tmp(const std::string& name) {
  return test::tmp_path("replicas", name);
}

std::string grads_cmd(const std::string& batch, const std::string& out) {
  return " grads --model " + kModel + " --batch " + batch + " --out " + out;
}

}  // namespace

TEST(ShardDigest, SeesOneUlpAnywhereAndTheLength) {
  // 1000 floats: 125 whole 32-byte rounds of the four lanes, then nothing; 1001: one more word in the tail.
  for (int64_t n : {1000, 1001, 7}) {
    Tensor t = Tensor::empty({n});
    for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = std::sin(float(i)) * 1e-3f;
    const uint64_t base = shard_digest(t);
    EXPECT_EQ(shard_digest(t.clone()), base) << "the digest depends on the bytes only";
    std::set<uint64_t> seen{base};
    for (int64_t i = 0; i < n; ++i) {
      Tensor u = t.clone();
      float& x = u.data<float>()[i];
      x = std::nextafter(x, INFINITY);
      EXPECT_TRUE(seen.insert(shard_digest(u)).second) << "one ulp at element " << i << " of " << n;
    }
    // Swapping two elements (the same multiset of values) changes it too.
    Tensor s = t.clone();
    std::swap(s.data<float>()[0], s.data<float>()[n - 1]);
    EXPECT_NE(shard_digest(s), base);
  }
  // Zeros of different lengths (a shard's padding) are told apart; an empty shard has a digest.
  EXPECT_NE(shard_digest(Tensor::zeros({64})), shard_digest(Tensor::zeros({65})));
  EXPECT_NE(shard_digest(Tensor::zeros({0})), shard_digest(Tensor::zeros({1})));
}

TEST(Replicas, ReplicatedGradientsAreBitwiseIdentical) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string batch = test::make_batch(kModel, tmp("batch.safetensors"));
  const std::string ref = tmp("ref.safetensors");
  test::ShellRun r = test::sh(test::kMoetrainBin + grads_cmd(batch, ref));
  ASSERT_EQ(r.code, 0) << r.out;
  struct Layout {
    int nproc;
    std::string flags;
  };
  for (const Layout& l : {Layout{2, "--dp-replicate 2"}, Layout{4, "--dp-replicate 2 --dp-shard 2"},
                          Layout{4, "--dp-replicate 2 --tp 2"}}) {
    const std::string out = tmp("out.safetensors");
    test::ShellRun p = test::sh(test::kMoetrainBin + " launch --nproc-per-node " + std::to_string(l.nproc) + " --" +
                                grads_cmd(batch, out) + " " + l.flags);
    ASSERT_EQ(p.code, 0) << l.flags << "\n" << p.out;
    EXPECT_NE(p.out.find("grads: replicated gradients identical on 2 replicas ("), std::string::npos) << l.flags << "\n"
                                                                                                      << p.out;
    EXPECT_NE(p.out.find(" units, bitwise)"), std::string::npos) << l.flags << "\n" << p.out;
    test::expect_same(out, ref, l.flags);
  }
  // Without replicas there is nothing to compare and no line.
  test::ShellRun p = test::sh(test::kMoetrainBin + " launch --nproc-per-node 2 --" +
                              grads_cmd(batch, tmp("fsdp.safetensors")) + " --dp-shard 2");
  ASSERT_EQ(p.code, 0) << p.out;
  EXPECT_EQ(p.out.find("replicated gradients"), std::string::npos) << p.out;
}

TEST(Replicas, OneUlpOnOneReplicaStopsTheRunNamingUnitAndRanks) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string batch = test::make_batch(kModel, tmp("batch.safetensors"));
  // The aux model has 3 layers: the perturbed unit is the last block's (block 2). dp_replicate 2 ×
  // dp_shard 2: rank 3's replica is rank 1 (world ranks are dp_replicate-major); × tp 2: rank 1's
  // replica is rank 3, and the block's tp-replicated unit is the one perturbed.
  struct Case {
    int nproc;
    std::string flags, perturb, first, second;  // the replica pair, as the message names them
  };
  for (const Case& c : {Case{4, "--dp-replicate 2 --dp-shard 2", "3", "on rank 1 and ", "on rank 3;"},
                        Case{4, "--dp-replicate 2 --tp 2", "1", "on rank 1 and ", "on rank 3;"},
                        Case{2, "--dp-replicate 2", "0", "on rank 0 and ", "on rank 1;"}}) {
    test::ShellRun p =
        test::sh("MOETRAIN_DEBUG_PERTURB_GRAD=" + c.perturb + " " + test::kMoetrainBin + " launch --nproc-per-node " +
                 std::to_string(c.nproc) + " --" + grads_cmd(batch, tmp("bad.safetensors")) + " " + c.flags);
    EXPECT_NE(p.code, 0) << c.flags << "\n" << p.out;
    EXPECT_NE(p.out.find("replicated gradients differ across the 2 dp_replicate replicas"), std::string::npos)
        << c.flags << "\n"
        << p.out;
    EXPECT_NE(p.out.find(": block 2 (unit "), std::string::npos) << c.flags << "\n" << p.out;
    EXPECT_NE(p.out.find(c.first), std::string::npos) << c.flags << "\n" << p.out;
    EXPECT_NE(p.out.find(c.second), std::string::npos) << c.flags << "\n" << p.out;
    EXPECT_NE(p.out.find("; 1 of "), std::string::npos) << "exactly one unit differs\n" << p.out;
    // No rank claims the replicas agree: the verdict is shared over the world before anyone logs.
    EXPECT_EQ(p.out.find("replicated gradients identical"), std::string::npos) << c.flags << "\n" << p.out;
  }
}

// The trainer compares the replicas' master weights at the schedule check's cadence (drift detection);
// off with the schedule check.
TEST(Replicas, TrainerChecksMasterWeightsAtTheScheduleCadence) {
  MT_SKIP_WITHOUT_GLOO();
  for (const char* check : {"periodic", "off"}) {
    const std::string dir = tmp(std::string("train_") + check);
    test::ShellRun p = test::sh(test::kMoetrainBin +
                                " launch --nproc-per-node 4 -- train --device cpu --model tiny --steps 4"
                                " --micro-batch-size 4 --seq-len 32 --warmup-steps 1 --eval-problems 0 --out-dir " +
                                dir + " --dp-replicate 2 --schedule-check-every 2 --schedule-check " + check);
    ASSERT_EQ(p.code, 0) << check << "\n" << p.out;
    const bool logged =
        p.out.find(
            "replicas: master weights identical on 2 replicas (4 units, bitwise) at step 2; checked every 2 "
            "steps") != std::string::npos;
    EXPECT_EQ(logged, std::string(check) == "periodic") << p.out;
  }
}
