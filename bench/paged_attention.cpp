// Benchmark: the CUDA paged decode attention (ops::paged_attention_fwd, backend/cuda/paged_attention.cu),
// each kernel the launcher can pick timed at the rollout engine's decode shape: bench-4L's heads (32
// query, 4 KV, head dim 128), 256 sequences decoding one token each, every sequence at the same context,
// the cache in shuffled blocks of 16 positions behind a block table as wide as the longest context (the
// engine fixes the width per generate call). The kernels are first checked against the CPU reference on
// the same inputs (relative L2 error in the line), then timed with CUDA events over back-to-back calls
// that rotate through `--layers` copies of the cache (as a decode step's layers do, so the cache is not
// served from L2). Prints one JSON line per (kernel, context): microseconds per call, the K/V bytes one
// call must read, their rate, and that rate over the device's copy bandwidth measured in this process
// (bytes read + written per second); then one line per kernel with the mean over the contexts times the
// layers (what a decode step at the mean context spends in attention).
//
// usage: paged_attention_bench [--sequences 256] [--contexts 128,384,640] [--heads 32] [--kv-heads 4]
//                              [--head-dim 128] [--block-size 16] [--width 640] [--layers 4] [--iters 50]
//                              [--kernels split,mma] [--no-check]
// --width: the block table's width in positions (default: the longest context); --kernels: names of
// MOETRAIN_PAGED_ATTENTION (serial, split, mma, auto). MOETRAIN_PAGED_SPLITS=S forces S splits of the
// positions (printed as splits_env), to see what splitting does to the last wave of blocks.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "bench_util.h"
#include "core/cli_args.h"
#include "core/rng.h"
#include "ops/ops.h"

#ifdef MT_HAVE_CUDA
#include "backend/cuda/common.cuh"
#endif

using namespace mt;
using namespace mt::bench;

namespace {

[[maybe_unused]] std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) out.push_back(x);
  return out;
}

[[maybe_unused]] double rel_l2(const Tensor& a, const Tensor& b) {  // a, b CPU f32; NaN or Inf anywhere: +inf
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double p = a.data<float>()[i], q = b.data<float>()[i];
    if (!std::isfinite(p) || !std::isfinite(q)) return INFINITY;
    num += (p - q) * (p - q);
    den += q * q;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t sequences = 256, H = 32, G = 4, Hd = 128, bs = 16, width = 0, layers = 4, iters = 50;
  std::vector<int64_t> contexts{128, 384, 640};
  std::vector<std::string> kernels{"split", "mma"};
  bool check = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    try {
      if (a == "--sequences")
        sequences = parse_flag_number<int64_t>(a, next());
      else if (a == "--heads")
        H = parse_flag_number<int64_t>(a, next());
      else if (a == "--kv-heads")
        G = parse_flag_number<int64_t>(a, next());
      else if (a == "--head-dim")
        Hd = parse_flag_number<int64_t>(a, next());
      else if (a == "--block-size")
        bs = parse_flag_number<int64_t>(a, next());
      else if (a == "--width")
        width = parse_flag_number<int64_t>(a, next());
      else if (a == "--layers")
        layers = parse_flag_number<int64_t>(a, next());
      else if (a == "--iters")
        iters = parse_flag_number<int64_t>(a, next());
      else if (a == "--kernels")
        kernels = split_list(next());
      else if (a == "--no-check")
        check = false;
      else if (a == "--contexts") {
        contexts.clear();
        for (const std::string& c : split_list(next())) contexts.push_back(parse_flag_number<int64_t>(a, c));
      } else {
        std::fprintf(stderr, "unknown argument %s\n", a.c_str());
        return 2;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "paged_attention bench: %s\n", e.what());
      return 2;
    }
  }
#ifndef MT_HAVE_CUDA
  (void)sequences, (void)H, (void)G, (void)Hd, (void)bs, (void)width, (void)layers, (void)iters, (void)check;
  std::printf("%s\n", nlohmann::json{{"bench", "paged_attention"}, {"skipped", "built without CUDA"}}.dump().c_str());
  return 0;
