// `moetrain _selftest comm` (comm_selftest.h): the checks and the timings; with --kill-rank R the other
// ranks ignore SIGTERM, so that the launcher's stop protocol cannot pre-empt the error they must raise
// themselves (the launcher's SIGKILL after its grace period still ends a rank that hangs).
#include "selftest/comm_selftest.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>

#include "comm/communicator.h"
#include "comm/dist_env.h"
#include "core/log.h"

namespace mt::comm {

namespace {

using Clock = std::chrono::steady_clock;

// f(r, i): distinct per rank and index, and exact in the dtype: 16-bit floats get small integers,
// whose sums over up to 8 ranks stay exact in bf16.
double value_of(DType dt, int r, int64_t i) {
  if (dt == DType::BF16 || dt == DType::F16) return double(r * 4 + i % 4);
  return double(r * 1000 + i % 1000);
}

struct Checker {
  int rank;
  int64_t checks = 0, failures = 0;
  // Compares every element (or, for large tensors, the given sample) of `dev` with want(i).
  void expect(const Tensor& dev, const std::function<double(int64_t)>& want, const std::string& what,
              const std::vector<int64_t>* sample = nullptr) {
    Tensor h = dev.to(Device::CPU);
    ++checks;
    int64_t bad = 0;
    auto one = [&](int64_t i) {
      double got = host_value_at(h, i), w = want(i);
      if (got != w) {
        if (bad < 3)
          std::fprintf(stderr, "rank %d: %s: element %lld is %g, expected %g\n", rank, what.c_str(), (long long)i, got,
                       w);
        ++bad;
      }
    };
    if (sample) {
      for (int64_t i : *sample) one(i);
    } else {
      for (int64_t i = 0; i < h.numel(); ++i) one(i);
    }
    if (bad) ++failures;
  }
};

Tensor on(Device d, const Tensor& host) {
  return d == Device::CPU ? host : host.to(d);
}

double reduced(DType dt, ReduceOp op, int n, int64_t i) {
  double s = 0, mx = -1e300, mn = 1e300;
  for (int r = 0; r < n; ++r) {
    double v = value_of(dt, r, i);
    s += v;
    mx = std::max(mx, v);
    mn = std::min(mn, v);
  }
  return op == ReduceOp::Sum ? s : op == ReduceOp::Max ? mx : mn;
}

void check_collectives(Communicator& c, Device dev, Checker& ck) {
  const int r = c.rank(), n = c.size();
  const DType dtypes[] = {DType::F32, DType::BF16, DType::I32, DType::I64};
  for (DType dt : dtypes) {
    for (int64_t count : {int64_t(0), int64_t(1), int64_t(1000), int64_t(65537)}) {
      Tensor in = on(dev, host_tensor_from(dt, count, [&](int64_t i) { return value_of(dt, r, i); }));
      Tensor out = Tensor::zeros({n * count}, dt, dev);
      c.all_gather(in, out)->wait();
      ck.expect(
          out, [&](int64_t j) { return value_of(dt, int(j / count), j % count); },
          str("all_gather ", dtype_name(dt), " x ", count));
    }
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) {
      for (int64_t count : {int64_t(0), int64_t(1001)}) {
        Tensor t = on(dev, host_tensor_from(dt, count, [&](int64_t i) { return value_of(dt, r, i); }));
        c.all_reduce(t, op)->wait();
        ck.expect(
            t, [&](int64_t i) { return reduced(dt, op, n, i); },
            str("all_reduce(", reduce_op_name(op), ") ", dtype_name(dt), " x ", count));
      }
      for (int64_t block : {int64_t(0), int64_t(1), int64_t(777)}) {
        Tensor in = on(dev, host_tensor_from(dt, n * block, [&](int64_t i) { return value_of(dt, r, i); }));
        Tensor out = Tensor::zeros({block}, dt, dev);
        c.reduce_scatter(in, out, op)->wait();
        ck.expect(
            out, [&](int64_t i) { return reduced(dt, op, n, r * block + i); },
            str("reduce_scatter(", reduce_op_name(op), ") ", dtype_name(dt), " block ", block));
      }
    }
    for (int root = 0; root < n; ++root) {
      Tensor t = on(dev, host_tensor_from(dt, 513, [&](int64_t i) { return value_of(dt, r, i); }));
      c.broadcast(t, root)->wait();
      ck.expect(
          t, [&](int64_t i) { return value_of(dt, root, i); }, str("broadcast ", dtype_name(dt), " root ", root));
    }
    // all_to_all_v: rank s sends 100 * ((s + 2d) % 3) elements to rank d (zero counts included);
    // element k of that block is f(s, k).
    auto cnt = [](int s, int d) { return int64_t(100 * ((s + 2 * d) % 3)); };
    std::vector<int64_t> send, recv;
    std::vector<double> want;
    int64_t total_in = 0;
    for (int d = 0; d < n; ++d) {
      send.push_back(cnt(r, d));
      total_in += cnt(r, d);
    }
    for (int s = 0; s < n; ++s) {
      recv.push_back(cnt(s, r));
      for (int64_t k = 0; k < cnt(s, r); ++k) want.push_back(value_of(dt, s, k));
    }
    std::vector<double> in_vals;
    for (int d = 0; d < n; ++d)
      for (int64_t k = 0; k < cnt(r, d); ++k) in_vals.push_back(value_of(dt, r, k));
    Tensor in = on(dev, host_tensor_from(dt, total_in, [&](int64_t i) { return in_vals[size_t(i)]; }));
    Tensor out = Tensor::zeros({int64_t(want.size())}, dt, dev);
    c.all_to_all_v(in, send, out, recv)->wait();
    ck.expect(
        out, [&](int64_t i) { return want[size_t(i)]; }, str("all_to_all_v ", dtype_name(dt)));
  }
  if (n > 1) {
    // Sends complete only when the peer receives, so even ranks send first, odd ranks receive first.
    int next = (r + 1) % n, prev = (r + n - 1) % n;
    Tensor mine = on(dev, host_tensor_from(DType::F32, 4099, [&](int64_t i) { return value_of(DType::F32, r, i); }));
    Tensor got = Tensor::zeros({4099}, DType::F32, dev);
    if (r % 2 == 0) {
      c.send(mine, next);
      c.recv(got, prev);
    } else {
      c.recv(got, prev);
      c.send(mine, next);
    }
    ck.expect(
        got, [&](int64_t i) { return value_of(DType::F32, prev, i); }, "send/recv ring");
  }
  c.barrier();
  // Two groups by parity, ordered by descending world rank.
  auto g = c.split(r % 2, -r, "parity");
  std::vector<int> members;
  for (int q = n - 1; q >= 0; --q)
    if (q % 2 == r % 2) members.push_back(q);
  Tensor in = on(dev, host_tensor_from(DType::F32, 3, [&](int64_t i) { return value_of(DType::F32, r, i); }));
  Tensor out = Tensor::zeros({g->size() * 3}, DType::F32, dev);
  g->all_gather(in, out)->wait();
  ck.expect(
      out, [&](int64_t j) { return value_of(DType::F32, members[size_t(j / 3)], j % 3); }, "split all_gather");
  ++ck.checks;
  if (int(members.size()) != g->size() || members[size_t(g->rank())] != r) {
    std::fprintf(stderr, "rank %d: split gave rank %d of %d, expected %zu members\n", r, g->rank(), g->size(),
                 members.size());
    ++ck.failures;
  }
  g->check_schedule();
  c.check_schedule();
}

// Times `op` (already validated) over `iters` runs; returns milliseconds per run.
double time_ms(Device dev, int iters, const std::function<void()>& op) {
  for (int i = 0; i < 2; ++i) op();
  device_mem::synchronize(dev);
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) op();
  device_mem::synchronize(dev);
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / iters;
}

