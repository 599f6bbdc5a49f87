// Benchmark: one training step (forward, backward, AdamW) of any model config on one device, with
// random weights and random tokens. Prints one JSON line per run: tokens/s, model TFLOP/s, MFU against
// a bf16 GEMM rate measured in the same process, peak memory, and the time split by op category
// (from a separate profiled step, so the timed steps run undisturbed). Before timing it checks that
// the step is numerically sane (finite loss near log(V) at init, finite gradient norm).
//
// usage: train_step [--model bench-4L] [--batch 1] [--seq 4096] [--steps 5] [--warmup 2]
//                   [--recompute none|full|selective|moe] [--device cuda|cpu] [--no-profile] [--zero-grads]
//                   [--grad-accum N] [--lora-rank R [--lora-targets LIST]]
// --lora-rank R: LoRA adapters on the frozen base (docs/lora.md): model_tflops then counts 4 N per token (no
// weight gradients of the base), adamw the adapters only.
// --grad-accum N: N micro-batches of --batch rows per optimizer step, accumulated as the trainer does
// (TrainSession::train_step over N micro-batches: the first writes the gradients, the rest add, one
// AdamW step); tokens/s counts whole optimizer steps, "fwd_bwd_mfu" the forward + backward time alone
// and "optimizer_share" the rest of the step.
// Under `moetrain launch` (or any launcher setting WORLD_SIZE > 1) the model is FSDP-sharded over
// the ranks (--dp-shard, --dp-replicate, --ep, --sp as in training); --batch is the batch per
// data-parallel rank (with --sp N, N GPUs share those rows, each a chunk of every sequence); every rank
// draws the same global batch and trains on its rows, and rank 0 prints the line with the global
// and per-GPU tokens/s and the loss of every step (to compare layouts on the same global batch).
// --zero-grads: zero the gradients and accumulate (+=) instead of writing them (=), as before the
// first_micro_batch contract (an A/B of that change in one build). --prefetch-depth N (default 1):
// how many units ahead the model announces its weights, i.e. how early FSDP starts each all-gather.
// --no-reshard-after-forward: FSDP keeps each unit's gathered weights from its forward to its
// backward (no all-gather in the backward; more memory). --optimizer-overlap: on one GPU, run each
// unit's AdamW update beside the next forward (config optimizer_overlap 1; the forward time then
// includes the wait for the updates it reaches; slower today, bench/NOTES.md). --layers N: the
// preset with N layers (a half-size qwen3-30b-a3b rehearsal on fewer GPUs: --model qwen3-30b-a3b
// --layers 24). --no-ep-overlap: under expert parallelism, send the experts' input gradient back after
// their weight gradients instead of beside them (the A/B of that overlap). In the per-op split,
// ep_prepare (the expert-parallel plan, with its host syncs and counts exchange) includes
// make_dispatch_plan, which is also listed on its own; with the EP overlap, experts_bwd includes the
// start of the returning all-to-all (its regroup and, since a profiled op waits for the device, its
// transfer). --deterministic (or MOETRAIN_DETERMINISTIC=1): the deterministic kernels of
// `train --deterministic` (core/determinism.h); the JSON line says which ran. Its cost on bench-4L:
// train_step --model bench-4L with and without it on the same machine (docs/cuda.md).
// MOETRAIN_FUSE_NORM_ADD=0|1 and MOETRAIN_FUSE_GEMM_ADD=0|1 (default 1): the residual-stream fusions
// (ModelOptions::fuse_norm_add, fuse_gemm_add), for their A/B; the JSON line says which ran.
// MOETRAIN_WGRAD_STREAM=0|1 (default 0): the experts' weight-gradient GEMMs on the side stream beside
// the rest of their layer's backward (ModelOptions::wgrad_stream); MOETRAIN_WGRAD_SMS=N: those GEMMs'
// CTAs (default: all SMs on the compute stream, half on the side stream); MOETRAIN_WGRAD_PRIORITY=
// high|low (default high): the urgent side stream or the optimizer's. The JSON line says all three.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "bench_util.h"
#include "core/determinism.h"
#include "core/device_select.h"
#include "core/log.h"
#include "core/rng.h"
#include "model/qwen3_moe.h"
#include "ops/ops.h"
#include "ops/profile.h"
#include "parallel/dist.h"
#include "parallel/fsdp.h"
#include "parallel/parallel_model.h"
#include "train/optimizer.h"
#include "train/session.h"
#include "train/trainer.h"

using namespace mt;
using namespace mt::bench;

