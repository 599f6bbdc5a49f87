// RolloutEngine (engine.h): the scheduler loop around Qwen3MoeModel::forward_cached.
#include "rollout/engine.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>

#include "core/cuda_graph.h"
#include "core/error.h"
#include "core/log.h"
#include "ops/ops.h"
#include "ops/profile.h"

namespace mt {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Seq {
  SeqId id = 0;
  int64_t req = 0, sample = 0, prompt_len = 0, cached = 0;  // cached: tokens whose K/V are in the cache
  std::vector<int32_t> tokens;                              // prompt, then the new tokens
  std::vector<float> logprobs;
  RoutingRecord routing;  // the experts of every token read (EngineOptions::record_routing)
  bool done = false;
  std::string reason;
};

// The batch a decode step is padded to for its CUDA graph: 1, 2, 4, 8, multiples of 8 to 64, of 32 to
// 512, of 128 beyond (at most 1/8 of a large batch is padding; few graphs per call).
int64_t decode_bucket(int64_t n) {
  if (n <= 8) {
    int64_t b = 1;
    while (b < n) b *= 2;
    return b;
  }
  const int64_t step = n <= 64 ? 8 : n <= 512 ? 32 : 128;
  return (n + step - 1) / step * step;
}

// A generate call's decode graphs: device inputs and outputs at fixed addresses, sized for the largest
// bucket the call can reach, and one graph per bucket: the forward and the sampler. Rows past a step's
// batch are padding: token 0 at position 0 of the cache's scratch block (which no sequence owns), whose key
// and value it writes first, drawn greedily.
struct DecodeGraphs {
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
};

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

// Lays out the step inputs and the draws over dg's staging buffers (device and pinned host), max_b rows.
void carve_stage(DecodeGraphs& dg, Device d) {
  const int64_t B = dg.max_b, W = dg.width;
  const size_t stage_bytes = 256 * 8 + size_t(B) * (8 + 8 + 8 * size_t(kSampleRowWords) + 3 * 4 + 4 * size_t(W));
  const int64_t stage_words = int64_t(stage_bytes + 7) / 8;
  dg.stage_d = Tensor::empty({stage_words}, DType::I64, d);
  dg.stage_h = Tensor::pinned({stage_words}, DType::I64);
  auto lay = [&](const Tensor& buf, CachedBatch& in, Tensor& rows) {
    size_t off = 0;
    in.tokens = carve(buf, off, {B}, DType::I64);
    in.logit_rows = carve(buf, off, {B}, DType::I64);
    rows = carve(buf, off, {B, kSampleRowWords}, DType::I64);
    in.positions = carve(buf, off, {B}, DType::I32);
    in.seq = carve(buf, off, {B}, DType::I32);
    in.slots = carve(buf, off, {B}, DType::I32);
    in.block_table = carve(buf, off, {B, W}, DType::I32);
    dg.table_offset = size_t(static_cast<char*>(in.block_table.raw()) - static_cast<char*>(buf.raw()));
  };
  lay(dg.stage_d, dg.in, dg.sample_rows);
  lay(dg.stage_h, dg.in_h, dg.sample_rows_h);
  const size_t draw_bytes = 512 + size_t(B) * 8;
  dg.draws_d = Tensor::empty({int64_t(draw_bytes / 8)}, DType::I64, d);
  dg.draws_h = Tensor::pinned({int64_t(draw_bytes / 8)}, DType::I64);
  size_t off = 0;
  dg.tokens = carve(dg.draws_d, off, {B}, DType::I32);
  dg.logprobs = carve(dg.draws_d, off, {B}, DType::F32);
  off = 0;
  dg.tokens_h = carve(dg.draws_h, off, {B}, DType::I32);
  dg.logprobs_h = carve(dg.draws_h, off, {B}, DType::F32);
}

bool graphs_env_on() {
  const char* v = std::getenv("MOETRAIN_CUDA_GRAPHS");
  if (!v || !*v || std::string(v) == "1") return true;
  if (std::string(v) == "0") return false;
  MT_THROW("MOETRAIN_CUDA_GRAPHS='", v, "': use 1 (decode steps as CUDA graphs, the default) or 0");
}

}  // namespace

