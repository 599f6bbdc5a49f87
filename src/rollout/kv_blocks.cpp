// Paged KV block manager: free list, reference counts, block tables, copy-on-write and reservations.
#include "rollout/kv_blocks.h"

#include <algorithm>
#include <cstdio>
#include <limits>

#include "core/error.h"

namespace mt {

KvBlockManager::KvBlockManager(int64_t num_blocks, int32_t block_size) : block_size_(block_size) {
  if (block_size < 1) MT_THROW("KV block size (", block_size, ") must be >= 1 token");
  if (num_blocks < 1 || num_blocks > std::numeric_limits<BlockId>::max())
    MT_THROW("KV block count (", num_blocks, ") must be in [1, ", std::numeric_limits<BlockId>::max(), "]");
  ref_count_.assign(size_t(num_blocks), 0);
  free_list_.resize(size_t(num_blocks));
  for (int64_t i = 0; i < num_blocks; ++i) free_list_[size_t(i)] = BlockId(num_blocks - 1 - i);
}

KvBlockManager::Seq& KvBlockManager::get(SeqId seq, const char* op) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) MT_THROW("KV blocks: ", op, ": unknown sequence ", seq);
  return it->second;
}

const KvBlockManager::Seq& KvBlockManager::get(SeqId seq, const char* op) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) MT_THROW("KV blocks: ", op, ": unknown sequence ", seq);
  return it->second;
}

BlockId KvBlockManager::pop_free() {
  MT_CHECK(!free_list_.empty(), "KV block pool empty although every take is reserved");
  const BlockId b = free_list_.back();
  free_list_.pop_back();
  MT_CHECK(ref_count_[size_t(b)] == 0, "block ", b, " on the free list has ", ref_count_[size_t(b)], " references");
  ref_count_[size_t(b)] = 1;
  return b;
}

int64_t KvBlockManager::future_blocks(const Seq& s) const {
  return blocks_for_tokens(s.capacity) - blocks_for_tokens(s.tokens);
}

int64_t KvBlockManager::blocks_needed(int64_t prompt_len, int64_t reserve_new_tokens, int64_t num_samples) const {
  if (prompt_len < 0 || reserve_new_tokens < 0 || num_samples < 1)
    MT_THROW("KV blocks: prompt length (", prompt_len, ") and reserve (", reserve_new_tokens,
             ") must be >= 0 and the number of samples (", num_samples, ") >= 1");
  const int64_t all = blocks_for_tokens(prompt_len + reserve_new_tokens);
  const int64_t per_fork = all - blocks_for_tokens(prompt_len) + (prompt_len % block_size_ != 0 ? 1 : 0);
  return all + (num_samples - 1) * per_fork;
}

bool KvBlockManager::can_admit(int64_t prompt_len, int64_t reserve_new_tokens, int64_t num_samples) const {
  return blocks_needed(prompt_len, reserve_new_tokens, num_samples) <= int64_t(free_list_.size()) - reserved_;
}

void KvBlockManager::allocate(SeqId seq, int64_t prompt_len, int64_t reserve_new_tokens, int64_t num_samples) {
  if (seqs_.count(seq)) MT_THROW("KV blocks: allocate: sequence ", seq, " already exists");
  const int64_t need = blocks_needed(prompt_len, reserve_new_tokens, num_samples);
  const int64_t available = int64_t(free_list_.size()) - reserved_;
  if (need > available)
    MT_THROW("out of KV blocks: sequence ", seq, " needs ", need, " blocks (", prompt_len, " prompt + ",
             reserve_new_tokens, " new tokens at ", block_size_, " tokens per block, ", num_samples,
             " samples) but ", available, " of ", num_blocks(),
             " are free and unreserved; admit sequences with can_admit first");
  Seq s;
  s.tokens = prompt_len;
  s.capacity = prompt_len + reserve_new_tokens;
  s.table.reserve(size_t(blocks_for_tokens(s.capacity)));
  for (int64_t i = 0; i < blocks_for_tokens(prompt_len); ++i) s.table.push_back(pop_free());
  s.fork_reserve = need - int64_t(s.table.size()) - future_blocks(s);
  reserved_ += future_blocks(s) + s.fork_reserve;
  seqs_.emplace(seq, std::move(s));
}

