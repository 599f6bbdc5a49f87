// The model's input: a micro-batch, and the plan of the rows one rank runs for it. Everything the model
// needs to know about the whole sequences (positions, shifted targets, per-token objective inputs,
// replayed routing, which rows are padding) is planned here, once, before the forward, by
// plan_micro_batch, so that nothing inside the model (recompute included) issues a collective to learn
// it and no second place builds it. The model plans a micro-batch that arrives without a plan itself
// (sequence parallelism 1, its own tensor-parallel row multiple). Below the model and the exchanges:
// the model, the Ulysses exchange and the training session all include it.
//
// Layout: every sequence of the micro-batch (B rows, real length S) is padded to S' = a multiple of
// sp (and, under tensor parallelism, until B × S' / sp divides by tp), and rank r of the sp group holds
// positions [r C, (r + 1) C) of each (C = S' / sp), so the model's local tokens are [B, C], row-major.
// Without sequence parallelism (sp 1) C = S', the whole (possibly padded) sequences. Padding (positions
// >= S) has token id 0 and label -100; it sits at the end of each sequence, so under causal attention
// no real query sees it, and the model keeps it out of every statistic (router counts, probability
// sums, z-loss, expert load).
//
// Packing (MicroBatch::segments): a row may hold several documents back to back, then padding. Each
// document is a sequence of its own: its positions restart at 0, its queries see only its own keys
// (BatchPlan::doc_start, passed to the attention op), its last token has no target (the next token
// belongs to another document), and the row's padding, like the plan's, is out of every statistic.
// Under sequence parallelism the boundaries travel with the plan: every rank plans from the whole
// rows, so its chunk's positions and the whole rows' doc_start (attention runs on whole sequences
// there) need no collective.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace mt {

struct BatchPlan {
  int sp = 1;              // ranks of the sequence-parallel group
  int rank = 0;            // this rank's chunk
  int64_t seq_len = 0;     // S: the real length of every sequence
  int64_t padded_len = 0;  // S' = ceil(S / sp) × sp, or more sp steps until B × C divides by row_multiple
  int64_t chunk = 0;       // C = S' / sp: local tokens per sequence
  // Real (not padding) tokens at the start of each local sequence chunk: clamp(S − rank C, 0, C).
  // Padding is always a suffix of a chunk, so this count is the whole validity mask, unless the rows
  // are packed with padding of their own: then row_valid holds it per row.
  int64_t valid = 0;
  // Per row b, the real tokens at the start of its local chunk (size B); all equal to valid unless
  // the rows are packed (MicroBatch::segments) and some end in padding.
  std::vector<int64_t> row_valid;
  // Real tokens of the whole sequences of the micro-batch (every sp chunk): B × S unpacked.
  int64_t real_tokens = 0;
  // Packed rows only (else undefined: plain causal attention over each row): for each token of the
  // whole padded rows, i32 [B S'] (host), the index in its row where its document starts (padding: where
  // the padding starts). A query at s sees the keys doc_start[s] .. s. Whole rows, also under sp:
  // attention runs on whole sequences there.
  Tensor doc_start;
  Tensor positions;       // i32 [B C] (host): the global position of each local token
  Tensor shifted_labels;  // i64 [B C] (host): the target of each local token (HF shift done over
                          // the whole sequence); -100 for padding; undefined without labels
  // MicroBatch::token_values, shifted like the labels (the value of each local token's target), 0 on
  // padding and on a sequence's last token: f32 [B C] each (host).
  std::vector<Tensor> shifted_values;
  // MicroBatch::routing for the local tokens: i32 [B C, K] per sparse layer (host); padding rows name
  // experts 0..K-1 (they are outside every statistic and gradient). Empty: the router decides.
  std::vector<Tensor> routing;
};

struct MicroBatch {
  MicroBatch() = default;
  MicroBatch(Tensor ids, Tensor labels_) : input_ids(std::move(ids)), labels(std::move(labels_)) {}
  Tensor input_ids;  // i64 (B, S) whole sequences; with a plan, the local tokens (B, C)
  Tensor labels;     // i64 (B, S), HF semantics (shifted by the plan), -100 = ignore; may be undefined
                     // for a forward; unused once planned (the plan holds the shifted targets)
  // Packing: the document of each token in its row, i32 (B, S): 0, 1, 2, ... non-decreasing along
  // the row, then -1 on padding (which may only end a row; ids 0, labels -100 there by convention).
  // Undefined: each row is one sequence.
  Tensor segments;
  // Per-token inputs of an objective (e.g. advantages, old log-probabilities), aligned with labels:
  // f32 (B, S) each, the value at (b, s) belonging to the target labels[b, s] (shifted with it).
  std::vector<Tensor> token_values;
  // Routing replay: the experts each input token uses in every sparse layer, i32 (B S, K) per sparse
  // layer in layer order (as Qwen3MoeModel::last_routing returns them); the routing weights are the
  // layer's own probabilities at those experts. Empty: the router decides.
  std::vector<Tensor> routing;
  // This rank's rows, planned from the whole sequences (plan_micro_batch). Null: input_ids are whole
  // sequences not planned yet.
  std::shared_ptr<const BatchPlan> plan;
};

// This rank's piece of a micro-batch of whole sequences for sequence chunk sp_rank of sp (see
// BatchPlan), its positions, shifted targets and values, and replayed routing; with segments, the
// document boundaries (positions restarting per document, no target across a boundary, doc_start).
// Segments that are not 0, 1, ... per row with padding (-1) only at the end are an error naming the
// row, the position and the values. row_multiple (tensor
// parallelism): the sequences are padded further, by whole sp steps, until the chunk's B × C rows
// divide by it. sp 1 gives the whole sequences (padded for row_multiple only). Host computation only:
// no collective. Errors name the tensor, its shape and the one expected.
MicroBatch plan_micro_batch(const MicroBatch& whole, int sp = 1, int sp_rank = 0, int row_multiple = 1);

// Rows [b0, b0 + n) of a micro-batch of whole sequences (data parallelism): ids, labels, segments,
// values and routing. Views, no copies.
MicroBatch micro_batch_rows(const MicroBatch& whole, int64_t b0, int64_t n);

}  // namespace mt
