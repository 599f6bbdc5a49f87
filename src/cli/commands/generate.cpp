// moetrain generate --model DIR --prompts FILE.jsonl --out FILE.jsonl [options]: loads a Hugging Face
// model directory, reads the prompts (rollout/prompts.h: ids, or text and chats through the directory's
// tokenizer.json), generates with the engine and writes one JSON line per sample (with its "text" when
// the directory has a tokenizer). Progress (sequences done, tokens/s, ETA) goes to stderr; the last line on stdout is
// `generate: <n> sequences, <m> new tokens in <s> s (<x> tokens/s)`.
// Under `moetrain launch` the model is laid out as in training (--dp-shard, --ep; frozen weights), the
// engine's inference layout gathers it once (the weight-sync time is printed), every rank generates for
// the prompts i with i % world == rank, and rank 0 collects the samples and writes --out.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "cli/commands.h"
#include "cli/common_options.h"
#include "comm/gather_words.h"
#include "core/cli_args.h"
#include "core/determinism.h"
#include "core/error.h"
#include "core/log.h"
#include "core/options.h"
#include "core/rng.h"
#include "data/tokenizer.h"
#include "model/hf_checkpoint.h"
#include "model/lora_peft.h"
#include "model/qwen3_moe.h"
#include "parallel/dist.h"
#include "rollout/engine.h"
#include "rollout/prompts.h"
#include "train/session.h"

namespace mt {

namespace {

const char* kPromptLines =
    "Prompt lines: {\"prompt_ids\": [...]}, or with a tokenizer.json in the model directory {\"prompt\": \"text\"} or\n"
    "{\"messages\": [{\"role\": \"user\", \"content\": \"...\"}]} (the Qwen3 chat template); other keys are allowed\n"
    "and not copied to --out (grpo's rewards read them): join the output to the prompts by its \"prompt_index\".";

// Available host memory (MemAvailable of /proc/meminfo), for the CPU's KV budget.
int64_t host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return int64_t(4) << 30;
}

// Every rank's samples on rank 0 (others get none), ordered by (prompt, sample): each rank's packed as
// i32 words (prompt, sample, finish, n, tokens, logprob bits), all-gathered over the world communicator
// (comm/gather_words.h).
std::vector<GeneratedSample> gather_samples(const std::vector<GeneratedSample>& mine, comm::Communicator& world,
                                            int rank) {
  std::vector<int32_t> words;
  for (const GeneratedSample& g : mine) {
    words.insert(words.end(), {int32_t(g.prompt_index), int32_t(g.sample_index), g.finish_reason == "stop" ? 1 : 0,
                               int32_t(g.tokens.size())});
    words.insert(words.end(), g.tokens.begin(), g.tokens.end());
    for (float lp : g.logprobs) words.push_back(std::bit_cast<int32_t>(lp));
  }
  const std::vector<std::vector<int32_t>> all = comm::all_gather_words(world, words);
  std::vector<GeneratedSample> out;
  if (rank != 0) return out;
  for (const std::vector<int32_t>& rank_words : all) {
    const int32_t* w = rank_words.data();
    const int32_t* end = w + rank_words.size();
    while (w < end) {
      GeneratedSample g;
      g.prompt_index = w[0];
      g.sample_index = w[1];
      g.finish_reason = w[2] ? "stop" : "length";
      const int32_t n = w[3];
      g.tokens.assign(w + 4, w + 4 + n);
      for (int32_t i = 0; i < n; ++i) g.logprobs.push_back(std::bit_cast<float>(w[4 + n + i]));
      w += 4 + 2 * n;
      out.push_back(std::move(g));
    }
  }
  std::sort(out.begin(), out.end(), [](const GeneratedSample& a, const GeneratedSample& b) {
    return a.prompt_index != b.prompt_index ? a.prompt_index < b.prompt_index : a.sample_index < b.sample_index;
  });
  return out;
}

}  // namespace

