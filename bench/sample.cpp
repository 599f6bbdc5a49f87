// Benchmark: the CUDA token sampler (ops::sample_tokens, backend/cuda/sample.cu) at the rollout engine's
// decode shape: R rows of f32 logits over bench-4L's vocabulary (151,936), N(0, 2) values. Each mode is
// first checked against the CPU reference on its first 8 rows (tokens equal), then timed over back-to-back
// calls (wall clock around `--iters` calls, the device synchronised before and after). Prints one JSON line
// per mode: microseconds per call, the logits' bytes, and the time one read of them takes at the device's
// copy bandwidth measured in this process (bytes read + written per second), the floor of a one-pass
// sampler.
//
// usage: sample_bench [--rows 256] [--vocab 151936] [--iters 200]
#include <cstdio>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/rng.h"
#include "ops/ops.h"
#include "ops/sampling.h"

using namespace mt;
using namespace mt::bench;

int main(int argc, char** argv) {
  int64_t R = 256, V = 151936, iters = 200;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", a.c_str());
      return 2;
    }
    const int64_t v = std::stoll(argv[++i]);
    if (a == "--rows")
      R = v;
    else if (a == "--vocab")
      V = v;
    else if (a == "--iters")
      iters = v;
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (R < 8 || V < 1 || iters < 1) {
    std::fprintf(stderr, "--rows (%lld) must be >= 8, --vocab (%lld) and --iters (%lld) >= 1\n", (long long)R,
                 (long long)V, (long long)iters);
    return 2;
  }
  try {
    if (!device_mem::cuda_available()) MT_THROW("sample_bench needs a GPU; none is visible");
    const Device dev = Device::CUDA;
    const double copy_gbps = measure_copy_gbps(dev);
    Rng rng(1);
    Tensor logits_h = Tensor::empty({R, V});
    rng.fill_normal(logits_h, 0.0f, 2.0f);
    const Tensor logits = logits_h.to(dev);
    Tensor tokens = Tensor::empty({R}, DType::I32, dev), logprobs = Tensor::empty({R}, DType::F32, dev);
    struct Mode {
      const char* name;
      float T;
      int32_t top_k;
      float top_p, min_p;
      int64_t every;  // the mode on rows r % every == 0, the plain race (T = 1) on the others
    };
    const Mode modes[] = {{"greedy", 0, 0, 1, 0, 1},           {"race", 1, 0, 1, 0, 1},
                          {"min_p", 1, 0, 1, 0.05f, 1},        {"top_k", 1, 50, 1, 0, 1},
                          {"top_p", 1, 0, 0.9f, 0, 1},         {"top_k_top_p", 1, 50, 0.9f, 0, 1},
                          {"top_p_one_in_8", 1, 0, 0.9f, 0, 8}};
    for (const Mode& m : modes) {
      std::vector<SamplingParams> ps;
      std::vector<DrawCounter> cs;
      for (int64_t r = 0; r < R; ++r) {
        SamplingParams p;
        if (r % m.every == 0) {
          p.temperature = m.T;
          p.top_k = m.top_k;
          p.top_p = m.top_p;
          p.min_p = m.min_p;
        }
        p.seed = uint64_t(r + 1);
        ps.push_back(p);
        cs.push_back({uint64_t(r), 300});
      }
      const Tensor rows = pack_sample_rows(ps, cs).to(dev);
      ops::sample_tokens(logits, rows, tokens, logprobs);
      const Tensor got = tokens.to(Device::CPU);
      const std::vector<SampledToken> want =
          sample_tokens(logits_h.rows(0, 8), std::span(ps).first(8), std::span(cs).first(8));
      int64_t mismatches = 0;
      for (int64_t r = 0; r < 8; ++r) mismatches += got.data<int32_t>()[r] != want[size_t(r)].token;
      device_mem::synchronize(dev);
      const auto t = Clock::now();
      for (int64_t i = 0; i < iters; ++i) ops::sample_tokens(logits, rows, tokens, logprobs);
      device_mem::synchronize(dev);
      const double us = 1e6 * secs(t) / double(iters);
      const double bytes = double(R) * double(V) * 4;
      nlohmann::json j{{"bench", "sample"},
                       {"mode", m.name},
                       {"rows", R},
                       {"vocab", V},
                       {"us_per_call", us},
                       {"logits_bytes", bytes},
                       {"one_read_us", copy_gbps > 0 ? 1e6 * bytes / (copy_gbps * 1e9) : 0.0},
                       {"copy_gbps", copy_gbps},
                       {"cpu_mismatches_of_8", mismatches}};
      std::printf("%s\n", j.dump().c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sample bench: %s\n", e.what());
    return 1;
  }
}
