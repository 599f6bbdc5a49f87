// The paged KV block manager: round trips, forks and reference counts, copy-on-write (exactly once, only
// for a shared partial last block), block boundaries, admission, a seeded stress test that simulates the
// cache contents, and the pool-size helper.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <vector>

#include "core/rng.h"
#include "rollout/kv_blocks.h"
#include "test_util.h"

using namespace mt;
using mt::testutil::error_of;

TEST(KvBlocks, AllocateAndFreeReturnEveryBlock) {
  KvBlockManager m(16, 4);
  EXPECT_EQ(m.stats().free_blocks, 16);
  m.allocate(1, 10, 0);  // 3 blocks
  m.allocate(2, 4, 0);   // 1 block
  m.allocate(3, 17, 3);  // 5 blocks, 0 future (20 tokens fit in 5)
  EXPECT_EQ(m.block_table(1), (std::vector<BlockId>{0, 1, 2}));
  EXPECT_EQ(m.block_table(2), (std::vector<BlockId>{3}));
  EXPECT_EQ(m.block_table(3).size(), 5u);
  KvBlockStats st = m.stats();
  EXPECT_EQ(st.used_blocks, 9);
  EXPECT_EQ(st.free_blocks, 7);
  EXPECT_EQ(st.num_sequences, 3);
  m.check_invariants();
  for (SeqId s : {2, 1, 3}) m.free(s);
  st = m.stats();
  EXPECT_EQ(st.free_blocks, 16);
  EXPECT_EQ(st.used_blocks, 0);
  EXPECT_EQ(st.reserved_blocks, 0);
  EXPECT_EQ(st.num_sequences, 0);
  m.check_invariants();
  // Every block comes back: a sequence of the whole pool fits again, each id once.
  m.allocate(4, 64, 0);
  std::vector<BlockId> t = m.block_table(4);
  std::sort(t.begin(), t.end());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(t[size_t(i)], i);
  m.check_invariants();
}

TEST(KvBlocks, ForkSharesEveryBlockAndCountsReferences) {
  KvBlockManager m(32, 4);
  m.allocate(1, 9, 8);  // blocks 0, 1, 2 (the last holds one token)
  m.fork(1, 2);
  m.fork(1, 3);
  EXPECT_EQ(m.block_table(2), m.block_table(1));
  EXPECT_EQ(m.block_table(3), m.block_table(1));
  EXPECT_EQ(m.num_tokens(3), 9);
  EXPECT_EQ(m.capacity(3), 17);
  for (BlockId b : m.block_table(1)) EXPECT_EQ(m.ref_count(b), 3);
  EXPECT_EQ(m.stats().used_blocks, 3);
  EXPECT_EQ(m.stats().shared_blocks, 3);
  m.check_invariants();
  m.free(1);
  for (BlockId b : m.block_table(2)) EXPECT_EQ(m.ref_count(b), 2);
  m.free(2);
  for (BlockId b : m.block_table(3)) EXPECT_EQ(m.ref_count(b), 1);
  EXPECT_EQ(m.stats().free_blocks, 29);
  m.free(3);
  EXPECT_EQ(m.stats().free_blocks, 32);
  EXPECT_EQ(m.stats().reserved_blocks, 0);
  m.check_invariants();
}

