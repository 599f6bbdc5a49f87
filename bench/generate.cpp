// Benchmark: the rollout engine (rollout/engine.h) generating from random prompts with random weights on
// one device, as RL's rollout phase does (the engine reads the training session's compute weights).
// Prints one JSON line: generated tokens/s over the whole generate call (prefill included), and beside
// it the decode floor: for the schedule where every sequence decodes at once, the bytes each decode step
// must read (the weights it touches: attention, routers, the experts B tokens reach in expectation under
// uniform routing, the LM head; plus every sequence's KV cache) divided by the device's copy bandwidth
// measured in this process (bytes read + written per second), summed over the steps.
//
// usage: generate [--model bench-4L] [--prompts 256] [--prompt-len 128] [--new-tokens 512] [--n 1]
//                 [--temperature 1] [--kv-cache-fraction 0.9] [--block-size 16] [--max-step-tokens 8192]
//                 [--max-running 256] [--device cuda|cpu] [--layers N] [--record-routing] [--profile]
// --record-routing: the engine keeps every token's experts (as RL does, for routing replay).
// Decode steps run as CUDA graphs unless MOETRAIN_CUDA_GRAPHS=0 (graph_steps, graph_captures in the line).
// --profile: a second generate call of the same requests with per-op timing (every op waits for the
// device before and after it), printed as a second JSON line: milliseconds per engine step by op, and
// what the ops do not cover (the host's batch building, copies, sampling's wait).
// --n N: N samples per prompt (the prompt prefilled once, its blocks shared): --prompts counts prompts.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "bench_util.h"
#include "core/device_select.h"
#include "core/log.h"
#include "core/rng.h"
#include "model/qwen3_moe.h"
#include "ops/profile.h"
#include "rollout/engine.h"
#include "train/session.h"
#include "train/trainer.h"

using namespace mt;
using namespace mt::bench;

