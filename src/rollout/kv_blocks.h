// Paged KV cache bookkeeping for the rollout engine: which block of the pool holds which tokens of
// which sequence. Host only, no tensors: the engine owns the K/V tensors, this class owns the block ids.
//
// The pool holds `num_blocks` blocks of `block_size` token slots each (the same block id in every layer,
// for K and for V). A sequence is a block table (block ids in position order) and a token count: its
// token i lives in block table[i / block_size] at offset i % block_size.
//
// Sharing and copy-on-write. fork(parent, child) gives the child all of the parent's blocks and adds
// one to each block's reference count: the n samples of a prompt share its prefilled blocks. A full
// block is never written again, so it stays shared until freed and is never copied. A partially filled
// last block is written by the next append: when it is shared, append_slot gives the appending
// sequence a fresh block and reports a copy (src, dst) that the engine must perform (the whole block,
// every layer, K and V) before writing the new token into dst; the last sharer writes in place. Holders
// of a block always agree on how many of its slots are filled.
//
// Admission control. A sequence declares the most tokens it will ever hold (prompt + reserve). allocate
// and fork reserve every block it may still take: its future blocks, and for a shared partial last block
// one copy per extra sharer. can_admit counts only blocks that are free and not reserved. So once a
// sequence is in, append_slot never runs out of blocks, whatever the order of appends across sequences;
// allocate with num_samples > 1 also reserves what the num_samples - 1 forks of the prompt will need,
// so prompts admitted one after another before their forks cannot take each other's blocks;
// running out happens only through misuse (allocate or fork when can_admit says no), which is an error
// that says so. The price is that a sequence that stops early keeps its reservation until it is freed
// (vLLM instead allocates on demand and preempts a running request when the pool is empty).
//
// Block ids are handed out lowest first from a fresh pool, and the most recently freed block is reused
// first; the same sequence of calls gives the same ids.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace mt {

using SeqId = int64_t;
using BlockId = int32_t;

struct KvSlot {
  BlockId block = -1;
  int32_t offset = 0;  // in [0, block_size)
};

struct BlockCopy {
  BlockId src = -1, dst = -1;
};

struct AppendResult {
  KvSlot slot;                    // where to write the new token's K and V
  std::optional<BlockCopy> copy;  // copy src to dst first (copy-on-write of a shared partial block)
  bool new_block = false;         // the table grew by one block (the previous last block was full)
};

struct KvBlockStats {
  int64_t num_blocks = 0;
  int64_t free_blocks = 0;       // on the free list
  int64_t used_blocks = 0;       // referenced by at least one sequence
  int64_t shared_blocks = 0;     // referenced by more than one sequence
  int64_t reserved_blocks = 0;   // free blocks promised to admitted sequences
  int64_t available_blocks = 0;  // free and not reserved: what can_admit may hand out
  int64_t num_sequences = 0;
};

class KvBlockManager {
 public:
  KvBlockManager(int64_t num_blocks, int32_t block_size);

  int32_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return int64_t(ref_count_.size()); }
  int64_t blocks_for_tokens(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  // Blocks taken from the pool (now or later) by a prompt of prompt_len tokens with num_samples
  // samples of up to reserve_new_tokens new tokens each: the sequence from allocate, then
  // num_samples - 1 forks of it.
  int64_t blocks_needed(int64_t prompt_len, int64_t reserve_new_tokens, int64_t num_samples = 1) const;
  bool can_admit(int64_t prompt_len, int64_t reserve_new_tokens, int64_t num_samples = 1) const;

  // A new sequence holding prompt_len tokens (blocks for all of them, to be written by the prefill
  // through slot()), with room reserved for reserve_new_tokens more, and for num_samples - 1 forks of it
  // (blocks_needed(prompt_len, reserve_new_tokens, num_samples) in all; what a fork does not use goes
  // back when the sequence is freed).
  void allocate(SeqId seq, int64_t prompt_len, int64_t reserve_new_tokens, int64_t num_samples = 1);
  // A new sequence `child` sharing every block of `parent`, with the parent's token count and capacity.
  void fork(SeqId parent, SeqId child);
  // Room for the next token of `seq`; see AppendResult. Refuses to go past the sequence's capacity.
  AppendResult append_slot(SeqId seq);
  // Drops the sequence: each of its blocks loses a reference, and goes back to the free list at zero.
  void free(SeqId seq);

  bool contains(SeqId seq) const { return seqs_.count(seq) != 0; }
  const std::vector<BlockId>& block_table(SeqId seq) const;
  int64_t num_tokens(SeqId seq) const;
  int64_t capacity(SeqId seq) const;               // prompt + reserve: the most tokens the sequence may hold
  KvSlot slot(SeqId seq, int64_t position) const;  // the slot of a token the sequence holds
  int32_t ref_count(BlockId block) const;
  KvBlockStats stats() const;

  // Recomputes every count from the block tables and throws mt::Error on the first disagreement
  // (tests; cost O(blocks + table entries)).
  void check_invariants() const;

 private:
  struct Seq {
    std::vector<BlockId> table;
    int64_t tokens = 0;
    int64_t capacity = 0;
    int64_t fork_reserve = 0;  // blocks reserved at allocate for forks not yet made
  };
  Seq& get(SeqId seq, const char* op);
  const Seq& get(SeqId seq, const char* op) const;
  BlockId pop_free();
  // Blocks the sequence may still take beyond its table: ceil(capacity / bs) - ceil(tokens / bs).
  int64_t future_blocks(const Seq& s) const;
  bool last_block_partial(const Seq& s) const { return s.tokens % block_size_ != 0; }

  int32_t block_size_;
  std::vector<int32_t> ref_count_;  // per block
  std::vector<BlockId> free_list_;  // a stack: back() is handed out next
  std::unordered_map<SeqId, Seq> seqs_;
  // Sum over sequences of future_blocks and fork_reserve, plus over shared partial last blocks of
  // (ref_count - 1).
  int64_t reserved_ = 0;
};

// Bytes of one block of the paged KV cache across all layers:
// 2 (K and V) * layers * kv_heads * head_dim * block_size * dtype_bytes.
struct KvCacheGeometry {
  int64_t layers = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t block_size = 0;  // tokens per block
  int64_t dtype_bytes = 0;
};
int64_t kv_bytes_per_block(const KvCacheGeometry& g);

// floor(budget_bytes / kv_bytes_per_block). Throws mt::Error naming the budget, the need and the flag
// --kv-cache-fraction when the budget cannot hold one sequence of max_seq_len tokens.
int64_t kv_pool_blocks(int64_t budget_bytes, const KvCacheGeometry& g, int64_t max_seq_len);

}  // namespace mt