TEST(KvBlocks, CopyOnWriteOnceAndOnlyForASharedPartialLastBlock) {
  KvBlockManager m(32, 4);
  m.allocate(1, 5, 8);  // blocks 0 (full), 1 (one token)
  m.fork(1, 2);
  m.fork(1, 3);
  // The parent appends first: block 1 is shared and partial, so it moves to a fresh copy.
  AppendResult r = m.append_slot(1);
  ASSERT_TRUE(r.copy.has_value());
  EXPECT_EQ(r.copy->src, 1);
  const BlockId copy1 = r.copy->dst;
  EXPECT_EQ(r.slot.block, copy1);
  EXPECT_EQ(r.slot.offset, 1);
  EXPECT_FALSE(r.new_block);
  EXPECT_EQ(m.block_table(1), (std::vector<BlockId>{0, copy1}));
  EXPECT_EQ(m.ref_count(1), 2);
  EXPECT_EQ(m.ref_count(copy1), 1);
  // Its next appends write in place: no second copy.
  for (int i = 0; i < 2; ++i) {
    r = m.append_slot(1);
    EXPECT_FALSE(r.copy.has_value());
    EXPECT_EQ(r.slot.block, copy1);
  }
  // Child 2: block 1 still shared with child 3, one copy.
  r = m.append_slot(2);
  ASSERT_TRUE(r.copy.has_value());
  EXPECT_EQ(r.copy->src, 1);
  EXPECT_EQ(m.ref_count(1), 1);
  // Child 3 is the last holder of block 1 and writes in place.
  r = m.append_slot(3);
  EXPECT_FALSE(r.copy.has_value());
  EXPECT_EQ(r.slot.block, 1);
  EXPECT_EQ(r.slot.offset, 1);
  // Block 0 (full) is shared by all three and was never copied.
  EXPECT_EQ(m.ref_count(0), 3);
  for (SeqId s : {1, 2, 3}) EXPECT_EQ(m.block_table(s)[0], 0);
  m.check_invariants();

  // A prompt that ends on a block boundary: nothing partial, nothing copied; each sample starts its
  // own block.
  KvBlockManager f(32, 4);
  f.allocate(1, 8, 4);
  f.fork(1, 2);
  for (SeqId s : {1, 2}) {
    r = f.append_slot(s);
    EXPECT_FALSE(r.copy.has_value());
    EXPECT_TRUE(r.new_block);
    EXPECT_EQ(r.slot.offset, 0);
  }
  EXPECT_NE(f.block_table(1)[2], f.block_table(2)[2]);
  for (int i = 0; i < 3; ++i)
    for (SeqId s : {1, 2}) EXPECT_FALSE(f.append_slot(s).copy.has_value());
  EXPECT_EQ(f.ref_count(0), 2);
  EXPECT_EQ(f.ref_count(1), 2);
  f.check_invariants();

  // A sequence forked after it has generated: the shared partial block is copied by whichever appends
  // first, exactly once for two holders.
  KvBlockManager g(32, 4);
  g.allocate(1, 4, 8);
  g.append_slot(1);  // token 4: block 1, offset 0
  g.fork(1, 2);
  EXPECT_TRUE(g.append_slot(2).copy.has_value());
  EXPECT_FALSE(g.append_slot(1).copy.has_value());
  EXPECT_FALSE(g.append_slot(2).copy.has_value());
  g.check_invariants();
}

TEST(KvBlocks, BlockBoundaries) {
  KvBlockManager m(8, 4);
  EXPECT_EQ(m.blocks_for_tokens(0), 0);
  EXPECT_EQ(m.blocks_for_tokens(1), 1);
  EXPECT_EQ(m.blocks_for_tokens(4), 1);
  EXPECT_EQ(m.blocks_for_tokens(5), 2);
  m.allocate(1, 3, 6);
  EXPECT_EQ(m.block_table(1).size(), 1u);
  EXPECT_EQ(m.slot(1, 2).offset, 2);
  AppendResult r = m.append_slot(1);  // token 3 fills block 0
  EXPECT_FALSE(r.new_block);
  EXPECT_EQ(r.slot.block, 0);
  EXPECT_EQ(r.slot.offset, 3);
  r = m.append_slot(1);  // token 4 opens block 1
  EXPECT_TRUE(r.new_block);
  EXPECT_EQ(r.slot.block, 1);
  EXPECT_EQ(r.slot.offset, 0);
  EXPECT_EQ(m.slot(1, 4).block, 1);
  EXPECT_EQ(m.slot(1, 3).block, 0);
  EXPECT_EQ(m.num_tokens(1), 5);
  // An empty prompt holds no block; its first append takes one.
  m.allocate(2, 0, 5);
  EXPECT_TRUE(m.block_table(2).empty());
  r = m.append_slot(2);
  EXPECT_TRUE(r.new_block);
  EXPECT_EQ(r.slot.offset, 0);
  // Block size 1: every token is a block.
  KvBlockManager one(6, 1);
  one.allocate(1, 2, 2);
  one.fork(1, 2);
  EXPECT_TRUE(one.append_slot(1).new_block);
  EXPECT_TRUE(one.append_slot(2).new_block);
  one.check_invariants();
  EXPECT_EQ(error_of([&] { m.slot(1, 5); }),
            "KV blocks: slot: position 5 of sequence 1 is outside its 5 tokens [0, 5)");
}

