// DocumentSampler and PackedDataset (see packing.h).
#include "data/packing.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"

namespace mt {

namespace {
constexpr uint64_t kSamplerSalt = 0x646f6373616d706cull;  // "docsampl"
}

DocumentSampler::DocumentSampler(int64_t n, uint64_t seed, int rank, int world, bool shuffle)
    : n_(n), seed_(seed), rank_(rank), world_(world), shuffle_(shuffle) {
  if (n < 1) MT_THROW("document sampler: ", n, " items; need at least 1");
  if (world < 1 || rank < 0 || rank >= world)
    MT_THROW("document sampler: rank ", rank, " of world ", world, "; need 0 <= rank < world");
}

const std::vector<int64_t>& DocumentSampler::permutation(int64_t e) const {
  MT_CHECK(e >= 0, "epoch ", e, " must be >= 0");
  if (perm_epoch_ != e) {
    perm_.resize(size_t(n_));
    for (int64_t i = 0; i < n_; ++i) perm_[size_t(i)] = i;
    if (shuffle_) {
      Rng rng(mix64(mix64(seed_ ^ kSamplerSalt) + uint64_t(e)));
      for (int64_t i = n_ - 1; i > 0; --i) std::swap(perm_[size_t(i)], perm_[size_t(rng.randint(0, i + 1))]);
    }
    perm_epoch_ = e;
  }
  return perm_;
}

int64_t DocumentSampler::item_at(int64_t p) const {
  MT_CHECK(p >= 0, "sampler position ", p, " must be >= 0");
  return permutation(p / n_)[size_t(p % n_)];
}

int64_t DocumentSampler::next() {
  return item_at(draws_++ * world_ + rank_);
}

void DocumentSampler::set_position(int64_t draws) {
  if (draws < 0) MT_THROW("document sampler: position ", draws, " must be >= 0");
  draws_ = draws;
}

PackedDataset::PackedDataset(std::shared_ptr<const DocumentSet> docs, int64_t batch_size, int64_t seq_len,
                             uint64_t seed, int64_t pad_id, std::string name)
    : docs_(std::move(docs)),
      B_(batch_size),
      S_(seq_len),
      pad_id_(pad_id),
      seed_(seed),
      sampler_(docs_ ? std::max<int64_t>(docs_->size(), 1) : 1, seed),
      name_(std::move(name)) {
  if (!docs_ || docs_->size() == 0) MT_THROW("packed dataset: no documents");
  if (batch_size < 1) MT_THROW("packed dataset: micro_batch_size = ", batch_size, " must be >= 1");
  if (seq_len < 2) MT_THROW("packed dataset: seq_len = ", seq_len, " must be >= 2");
  for (int64_t d = 0; d < docs_->size(); ++d) truncated_ += docs_->length(d) > S_;
  if (truncated_ > 0)
    log_info("data: ", truncated_, " of ", docs_->size(), " documents are longer than seq_len ", S_,
             " tokens and are cut to their first ", S_, " (raise seq_len to keep them whole)");
  rows_before_.push_back(0);
}

const PackedDataset::Epoch& PackedDataset::epoch(int64_t e) const {
  for (const Epoch& c : cache_)
    if (c.e == e) return c;
  Epoch& ep = cache_[0].e < cache_[1].e ? cache_[0] : cache_[1];  // replace the older one
  ep.e = e;
  ep.docs = sampler_.permutation(e);
  ep.row_first.clear();
  int64_t used = S_;  // no row open yet
  for (size_t i = 0; i < ep.docs.size(); ++i) {
    const int64_t len = std::min(docs_->length(ep.docs[i]), S_);
    if (used + len > S_) {
      ep.row_first.push_back(int64_t(i));
      used = 0;
    }
    used += len;
  }
  ep.row_first.push_back(int64_t(ep.docs.size()));
  return ep;
}

int64_t PackedDataset::rows_in_epoch(int64_t e) const {
  std::lock_guard<std::mutex> lock(mu_);
  return int64_t(epoch(e).row_first.size()) - 1;
}

std::pair<int64_t, int64_t> PackedDataset::locate(int64_t r) const {
  // rows_before_ grows one epoch at a time; a row far ahead (a resume) packs the epochs before it once.
  while (rows_before_.back() <= r) {
    const int64_t e = int64_t(rows_before_.size()) - 1;
    rows_before_.push_back(rows_before_.back() + int64_t(epoch(e).row_first.size()) - 1);
  }
  const int64_t e = int64_t(std::upper_bound(rows_before_.begin(), rows_before_.end(), r) - rows_before_.begin()) - 1;
  return {e, r - rows_before_[size_t(e)]};
}

std::vector<int64_t> PackedDataset::row_documents(int64_t r) const {
  MT_CHECK(r >= 0, "row ", r, " must be >= 0");
  std::lock_guard<std::mutex> lock(mu_);
  auto [e, k] = locate(r);
  const Epoch& ep = epoch(e);
  return std::vector<int64_t>(ep.docs.begin() + ep.row_first[size_t(k)], ep.docs.begin() + ep.row_first[size_t(k) + 1]);
}

Batch PackedDataset::batch(int64_t index) const {
  MT_CHECK(index >= 0, "batch index must be >= 0, got ", index);
  Batch out{Tensor::empty({B_, S_}, DType::I64), Tensor::empty({B_, S_}, DType::I64),
            Tensor::empty({B_, S_}, DType::I32)};
  int64_t* ids = out.input_ids.data<int64_t>();
  int64_t* lab = out.labels.data<int64_t>();
  int32_t* seg = out.segments.data<int32_t>();
  const DocumentSet& ds = *docs_;
  for (int64_t b = 0; b < B_; ++b) {
    const std::vector<int64_t> row = row_documents(index * B_ + b);
    int64_t s = 0;
    for (size_t k = 0; k < row.size(); ++k) {
      const int64_t d = row[k], off = ds.offsets[size_t(d)], n = std::min(ds.length(d), S_);
      for (int64_t i = 0; i < n; ++i, ++s) {
        const int64_t at = b * S_ + s;
        ids[at] = ds.ids[size_t(off + i)];
        lab[at] = ds.target[size_t(off + i)] ? ids[at] : kIgnoreIndex;
        seg[at] = int32_t(k);
      }
    }
    for (; s < S_; ++s) {
      ids[b * S_ + s] = pad_id_;
      lab[b * S_ + s] = kIgnoreIndex;
      seg[b * S_ + s] = -1;
    }
  }
  return out;
}

std::string PackedDataset::describe() const {
  const DocumentSet& ds = *docs_;
  const int64_t rows = rows_in_epoch(0);
  int64_t kept = 0;
  for (int64_t d = 0; d < ds.size(); ++d) kept += std::min(ds.length(d), S_);
  return str("packed documents", name_.empty() ? "" : " from " + name_, ": ", ds.size(), " documents, ", ds.tokens(),
             " tokens (", ds.target_tokens(), " targets), ", truncated_, " cut to seq_len; ", rows, " rows of ", S_,
             " per epoch (", int64_t(1000.0 * double(kept) / double(rows * S_)) / 10.0, "% real tokens), ", B_,
             " rows per micro-batch, ", rows / B_, " micro-batches per epoch, seed ", seed_);
}

}  // namespace mt