void bench(Communicator& c, Device dev, int64_t mib, int iters, Checker& ck) {
  const int r = c.rank(), n = c.size();
  auto sample = [&](int64_t numel) {
    std::vector<int64_t> s;
    for (int64_t i = 0; i < 4096; ++i) s.push_back((i * 2654435761ll) % numel);
    for (int q = 0; q <= n; ++q)
      for (int64_t d : {int64_t(-1), int64_t(0)}) {
        int64_t i = q * (numel / n) + d;
        if (i >= 0 && i < numel) s.push_back(i);
      }
    return s;
  };
  auto report = [&](const char* op, DType dt, int64_t bytes, double ms, double bus_factor) {
    double algbw = double(bytes) / (ms * 1e-3) / 1e9;
    if (r == 0)
      std::printf(
          "{\"bench\": \"comm_check\", \"op\": \"%s\", \"backend\": \"%s\", \"device\": \"%s\", \"world\": %d, "
          "\"dtype\": \"%s\", \"bytes\": %lld, \"iters\": %d, \"ms\": %.3f, \"algbw_GBps\": %.2f, \"busbw_GBps\": "
          "%.2f}\n",
          op, c.backend(), device_name(dev), n, dtype_name(dt), (long long)bytes, iters, ms, algbw, algbw * bus_factor);
    std::fflush(stdout);
  };
  const int64_t bytes = (mib << 20) / (8 * n) * (8 * n);  // divisible into n blocks of 8-byte elements
  {
    // all_gather, bf16 (FSDP's parameter gather): `bytes` of output.
    DType dt = DType::BF16;
    int64_t total = bytes / 2, block = total / n;
    Tensor in = on(dev, host_tensor_from(dt, block, [&](int64_t i) { return value_of(dt, r, i); }));
    Tensor out = Tensor::zeros({total}, dt, dev);
    c.all_gather(in, out)->wait();
    auto s = sample(total);
    ck.expect(
        out, [&](int64_t j) { return value_of(dt, int(j / block), j % block); }, "bench all_gather", &s);
    double ms = time_ms(dev, iters, [&] { c.all_gather(in, out)->wait(); });
    report("all_gather", dt, bytes, ms, double(n - 1) / n);
  }
  {
    // reduce_scatter, f32 (FSDP's gradient reduction): `bytes` of input.
    DType dt = DType::F32;
    int64_t total = bytes / 4, block = total / n;
    Tensor in = on(dev, host_tensor_from(dt, total, [&](int64_t i) { return double(r + i % 7); }));
    Tensor out = Tensor::zeros({block}, dt, dev);
    c.reduce_scatter(in, out)->wait();
    std::vector<int64_t> s;
    for (int64_t i : sample(total))
      if (i < block) s.push_back(i);
    ck.expect(
        out, [&](int64_t j) { return double(n * (n - 1) / 2 + n * ((r * block + j) % 7)); }, "bench reduce_scatter",
        &s);
    double ms = time_ms(dev, iters, [&] { c.reduce_scatter(in, out)->wait(); });
    report("reduce_scatter", dt, bytes, ms, double(n - 1) / n);
  }
  {
    DType dt = DType::F32;
    Tensor t = Tensor::zeros({bytes / 4}, dt, dev);
    double ms = time_ms(dev, iters, [&] { c.all_reduce(t)->wait(); });
    report("all_reduce", dt, bytes, ms, 2.0 * (n - 1) / n);
  }
  {
    // all_to_all_v, bf16 (the expert-parallel dispatch and combine): `bytes` of input, equal blocks.
    DType dt = DType::BF16;
    int64_t total = bytes / 2, block = total / n;
    Tensor in = on(dev, host_tensor_from(dt, total, [&](int64_t i) { return value_of(dt, r, i); }));
    Tensor out = Tensor::zeros({total}, dt, dev);
    const std::vector<int64_t> counts(size_t(n), block);
    c.all_to_all_v(in, counts, out, counts)->wait();
    auto s = sample(total);
    // Block q of the output is block r of rank q's input: rank q's values at r * block + j.
    ck.expect(
        out, [&](int64_t j) { return value_of(dt, int(j / block), r * block + j % block); }, "bench all_to_all_v", &s);
    double ms = time_ms(dev, iters, [&] { c.all_to_all_v(in, counts, out, counts)->wait(); });
    report("all_to_all_v", dt, bytes, ms, double(n - 1) / n);
  }
}

}  // namespace