RolloutEngine::RolloutEngine(Qwen3MoeModel& model, const EngineOptions& opt)
    : model_(model),
      opt_(opt),
      blocks_([&] {
        const ModelConfig& c = model.config();
        if (opt.block_size < 1) MT_THROW("block size ", opt.block_size, " must be >= 1");
        const KvCacheGeometry g{c.num_hidden_layers, c.num_key_value_heads, c.head_dim, opt.block_size,
                                model.device() == Device::CUDA ? 2 : 4};
        return kv_pool_blocks(opt.kv_cache_bytes, g, opt.block_size);
      }(), opt.block_size) {
  if (opt_.max_step_tokens < 1 || opt_.max_running < 1)
    MT_THROW("engine: max_step_tokens (", opt_.max_step_tokens, ") and max_running (", opt_.max_running,
             ") must be >= 1");
  cache_ = KvCache::allocate(model.config(), model.device(), blocks_.num_blocks() + 1, opt.block_size);
  stats_.num_blocks = blocks_.num_blocks();
}

int64_t RolloutEngine::kv_bytes_needed(const Qwen3MoeModel& model, const std::vector<GenerateRequest>& requests,
                                       int32_t block_size) {
  const ModelConfig& c = model.config();
  const KvCacheGeometry g{c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size,
                          model.device() == Device::CUDA ? 2 : 4};
  const KvBlockManager sizing(1, block_size);
  int64_t blocks = 0;
  for (const GenerateRequest& r : requests) blocks += sizing.blocks_needed(int64_t(r.prompt.size()), r.max_new_tokens, r.n);
  return std::max<int64_t>(blocks, 1) * kv_bytes_per_block(g);
}