TEST(KvBlocks, AdmissionRefusesWhenBlocksRunOutAndAcceptsAfterAFree) {
  KvBlockManager m(10, 4);
  EXPECT_EQ(m.blocks_needed(16, 4), 5);
  EXPECT_TRUE(m.can_admit(16, 4));
  m.allocate(1, 16, 4);  // 4 blocks now, 1 reserved
  KvBlockStats st = m.stats();
  EXPECT_EQ(st.free_blocks, 6);
  EXPECT_EQ(st.reserved_blocks, 1);
  EXPECT_EQ(st.available_blocks, 5);
  EXPECT_FALSE(m.can_admit(17, 4));  // 6 blocks
  EXPECT_EQ(error_of([&] { m.allocate(2, 17, 4); }),
            "out of KV blocks: sequence 2 needs 6 blocks (17 prompt + 4 new tokens at 4 tokens per block, 1 "
            "samples) but 5 of 10 are free and unreserved; admit sequences with can_admit first");
  EXPECT_TRUE(m.can_admit(16, 4));
  m.allocate(2, 16, 4);
  EXPECT_EQ(m.stats().available_blocks, 0);
  EXPECT_FALSE(m.can_admit(1, 0));
  m.free(1);
  EXPECT_TRUE(m.can_admit(17, 3));
  EXPECT_FALSE(m.can_admit(17, 4));

  // A prompt of 5 tokens with 3 samples of up to 3 new tokens: 2 blocks for the first, and for each
  // further sample a copy of the partial block (no further block: 8 tokens fit in 2).
  KvBlockManager g(8, 4);
  EXPECT_EQ(g.blocks_needed(5, 3, 3), 4);
  EXPECT_EQ(g.blocks_needed(5, 4, 3), 3 + 2 * 2);  // 9 tokens: 3 blocks; each further sample a copy + 1
  EXPECT_EQ(g.blocks_needed(8, 4, 3), 3 + 2 * 1);  // a full last prompt block is never copied
  ASSERT_TRUE(g.can_admit(5, 3, 3));
  g.allocate(1, 5, 3);
  g.fork(1, 2);
  g.fork(1, 3);
  EXPECT_EQ(g.stats().available_blocks, 8 - 4);
  // A fork beyond what was admitted is refused with the reason.
  KvBlockManager h(3, 4);
  h.allocate(1, 5, 3);
  h.fork(1, 2);
  EXPECT_EQ(error_of([&] { h.fork(1, 3); }),
            "out of KV blocks: fork of sequence 1 into 3 needs 1 blocks (5 tokens held, capacity 8, at 4 tokens per "
            "block) but 0 of 3 are free and unreserved; admit the samples of a prompt together with "
            "can_admit(prompt_len, reserve_new_tokens, num_samples) and allocate(..., num_samples)");
  // Once admitted, every sample reaches its capacity whatever the order of appends.
  for (int i = 0; i < 3; ++i)
    for (SeqId s : {3, 1, 2}) g.append_slot(s);
  EXPECT_EQ(g.stats().reserved_blocks, 0);
  g.check_invariants();
}

