// plan_micro_batch (micro_batch.h): host planning of the rows one rank runs for a micro-batch.
#include "model/micro_batch.h"

#include <algorithm>

#include "core/error.h"

namespace mt {

namespace {

void check_whole(const MicroBatch& mb) {
  const Tensor& ids = mb.input_ids;
  if (ids.dim() != 2 || ids.dtype() != DType::I64) MT_THROW("input_ids must be i64 [B, S], got ", ids.desc());
  if (mb.labels.defined() && (mb.labels.shape() != ids.shape() || mb.labels.dtype() != DType::I64))
    MT_THROW("labels must be i64 with the shape of input_ids ", shape_str(ids.shape()), ", got ", mb.labels.desc());
  for (size_t i = 0; i < mb.token_values.size(); ++i)
    if (mb.token_values[i].shape() != ids.shape() || mb.token_values[i].dtype() != DType::F32)
      MT_THROW("token_values[", i, "] must be f32 with the shape of input_ids ", shape_str(ids.shape()), ", got ",
               mb.token_values[i].desc());
  const int64_t T = ids.numel();
  if (mb.segments.defined() && (mb.segments.shape() != ids.shape() || mb.segments.dtype() != DType::I32))
    MT_THROW("segments must be i32 with the shape of input_ids ", shape_str(ids.shape()), ", got ", mb.segments.desc());
  for (size_t i = 0; i < mb.routing.size(); ++i) {
    const Tensor& r = mb.routing[i];
    if (r.dim() != 2 || r.size(0) != T || r.dtype() != DType::I32)
      MT_THROW("routing replay for sparse layer ", i, " is ", r.desc(), "; expected i32[", T,
               ", K] (one row per token "
               "of input_ids ",
               shape_str(ids.shape()), ")");
  }
}

// Per row, where each token's document starts (padding: where the padding starts), from the segments;
// returns the padding start of every row. Checks that each row's segments count 0, 1, ... and that
// padding (-1) only ends a row.
std::vector<int64_t> document_starts(const Tensor& seg_BS, std::vector<int32_t>& start_BS) {
  const int64_t B = seg_BS.size(0), S = seg_BS.size(1);
  const int32_t* seg = seg_BS.data<int32_t>();
  std::vector<int64_t> pad_start(size_t(B), S);
  start_BS.assign(size_t(B * S), 0);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* r = seg + b * S;
    int64_t start = 0;
    for (int64_t s = 0; s < S; ++s) {
      const int32_t prev = s ? r[s - 1] : 0, cur = r[s];
      const bool ok =
          s == 0 ? (cur == 0 || cur == -1) : (prev == -1 ? cur == -1 : (cur == prev || cur == prev + 1 || cur == -1));
      if (!ok)
        MT_THROW("segments row ", b, " position ", s, ": ", cur, " after ", s ? prev : 0,
                 "; a row's documents are numbered 0, 1, 2, ... in order and padding (-1) may only end the row");
      if (s == 0 || cur != prev) start = s;
      if (cur == -1 && pad_start[size_t(b)] == S) pad_start[size_t(b)] = s;
      start_BS[size_t(b * S + s)] = int32_t(start);
    }
  }
  return pad_start;
}

}  // namespace