int main(int argc, char** argv) {
  std::string model = "bench-4L", device = "cuda";
  int64_t prompts = 256, prompt_len = 128, new_tokens = 512, n = 1, layers = 0;
  float temperature = 1.0f;
  double kv_fraction = 0.9;
  bool profile = false;
  EngineOptions eo;
  eo.max_step_tokens = 8192;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) MT_THROW(a, " needs a value");
      return argv[++i];
    };
    if (a == "--model")
      model = next();
    else if (a == "--prompts")
      prompts = std::stoll(next());
    else if (a == "--prompt-len")
      prompt_len = std::stoll(next());
    else if (a == "--new-tokens")
      new_tokens = std::stoll(next());
    else if (a == "--n")
      n = std::stoll(next());
    else if (a == "--temperature")
      temperature = std::stof(next());
    else if (a == "--kv-cache-fraction")
      kv_fraction = std::stod(next());
    else if (a == "--block-size")
      eo.block_size = std::stoi(next());
    else if (a == "--max-step-tokens")
      eo.max_step_tokens = std::stoll(next());
    else if (a == "--max-running")
      eo.max_running = std::stoll(next());
    else if (a == "--device")
      device = next();
    else if (a == "--layers")
      layers = std::stoll(next());
    else if (a == "--profile")
      profile = true;
    else if (a == "--record-routing")
      eo.record_routing = true;
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  try {
    const Device dev = resolve_device(device);
    ModelConfig mc = resolve_model_config(model);
    if (layers > 0) mc.num_hidden_layers = layers;
    mc.eos_token_id = -1;
    SessionOptions so;
    so.device = dev;
    TrainSession session(mc, so);
    session.init_weights(1);
    const double copy_gbps = measure_copy_gbps(dev);
    Qwen3MoeModel& m = session.model();
    eo.kv_cache_bytes =
        dev == Device::CUDA ? int64_t(double(device_mem::cuda_free_bytes()) * kv_fraction) : int64_t(4) << 30;
    RolloutEngine engine(m, eo);

    Rng rng(7);
    std::vector<GenerateRequest> reqs(static_cast<size_t>(prompts));
    for (int64_t p = 0; p < prompts; ++p) {
      GenerateRequest& r = reqs[size_t(p)];
      for (int64_t t = 0; t < prompt_len; ++t) r.prompt.push_back(int32_t(rng.next_u64() % uint64_t(mc.vocab_size)));
      r.sampling.temperature = temperature;
      r.sampling.seed = uint64_t(p);
      r.n = n;
      r.max_new_tokens = new_tokens;
      r.ignore_eos = true;
    }
    // Warm-up: a short generate (kernel loading, the allocator's first growth).
    {
      std::vector<GenerateRequest> w(reqs.begin(), reqs.begin() + std::min<int64_t>(prompts, 8));
      for (auto& r : w) r.max_new_tokens = 4;
      engine.generate(w);
    }
    const EngineStats before = engine.stats();
    auto t = Clock::now();
    const std::vector<GeneratedSample> out = engine.generate(reqs);
    device_mem::synchronize(dev);
    const double s = secs(t);
    int64_t generated = 0;
    for (const auto& g : out) generated += int64_t(g.tokens.size());
    const EngineStats& st = engine.stats();

    // The floor: every sequence decoding at once, context prompt_len + j at step j.
    const int64_t B = prompts * n, wb = dev == Device::CUDA ? 2 : 4;
    double floor_s = 0;
    for (int64_t j = 0; j < new_tokens; ++j)
      floor_s += decode_step_bytes(mc, B, double(B) * double(prompt_len + j), wb, wb) / (copy_gbps * 1e9);
    const double tps = double(generated) / s, floor_tps = floor_s > 0 ? double(generated) / floor_s : 0;
    nlohmann::json j{{"bench", "generate"},
                     {"model", model},
                     {"layers", mc.num_hidden_layers},
                     {"device", device_name(dev)},
                     {"prompts", prompts},
                     {"prompt_len", prompt_len},
                     {"n", n},
                     {"new_tokens", new_tokens},
                     {"temperature", temperature},
                     {"record_routing", eo.record_routing},
                     {"generated_tokens", generated},
                     {"seconds", s},
                     {"tokens_per_s", tps},
                     {"floor_tokens_per_s", floor_tps},
                     {"fraction_of_floor", floor_tps > 0 ? tps / floor_tps : 0.0},
                     {"copy_gbps", copy_gbps},
                     {"steps", st.steps - before.steps},
                     {"forward_s", st.forward_seconds - before.forward_seconds},
                     {"sample_s", st.sample_seconds - before.sample_seconds},
                     {"prefill_tokens", st.prefill_tokens - before.prefill_tokens},
                     {"block_copies", st.block_copies - before.block_copies},
                     {"graph_steps", st.graph_steps - before.graph_steps},
                     {"graph_captures", st.graph_captures - before.graph_captures},
                     {"graph_capture_s", st.graph_capture_seconds - before.graph_capture_seconds},
                     {"kv_blocks", st.num_blocks},
                     {"block_size", eo.block_size}};
    std::printf("%s\n", j.dump().c_str());
    if (profile) {
      const EngineStats b2 = engine.stats();
      ops::reset_op_seconds();
      ops::set_op_profiling(true);
      auto t2 = Clock::now();
      engine.generate(reqs);
      device_mem::synchronize(dev);
      const double s2 = secs(t2);
      ops::set_op_profiling(false);
      const double steps2 = double(engine.stats().steps - b2.steps);
      nlohmann::json per_op;
      double covered = 0;
      for (const auto& [op, sec] : ops::op_seconds()) {
        per_op[op] = 1e3 * sec / steps2;
        covered += sec;
      }
      nlohmann::json p{{"bench", "generate_profile"},
                       {"steps", steps2},
                       {"step_ms", 1e3 * s2 / steps2},
                       {"ops_ms", 1e3 * covered / steps2},
                       {"outside_ops_ms", 1e3 * (s2 - covered) / steps2},
                       {"per_op_ms", per_op}};
      std::printf("%s\n", p.dump().c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "generate bench: %s\n", e.what());
    return 1;
  }
}