#else
  try {
    if (!device_mem::cuda_available()) MT_THROW("no GPU visible: this benchmark times CUDA kernels");
    if (sequences < 1 || layers < 1 || iters < 1 || bs < 1 || H < 1 || G < 1 || H % G != 0 || contexts.empty())
      MT_THROW("sequences (", sequences, "), layers (", layers, "), iters (", iters, "), block size (", bs,
               ") must be >= 1, heads (", H, ") a multiple of kv heads (", G, "), and --contexts non-empty");
    const int64_t max_ctx = *std::max_element(contexts.begin(), contexts.end());
    if (*std::min_element(contexts.begin(), contexts.end()) < 1) MT_THROW("every context must be >= 1");
    if (width == 0) width = max_ctx;
    if (width < max_ctx) MT_THROW("--width (", width, ") must be at least the longest context (", max_ctx, ")");
    const int64_t M = (width + bs - 1) / bs, blocks = sequences * M, slots = blocks * bs;
    cudaDeviceProp prop{};
    MT_CUDA_CHECK("paged_attention bench", cudaGetDeviceProperties(&prop, 0));
    const double copy_gbps = measure_copy_gbps(Device::CUDA);

    // One layer's cache on the host (bf16-exact values for the CPU reference), copied to every layer.
    Rng rng(11);
    Tensor kc_h = Tensor::empty({slots, G, Hd}), vc_h = Tensor::empty({slots, G, Hd});
    rng.fill_normal(kc_h, 0, 1);
    rng.fill_normal(vc_h, 0, 1);
    kc_h = kc_h.to(DType::BF16).to(DType::F32);
    vc_h = vc_h.to(DType::BF16).to(DType::F32);
    std::vector<Tensor> kc, vc;
    kc.push_back(kc_h.to(DType::BF16).to(Device::CUDA));
    vc.push_back(vc_h.to(DType::BF16).to(Device::CUDA));
    for (int64_t l = 1; l < layers; ++l) {
      kc.push_back(kc[0].clone());
      vc.push_back(vc[0].clone());
    }
    // Block tables: each sequence's M blocks drawn from a shuffled pool.
    std::vector<int32_t> ids(static_cast<size_t>(blocks));
    std::iota(ids.begin(), ids.end(), 0);
    for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[size_t(rng.randint(0, int64_t(i)))]);
    Tensor table_h = Tensor::empty({sequences, M}, DType::I32), seq_h = Tensor::empty({sequences}, DType::I32);
    std::copy(ids.begin(), ids.end(), table_h.data<int32_t>());
    for (int64_t n = 0; n < sequences; ++n) seq_h.data<int32_t>()[n] = int32_t(n);
    Tensor q_h = Tensor::empty({sequences, H, Hd});
    rng.fill_normal(q_h, 0, 1);
    q_h = q_h.to(DType::BF16).to(DType::F32);
    const Tensor table = table_h.to(Device::CUDA), seq = seq_h.to(Device::CUDA),
                 q = q_h.to(DType::BF16).to(Device::CUDA);
    Tensor out = Tensor::empty({sequences, H, Hd}, DType::BF16, Device::CUDA);

    cudaEvent_t ev0, ev1;
    MT_CUDA_CHECK("paged_attention bench", cudaEventCreate(&ev0));
    MT_CUDA_CHECK("paged_attention bench", cudaEventCreate(&ev1));
    std::map<std::string, double> step_us;  // kernel -> sum over contexts of us per call
    for (const int64_t ctx : contexts) {
      Tensor pos_h = Tensor::empty({sequences}, DType::I32);
      for (int64_t n = 0; n < sequences; ++n) pos_h.data<int32_t>()[n] = int32_t(ctx - 1);
      const Tensor pos = pos_h.to(Device::CUDA);
      Tensor want;
      if (check) {
        want = Tensor::empty({sequences, H, Hd});
        cpu::paged_attention_fwd(q_h, kc_h, vc_h, table_h, bs, seq_h, pos_h, want);
      }
      const double kv_bytes = double(sequences) * double(ctx) * double(G) * double(Hd) * 2.0 * 2.0;
      for (const std::string& kernel : kernels) {
        setenv("MOETRAIN_PAGED_ATTENTION", kernel.c_str(), 1);
        double err = -1;
        if (check) {
          ops::paged_attention_fwd(q, kc[0], vc[0], table, bs, seq, pos, out);
          err = rel_l2(out.to(Device::CPU).to(DType::F32), want);
          if (!(err < 1e-2))
            MT_THROW("kernel ", kernel, " at context ", ctx, ": relative L2 error ", err,
                     " against the CPU reference (allowed < 1e-2); not timing it");
        }
        for (int64_t l = 0; l < layers; ++l)
          ops::paged_attention_fwd(q, kc[size_t(l)], vc[size_t(l)], table, bs, seq, pos, out);
        device_mem::synchronize(Device::CUDA);
        MT_CUDA_CHECK("paged_attention bench", cudaEventRecord(ev0, cuda::stream()));
        for (int64_t i = 0; i < iters; ++i)
          for (int64_t l = 0; l < layers; ++l)
            ops::paged_attention_fwd(q, kc[size_t(l)], vc[size_t(l)], table, bs, seq, pos, out);
        MT_CUDA_CHECK("paged_attention bench", cudaEventRecord(ev1, cuda::stream()));
        MT_CUDA_CHECK("paged_attention bench", cudaEventSynchronize(ev1));
        float ms = 0;
        MT_CUDA_CHECK("paged_attention bench", cudaEventElapsedTime(&ms, ev0, ev1));
        const double us = 1e3 * double(ms) / double(iters * layers), gbps = kv_bytes / (us * 1e-6) / 1e9;
        step_us[kernel] += us;
        nlohmann::json j{
            {"bench", "paged_attention"},
            {"gpu", prop.name},
            {"kernel", kernel},
            {"sequences", sequences},
            {"context", ctx},
            {"heads", H},
            {"kv_heads", G},
            {"head_dim", Hd},
            {"block_size", bs},
            {"table_width_blocks", M},
            {"layers_rotated", layers},
            {"splits_env", std::getenv("MOETRAIN_PAGED_SPLITS") ? std::getenv("MOETRAIN_PAGED_SPLITS") : ""},
            {"calls", iters * layers},
            {"us_per_call", us},
            {"kv_mbytes_per_call", kv_bytes / 1e6},
            {"gb_per_s", gbps},
            {"copy_gbps", copy_gbps},
            {"fraction_of_copy", gbps / copy_gbps},
            {"rel_l2_vs_cpu", err}};
        std::printf("%s\n", j.dump().c_str());
        std::fflush(stdout);
      }
    }
    unsetenv("MOETRAIN_PAGED_ATTENTION");
    double mean_ctx = 0;
    for (int64_t c : contexts) mean_ctx += double(c) / double(contexts.size());
    for (const std::string& kernel : kernels) {
      const double us = step_us[kernel] / double(contexts.size());
      const double floor_us =
          double(sequences) * mean_ctx * double(G) * double(Hd) * 4.0 / (copy_gbps * 1e9) * 1e6;  // K + V, bf16
      nlohmann::json j{{"bench", "paged_attention_step"},
                       {"gpu", prop.name},
                       {"kernel", kernel},
                       {"mean_context", mean_ctx},
                       {"layers", layers},
                       {"ms_per_step_all_layers", 1e-3 * us * double(layers)},
                       {"floor_ms_per_step_all_layers", 1e-3 * floor_us * double(layers)},
                       {"fraction_of_floor", floor_us / us}};
      std::printf("%s\n", j.dump().c_str());
    }
    cudaEventDestroy(ev0);
    cudaEventDestroy(ev1);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "paged_attention bench: %s\n", e.what());
    return 1;
  }
#endif
}