static std::string category(const std::string& op) {
  if (op.rfind("attention", 0) == 0) return "attention";
  if (op.rfind("experts", 0) == 0) return "experts";
  if (op.rfind("linear", 0) == 0 || op == "lm_head_cross_entropy") return "other_gemms";
  if (op.rfind("comm", 0) == 0) return "communication";
  if (op == "adamw_step" || op == "sum_squares") return "optimizer";
  return "other";
}

int main(int argc, char** argv) {
  std::string model = "bench-4L", rc = "none", device = "cuda";
  int64_t batch = 1, seq = 4096, steps = 5, warmup = 2, grad_accum = 1;
  bool profile = true, zero_grads = false;
  int dp_shard = 0, dp_replicate = 1, ep = 1, tp = 1, etp = 1, sp = 1;
  int64_t prefetch_depth = 1;
  bool reshard = true;     // FSDP: free gathered weights after each unit's forward (false: keep them for the backward)
  bool ep_overlap = true;  // expert parallelism: dxp returns beside the weight gradients (--no-ep-overlap: after)
  bool opt_overlap = false;  // one device on CUDA: AdamW per unit beside the next forward (--optimizer-overlap)
  int64_t layers = 0;        // > 0: the preset cut (or grown) to this many layers, e.g. half of qwen3-30b-a3b
  std::string reduce_dtype = "f32";
  int64_t lora_rank = 0;  // > 0: LoRA adapters of this rank on the frozen base (--lora-targets, default attn,mlp,experts)
  std::string lora_targets = kDefaultLoraTargets;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) MT_THROW(a, " needs a value");
      return argv[++i];
    };
    if (a == "--model")
      model = next();
    else if (a == "--batch")
      batch = std::stoll(next());
    else if (a == "--seq")
      seq = std::stoll(next());
    else if (a == "--steps")
      steps = std::stoll(next());
    else if (a == "--warmup")
      warmup = std::stoll(next());
    else if (a == "--grad-accum")
      grad_accum = std::stoll(next());
    else if (a == "--recompute")
      rc = next();
    else if (a == "--device")
      device = next();
    else if (a == "--no-profile")
      profile = false;
    else if (a == "--zero-grads")
      zero_grads = true;
    else if (a == "--dp-shard")
      dp_shard = std::stoi(next());
    else if (a == "--dp-replicate")
      dp_replicate = std::stoi(next());
    else if (a == "--ep")
      ep = std::stoi(next());
    else if (a == "--tp")
      tp = std::stoi(next());  // tensor parallelism: the tp ranks share the batch rows
    else if (a == "--etp")
      etp = std::stoi(next());
    else if (a == "--sp")
      sp = std::stoi(next());
    else if (a == "--grad-reduce-dtype")
      reduce_dtype = next();
    else if (a == "--prefetch-depth")
      prefetch_depth = std::stoll(next());
    else if (a == "--no-reshard-after-forward")
      reshard = false;
    else if (a == "--optimizer-overlap")
      opt_overlap = true;
    else if (a == "--no-ep-overlap")
      ep_overlap = false;
    else if (a == "--layers")
      layers = std::stoll(next());
    else if (a == "--lora-rank")
      lora_rank = std::stoll(next());
    else if (a == "--lora-targets")
      lora_targets = next();
    else if (a == "--deterministic")
      set_deterministic(true);  // as MOETRAIN_DETERMINISTIC=1
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  try {
    if (grad_accum < 1) MT_THROW("--grad-accum ", grad_accum, " must be >= 1");
    Device dev = resolve_device(device);
    ModelConfig mc = resolve_model_config(model);
    if (layers < 0) MT_THROW("--layers ", layers, " must be >= 1 (or 0: the preset's own count)");
    if (layers > 0) {
      mc.num_hidden_layers = layers;
      mc.validate();
    }
    DistOptions dopt;
    dopt.mesh.dp_shard = dp_shard;
    dopt.mesh.dp_replicate = dp_replicate;
    dopt.mesh.ep = ep;
    dopt.mesh.tp = tp;
    dopt.mesh.etp = etp;
    dopt.mesh.sp = sp;
    FsdpOptions fo;
    if (reduce_dtype != "f32" && reduce_dtype != "bf16")
      MT_THROW("--grad-reduce-dtype '", reduce_dtype, "' is not supported; allowed: f32, bf16");
    fo.reduce_dtype = reduce_dtype == "bf16" ? DType::BF16 : DType::F32;
    fo.reshard_after_forward = reshard;
    if (prefetch_depth < 1) MT_THROW("--prefetch-depth ", prefetch_depth, " must be >= 1");
    SessionOptions so;
    so.device = dev;
    so.dist = dopt;
    so.fsdp = fo;
    so.recompute = parse_recompute(rc);
    so.model.prefetch_depth = prefetch_depth;
    so.model.ep_backward_overlap = ep_overlap;
    if (lora_rank > 0) {
      so.lora.rank = lora_rank;
      so.lora.targets = parse_lora_targets(lora_targets);
    }
    // init_s: the session (distributed context, parallel parts, model) and the weights' init and
    // optimizer; the GEMM and copy measurements between them are not counted, nor their memory.
    auto t_session = Clock::now();
    TrainSession session(mc, so);  // its distributed context selects the local GPU first
    const double session_s = secs(t_session);
    DistContext* dist = &session.dist();
    const int dp = dist->dp_size();
    double gemm_tflops = measure_gemm_tflops(dev), copy_gbps = measure_copy_gbps(dev);
    if (dev == Device::CUDA) device_mem::cuda_reset_peak();
    auto t_init = Clock::now();
    FsdpParams* fsdp = session.fsdp();
    Qwen3MoeModel& m = session.model();
    session.init_weights(1);
    AdamWConfig oc;
    session.make_optimizer(oc, opt_overlap);  // overlap: one device, CUDA, as the trainer decides
    AdamW& opt = session.optimizer();
    const bool overlap = opt_overlap && !fsdp && dev == Device::CUDA;
    double init_s = session_s + secs(t_init);

    // The global batch (batch rows per data-parallel rank) is the same on every rank; each trains on
    // its rows (the tp ranks of a dp rank share them and split their tokens; --sp: each of the sp ranks
    // of a data-parallel rank takes its chunk of every sequence).
    Rng rng(7);
    const int64_t global = batch * dp;
    std::vector<MicroBatch> micro;
    for (int64_t k = 0; k < grad_accum; ++k) {
      MicroBatch mb{Tensor::empty({global, seq}, DType::I64), Tensor::empty({global, seq}, DType::I64)};
      for (int64_t i = 0; i < global * seq; ++i)
        mb.input_ids.data<int64_t>()[i] = mb.labels.data<int64_t>()[i] = rng.randint(0, mc.vocab_size);
      micro.push_back(std::move(mb));
    }
    const int64_t tokens = global * seq * grad_accum;  // per optimizer step
    std::vector<double> losses;
    StepOptions step_opt;
    step_opt.lr = 1e-4;
    step_opt.zero_grads = zero_grads;  // default: gradients written with =, as the trainer does (no zeroing pass)

    // The trainer's step (TrainSession::train_step): planning, forward and backward, the optimizer, the
    // expert load and the metrics' reduction.
    auto one_step = [&]() {
      StepResult r = session.train_step(micro, step_opt);
      if (!overlap) device_mem::synchronize(dev);  // overlapped: the update runs on into the next forward
      losses.push_back(r.ce);
      return r;
    };
    // Sanity before timing: at init the loss is near log(V) and everything is finite.
    const StepResult r0 = one_step();
    const double ce0 = r0.ce;
    if (!std::isfinite(ce0) || std::abs(ce0 - std::log(double(mc.vocab_size))) > 1.0 ||
        !std::isfinite(r0.opt.grad_norm))
      MT_THROW("sanity check failed: initial loss ", ce0, " (log V = ", std::log(double(mc.vocab_size)),
               "), grad norm ", r0.opt.grad_norm);
    for (int64_t i = 1; i < warmup; ++i) one_step();
    double fwd = 0, bwd = 0, opt_s = 0;
    auto t = Clock::now();
    for (int64_t i = 0; i < steps; ++i) {
      auto t_step = Clock::now();
      const StepResult r = one_step();
      fwd += r.forward_s;  // summed over the micro-batches
      bwd += r.backward_s;
      opt_s += secs(t_step) - r.forward_s - r.backward_s;
    }
    opt.join();
    device_mem::synchronize(dev);
    double step_s = secs(t) / double(steps);
    size_t peak = dev == Device::CUDA ? device_mem::cuda_peak_bytes() : m.activation_peak_bytes();

    std::map<std::string, double> split, per_op;
    if (profile) {
      ops::reset_op_seconds();
      ops::set_op_profiling(true);
      one_step();
      ops::set_op_profiling(false);
      double total = 0;
      per_op = ops::op_seconds();
      for (auto& [op, s] : per_op) {
        split[category(op)] += s;
        total += s;
      }
      split["communication"] += 0.0;  // present even without collectives
      split["profiled_step"] = total;
    }
    const int64_t L = mc.num_hidden_layers;
    // With LoRA the base's weight gradients are not computed: 4 N per token (forward, input gradients) instead
    // of 6 N (the adapters' own GEMMs, r / D of those, are left out).
    double flops_per_token = (lora_rank > 0 ? 4.0 : 6.0) * double(mc.active_matmul_parameters()) +
                             6.0 * double(L) * double(seq) * double(mc.num_attention_heads * mc.head_dim);
    double tflops = flops_per_token * double(tokens) / step_s / 1e12 / double(dist->world_size());  // per GPU
    const int64_t P = session.table().total();
    double adamw_bytes = 30.0 * double(session.trainable_params().numel());  // this rank's shard under FSDP  // read p,g,m,v (16
                                                                   // B), write p,m,v (12 B), bf16 copy (2 B)
    nlohmann::json j{{"bench", "train_step"},
                     {"model", model},
                     {"layers", mc.num_hidden_layers},
                     {"device", device_name(dev)},
                     {"params", P},
                     {"active_matmul_params", mc.active_matmul_parameters()},
                     {"batch_per_gpu", batch},
                     {"world_size", dist->world_size()},
                     {"grad_reduce_dtype", dist->distributed() ? reduce_dtype : "-"},
                     {"reshard_after_forward", reshard},
                     {"prefetch_depth", prefetch_depth},
                     {"mesh", dist->describe()},
                     {"seq", seq},
                     {"recompute", rc},
                     {"lora_rank", lora_rank},
                     {"lora_targets", lora_rank > 0 ? lora_targets : "-"},
                     {"trainable_params", session.trainable_params().numel()},
                     {"grads", zero_grads ? "zeroed, +=" : "first micro-batch ="},
                     {"steps", steps},
                     {"grad_accum", grad_accum},
                     {"tokens_per_optimizer_step", tokens},
                     {"fwd_bwd_mfu", gemm_tflops > 0 && fwd + bwd > 0
                                         ? flops_per_token * double(tokens) / ((fwd + bwd) / double(steps)) / 1e12 /
                                               double(dist->world_size()) / gemm_tflops
                                         : 0.0},
                     {"optimizer_share", step_s > 0 ? opt_s / double(steps) / step_s : 0.0},
                     {"step_s", step_s},
                     {"tokens_per_s", double(tokens) / step_s},
                     {"tokens_per_s_per_gpu", double(tokens) / step_s / double(dist->world_size())},
                     {"model_tflops", tflops},
                     {"gemm_bf16_tflops_measured", gemm_tflops},
                     {"mfu", gemm_tflops > 0 ? tflops / gemm_tflops : 0.0},
                     {"peak_mem_gib", double(peak) / double(1 << 30)},
                     // The activation arenas' peaks (keep + work; docs/model.md's table predicts them).
                     {"activation_peak_gib", double(m.activation_peak_bytes()) / double(1 << 30)},
                     {"optimizer_overlap", overlap},
                     {"ep_backward_overlap", ep_overlap},
                     {"deterministic", deterministic()},
                     {"fuse_norm_add", so.model.fuse_norm_add},
                     {"fuse_gemm_add", so.model.fuse_gemm_add},
                     {"wgrad_stream", so.model.wgrad_stream},
                     {"wgrad_sms", so.model.wgrad_sms},
                     {"wgrad_priority", so.model.wgrad_priority == streams::Side::high ? "high" : "low"},
                     {"peak_reserved_gib",
                      dev == Device::CUDA ? double(device_mem::cuda_reserved_peak_bytes()) / double(1 << 30) : 0.0},
                     {"time_s",
                      {{"forward", fwd / double(steps)},
                       {"backward", bwd / double(steps)},
                       {"optimizer_and_rest", opt_s / double(steps)}}},
                     {"split_s", split},
                     {"op_s", per_op},
                     {"optimizer_floor_s", copy_gbps > 0 ? adamw_bytes / (copy_gbps * 1e9) : 0.0},
                     {"copy_gbps_measured", copy_gbps},
                     {"init_s", init_s},
                     {"initial_loss", ce0},
                     {"losses", losses}};
    if (dist->rank() == 0) std::printf("%s\n", j.dump().c_str());
    dist->finish();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_step: error: %s\n", e.what());
    return 1;
  }
}
