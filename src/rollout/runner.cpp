// The rollout model runner (runner.h): the step's inputs, the forward (eager or a decode graph) and the
// KV cache's block copies.
#include "rollout/runner.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>

#include "core/clock.h"
#include "core/cuda_graph.h"
#include "core/error.h"
#include "core/log.h"
#include "ops/ops.h"

namespace mt {

namespace {

// Views of a flat buffer (i64 words) at 256-byte aligned byte offsets, in the order asked for (off: the running
// offset in bytes).
Tensor carve(const Tensor& buf, size_t& off, const Shape& shape, DType dt) {
  off = (off + 255) / 256 * 256;
  const size_t bytes = size_t(shape_numel(shape)) * dtype_size(dt);
  MT_CHECK(off + bytes <= buf.nbytes(), "engine: staging buffer of ", buf.nbytes(), " bytes, need ", off + bytes);
  Tensor t(buf.owner(), static_cast<char*>(buf.raw()) + off, shape, dt, buf.device());
  off += bytes;
  return t;
}

}  // namespace

int64_t decode_bucket(int64_t n) {
  if (n <= 8) {
    int64_t b = 1;
    while (b < n) b *= 2;
    return b;
  }
  const int64_t step = n <= 64 ? 8 : n <= 512 ? 32 : 128;
  return (n + step - 1) / step * step;
}

bool decode_graphs_env() {
  const char* v = std::getenv("MOETRAIN_CUDA_GRAPHS");
  if (!v || !*v || std::string(v) == "1") return true;
  if (std::string(v) == "0") return false;
  MT_THROW("MOETRAIN_CUDA_GRAPHS='", v, "': use 1 (decode steps as CUDA graphs, the default) or 0");
}

std::vector<Tensor> routing_to_host(std::vector<Tensor> routing) {
  for (Tensor& t : routing)
    if (t.device() != Device::CPU) t = t.to(Device::CPU);
  return routing;
}

// The step's inputs on the host, one entry per token (tok, pos, seq_row, slot), per sequence (tables: its
// block table, in the plan's order) and per draw (logit_rows: the token whose logits it draws from).
struct ModelRunner::Inputs {
  std::vector<int64_t> tok, pos, seq_row, slot, logit_rows;
  std::vector<const std::vector<BlockId>*> tables;
  size_t width = 1;  // the longest block table
  bool decode_only = false;
};

// A generate call's decode graphs: device inputs and outputs at fixed addresses, sized for the largest
// bucket the call can reach, and one graph per bucket: the forward and the sampler.
struct ModelRunner::DecodeGraphs {
  int64_t max_b = 0, width = 0;  // buffer rows, block-table width
  CachedBatch in;                // device tensors of max_b rows
  Tensor sample_rows;            // i64 [max_b, 5]: each row's sampling parameters and draw counter
  Tensor logits;                 // f32 [max_b, V]
  std::vector<Tensor> routing;   // per sparse layer, i32 [max_b, K]
  Tensor tokens, logprobs;       // i32, f32 [max_b]: the draws
  std::map<int64_t, cuda_graph::Graph> graphs;
  // The step's inputs (in's six tensors and sample_rows) are views of one device buffer, filled from one
  // page-locked host buffer of the same layout by one asynchronous copy per step; the draws (tokens, then
  // logprobs) are views of one device buffer read back by one copy. in_h, sample_rows_h, tokens_h and
  // logprobs_h: the host views. The block table comes last, so a step copies only up to its bucket's rows.
  Tensor stage_d, stage_h, draws_d, draws_h;
  CachedBatch in_h;
  Tensor sample_rows_h, tokens_h, logprobs_h;
  size_t table_offset = 0;  // bytes

