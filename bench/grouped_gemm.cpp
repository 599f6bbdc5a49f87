// Benchmark: the MoE experts' forward on the CUDA grouped GEMM at decode sizes (few rows per expert), per
// tile configuration (grouped_gemm.cuh's RowsTile: large 128x256 cooperative, m64n256 / m64n128 pingpong).
// One bench-4L layer by default: E 128 experts, D 2048, F 768; R = rows_per_expert * E rows, either
// exactly that many per expert ("uniform") or from random top-8 routing of R / 8 tokens ("topk": uneven,
// as at decode). Per (rows per expert, routing) and tile:
//   - "gemms": the two grouped GEMMs alone (gate_up: gu = xp @ w_gate_up[e]^T, down: yp = h @ w_down[e]^T)
//     with the tile passed explicitly;
//   - "experts_fwd": ops::experts_fwd (gate_up, SwiGLU, down) with MOETRAIN_GROUPED_SMALL set to the
//     tile's value (0, 64x256, 64x128, or auto: what the engine runs).
// Each tile's yp is first checked against the large tile's (relative L2; bf16 outputs of the same
// products, expected 0 or ~1e-3 at most). Then timed: wall clock around --iters back-to-back calls, the
// device synchronised before and after, after 3 warm-up calls. Prints one JSON line per measurement:
// microseconds per call, the expert weights read (experts with rows: 3 F D bf16 each) per second, and
// that rate as a fraction of the device's copy bandwidth measured in this process (read + write bytes
// per second of a 1 GiB copy).
//
// usage: grouped_gemm_bench [--rows 16,32,64] [--experts 128] [--dim 2048] [--ffn 768] [--iters 50]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/rng.h"
#include "ops/ops.h"

#ifdef MT_HAVE_CUDA
#include "backend/cuda/grouped_gemm.cuh"
#endif

using namespace mt;
using namespace mt::bench;