void KvBlockManager::fork(SeqId parent, SeqId child) {
  Seq& p = get(parent, "fork");
  if (seqs_.count(child)) MT_THROW("KV blocks: fork: child sequence ", child, " already exists");
  const int64_t need = future_blocks(p) + (last_block_partial(p) ? 1 : 0);
  // What allocate set aside for this fork is the parent's to hand over first.
  const int64_t pre = std::min(need, p.fork_reserve);
  const int64_t available = int64_t(free_list_.size()) - reserved_ + pre;
  if (need > available)
    MT_THROW("out of KV blocks: fork of sequence ", parent, " into ", child, " needs ", need, " blocks (", p.tokens,
             " tokens held, capacity ", p.capacity, ", at ", block_size_, " tokens per block) but ", available, " of ",
             num_blocks(),
             " are free and unreserved; admit the samples of a prompt together with "
             "can_admit(prompt_len, reserve_new_tokens, num_samples) and allocate(..., num_samples)");
  p.fork_reserve -= pre;
  reserved_ -= pre;
  Seq c = p;
  c.fork_reserve = 0;
  for (BlockId b : c.table) ++ref_count_[size_t(b)];
  reserved_ += need;
  seqs_.emplace(child, std::move(c));
}

AppendResult KvBlockManager::append_slot(SeqId seq) {
  Seq& s = get(seq, "append_slot");
  if (s.tokens >= s.capacity)
    MT_THROW("KV blocks: append_slot: sequence ", seq, " holds ", s.tokens,
             " tokens, its capacity (prompt + reserve at allocate); it may not grow past it");
  AppendResult r;
  if (!last_block_partial(s)) {
    s.table.push_back(pop_free());
    --reserved_;  // one future block of this sequence taken
    r.new_block = true;
  } else {
    const BlockId last = s.table.back();
    if (ref_count_[size_t(last)] > 1) {
      const BlockId fresh = pop_free();
      --ref_count_[size_t(last)];
      --reserved_;  // one copy of this shared partial block taken
      s.table.back() = fresh;
      r.copy = BlockCopy{last, fresh};
    }
  }
  r.slot = KvSlot{s.table.back(), int32_t(s.tokens % block_size_)};
  ++s.tokens;
  return r;
}

void KvBlockManager::free(SeqId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) MT_THROW("KV blocks: free: unknown sequence ", seq);
  const Seq& s = it->second;
  reserved_ -= future_blocks(s) + s.fork_reserve;
  if (last_block_partial(s) && ref_count_[size_t(s.table.back())] > 1) --reserved_;  // one copy fewer
  // Released last block first, so that the next take reuses the blocks in table order.
  for (auto b = s.table.rbegin(); b != s.table.rend(); ++b) {
    MT_CHECK(ref_count_[size_t(*b)] > 0, "block ", *b, " of sequence ", seq, " has no reference");
    if (--ref_count_[size_t(*b)] == 0) free_list_.push_back(*b);
  }
  seqs_.erase(it);
}

const std::vector<BlockId>& KvBlockManager::block_table(SeqId seq) const {
  return get(seq, "block_table").table;
}
int64_t KvBlockManager::num_tokens(SeqId seq) const {
  return get(seq, "num_tokens").tokens;
}
int64_t KvBlockManager::capacity(SeqId seq) const {
  return get(seq, "capacity").capacity;
}

KvSlot KvBlockManager::slot(SeqId seq, int64_t position) const {
  const Seq& s = get(seq, "slot");
  if (position < 0 || position >= s.tokens)
    MT_THROW("KV blocks: slot: position ", position, " of sequence ", seq, " is outside its ", s.tokens, " tokens [0, ",
             s.tokens, ")");
  return KvSlot{s.table[size_t(position / block_size_)], int32_t(position % block_size_)};
}

int32_t KvBlockManager::ref_count(BlockId block) const {
  if (block < 0 || block >= num_blocks())
    MT_THROW("KV blocks: block id ", block, " is outside the pool [0, ", num_blocks(), ")");
  return ref_count_[size_t(block)];
}

KvBlockStats KvBlockManager::stats() const {
  KvBlockStats st;
  st.num_blocks = num_blocks();
  st.free_blocks = int64_t(free_list_.size());
  st.used_blocks = st.num_blocks - st.free_blocks;
  for (int32_t rc : ref_count_) st.shared_blocks += rc > 1;
  st.reserved_blocks = reserved_;
  st.available_blocks = st.free_blocks - reserved_;
  st.num_sequences = int64_t(seqs_.size());
  return st;
}

