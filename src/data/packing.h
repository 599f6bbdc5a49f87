// Packing documents into rows, and the deterministic sampler that orders them.
//
// DocumentSampler: a seeded shuffle of N items, a new permutation each epoch, read as one stream of
// positions p = 0, 1, 2, ... (item perm_{p / N}[p % N]). Rank r of `world` data-parallel ranks draws the
// positions r, r + world, r + 2 world, ...: disjoint shares, together the whole stream. Its state is one
// number, the draws done (position()); set_position() restores it, so a resumed run draws what the
// interrupted one would have drawn next.
//
// PackedDataset: the documents of a DocumentSet, in the sampler's order (world 1: every rank builds the
// same global micro-batch and the training session takes its rows), packed greedily into rows of S
// tokens: a document starts a new row when it does not fit in what is left of the current one; one
// longer than S is cut to its first S tokens (counted). Each row carries its documents back to back,
// then padding (id pad_id, label -100, segment -1); Batch::segments numbers the documents of a row, so
// the model keeps each document to itself (positions restart, attention masked, no target across a
// boundary, padding out of the router statistics: model/micro_batch.h). Labels are the ids on target
// tokens and -100 elsewhere (SFT: the prompt side of a conversation).
// Micro-batch i is rows [i B, (i + 1) B) of the stream of rows of epoch 0, then epoch 1, ...: a pure
// function of (seed, i), so BatchSource's position is the whole resumable state (a checkpoint saves it).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "data/batch.h"
#include "data/documents.h"

namespace mt {

class DocumentSampler {
 public:
  DocumentSampler(int64_t n, uint64_t seed, int rank = 0, int world = 1, bool shuffle = true);
  int64_t next();  // this rank's next item
  // The item at global stream position p (every rank's view of the same stream).
  int64_t item_at(int64_t p) const;
  int64_t position() const { return draws_; }  // this rank's draws so far
  void set_position(int64_t draws);
  int64_t epoch() const { return (draws_ * world_ + rank_) / n_; }  // the epoch of the next draw
  // The items of epoch e in order (the whole permutation, every rank's share).
  const std::vector<int64_t>& permutation(int64_t e) const;

 private:
  int64_t n_;
  uint64_t seed_;
  int rank_, world_;
  bool shuffle_;
  int64_t draws_ = 0;
  mutable int64_t perm_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
};

class PackedDataset : public BatchSource {
 public:
  PackedDataset(std::shared_ptr<const DocumentSet> docs, int64_t batch_size, int64_t seq_len, uint64_t seed,
                int64_t pad_id = 0, std::string name = "");

  Batch batch(int64_t index) const override;
  int64_t batch_size() const override { return B_; }
  int64_t seq_len() const override { return S_; }
  std::string describe() const override;

  const DocumentSet& documents() const { return *docs_; }
  int64_t rows_in_epoch(int64_t e) const;           // rows the packing of epoch e makes
  int64_t truncated() const { return truncated_; }  // documents longer than seq_len (cut)
  // The documents of stream row r, in row order (each cut to S tokens if longer).
  std::vector<int64_t> row_documents(int64_t r) const;

 private:
  struct Epoch {
    int64_t e = -1;
    std::vector<int64_t> docs;       // the epoch's documents in sampler order
    std::vector<int64_t> row_first;  // row k holds docs [row_first[k], row_first[k + 1])
  };
  const Epoch& epoch(int64_t e) const;                  // built on demand; the last two are kept (callers hold mu_)
  std::pair<int64_t, int64_t> locate(int64_t r) const;  // stream row -> (epoch, row in epoch); holds mu_

  std::shared_ptr<const DocumentSet> docs_;
  int64_t B_, S_, pad_id_;
  uint64_t seed_;
  DocumentSampler sampler_;
  std::string name_;
  int64_t truncated_ = 0;
  mutable std::mutex mu_;
  mutable Epoch cache_[2];
  mutable std::vector<int64_t> rows_before_;  // rows of the stream before epoch e (known epochs)
};

}  // namespace mt