  // Lays out the step inputs and the draws over the staging buffers (device and pinned host), max_b rows.
  void carve_stage(Device d) {
    const int64_t B = max_b, W = width;
    const size_t stage_bytes = 256 * 8 + size_t(B) * (8 + 8 + 8 * size_t(kSampleRowWords) + 3 * 4 + 4 * size_t(W));
    const int64_t stage_words = int64_t(stage_bytes + 7) / 8;
    stage_d = Tensor::empty({stage_words}, DType::I64, d);
    stage_h = Tensor::pinned({stage_words}, DType::I64);
    auto lay = [&](const Tensor& buf, CachedBatch& in, Tensor& rows) {
      size_t off = 0;
      in.tokens = carve(buf, off, {B}, DType::I64);
      in.logit_rows = carve(buf, off, {B}, DType::I64);
      rows = carve(buf, off, {B, kSampleRowWords}, DType::I64);
      in.positions = carve(buf, off, {B}, DType::I32);
      in.seq = carve(buf, off, {B}, DType::I32);
      in.slots = carve(buf, off, {B}, DType::I32);
      in.block_table = carve(buf, off, {B, W}, DType::I32);
      table_offset = size_t(static_cast<char*>(in.block_table.raw()) - static_cast<char*>(buf.raw()));
    };
    lay(stage_d, in, sample_rows);
    lay(stage_h, in_h, sample_rows_h);
    const size_t draw_bytes = 512 + size_t(B) * 8;
    draws_d = Tensor::empty({int64_t(draw_bytes / 8)}, DType::I64, d);
    draws_h = Tensor::pinned({int64_t(draw_bytes / 8)}, DType::I64);
    size_t off = 0;
    tokens = carve(draws_d, off, {B}, DType::I32);
    logprobs = carve(draws_d, off, {B}, DType::F32);
    off = 0;
    tokens_h = carve(draws_h, off, {B}, DType::I32);
    logprobs_h = carve(draws_h, off, {B}, DType::F32);
  }
};

ModelRunner::ModelRunner(Qwen3MoeModel& model, KvCache& cache, const KvBlockManager& blocks, const RunnerSetup& setup)
    : model_(model), cache_(cache), blocks_(blocks), setup_(setup) {
  if (setup_.decode_graphs) {
    graphs_ = std::make_unique<DecodeGraphs>();
    graphs_->max_b = setup_.max_batch;
    graphs_->width = setup_.table_width;
  }
}

ModelRunner::~ModelRunner() = default;

StepOutput ModelRunner::run(const StepPlan& plan, const SamplingBatch& draws) {
  for (const BlockCopy& cp : plan.copies) cache_.copy_block(cp.src, cp.dst);
  // The tokens: each decoding sequence's next one, each appended chunk (over its cached prefix), each admitted
  // prompt whole; their slots from the block tables.
  Inputs in;
  in.tok.reserve(size_t(plan.num_tokens));
  const int64_t bs = blocks_.block_size();
  for (const ScheduledSeq& e : plan.seqs) {
    const Sequence& s = *e.seq;
    const int64_t row = int64_t(in.tables.size());
    const std::vector<BlockId>& table = blocks_.block_table(s.id);
    for (int64_t p = s.cached; p < s.cached + e.num_tokens; ++p) {  // token p lives in table[p / bs], p % bs
      in.tok.push_back(s.tokens[size_t(p)]);
      in.pos.push_back(p);
      in.seq_row.push_back(row);
      in.slot.push_back(int64_t(table[size_t(p / bs)]) * bs + p % bs);
    }
    for (int64_t j = 0; j < e.num_draws; ++j) in.logit_rows.push_back(e.first_token + e.num_tokens - 1);
    in.tables.push_back(&table);
    in.width = std::max(in.width, table.size());
  }
  in.decode_only = plan.decode_only();
  if (graphs_ && graphs_off_.empty() && in.decode_only && int64_t(in.width) <= graphs_->width)
    return run_graph(in, draws);
  return run_eager(in);
}

StepOutput ModelRunner::run_eager(const Inputs& in) {
  const int64_t N = int64_t(in.tok.size()), B = int64_t(in.tables.size()), M = int64_t(in.width);
  CachedBatch b;
  b.tokens = Tensor::empty({N}, DType::I64);
  b.positions = Tensor::empty({N}, DType::I32);
  b.seq = Tensor::empty({N}, DType::I32);
  b.slots = Tensor::empty({N}, DType::I32);
  for (int64_t i = 0; i < N; ++i) {
    b.tokens.data<int64_t>()[i] = in.tok[size_t(i)];
    b.positions.data<int32_t>()[i] = int32_t(in.pos[size_t(i)]);
    b.seq.data<int32_t>()[i] = int32_t(in.seq_row[size_t(i)]);
    b.slots.data<int32_t>()[i] = int32_t(in.slot[size_t(i)]);
  }
  b.block_table = Tensor::zeros({B, M}, DType::I32);
  for (int64_t r = 0; r < B; ++r)
    std::copy(in.tables[size_t(r)]->begin(), in.tables[size_t(r)]->end(), b.block_table.data<int32_t>() + r * M);
  b.logit_rows = Tensor::empty({int64_t(in.logit_rows.size())}, DType::I64);
  std::copy(in.logit_rows.begin(), in.logit_rows.end(), b.logit_rows.data<int64_t>());
  StepOutput out;
  out.logits = model_.forward_cached(b, cache_, setup_.record_routing ? &out.routing : nullptr);
  return out;
}

// A decode step: N sequences, one token each, padded to the bucket; its graph replayed (captured first).
StepOutput ModelRunner::run_graph(const Inputs& in, const SamplingBatch& draws) {
  DecodeGraphs& dg = *graphs_;
  const ModelConfig& c = model_.config();
  const int64_t N = int64_t(in.tok.size()), Bk = decode_bucket(N);
  if (!dg.logits.defined()) {
    const Device d = model_.device();
    dg.carve_stage(d);
    dg.logits = Tensor::empty({dg.max_b, c.vocab_size}, DType::F32, d);
    if (setup_.record_routing)
      for (int64_t l = 0; l < c.num_hidden_layers; ++l)
        if (c.is_sparse_layer(l)) dg.routing.push_back(Tensor::empty({dg.max_b, c.num_experts_per_tok}, DType::I32, d));
  }
  // The step's inputs, written into the pinned host views (rows past N: padding) and copied in one go.
  int64_t* h_tok = dg.in_h.tokens.data<int64_t>();
  int64_t* h_rows = dg.in_h.logit_rows.data<int64_t>();
  int32_t *h_pos = dg.in_h.positions.data<int32_t>(), *h_seq = dg.in_h.seq.data<int32_t>(),
          *h_slot = dg.in_h.slots.data<int32_t>(), *h_table = dg.in_h.block_table.data<int32_t>();
  const int32_t scratch_slot = int32_t(blocks_.num_blocks() * blocks_.block_size());
  for (int64_t i = 0; i < Bk; ++i) {
    const bool real = i < N;
    h_tok[i] = real ? in.tok[size_t(i)] : 0;
    h_pos[i] = real ? int32_t(in.pos[size_t(i)]) : 0;
    h_seq[i] = int32_t(i);
    h_slot[i] = real ? int32_t(in.slot[size_t(i)]) : scratch_slot;
    h_rows[i] = i;
    int32_t* trow = h_table + i * dg.width;
    if (real) {
      const std::vector<int32_t>& t = *in.tables[size_t(i)];
      std::copy(t.begin(), t.end(), trow);
      std::fill(trow + t.size(), trow + dg.width, 0);
    } else {
      std::fill(trow, trow + dg.width, int32_t(blocks_.num_blocks()));  // reads only its own key, just written
    }
  }
  // The draws' rows (the step's counters among them: a replay draws new numbers); padding rows greedy.
  const Tensor packed = pack_padded_sample_rows(draws, Bk);
  std::copy_n(packed.data<int64_t>(), Bk * kSampleRowWords, dg.sample_rows_h.data<int64_t>());
  // One copy, ordered after the previous step's kernels on the compute stream; the host does not wait.
  const int64_t used = int64_t(dg.table_offset + size_t(Bk * dg.width) * sizeof(int32_t) + 7) / 8;  // words
  dg.stage_d.rows(0, used).copy_from_async(dg.stage_h.rows(0, used));
  CachedBatch b{dg.in.tokens.rows(0, Bk), dg.in.positions.rows(0, Bk),   dg.in.seq.rows(0, Bk),
                dg.in.slots.rows(0, Bk),  dg.in.block_table.rows(0, Bk), dg.in.logit_rows.rows(0, Bk)};
  Tensor srows = dg.sample_rows.rows(0, Bk), stok = dg.tokens.rows(0, Bk), slp = dg.logprobs.rows(0, Bk);
  Tensor logits = dg.logits.rows(0, Bk);
  std::vector<Tensor>* rec = setup_.record_routing && !dg.routing.empty() ? &dg.routing : nullptr;
  auto decode_step = [&] {
    model_.forward_cached_into(b, cache_, logits, rec);
    ops::sample_tokens(logits, srows, stok, slp);
  };
  StepOutput out;
  cuda_graph::Graph& g = dg.graphs[Bk];
  if (!g.empty() && g.captured_epoch() == cuda_graph::epoch()) {
    g.replay();
    out.graph_replayed = true;
  } else {
    decode_step();           // this step's results; it also grows what the graph needs
    model_.settle_arenas();  // their blocks merged now, so the capture allocates nothing
    const auto tc = Clock::now();
    std::string why;
    if (g.capture(decode_step, &why)) {
      out.graph_captured = true;
    } else {
      graphs_off_ = why;
      out.graphs_off = why;
      log_info("engine: decode steps run without CUDA graphs from here on: ", why);
    }
    out.graph_capture_seconds = seconds_since(tc);
  }
  out.logits = dg.logits.rows(0, N);
  out.drawn = true;
  drawn_rows_ = N;
  for (const Tensor& t : dg.routing) out.routing.push_back(t.rows(0, N));
  return out;
}

StepDraws ModelRunner::read_draws() {
  MT_CHECK(graphs_ && drawn_rows_ > 0, "runner: read_draws() without a decode graph step");
  DecodeGraphs& dg = *graphs_;
  dg.draws_h.copy_from_async(dg.draws_d);  // tokens and log-probs in one buffer: one copy into pinned memory
  device_mem::synchronize(Device::CUDA);
  const int64_t N = drawn_rows_;
  StepDraws r;
  r.tokens.assign(dg.tokens_h.data<int32_t>(), dg.tokens_h.data<int32_t>() + N);
  r.logprobs.assign(dg.logprobs_h.data<float>(), dg.logprobs_h.data<float>() + N);
  return r;
}

}  // namespace mt