void KvBlockManager::check_invariants() const {
  const int64_t nb = num_blocks();
  std::vector<int32_t> refs(size_t(nb), 0);
  std::vector<int64_t> fill(size_t(nb), -1);  // filled slots of each referenced block, as its holders see it
  int64_t reserved = 0;
  for (const auto& [id, s] : seqs_) {
    if (s.tokens < 0 || s.tokens > s.capacity)
      MT_THROW("KV invariant: sequence ", id, " holds ", s.tokens, " tokens, capacity ", s.capacity);
    if (int64_t(s.table.size()) != blocks_for_tokens(s.tokens))
      MT_THROW("KV invariant: sequence ", id, " has ", s.table.size(), " blocks for ", s.tokens, " tokens");
    for (size_t j = 0; j < s.table.size(); ++j) {
      const BlockId b = s.table[j];
      if (b < 0 || b >= nb) MT_THROW("KV invariant: sequence ", id, " references block ", b, " outside the pool");
      ++refs[size_t(b)];
      const int64_t f = std::min<int64_t>(block_size_, s.tokens - int64_t(j) * block_size_);
      if (fill[size_t(b)] >= 0 && fill[size_t(b)] != f)
        MT_THROW("KV invariant: holders of block ", b, " disagree on its fill (", fill[size_t(b)], " and ", f, ")");
      fill[size_t(b)] = f;
    }
    reserved += future_blocks(s) + s.fork_reserve;
  }
  // One copy per holder of a shared partial last block beyond the first.
  std::vector<int32_t> partial_holders(size_t(nb), 0);
  for (const auto& [id, s] : seqs_)
    if (last_block_partial(s)) ++partial_holders[size_t(s.table.back())];
  for (int64_t b = 0; b < nb; ++b) reserved += std::max(0, partial_holders[size_t(b)] - 1);
  std::vector<char> on_free(size_t(nb), 0);
  for (BlockId b : free_list_) {
    if (b < 0 || b >= nb) MT_THROW("KV invariant: free list holds block ", b, " outside the pool");
    if (on_free[size_t(b)]++) MT_THROW("KV invariant: block ", b, " is on the free list twice");
    if (refs[size_t(b)] != 0)
      MT_THROW("KV invariant: block ", b, " is free and referenced ", refs[size_t(b)], " times");
  }
  for (int64_t b = 0; b < nb; ++b) {
    if (refs[size_t(b)] != ref_count_[size_t(b)])
      MT_THROW("KV invariant: block ", b, " has ref_count ", ref_count_[size_t(b)], " but ", refs[size_t(b)],
               " table references");
    if (refs[size_t(b)] == 0 && !on_free[size_t(b)])
      MT_THROW("KV invariant: block ", b, " is neither referenced nor free (leaked)");
  }
  if (reserved != reserved_) MT_THROW("KV invariant: reserved ", reserved_, " blocks, recomputed ", reserved);
  if (reserved_ > int64_t(free_list_.size()))
    MT_THROW("KV invariant: ", reserved_, " blocks reserved but only ", free_list_.size(), " free");
}

namespace {

std::string bytes_str(int64_t bytes) {
  char buf[64];
  const bool gib = bytes >= (1ll << 30);
  std::snprintf(buf, sizeof(buf), "%.2f %s (%lld bytes)", double(bytes) / double(gib ? 1ll << 30 : 1ll << 20),
                gib ? "GiB" : "MiB", (long long)bytes);
  return buf;
}

}  // namespace

int64_t kv_bytes_per_block(const KvCacheGeometry& g) {
  const std::pair<const char*, int64_t> fields[] = {{"layers", g.layers},
                                                    {"kv_heads", g.kv_heads},
                                                    {"head_dim", g.head_dim},
                                                    {"block_size", g.block_size},
                                                    {"dtype_bytes", g.dtype_bytes}};
  int64_t bytes = 2;
  for (const auto& [name, v] : fields) {
    if (v < 1) MT_THROW("KV cache geometry: ", name, " (", v, ") must be >= 1");
    if (bytes > std::numeric_limits<int64_t>::max() / v)
      MT_THROW("KV cache geometry: bytes per block overflow 64 bits at ", name, " (", v, ")");
    bytes *= v;
  }
  return bytes;
}

int64_t kv_pool_blocks(int64_t budget_bytes, const KvCacheGeometry& g, int64_t max_seq_len) {
  const int64_t per_block = kv_bytes_per_block(g);
  if (max_seq_len < 1) MT_THROW("KV cache: the maximum sequence length (", max_seq_len, ") must be >= 1");
  const int64_t blocks = budget_bytes > 0 ? budget_bytes / per_block : 0;
  const int64_t need = (max_seq_len + g.block_size - 1) / g.block_size;
  if (blocks < need)
    MT_THROW("the KV cache budget of ", bytes_str(std::max<int64_t>(budget_bytes, 0)), " holds ", blocks, " blocks of ",
             g.block_size, " tokens at ", per_block, " bytes each, but one sequence of the maximum length ",
             max_seq_len, " needs ", need, " blocks, ", bytes_str(need * per_block),
             "; raise --kv-cache-fraction or lower the maximum sequence length");
  return std::min<int64_t>(blocks, std::numeric_limits<BlockId>::max());
}

}  // namespace mt