MicroBatch plan_micro_batch(const MicroBatch& whole, int sp, int sp_rank, int row_multiple) {
  if (whole.plan) MT_THROW("plan_micro_batch: this micro-batch is already planned (chunk ", whole.plan->chunk, ")");
  check_whole(whole);
  MT_CHECK(sp >= 1 && sp_rank >= 0 && sp_rank < sp, "sp rank ", sp_rank, " of ", sp);
  MT_CHECK(row_multiple >= 1, "row_multiple ", row_multiple);
  const Tensor& ids_BS = whole.input_ids;
  const bool labels = whole.labels.defined();
  auto pl = std::make_shared<BatchPlan>();
  const int64_t B = ids_BS.size(0), S = ids_BS.size(1);
  pl->sp = sp;
  pl->rank = sp_rank;
  pl->seq_len = S;
  pl->padded_len = (S + sp - 1) / sp * sp;
  while (B * (pl->padded_len / sp) % row_multiple != 0) pl->padded_len += sp;  // tp splits the B × C rows
  const int64_t C = pl->chunk = pl->padded_len / sp, s0 = int64_t(sp_rank) * C;
  pl->valid = std::max<int64_t>(0, std::min(C, S - s0));
  // Packing: each token's document start, each row's padding start (S: no padding of its own).
  const bool packed = whole.segments.defined();
  std::vector<int32_t> start_BS;
  Tensor seg_host = packed ? whole.segments.to(Device::CPU) : Tensor();
  const std::vector<int64_t> pad_start =
      packed ? document_starts(seg_host, start_BS) : std::vector<int64_t>(size_t(B), S);
  const int32_t* seg = packed ? seg_host.data<int32_t>() : nullptr;
  pl->row_valid.resize(size_t(B));
  pl->real_tokens = 0;
  for (int64_t b = 0; b < B; ++b) {
    pl->row_valid[size_t(b)] = std::max<int64_t>(0, std::min(C, pad_start[size_t(b)] - s0));
    pl->real_tokens += pad_start[size_t(b)];
  }
  if (packed) {
    const int64_t Sp = pl->padded_len;
    pl->doc_start = Tensor::empty({B * Sp}, DType::I32);
    int32_t* ds = pl->doc_start.data<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < Sp; ++s)
        ds[b * Sp + s] = s < pad_start[size_t(b)] ? start_BS[size_t(b * S + s)] : int32_t(pad_start[size_t(b)]);
  }
  // The ids need a copy only when the local tokens are not the whole, unpadded sequences.
  const bool same_ids = sp == 1 && C == S;
  Tensor ids = same_ids ? Tensor() : ids_BS.to(Device::CPU), lab = labels ? whole.labels.to(Device::CPU) : Tensor();
  Tensor local_ids = same_ids ? ids_BS : Tensor::empty({B, C}, DType::I64);
  pl->positions = Tensor::empty({B * C}, DType::I32);
  if (labels) pl->shifted_labels = Tensor::empty({B * C}, DType::I64);
  std::vector<Tensor> vals;
  for (const Tensor& v : whole.token_values) {
    vals.push_back(v.to(Device::CPU));
    pl->shifted_values.push_back(Tensor::empty({B * C}));
  }
  std::vector<Tensor> routes;
  for (const Tensor& r : whole.routing) {
    routes.push_back(r.to(Device::CPU));
    pl->routing.push_back(Tensor::empty({B * C, r.size(1)}, DType::I32));
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < C; ++c) {
      const int64_t s = s0 + c, t = b * C + c;
      const bool real = s < S;
      if (!same_ids) local_ids.data<int64_t>()[t] = real ? ids.data<int64_t>()[b * S + s] : 0;
      // Packed: positions restart at each document (and at the padding, whose positions are unused).
      pl->positions.data<int32_t>()[t] =
          packed ? int32_t(s - pl->doc_start.data<int32_t>()[b * pl->padded_len + s]) : int32_t(s);
      // HF shift over the whole sequence: the target of position s is labels[s + 1], which for the
      // last token of a chunk lies in the next rank's chunk (every rank has the whole batch). A
      // document's last token has none: the next token starts another document (or the padding).
      const bool has_next = s + 1 < S && (!packed || (seg[b * S + s] >= 0 && seg[b * S + s + 1] == seg[b * S + s]));
      if (labels) pl->shifted_labels.data<int64_t>()[t] = has_next ? lab.data<int64_t>()[b * S + s + 1] : int64_t(-100);
      for (size_t i = 0; i < vals.size(); ++i)
        pl->shifted_values[i].data<float>()[t] = has_next ? vals[i].data<float>()[b * S + s + 1] : 0.0f;
      for (size_t i = 0; i < routes.size(); ++i) {
        const int64_t K = routes[i].size(1);
        for (int64_t k = 0; k < K; ++k)
          pl->routing[i].data<int32_t>()[t * K + k] =
              real ? routes[i].data<int32_t>()[(b * S + s) * K + k] : int32_t(k);
      }
    }
  MicroBatch mb{same_ids ? local_ids : local_ids.to(ids_BS.device()), Tensor()};
  mb.plan = std::move(pl);
  return mb;
}

MicroBatch micro_batch_rows(const MicroBatch& whole, int64_t b0, int64_t n) {
  if (whole.plan) MT_THROW("micro_batch_rows: the micro-batch is already planned; take rows of whole sequences");
  check_whole(whole);
  MicroBatch mb{whole.input_ids.rows(b0, n), whole.labels.defined() ? whole.labels.rows(b0, n) : Tensor()};
  if (whole.segments.defined()) mb.segments = whole.segments.rows(b0, n);
  for (const Tensor& v : whole.token_values) mb.token_values.push_back(v.rows(b0, n));
  const int64_t S = whole.input_ids.size(1);
  for (const Tensor& r : whole.routing) mb.routing.push_back(r.rows(b0 * S, n * S));
  return mb;
}

}  // namespace mt