TEST(KvBlocks, MisuseIsAnErrorNamingTheSequence) {
  KvBlockManager m(4, 4);
  m.allocate(1, 2, 1);
  EXPECT_EQ(error_of([&] { m.append_slot(7); }), "KV blocks: append_slot: unknown sequence 7");
  EXPECT_EQ(error_of([&] { m.free(7); }), "KV blocks: free: unknown sequence 7");
  EXPECT_EQ(error_of([&] { m.fork(7, 8); }), "KV blocks: fork: unknown sequence 7");
  EXPECT_EQ(error_of([&] { m.block_table(7); }), "KV blocks: block_table: unknown sequence 7");
  EXPECT_EQ(error_of([&] { m.allocate(1, 1, 0); }), "KV blocks: allocate: sequence 1 already exists");
  EXPECT_EQ(error_of([&] { m.fork(1, 1); }), "KV blocks: fork: child sequence 1 already exists");
  m.append_slot(1);
  EXPECT_EQ(error_of([&] { m.append_slot(1); }),
            "KV blocks: append_slot: sequence 1 holds 3 tokens, its capacity (prompt + reserve at allocate); it may "
            "not grow past it");
  EXPECT_EQ(error_of([&] { m.allocate(2, -1, 0); }),
            "KV blocks: prompt length (-1) and reserve (0) must be >= 0 and the number of samples (1) >= 1");
  EXPECT_EQ(error_of([&] { KvBlockManager(0, 16); }), "KV block count (0) must be in [1, 2147483647]");
  EXPECT_EQ(error_of([&] { KvBlockManager(8, 0); }), "KV block size (0) must be >= 1 token");
  EXPECT_EQ(error_of([&] { m.ref_count(4); }), "KV blocks: block id 4 is outside the pool [0, 4)");
  m.check_invariants();
}

// Thousands of random operations on a small pool. Admission goes through can_admit, so no append may
// fail; after every operation the counts are recomputed from the tables. The cache contents are
// simulated: every append writes a value unique to (sequence, position) into its slot, after performing
// the reported copy, and every sequence must read back exactly the values of its own history.
namespace {

void stress(int32_t bs, int64_t nb, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "block size " << bs << ", " << nb << " blocks, seed " << seed);
  KvBlockManager m(nb, bs);
  std::vector<std::vector<int64_t>> pool(size_t(nb), std::vector<int64_t>(size_t(bs), -1));
  std::map<SeqId, std::vector<int64_t>> history;  // the values each sequence wrote or inherited
  Rng rng(seed);
  SeqId next_id = 0;
  int64_t copies = 0, refused = 0, appends = 0;
  const auto check_contents = [&] {
    for (const auto& [id, h] : history)
      for (int64_t i = 0; i < int64_t(h.size()); ++i) {
        const KvSlot s = m.slot(id, i);
        ASSERT_EQ(pool[size_t(s.block)][size_t(s.offset)], h[size_t(i)]) << "sequence " << id << " position " << i;
      }
  };
  for (int op = 0; op < 5000; ++op) {
    const int64_t kind = rng.randint(0, 10);
    if (kind < 2) {  // admit a prompt with 1-4 samples
      const int64_t P = rng.randint(1, 14), R = rng.randint(0, 12), n = rng.randint(1, 5);
      if (!m.can_admit(P, R, n)) {
        ++refused;
        if (!m.can_admit(P, R)) {
          EXPECT_THROW(m.allocate(next_id, P, R), Error);
        }
        continue;
      }
      const SeqId first = next_id++;
      m.allocate(first, P, R);
      history[first] = {};
      for (int64_t i = 0; i < P; ++i) {  // the prefill writes the prompt
        const int64_t v = first * 1000 + i;
        const KvSlot s = m.slot(first, i);
        pool[size_t(s.block)][size_t(s.offset)] = v;
        history[first].push_back(v);
      }
      for (int64_t j = 1; j < n; ++j) {
        m.fork(first, next_id);
        history[next_id++] = history[first];
      }
    } else if (kind < 8 && !history.empty()) {  // append to a random live sequence
      auto it = history.begin();
      std::advance(it, rng.randint(0, int64_t(history.size())));
      const SeqId id = it->first;
      if (m.num_tokens(id) == m.capacity(id)) continue;
      const AppendResult r = m.append_slot(id);  // must not throw: admitted
      ++appends;
      if (r.copy) {
        ++copies;
        EXPECT_GT(m.ref_count(r.copy->src), 0);
        EXPECT_EQ(m.ref_count(r.copy->dst), 1);
        pool[size_t(r.copy->dst)] = pool[size_t(r.copy->src)];
      }
      const int64_t v = id * 1000 + m.num_tokens(id) - 1;
      pool[size_t(r.slot.block)][size_t(r.slot.offset)] = v;
      it->second.push_back(v);
    } else if (!history.empty()) {  // free a random sequence
      auto it = history.begin();
      std::advance(it, rng.randint(0, int64_t(history.size())));
      m.free(it->first);
      history.erase(it);
    }
    m.check_invariants();
    if (op % 50 == 0) check_contents();
  }
  check_contents();
  std::printf("%lld appends, %lld copies, %lld refusals\n", (long long)appends, (long long)copies, (long long)refused);
  if (bs > 1)
    EXPECT_GT(copies, 50);
  else
    EXPECT_EQ(copies, 0);  // a block of one token is never partial
  EXPECT_GT(refused, 50);
  EXPECT_GT(appends, 1000);
  for (const auto& [id, h] : history) m.free(id);
  const KvBlockStats st = m.stats();
  EXPECT_EQ(st.free_blocks, nb);
  EXPECT_EQ(st.reserved_blocks, 0);
  m.check_invariants();
}

}  // namespace