#ifdef MT_HAVE_CUDA
namespace {

// Fills a device bf16 tensor with repeats of a random block (the values do not matter for the timing;
// filling 1.2 GB on the host would).
void fill_random(Tensor& t, const Tensor& block) {
  Tensor flat = t.view({t.numel()});
  const Tensor src = block.view({block.numel()});
  for (int64_t at = 0; at < flat.numel(); at += src.numel()) {
    const int64_t n = std::min(src.numel(), flat.numel() - at);
    flat.rows(at, n).copy_from(src.rows(0, n));
  }
}

// Offsets of E experts: m rows each (uniform) or the counts of random top-k routing of m * E / k tokens.
Tensor make_offsets(int64_t E, int64_t m, bool topk, int64_t k, Rng& rng) {
  std::vector<int64_t> counts(size_t(E), topk ? 0 : m);
  if (topk) {
    const int64_t T = m * E / k;
    std::vector<int64_t> pick;
    for (int64_t t = 0; t < T; ++t) {
      pick.clear();
      while (int64_t(pick.size()) < k) {
        const int64_t e = rng.randint(0, E);
        if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
      }
      for (int64_t e : pick) ++counts[size_t(e)];
    }
  }
  Tensor off = Tensor::empty({E + 1}, DType::I64);
  off.data<int64_t>()[0] = 0;
  for (int64_t e = 0; e < E; ++e) off.data<int64_t>()[e + 1] = off.data<int64_t>()[e] + counts[size_t(e)];
  return off;
}

double rel_l2_host(const Tensor& a_dev, const Tensor& b_dev) {
  const Tensor a = a_dev.to(Device::CPU).to(DType::F32), b = b_dev.to(Device::CPU).to(DType::F32);
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double p = a.data<float>()[i], q = b.data<float>()[i];
    num += (p - q) * (p - q);
    den += q * q;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

}  // namespace
#endif

int main(int argc, char** argv) {
#ifndef MT_HAVE_CUDA
  (void)argc;
  (void)argv;
  std::fprintf(stderr, "grouped_gemm_bench needs a CUDA build\n");
  return 1;
#else
  std::vector<int64_t> rows_list{16, 32, 64};
  int64_t E = 128, D = 2048, F = 768, iters = 50;
  const int64_t topk = 8;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", a.c_str());
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--rows")
      rows_list = parse_list(v);
    else if (a == "--experts")
      E = std::stoll(v);
    else if (a == "--dim")
      D = std::stoll(v);
    else if (a == "--ffn")
      F = std::stoll(v);
    else if (a == "--iters")
      iters = std::stoll(v);
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  for (int64_t m : rows_list)
    if (m < 1 || (m * E) % topk != 0) {
      std::fprintf(stderr, "--rows (%lld) must be >= 1 with rows * experts (%lld) a multiple of %lld\n", (long long)m,
                   (long long)E, (long long)topk);
      return 2;
    }
  if (E < topk || D % 8 != 0 || F % 8 != 0 || D < 8 || F < 8 || iters < 1) {
    std::fprintf(stderr,
                 "--experts (%lld) must be >= %lld, --dim (%lld) and --ffn (%lld) positive multiples of 8, --iters "
                 "(%lld) >= 1\n",
                 (long long)E, (long long)topk, (long long)D, (long long)F, (long long)iters);
    return 2;
  }
  try {
    if (!device_mem::cuda_available()) MT_THROW("grouped_gemm_bench needs a GPU; none is visible");
    if (!cuda::grouped_gemm_available()) MT_THROW("grouped_gemm_bench needs the CUTLASS grouped GEMM (sm_90)");
    const Device dev = Device::CUDA;
    const double copy_gbps = measure_copy_gbps(dev);
    Rng rng(1);
    Tensor block_h = Tensor::empty({int64_t(1) << 22});
    rng.fill_normal(block_h, 0.0f, 0.02f);
    const Tensor block = block_h.to(DType::BF16).to(dev);
    Tensor wgu = Tensor::empty({E, 2 * F, D}, DType::BF16, dev), wd = Tensor::empty({E, D, F}, DType::BF16, dev);
    fill_random(wgu, block);
    fill_random(wd, block);
    const auto* wgu_p = static_cast<const __nv_bfloat16*>(wgu.raw());
    const auto* wd_p = static_cast<const __nv_bfloat16*>(wd.raw());
    struct Config {
      cuda::RowsTile tile;
      const char* env;  // MOETRAIN_GROUPED_SMALL for the experts_fwd timing
    };
    const Config configs[] = {{cuda::RowsTile::large, "0"},
                              {cuda::RowsTile::m64n256, "64x256"},
                              {cuda::RowsTile::m64n128, "64x128"},
                              {cuda::RowsTile::automatic, "auto"}};
    for (int64_t m : rows_list)
      for (const bool routed : {false, true}) {
        const int64_t R = m * E;
        const Tensor off_h = make_offsets(E, m, routed, topk, rng);
        int64_t experts_with_rows = 0, max_rows = 0;
        for (int64_t e = 0; e < E; ++e) {
          const int64_t n = off_h.data<int64_t>()[e + 1] - off_h.data<int64_t>()[e];
          experts_with_rows += n > 0;
          max_rows = std::max(max_rows, n);
        }
        const double weight_bytes = double(experts_with_rows) * 3.0 * double(F) * double(D) * 2.0;
        const Tensor off = off_h.to(dev);
        const int64_t* off_p = off.data<int64_t>();
        Tensor xp = Tensor::empty({R, D}, DType::BF16, dev), gu = Tensor::empty({R, 2 * F}, DType::BF16, dev),
               h = Tensor::empty({R, F}, DType::BF16, dev), yp = Tensor::empty({R, D}, DType::BF16, dev);
        fill_random(xp, block);
        fill_random(h, block);
        auto gemms = [&](cuda::RowsTile tile) {
          cuda::grouped_gemm_rows("bench gate_up", E, off_p, R, 2 * F, D, static_cast<const __nv_bfloat16*>(xp.raw()),
                                  wgu_p, true, static_cast<__nv_bfloat16*>(gu.raw()), tile);
          cuda::grouped_gemm_rows("bench down", E, off_p, R, D, F, static_cast<const __nv_bfloat16*>(h.raw()), wd_p,
                                  true, static_cast<__nv_bfloat16*>(yp.raw()), tile);
        };
        auto experts = [&] { ops::experts_fwd(xp, off, wgu, wd, gu, h, yp); };
        auto time_us = [&](const std::function<void()>& fn) {
          for (int i = 0; i < 3; ++i) fn();
          device_mem::synchronize(dev);
          const auto t = Clock::now();
          for (int64_t i = 0; i < iters; ++i) fn();
          device_mem::synchronize(dev);
          return 1e6 * secs(t) / double(iters);
        };
        Tensor yp_large;
        for (const Config& c : configs) {
          setenv("MOETRAIN_GROUPED_SMALL", c.env, 1);
          const cuda::RowsTile ran = cuda::grouped_rows_tile(E, R, true, c.tile);
          experts();  // the check: the whole forward, yp against the large tile's
          device_mem::synchronize(dev);
          double vs_large = 0;
          if (c.tile == cuda::RowsTile::large)
            yp_large = yp.clone();
          else
            vs_large = rel_l2_host(yp, yp_large);
          for (const char* what : {"gemms", "experts_fwd"}) {
            const bool only_gemms = std::string(what) == "gemms";
            const double us = only_gemms ? time_us([&] { gemms(c.tile); }) : time_us(experts);
            const double gbps = weight_bytes / (us * 1e-6) / 1e9;
            nlohmann::json j{{"bench", "grouped_gemm"},
                             {"what", what},
                             {"tile", cuda::rows_tile_name(ran)},
                             {"MOETRAIN_GROUPED_SMALL", c.env},
                             {"rows_per_expert", m},
                             {"routing", routed ? "topk8" : "uniform"},
                             {"max_rows_of_an_expert", max_rows},
                             {"experts", E},
                             {"dim", D},
                             {"ffn", F},
                             {"rows", R},
                             {"us_per_call", us},
                             {"weight_bytes", weight_bytes},
                             {"weight_gbps", gbps},
                             {"copy_gbps", copy_gbps},
                             {"of_copy_rate", copy_gbps > 0 ? gbps / copy_gbps : 0.0},
                             {"yp_rel_l2_vs_large", vs_large},
                             {"iters", iters}};
            std::printf("%s\n", j.dump().c_str());
            std::fflush(stdout);
          }
        }
        unsetenv("MOETRAIN_GROUPED_SMALL");
      }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "grouped_gemm bench: %s\n", e.what());
    return 1;
  }
#endif
}