int generate_main(const std::vector<std::string>& args) {
  std::string model_dir, prompts_path, out_path, adapter;
  bool merge_adapter = true;
  GenerateRequest base;
  base.max_new_tokens = 16;
  base.sampling.seed = uint64_t(cli::kDefaultSeed);
  int64_t seed = cli::kDefaultSeed;
  double kv_fraction = 0.5;
  EngineOptions eo;
  cli::DeviceOptions dev;
  MeshSpec mesh;
  std::string stop_ids;
  cli::Options opt("generate", "--model DIR --prompts FILE.jsonl --out FILE.jsonl [options]",
                   "Samples from a Hugging Face model directory with the rollout engine (paged KV cache).\n" +
                       std::string(kPromptLines));
  opt.group("input and output");
  opt.add("model", &model_dir, "the Hugging Face model directory").var("DIR").required();
  opt.add("adapter", &adapter,
          "LoRA adapters on the model: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) or "
          "a checkpoint-N of a run trained with --lora-rank")
      .var("DIR");
  opt.add("merge-adapter", &merge_adapter,
          "add the adapters into the weights once at load (the fastest generation); off: run them beside the base "
          "weights as RL does (one process or --dp-shard)");
  opt.add("prompts", &prompts_path, "one prompt per line (JSON)").var("FILE.jsonl").required();
  opt.add("out", &out_path, "one JSON line per sample (prompt_index, sample_index, token_ids, logprobs, ...)")
      .var("FILE.jsonl")
      .required();
  opt.group("generation");
  opt.add("max-new-tokens", &base.max_new_tokens, "new tokens per sample at most").at_least(1);
  opt.add("n", &base.n, "samples per prompt").at_least(1);
  opt.add("seed", &seed, "the sampler's seed (each prompt its own stream: the same samples on any number of ranks)")
      .at_least(0);
  opt.add("stop-token-ids", &stop_ids, "a sample also ends at these tokens (a,b,c); the EOS always stops it")
      .var("a,b,...");
  opt.add("ignore-eos", &base.ignore_eos, "keep sampling past the EOS token");
  cli::add_sampling_options(opt, base.sampling);
  opt.group("engine");
  opt.add("kv-cache-fraction", &kv_fraction, "the share of free memory for the KV cache").above(0).at_most(1);
  opt.add("block-size", &eo.block_size, "tokens per KV-cache block").at_least(1);
  opt.add("max-running", &eo.max_running, "sequences decoded together at most").at_least(1);
  bool true_on_policy = false;
  opt.add("true-on-policy", &true_on_policy,
          "batch-invariant kernels: a sample's tokens and log-probs do not depend on the batch around it, and (at "
          "temperature 1) equal the trainer's forward bit for bit (docs/rl.md)");
  cli::add_device_options(opt, dev);
  cli::add_mesh_options(opt, mesh, {.replicate = false, .tp = false, .sp = false});
  if (!opt.parse(args)) {
    std::printf("%s", opt.help().c_str());
    return 0;
  }
  opt.check();
  base.sampling.seed = uint64_t(seed);
  if (!stop_ids.empty()) {
    std::stringstream ss(stop_ids);
    std::string item;
    while (std::getline(ss, item, ','))
      base.stop_token_ids.push_back(parse_flag_number<int32_t>("--stop-token-ids", item));
  }
  validate_sampling_params(base.sampling);
  const Device device = cli::apply_device_options(dev);
  if (true_on_policy) set_batch_invariant(true);
  const int dp_shard = mesh.dp_shard, ep = mesh.ep;

  ModelConfig cfg = load_model_config(model_dir);
  for (int32_t id : base.stop_token_ids)  // one outside the vocabulary is never sampled: it would stop nothing
    if (id < 0 || id >= cfg.vocab_size)
      MT_THROW("--stop-token-ids: ", id, " is not a token id of the model (vocabulary [0, ", cfg.vocab_size, ") of ",
               model_dir, ")");
  // The model directory's tokenizer, when it has one: text and chat prompts, and each sample's text.
  std::optional<Tokenizer> tokenizer;
  if (std::filesystem::exists(model_dir + "/tokenizer.json"))
    tokenizer = Tokenizer::from_file(model_dir + "/tokenizer.json");
  const std::vector<Prompt> all_prompts =
      read_prompts(prompts_path, cfg.vocab_size, cfg.max_position_embeddings, tokenizer ? &*tokenizer : nullptr);
  // Every rank checks every prompt, so a bad one stops all ranks before any collective.
  for (const Prompt& p : all_prompts)
    if (int64_t(p.ids.size()) + base.max_new_tokens > cfg.max_position_embeddings)
      MT_THROW(prompts_path, " line ", p.line, ": prompt of ", p.ids.size(), " tokens + --max-new-tokens ",
               base.max_new_tokens, " exceeds the model's max_position_embeddings (", cfg.max_position_embeddings, ")");
  SessionOptions so;
  so.device = device;
  so.dist.mesh.dp_shard = dp_shard;
  so.dist.mesh.ep = ep;
  so.weights = Weights::Frozen;
  TrainSession session(cfg, so);
  DistContext& dist = session.dist();
  const int rank = dist.rank(), world = dist.world_size();
  const LoadReport rep = session.load(model_dir);
  Qwen3MoeModel& model = session.model();
  std::unique_ptr<LoraAdapters> lora;
  if (!adapter.empty()) {
    const std::string adir = find_adapter_dir(adapter);
    const LoraSpec spec = read_peft_config(adir);
    const Tensor values = read_peft_adapter(adir, cfg, spec);
    if (merge_adapter) {
      if (world > 1)
        MT_THROW("generate --adapter with --merge-adapter on runs on one process (each rank holds a shard of the "
                 "weights); add --merge-adapter off to run the adapters beside the sharded weights");
      merge_lora(cfg, spec, values, session.table(), session.master());
      session.refresh_compute_weights();
    } else {
      lora = std::make_unique<LoraAdapters>(model.config(), spec, device, 0);
      lora->load(values);
      model.attach_lora(lora.get());
    }
    if (rank == 0)
      log_info("generate: LoRA adapters from ", adir, " (rank ", spec.rank, ", ", lora_targets_text(spec), "), ",
               merge_adapter ? "merged into the weights" : "beside the base weights");
  }
  std::vector<Prompt> prompts;  // this rank's: i % world == rank
  std::vector<int64_t> prompt_index;
  for (size_t i = 0; i < all_prompts.size(); ++i)
    if (int(i % size_t(world)) == rank) {
      prompts.push_back(all_prompts[i]);
      prompt_index.push_back(int64_t(i));
    }
  if (rank == 0)
    log_info("generate: loaded ", rep.tensors, " tensors from ", model_dir, " in ", rep.seconds, " s",
             rep.router_bias ? " (and its router bias)" : "",
             cfg.score_before_experts ? " (score_before_experts, as its config.json says)" : "", "; ",
             all_prompts.size(), " prompts from ", prompts_path, ", device ", mt::device_name(device),
             world > 1 ? str(", ", world, " ranks (ep ", ep, ")") : std::string());
  std::vector<GenerateRequest> reqs;
  int64_t max_tokens = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Prompt& p = prompts[i];
    GenerateRequest r = base;
    r.prompt = p.ids;
    // Each prompt its own stream (the draw counters are only (sample, position)): the same --seed gives
    // the same samples whatever the number of ranks.
    r.sampling.seed = mix64(base.sampling.seed + uint64_t(prompt_index[i]));
    max_tokens += r.n * r.max_new_tokens;
    reqs.push_back(std::move(r));
  }
  double last_log = -1;
  eo.on_step = [&](const EngineProgress& p) {
    if (rank != 0 || (p.seconds - last_log < 2.0 && p.finished < p.total)) return;
    last_log = p.seconds;
    const double rate = p.seconds > 0 ? double(p.new_tokens) / p.seconds : 0;
    const double eta = rate > 0 ? double(max_tokens - p.new_tokens) / rate : 0;  // an upper bound (stops end early)
    log_info("generate: ", p.finished, "/", p.total, " sequences, ", p.new_tokens, " new tokens, ", p.running,
             " running, ", p.waiting, " prompts waiting, ", std::round(rate), " tokens/s, ETA <= ", std::round(eta),
             " s");
  };
  eo.lockstep = dist.ep();
  // The inference layout first (the gathers), then the KV budget: a fraction of the memory then free.
  const double sync_s = model.begin_inference();
  // On the CPU the ranks of a launch share the host's memory: each takes its share. Never more than the
  // requests can hold at once.
  const int64_t free_bytes =
      device == Device::CUDA ? int64_t(device_mem::cuda_free_bytes()) : host_available_bytes() / std::max(1, world);
  eo.kv_cache_bytes =
      std::min(int64_t(double(free_bytes) * kv_fraction), RolloutEngine::kv_bytes_needed(model, reqs, eo.block_size));
  RolloutEngine engine(model, eo);
  if (rank == 0)
    log_info("generate: weight sync (inference layout) ", sync_s, " s; KV cache of ", engine.num_blocks(),
             " blocks of ", eo.block_size, " tokens (", eo.kv_cache_bytes / 1e6, " MB: --kv-cache-fraction ",
             kv_fraction, " of the free memory, capped at what the requests can hold)");
  std::vector<GeneratedSample> out = engine.generate(reqs);
  model.end_inference();
  for (GeneratedSample& g : out) g.prompt_index = prompt_index[size_t(g.prompt_index)];
  if (world > 1) out = gather_samples(out, *dist.world(), rank);
  if (rank != 0) return 0;

  std::ofstream f(out_path, std::ios::trunc);
  if (!f) MT_THROW("cannot open --out file ", out_path);
  int64_t new_tokens = 0;
  for (const GeneratedSample& s : out) {
    nlohmann::json j{{"prompt_index", s.prompt_index},
                     {"sample_index", s.sample_index},
                     {"token_ids", s.tokens},
                     {"logprobs", s.logprobs},
                     {"finish_reason", s.finish_reason}};
    if (tokenizer) {
      // The sample's text, special tokens (the EOS, a stop token) left out, and ids the tokenizer lacks
      // (a model's vocabulary is often padded past the tokenizer's: such rows have no text).
      std::vector<uint32_t> ids;
      for (int32_t t : s.tokens)
        if (t >= 0 && uint32_t(t) < tokenizer->vocab_size()) ids.push_back(uint32_t(t));
      j["text"] = tokenizer->decode(ids, true);
    }
    f << j.dump() << "\n";
    new_tokens += int64_t(s.tokens.size());
  }
  f.close();
  if (!f) MT_THROW("writing ", out_path, " failed");
  const double secs = engine.stats().seconds;  // rank 0's; the ranks step together under ep
  std::printf("generate: %zu sequences, %lld new tokens in %.2f s (%.0f tokens/s)\n", out.size(), (long long)new_tokens,
              secs, secs > 0 ? double(new_tokens) / secs : 0.0);
  return 0;
}

}  // namespace mt