std::vector<GeneratedSample> RolloutEngine::generate(const std::vector<GenerateRequest>& requests) {
  const ModelConfig& c = model_.config();
  int64_t total = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerateRequest& r = requests[i];
    if (r.prompt.empty()) MT_THROW("request ", i, ": the prompt is empty");
    for (size_t j = 0; j < r.prompt.size(); ++j)
      if (r.prompt[j] < 0 || r.prompt[j] >= c.vocab_size)
        MT_THROW("request ", i, ": token ", r.prompt[j], " at index ", j, " is outside the vocabulary [0, ",
                 c.vocab_size, ")");
    if (r.n < 1) MT_THROW("request ", i, ": n = ", r.n, " samples; allowed: n >= 1");
    if (r.max_new_tokens < 1) MT_THROW("request ", i, ": max_new_tokens ", r.max_new_tokens, " must be >= 1");
    const int64_t need = int64_t(r.prompt.size()) + r.max_new_tokens;
    if (need > c.max_position_embeddings)
      MT_THROW("request ", i, ": prompt (", r.prompt.size(), " tokens) + max_new_tokens (", r.max_new_tokens,
               ") = ", need, " exceeds the model's max_position_embeddings (", c.max_position_embeddings, ")");
    validate_sampling_params(r.sampling);
    const int64_t blocks = blocks_.blocks_needed(int64_t(r.prompt.size()), r.max_new_tokens, r.n);
    if (blocks > blocks_.num_blocks())
      MT_THROW("request ", i, ": its ", r.n, " samples of up to ", need, " tokens need ", blocks,
               " KV blocks; the cache holds ", blocks_.num_blocks(), " (raise --kv-cache-fraction, or lower n or "
               "max_new_tokens)");
    if (r.n > opt_.max_running)
      MT_THROW("request ", i, ": n = ", r.n, " exceeds the engine's max running sequences (", opt_.max_running, ")");
    total += r.n;
  }
  const auto t_start = Clock::now();
  // The inference layout for the whole call, unless the caller holds it already.
  struct InferenceGuard {
    Qwen3MoeModel& m;
    bool mine;
    ~InferenceGuard() {
      if (mine) m.end_inference();
    }
  } guard{model_, !model_.in_inference()};
  if (guard.mine) stats_.weight_sync_seconds += model_.begin_inference();
  // Expert parallelism: step while any rank of the group has work (a max of a flag per step).
  auto group_busy = [&](bool mine) {
    if (!opt_.lockstep || opt_.lockstep->size() == 1) return mine;
    Tensor f = Tensor::zeros({1}, DType::F32);
    f.data<float>()[0] = mine ? 1.0f : 0.0f;
    Tensor d = opt_.lockstep->device() == Device::CPU ? f : f.to(opt_.lockstep->device());
    opt_.lockstep->all_reduce(d, comm::ReduceOp::Max)->wait();
    return d.to(Device::CPU).data<float>()[0] > 0.0f;
  };
  const bool record = opt_.record_routing;
  DecodeGraphs dg;
  const bool use_graphs = opt_.cuda_graphs && graphs_off_.empty() && model_.capturable_cached() &&
                          !ops::op_profiling() && graphs_env_on();
  if (use_graphs) {
    for (const GenerateRequest& r : requests)
      dg.width = std::max(dg.width, (int64_t(r.prompt.size()) + r.max_new_tokens + opt_.block_size - 1) / opt_.block_size);
    dg.max_b = decode_bucket(std::min(opt_.max_running, total));
  }
  std::deque<int64_t> waiting;
  for (size_t i = 0; i < requests.size(); ++i) waiting.push_back(int64_t(i));
  std::vector<std::unique_ptr<Seq>> running, finished;
  SeqId next_id = 0;
  EngineProgress prog;
  prog.total = total;
  while (group_busy(!waiting.empty() || !running.empty())) {
    // The step's batch: every running sequence's next token, then whole prompts while they fit.
    std::vector<int64_t> tok, pos, seq_row, slot, logit_rows;
    std::vector<const std::vector<BlockId>*> tables;
    struct Fed {
      Seq* s;
      int64_t first_row, rows;  // its tokens in the batch
      bool prefill;
      int64_t first_logit;  // its logit rows: one per sample drawn (n for a prompt, the prefill's last token)
    };
    std::vector<Fed> fed;
    std::vector<std::unique_ptr<Seq>> admitted;
    auto add_token = [&](int32_t t, int64_t p, int64_t row, KvSlot sl) {
      tok.push_back(t);
      pos.push_back(p);
      seq_row.push_back(row);
      slot.push_back(int64_t(sl.block) * opt_.block_size + sl.offset);
    };
    for (auto& sp : running) {
      Seq& s = *sp;
      AppendResult ar = blocks_.append_slot(s.id);
      if (ar.copy) {
        cache_.copy_block(ar.copy->src, ar.copy->dst);
        ++stats_.block_copies;
      }
      const int64_t row = int64_t(tables.size());
      fed.push_back({&s, int64_t(tok.size()), 1, false, int64_t(logit_rows.size())});
      add_token(s.tokens[size_t(s.cached)], s.cached, row, ar.slot);
      logit_rows.push_back(int64_t(tok.size()) - 1);
      tables.push_back(&blocks_.block_table(s.id));
    }
    int64_t in_flight = int64_t(running.size());
    while (!waiting.empty()) {
      const GenerateRequest& r = requests[size_t(waiting.front())];
      const int64_t L = int64_t(r.prompt.size());
      const bool fits_tokens = tok.empty() || int64_t(tok.size()) + L <= opt_.max_step_tokens;
      if (!fits_tokens || in_flight + r.n > opt_.max_running || !blocks_.can_admit(L, r.max_new_tokens, r.n)) break;
      auto s = std::make_unique<Seq>();
      s->id = next_id++;
      s->req = waiting.front();
      s->prompt_len = L;
      s->tokens = r.prompt;
      blocks_.allocate(s->id, L, r.max_new_tokens, r.n);  // the forks' blocks reserved too
      const int64_t row = int64_t(tables.size());
      fed.push_back({s.get(), int64_t(tok.size()), L, true, int64_t(logit_rows.size())});
      for (int64_t p = 0; p < L; ++p) add_token(r.prompt[size_t(p)], p, row, blocks_.slot(s->id, p));
      for (int64_t j = 0; j < r.n; ++j) logit_rows.push_back(int64_t(tok.size()) - 1);  // a row per sample
      tables.push_back(&blocks_.block_table(s->id));
      stats_.prefill_tokens += L;
      in_flight += r.n;
      admitted.push_back(std::move(s));
      waiting.pop_front();
    }
    const bool idle = waiting.empty() && running.empty() && admitted.empty();  // stepping for the ep group
    if (idle) ++stats_.idle_steps;
    if (tok.empty() && !idle)  // cannot happen: a request that fits nothing was refused up front
      MT_THROW("engine: nothing could be scheduled (", waiting.size(), " waiting, ", blocks_.stats().available_blocks,
               " KV blocks available)");
    stats_.decode_tokens += int64_t(running.size());

    const int64_t N = int64_t(tok.size()), B = int64_t(tables.size());
    size_t M = 1;
    for (const auto* t : tables) M = std::max(M, t->size());
    // Each draw's sampling parameters and counter: row j of a prompt's n is sample j; position = the
    // position of the token being drawn.
    std::vector<SamplingParams> params(logit_rows.size());
    std::vector<DrawCounter> counters(logit_rows.size());
    for (const Fed& f : fed) {
      const GenerateRequest& r = requests[size_t(f.s->req)];
      const int64_t draws = f.prefill ? r.n : 1;
      for (int64_t j = 0; j < draws; ++j) {
        params[size_t(f.first_logit + j)] = r.sampling;
        counters[size_t(f.first_logit + j)] = {uint64_t(f.prefill ? j : f.s->sample), uint64_t(f.s->tokens.size())};
      }
    }
    std::vector<Tensor> routing;
    Tensor logits, drawn, drawn_lp;  // the draws are defined here when the decode graph's sampler made them
    bool graph_step = false;         // ... into dg's draw buffers
    auto tf = Clock::now();
    if (use_graphs && graphs_off_.empty() && admitted.empty() && N > 0 && int64_t(M) <= dg.width) {
      // A decode step: N sequences, one token each, padded to the bucket; its graph replayed (captured first).
      const int64_t Bk = decode_bucket(N);
      if (!dg.logits.defined()) {
        const Device d = model_.device();
        carve_stage(dg, d);
        dg.logits = Tensor::empty({dg.max_b, c.vocab_size}, DType::F32, d);
        if (record)
          for (int64_t l = 0; l < c.num_hidden_layers; ++l)
            if (c.is_sparse_layer(l)) dg.routing.push_back(Tensor::empty({dg.max_b, c.num_experts_per_tok}, DType::I32, d));
      }
      // The step's inputs, written into the pinned host views (rows past N: padding) and copied in one go.
      int64_t* h_tok = dg.in_h.tokens.data<int64_t>();
      int64_t* h_rows = dg.in_h.logit_rows.data<int64_t>();
      int32_t *h_pos = dg.in_h.positions.data<int32_t>(), *h_seq = dg.in_h.seq.data<int32_t>(),
              *h_slot = dg.in_h.slots.data<int32_t>(), *h_table = dg.in_h.block_table.data<int32_t>();
      const int32_t scratch_slot = int32_t(blocks_.num_blocks() * opt_.block_size);
      for (int64_t i = 0; i < Bk; ++i) {
        const bool real = i < N;
        h_tok[i] = real ? tok[size_t(i)] : 0;
        h_pos[i] = real ? int32_t(pos[size_t(i)]) : 0;
        h_seq[i] = int32_t(i);
        h_slot[i] = real ? int32_t(slot[size_t(i)]) : scratch_slot;
        h_rows[i] = i;
        int32_t* trow = h_table + i * dg.width;
        if (real) {
          const std::vector<int32_t>& t = *tables[size_t(i)];
          std::copy(t.begin(), t.end(), trow);
          std::fill(trow + t.size(), trow + dg.width, 0);
        } else {
          std::fill(trow, trow + dg.width, int32_t(blocks_.num_blocks()));  // reads only its own key, just written
        }
      }
      // The draws' rows (the step's counters among them: a replay draws new numbers); padding rows greedy.
      std::vector<SamplingParams> pad_params(params);
      std::vector<DrawCounter> pad_counters(counters);
      SamplingParams greedy;
      greedy.temperature = 0.0f;
      pad_params.resize(size_t(Bk), greedy);
      pad_counters.resize(size_t(Bk), DrawCounter{});
      const Tensor packed = pack_sample_rows(pad_params, pad_counters);
      std::copy_n(packed.data<int64_t>(), Bk * kSampleRowWords, dg.sample_rows_h.data<int64_t>());
      // One copy, ordered after the previous step's kernels on the compute stream; the host does not wait.
      const int64_t used = int64_t(dg.table_offset + size_t(Bk * dg.width) * sizeof(int32_t) + 7) / 8;  // words
      dg.stage_d.rows(0, used).copy_from_async(dg.stage_h.rows(0, used));
      CachedBatch in{dg.in.tokens.rows(0, Bk), dg.in.positions.rows(0, Bk), dg.in.seq.rows(0, Bk),
                     dg.in.slots.rows(0, Bk),  dg.in.block_table.rows(0, Bk), dg.in.logit_rows.rows(0, Bk)};
      Tensor srows = dg.sample_rows.rows(0, Bk), stok = dg.tokens.rows(0, Bk), slp = dg.logprobs.rows(0, Bk);
      Tensor out = dg.logits.rows(0, Bk);
      std::vector<Tensor>* rec = record && !dg.routing.empty() ? &dg.routing : nullptr;
      auto decode_step = [&] {
        model_.forward_cached_into(in, cache_, out, rec);
        ops::sample_tokens(out, srows, stok, slp);
      };
      cuda_graph::Graph& g = dg.graphs[Bk];
      if (!g.empty() && g.captured_epoch() == cuda_graph::epoch()) {
        g.replay();
        ++stats_.graph_steps;
      } else {
        decode_step();  // this step's results; it also grows what the graph needs
        model_.settle_arenas();  // their blocks merged now, so the capture allocates nothing
        const auto tc = Clock::now();
        std::string why;
        if (g.capture(decode_step, &why)) {
          ++stats_.graph_captures;
        } else {
          graphs_off_ = why;
          log_info("engine: decode steps run without CUDA graphs from here on: ", why);
        }
        stats_.graph_capture_seconds += since(tc);
      }
      logits = dg.logits.rows(0, N);
      graph_step = true;
      drawn = dg.tokens.rows(0, N);
      drawn_lp = dg.logprobs.rows(0, N);
      for (const Tensor& t : dg.routing) routing.push_back(t.rows(0, N));
    } else {
      CachedBatch b;
      b.tokens = Tensor::empty({N}, DType::I64);
      b.positions = Tensor::empty({N}, DType::I32);
      b.seq = Tensor::empty({N}, DType::I32);
      b.slots = Tensor::empty({N}, DType::I32);
      for (int64_t i = 0; i < N; ++i) {
        b.tokens.data<int64_t>()[i] = tok[size_t(i)];
        b.positions.data<int32_t>()[i] = int32_t(pos[size_t(i)]);
        b.seq.data<int32_t>()[i] = int32_t(seq_row[size_t(i)]);
        b.slots.data<int32_t>()[i] = int32_t(slot[size_t(i)]);
      }
      b.block_table = Tensor::zeros({B, int64_t(M)}, DType::I32);
      for (int64_t r = 0; r < B; ++r)
        std::copy(tables[size_t(r)]->begin(), tables[size_t(r)]->end(), b.block_table.data<int32_t>() + r * int64_t(M));
      b.logit_rows = Tensor::empty({int64_t(logit_rows.size())}, DType::I64);
      std::copy(logit_rows.begin(), logit_rows.end(), b.logit_rows.data<int64_t>());
      logits = model_.forward_cached(b, cache_, record ? &routing : nullptr);
    }
    stats_.forward_seconds += since(tf);
    ++stats_.steps;

    // Sample on the model's device (inside a decode step's graph, or after the forward), one row per draw:
    // a decoding sequence's next token, or each of an admitted prompt's n first tokens (its samples share
    // the prompt's blocks from here on: forks).
    auto ts = Clock::now();
    if (!drawn.defined()) {
      const int64_t R = int64_t(logit_rows.size());
      const Device dev = logits.device();
      const Tensor sample_rows = pack_sample_rows(params, counters);
      drawn = Tensor::empty({R}, DType::I32, dev);
      drawn_lp = Tensor::empty({R}, DType::F32, dev);
      ops::sample_tokens(logits, dev == Device::CPU ? sample_rows : sample_rows.to(dev), drawn, drawn_lp);
    }
    Tensor tokens_h, logprobs_h;  // the step's one sync
    if (graph_step) {  // tokens and log-probs in one buffer: one copy into pinned memory
      dg.draws_h.copy_from_async(dg.draws_d);
      device_mem::synchronize(Device::CUDA);
      tokens_h = dg.tokens_h.rows(0, N);
      logprobs_h = dg.logprobs_h.rows(0, N);
    } else {
      tokens_h = drawn.to(Device::CPU);
      logprobs_h = drawn_lp.to(Device::CPU);
    }
    for (Tensor& t : routing)
      if (t.device() != Device::CPU) t = t.to(Device::CPU);  // after the sync: no layer waited for these
    std::vector<std::unique_ptr<Seq>> next_running;
    auto keep_routing = [&](Seq& s, int64_t first_row, int64_t rows) {
      if (!record || routing.empty()) return;  // no sparse layer: nothing to record
      if (s.routing.empty()) s.routing = RoutingRecord(int64_t(routing.size()), c.num_experts_per_tok, c.num_experts);
      s.routing.append(routing, first_row, rows);
    };
    auto take = [&](std::unique_ptr<Seq> sp, int64_t logit_row) {
      Seq& s = *sp;
      const GenerateRequest& r = requests[size_t(s.req)];
      const int32_t token = tokens_h.data<int32_t>()[logit_row];
      s.tokens.push_back(token);
      s.logprobs.push_back(logprobs_h.data<float>()[logit_row]);
      ++prog.new_tokens;
      const bool eos = !r.ignore_eos && c.eos_token_id >= 0 && token == c.eos_token_id;
      const bool stop = eos || std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), token) !=
                                   r.stop_token_ids.end();
      const int64_t generated = int64_t(s.tokens.size()) - s.prompt_len;
      if (stop || generated >= r.max_new_tokens) {
        s.done = true;
        s.reason = stop ? "stop" : "length";
        blocks_.free(s.id);
        finished.push_back(std::move(sp));
        ++prog.finished;
      } else {
        next_running.push_back(std::move(sp));
      }
    };
    size_t admitted_i = 0;
    for (size_t f = 0; f < fed.size(); ++f) {
      Seq& s = *fed[f].s;
      keep_routing(s, fed[f].first_row, fed[f].rows);
      s.cached += fed[f].rows;
      if (!fed[f].prefill) {
        auto it = std::find_if(running.begin(), running.end(), [&](const auto& p) { return p.get() == &s; });
        take(std::move(*it), fed[f].first_logit);
        continue;
      }
      std::unique_ptr<Seq> parent = std::move(admitted[admitted_i++]);
      const GenerateRequest& r = requests[size_t(parent->req)];
      std::vector<std::unique_ptr<Seq>> samples;
      for (int64_t j = 1; j < r.n; ++j) {
        auto child = std::make_unique<Seq>(*parent);
        child->id = next_id++;
        child->sample = j;
        blocks_.fork(parent->id, child->id);
        samples.push_back(std::move(child));
      }
      take(std::move(parent), fed[f].first_logit);
      for (int64_t j = 1; j < r.n; ++j) take(std::move(samples[size_t(j - 1)]), fed[f].first_logit + j);
    }
    running = std::move(next_running);
    stats_.sample_seconds += since(ts);
    prog.running = int64_t(running.size());
    prog.waiting = int64_t(waiting.size());
    prog.seconds = since(t_start);
    if (opt_.on_step) opt_.on_step(prog);
  }
  stats_.seconds += since(t_start);

  std::vector<GeneratedSample> out;
  for (auto& sp : finished) {
    Seq& s = *sp;
    GeneratedSample g;
    g.prompt_index = s.req;
    g.sample_index = s.sample;
    g.tokens.assign(s.tokens.begin() + s.prompt_len, s.tokens.end());
    g.logprobs = s.logprobs;
    g.finish_reason = s.reason;
    g.routing = std::move(s.routing);
    out.push_back(std::move(g));
  }
  std::sort(out.begin(), out.end(), [](const GeneratedSample& a, const GeneratedSample& b) {
    return a.prompt_index != b.prompt_index ? a.prompt_index < b.prompt_index : a.sample_index < b.sample_index;
  });
  return out;
}

}  // namespace mt