int run_comm_selftest(const CommSelftestOptions& o) {
  const Device dev = o.device;
  const int bench_mib = o.bench_mib >= 0 ? o.bench_mib : dev == Device::CUDA ? 256 : 16;
  DistEnv env = detect_dist_env();
  set_log_rank(env.rank);
  if (dev == Device::CUDA && device_mem::cuda_device_count() < o.skip_without_gpus) {
    std::printf("rank %d: skipped: no GPU (%d visible, %d needed)\n", env.rank, device_mem::cuda_device_count(),
                o.skip_without_gpus);
    return 0;
  }
  const int r = env.rank, w = env.world_size;
  if (o.kill_rank >= 0 && r != o.kill_rank) std::signal(SIGTERM, SIG_IGN);
  if (dev == Device::CUDA) device_mem::set_cuda_device(env.local_rank);
  CommOptions opt;
  opt.timeout = Millis(o.timeout_ms);
  std::unique_ptr<Store> store =
      w == 1 ? make_memory_store() : make_tcp_store(env.master_addr, env.master_port, r == 0, opt.timeout);
  auto world = make_world(dev, r, w, *store, opt, env.local_rank);
  Watchdog watchdog(*store, r, opt.timeout);
  watchdog.watch(world.get());
  Checker ck{r};
  check_collectives(*world, dev, ck);
  std::printf("rank %d of %d: %s collectives: %lld checks, %lld failed\n", r, w, world->backend(), (long long)ck.checks,
              (long long)ck.failures);
  std::fflush(stdout);
  if (o.kill_rank >= 0) {
    Tensor t = Tensor::zeros({1 << 20}, DType::F32, dev);
    for (int i = 0; i < 20; ++i) {
      if (i == 5 && r == o.kill_rank) {
        std::printf("rank %d: killing myself (SIGKILL) before all_reduce %d\n", r, i);
        std::fflush(stdout);
        ::kill(::getpid(), SIGKILL);
      }
      world->all_reduce(t)->wait();
      device_mem::synchronize(dev);
    }
    MT_THROW("rank ", r, ": 20 all_reduces completed although rank ", o.kill_rank, " was killed");
  }
  if (bench_mib > 0 && w > 1) bench(*world, dev, bench_mib, o.iters, ck);
  world->barrier();
  watchdog.unwatch(world.get());
  if (ck.failures) {
    std::fprintf(stderr, "rank %d: %lld of %lld checks failed\n", r, (long long)ck.failures, (long long)ck.checks);
    return 1;
  }
  std::printf("rank %d of %d ok\n", r, w);
  std::fflush(stdout);
  return 0;
}

}  // namespace mt::comm