TEST(KvBlocks, RandomStressKeepsInvariantsAndContents) {
  stress(4, 48, 2024);
  stress(1, 160, 7);
  stress(16, 16, 99);
}

TEST(KvBlocks, PoolSizeFromTheBudget) {
  // Qwen3-30B-A3B: 48 layers, 4 KV heads of 128, bf16, 16 tokens per block: 1.5 MiB per block.
  const KvCacheGeometry g{48, 4, 128, 16, 2};
  EXPECT_EQ(kv_bytes_per_block(g), 2ll * 48 * 4 * 128 * 16 * 2);
  EXPECT_EQ(kv_pool_blocks(10ll << 30, g, 4096), (10ll << 30) / (3ll << 19));
  EXPECT_EQ(kv_pool_blocks((3ll << 19) * 256 + 5, g, 4096), 256);  // exactly one sequence of 4096
  EXPECT_EQ(error_of([&] { kv_pool_blocks((3ll << 19) * 255, g, 4096); }),
            "the KV cache budget of 382.50 MiB (401080320 bytes) holds 255 blocks of 16 tokens at 1572864 bytes each, "
            "but one sequence of the maximum length 4096 needs 256 blocks, 384.00 MiB (402653184 bytes); raise "
            "--kv-cache-fraction or lower the maximum sequence length");
  EXPECT_EQ(error_of([&] {
              kv_bytes_per_block(KvCacheGeometry{48, 0, 128, 16, 2});
            }),
            "KV cache geometry: kv_heads (0) must be >= 1");
}

TEST(KvBlocks, AllocateReservesThePromptsForks) {
  // 8 samples of an 11-token prompt, 6 new tokens each, 16-token blocks: the prompt's block, its
  // second block, and 7 forks x (a copy of the partial block + a second block) = 16 blocks.
  KvBlockManager m(20, 16);
  ASSERT_EQ(m.blocks_needed(11, 6, 8), 16);
  ASSERT_TRUE(m.can_admit(11, 6, 8));
  m.allocate(1, 11, 6, 8);
  m.check_invariants();
  // A second prompt must wait: the first one's forks hold their blocks already. (Before, only the
  // first sequence's own blocks were reserved, the second prompt got in and the forks ran out.)
  EXPECT_EQ(m.stats().available_blocks, 4);
  EXPECT_FALSE(m.can_admit(11, 6, 8));
  for (SeqId c = 2; c <= 8; ++c) m.fork(1, c);
  m.check_invariants();
  EXPECT_EQ(m.stats().available_blocks, 4);
  for (int t = 0; t < 6; ++t)
    for (SeqId s = 1; s <= 8; ++s) m.append_slot(s);
  m.check_invariants();
  for (SeqId s = 1; s <= 8; ++s) m.free(s);
  m.check_invariants();
  EXPECT_EQ(m.stats().available_blocks, 20);
  // Forks never made: the rest of the reserve comes back with the parent.
  m.allocate(1, 11, 6, 8);
  m.fork(1, 2);
  m.free(2);
  m.free(1);
  m.check_invariants();
  EXPECT_EQ(m.stats().available_blocks, 20);
}
