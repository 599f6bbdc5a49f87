// The Python module moetrain._moetrain (nanobind), thin over the library: python/moetrain/__init__.py wraps it
// and docs/python.md documents the API. One Model holds one TrainSession (one set of weights, trained in place)
// and a RolloutEngine on the same weights (no copy on one device): the sampler and the trainer are views of it.
// Every long call releases the GIL; Python callbacks (reward functions, environments) take it back. Ctrl-C
// during a call interrupts it (KeyboardInterrupt) at the next engine step or micro-batch.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

#include "cli/commands.h"
#include "cli/commands/grpo_args.h"
#include "core/device_select.h"
#include "core/error.h"
#include "core/interrupt.h"
#include "data/char_tokenizer.h"
#include "data/tokenizer.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/objective.h"
#include "rl/env/env_program.h"
#include "rl/grpo.h"
#include "rl/grpo_checkpoint.h"
#include "rl/policy_loss.h"
#include "rl/tasks/addition.h"
#include "rl/rollout_batch.h"
#include "rollout/engine.h"
#include "train/checkpoint.h"
#include "train/convert.h"
#include "train/run_dir.h"
#include "train/session.h"

namespace nb = nanobind;
namespace fs = std::filesystem;
using namespace mt;

namespace {

// ---- Ctrl-C: while a call runs without the GIL, SIGINT sets a flag the call polls (then KeyboardInterrupt) ----

std::atomic<bool> g_interrupted{false};
struct Interrupted : std::exception {
  const char* what() const noexcept override { return "interrupted"; }
};
extern "C" void on_sigint(int) { g_interrupted.store(true); }

// Installs the flag-setting handler for the call and puts Python's back after it.
class SigintGuard {
 public:
  SigintGuard() {
    g_interrupted.store(false);
    struct sigaction sa {};
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    active_ = sigaction(SIGINT, &sa, &old_) == 0;
  }
  ~SigintGuard() {
    if (active_) sigaction(SIGINT, &old_, nullptr);
  }
  static void poll() {
    if (g_interrupted.load()) throw Interrupted();
  }

 private:
  struct sigaction old_ {};
  bool active_ = false;
};

// ---- arrays ----

template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> array1(const std::vector<T>& v) {
  auto* data = new std::vector<T>(v);
  nb::capsule owner(data, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(data->data(), {data->size()}, owner);
}
template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> array1(std::vector<T>&& v) {
  auto* data = new std::vector<T>(std::move(v));
  nb::capsule owner(data, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(data->data(), {data->size()}, owner);
}

// A Python sequence of numbers (a list, a tuple or a 1-d numpy array) as a vector; errors name `what`.
template <typename T>
std::vector<T> to_vector(const nb::handle& h, const std::string& what) {
  std::vector<T> out;
  if (nb::isinstance<nb::ndarray<>>(h)) {
    nb::ndarray<> a = nb::cast<nb::ndarray<>>(h);
    if (a.ndim() != 1) throw nb::value_error((what + " must be 1-dimensional").c_str());
  }
  try {
    for (nb::handle x : nb::iter(h)) out.push_back(nb::cast<T>(x));
  } catch (const nb::cast_error&) {
    throw nb::type_error((what + ": expected a sequence of numbers").c_str());
  } catch (const nb::python_error&) {
    throw nb::type_error((what + ": expected a sequence of numbers").c_str());
  }
  return out;
}

// ---- the model ----

struct Model {
  ModelConfig cfg;
  std::string source;  // the directory, or the preset's name
  bool preset = false;
  uint64_t seed = 0;
  Device device = Device::CPU;
  std::unique_ptr<TrainSession> session;
  std::optional<Tokenizer> tok;  // tokenizer.json of the directory (or given with a preset)
  std::string tokenizer_path;
  bool char_vocab = false;       // the demo's character vocabulary (no tokenizer.json)
  std::unique_ptr<RolloutEngine> engine;
  int64_t engine_kv = 0;
  bool engine_routing = false;  // the engine records the routing
  std::optional<AdamWConfig> adam;
  int64_t generate_calls = 0;
  // Under tp or sp the sampler runs on a one-device copy of the whole weights (rl::TpGenerator), gathered again
  // when the weights changed since (weights_version: optim_step, set_parameters and load_state count it up).
  std::unique_ptr<rl::TpGenerator> tp_copy;
  int64_t weights_version = 0, tp_copy_version = -1;

  TrainSession& s() { return *session; }
};

std::shared_ptr<Model> make_model(const std::string& path, const std::string& device, int64_t lora_rank,
                                  double lora_alpha, const std::string& lora_targets, uint64_t seed,
                                  const nb::dict& mesh, const std::string& tokenizer) {
  auto m = std::make_shared<Model>();
  m->source = path;
  m->seed = seed;
  const std::vector<std::string> presets = preset_names();
  m->preset = !fs::is_directory(path) && std::find(presets.begin(), presets.end(), path) != presets.end();
  if (!m->preset && !fs::exists(path + "/config.json")) {
    std::string names;
    for (const std::string& p : presets) names += (names.empty() ? "" : ", ") + p;
    throw nb::value_error(
        str("Model: '", path, "' is neither a model directory with config.json nor a preset (", names, ")").c_str());
  }
  if (lora_rank < 0) throw nb::value_error(str("Model: lora_rank = ", lora_rank, "; need >= 0 (0: no LoRA)").c_str());
  SessionOptions so;
  for (auto [k, v] : mesh) {
    const std::string key = nb::cast<std::string>(k);
    const int value = nb::cast<int>(v);
    if (key == "dp_replicate") so.dist.mesh.dp_replicate = value;
    else if (key == "dp_shard") so.dist.mesh.dp_shard = value;
    else if (key == "ep") so.dist.mesh.ep = value;
    else if (key == "tp") so.dist.mesh.tp = value;
    else if (key == "sp") so.dist.mesh.sp = value;
    else
      throw nb::value_error(
          str("Model: mesh key '", key, "' is unknown; use dp_replicate, dp_shard, ep, tp, sp").c_str());
  }
  {
    nb::gil_scoped_release release;
    m->device = resolve_device(device);
    m->cfg = m->preset ? preset_model_config(path) : load_model_config(path);
    if (!tokenizer.empty()) {
      if (!m->preset)
        throw nb::value_error(str("Model: tokenizer= is for a preset; ", path, " has its own tokenizer.json").c_str());
      // As `sft --model PRESET --tokenizer`: the vocabulary widened to hold every id (a multiple of 64), the end
      // of an assistant turn as the EOS.
      m->tok = Tokenizer::from_file(tokenizer);
      m->tokenizer_path = tokenizer;
      const int64_t need = (int64_t(m->tok->vocab_size()) + 63) / 64 * 64;
      if (m->cfg.vocab_size < need) m->cfg.vocab_size = need;
      const int64_t im_end = m->tok->token_to_id("<|im_end|>"), eot = m->tok->token_to_id("<|endoftext|>");
      m->cfg.eos_token_id = im_end >= 0 ? im_end : eot;
    }
    so.device = m->device;
    if (lora_rank > 0) {
      so.lora.rank = lora_rank;
      so.lora.alpha = lora_alpha;
      so.lora.targets = parse_lora_targets(lora_targets);
      so.lora_seed = seed;
    }
    m->session = std::make_unique<TrainSession>(m->cfg, so);
    if (m->preset)
      m->session->init_weights(seed);
    else
      m->session->load(path);
  }
  if (!m->preset && fs::exists(path + "/tokenizer.json")) {
    m->tok = Tokenizer::from_file(path + "/tokenizer.json");
    m->tokenizer_path = path + "/tokenizer.json";
  }
  m->char_vocab = !m->tok && m->cfg.vocab_size <= 32;
  return m;
}

// The sampler's engine, with a KV budget for these requests (grown when a call needs more), recording the routing
// once a call asks for it (host bytes per token and layer: routing_record.h).
RolloutEngine& engine_for(Model& m, const std::vector<GenerateRequest>& reqs, bool routing) {
  const DeviceMesh& mesh = m.s().dist().mesh();
  const bool copy = mesh.size(Axis::Tp) > 1 || mesh.size(Axis::Sp) > 1;
  if (copy && !m.tp_copy) {
    m.tp_copy = std::make_unique<rl::TpGenerator>(m.s());
    m.engine.reset();  // built on the copy below
  }
  if (copy && m.tp_copy_version != m.weights_version) {  // collective: every rank samples (SPMD)
    m.tp_copy->refresh();
    m.tp_copy_version = m.weights_version;
  }
  Qwen3MoeModel& model = copy ? m.tp_copy->model() : m.s().model();
  const int64_t need = RolloutEngine::kv_bytes_needed(model, reqs, 16);
  if (!m.engine || need > m.engine_kv || (routing && !m.engine_routing)) {
    m.engine.reset();
    EngineOptions eo;
    eo.kv_cache_bytes = std::max<int64_t>(need, m.engine_kv > 0 ? m.engine_kv : int64_t(64) << 20);
    eo.record_routing = routing || m.engine_routing;
    m.engine_routing = eo.record_routing;
    eo.on_step = [](const EngineProgress&) { SigintGuard::poll(); };
    eo.lockstep = copy ? nullptr : m.s().dist().ep();  // the copy holds every expert
    m.engine = std::make_unique<RolloutEngine>(model, eo);
    m.engine_kv = eo.kv_cache_bytes;
  }
  return *m.engine;
}

nb::list sample(Model& m, const std::vector<std::vector<int32_t>>& prompts, int64_t n, int64_t max_new_tokens,
                double temperature, double top_p, int64_t top_k, double min_p, uint64_t seed,
                const std::vector<int32_t>& stop, bool routing) {
  if (prompts.empty()) throw nb::value_error("sample: no prompts");
  if (n < 1) throw nb::value_error(str("sample: n = ", n, "; need >= 1").c_str());
  if (max_new_tokens < 1) throw nb::value_error(str("sample: max_new_tokens = ", max_new_tokens, "; need >= 1").c_str());
  if (!(temperature >= 0)) throw nb::value_error(str("sample: temperature = ", temperature, "; need >= 0").c_str());
  if (!(top_p > 0 && top_p <= 1)) throw nb::value_error(str("sample: top_p = ", top_p, "; need in (0, 1]").c_str());
  if (top_k < 0) throw nb::value_error(str("sample: top_k = ", top_k, "; need >= 0 (0: off)").c_str());
  if (!(min_p >= 0 && min_p <= 1)) throw nb::value_error(str("sample: min_p = ", min_p, "; need in [0, 1]").c_str());
  const DeviceMesh& mesh = m.s().dist().mesh();
  if (routing && (mesh.size(Axis::Tp) > 1 || mesh.size(Axis::Sp) > 1))
    throw nb::value_error("sample: routing=True under tp or sp: the trainer cannot replay a routing record there "
                          "(it routes itself); sample without it");
  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateRequest r;
    r.prompt = prompts[i];
    r.n = n;
    r.max_new_tokens = max_new_tokens;
    r.sampling.temperature = float(temperature);
    r.sampling.top_p = float(top_p);
    r.sampling.top_k = int32_t(top_k);
    r.sampling.min_p = float(min_p);
    r.sampling.seed = seed + 0x9e3779b97f4a7c15ull * uint64_t(i);
    r.stop_token_ids = stop;
    reqs.push_back(std::move(r));
  }
  std::vector<GeneratedSample> gen;
  {
    nb::gil_scoped_release release;
    SigintGuard guard;
    RolloutEngine& e = engine_for(m, reqs, routing);
    gen = e.generate(reqs);
    ++m.generate_calls;
  }
  nb::list out;
  const int64_t K = m.cfg.num_experts_per_tok;
  for (GeneratedSample& g : gen) {
    nb::dict d;
    d["prompt_index"] = g.prompt_index;
    d["sample_index"] = g.sample_index;
    d["finish_reason"] = g.finish_reason;
    if (routing && !g.routing.empty()) {
      const int64_t L = g.routing.layers(), T = g.routing.tokens();
      auto* data = new std::vector<int32_t>(size_t(L * T * K));
      const std::vector<Tensor> ts = g.routing.tensors();
      for (int64_t l = 0; l < L; ++l) std::copy_n(ts[size_t(l)].data<int32_t>(), T * K, data->data() + l * T * K);
      nb::capsule owner(data, [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
      d["routing"] = nb::ndarray<nb::numpy, int32_t, nb::ndim<3>>(data->data(), {size_t(L), size_t(T), size_t(K)}, owner);
    } else {
      d["routing"] = nb::none();
    }
    d["tokens"] = array1(std::move(g.tokens));
    d["logprobs"] = array1(std::move(g.logprobs));
    out.append(d);
  }
  return out;
}

// ---- the trainer ----

// A training example: a prompt and a response (token ids), per response token optional values.
struct Datum {
  std::vector<int32_t> prompt, response;
  std::vector<float> weights, advantages, logprobs, ref_logprobs;
  std::vector<uint8_t> mask;  // model_mask: 1 the model's token, 0 an observation
  RoutingRecord routing;      // the sampler's (routing replay), or empty
};

std::vector<float> field(const nb::dict& d, const char* key, size_t len, size_t index) {
  if (!d.contains(key) || d[key].is_none()) return {};
  std::vector<float> v = to_vector<float>(d[key], str("datum ", index, " '", key, "'"));
  if (v.size() != len)
    throw nb::value_error(
        str("datum ", index, ": '", key, "' has ", v.size(), " values for ", len, " response tokens").c_str());
  return v;
}

std::vector<Datum> to_data(const Model& m, const nb::list& batch) {
  if (batch.size() == 0) throw nb::value_error("the batch is empty");
  std::vector<Datum> out;
  size_t i = 0;
  for (nb::handle h : batch) {
    if (!nb::isinstance<nb::dict>(h))
      throw nb::type_error(str("datum ", i, ": expected a dict (moetrain.Datum(...) makes one)").c_str());
    nb::dict d = nb::cast<nb::dict>(h);
    for (auto [k, v] : d) {
      const std::string key = nb::cast<std::string>(k);
      static const char* known[] = {"prompt",       "response", "weights", "advantages", "logprobs",
                                    "ref_logprobs", "mask",     "routing"};
      if (std::find_if(std::begin(known), std::end(known), [&](const char* s) { return key == s; }) == std::end(known))
        throw nb::value_error(str("datum ", i, ": unknown field '", key,
                                  "'; the fields are prompt, response, weights, advantages, logprobs, "
                                  "ref_logprobs, mask, routing")
                                  .c_str());
    }
    Datum x;
    if (!d.contains("prompt") || !d.contains("response"))
      throw nb::value_error(str("datum ", i, ": needs 'prompt' and 'response' (token ids)").c_str());
    x.prompt = to_vector<int32_t>(d["prompt"], str("datum ", i, " 'prompt'"));
    x.response = to_vector<int32_t>(d["response"], str("datum ", i, " 'response'"));
    if (x.prompt.empty()) throw nb::value_error(str("datum ", i, ": the prompt is empty").c_str());
    if (x.response.empty()) throw nb::value_error(str("datum ", i, ": the response is empty").c_str());
    for (const std::vector<int32_t>* ids : {&x.prompt, &x.response})
      for (int32_t t : *ids)
        if (t < 0 || t >= m.cfg.vocab_size)
          throw nb::value_error(
              str("datum ", i, ": token ", t, " is outside the vocabulary [0, ", m.cfg.vocab_size, ")").c_str());
    if (int64_t(x.prompt.size() + x.response.size()) > m.cfg.max_position_embeddings)
      throw nb::value_error(str("datum ", i, ": ", x.prompt.size() + x.response.size(),
                                " tokens exceed max_position_embeddings ", m.cfg.max_position_embeddings)
                                .c_str());
    const size_t T = x.response.size();
    x.weights = field(d, "weights", T, i);
    x.advantages = field(d, "advantages", T, i);
    x.logprobs = field(d, "logprobs", T, i);
    x.ref_logprobs = field(d, "ref_logprobs", T, i);
    for (float v : field(d, "mask", T, i)) x.mask.push_back(v != 0 ? 1 : 0);
    if (d.contains("routing") && !d["routing"].is_none()) {
      // The sampler's record: int32 [layers, prompt + response - 1, experts_per_token].
      auto r = nb::cast<nb::ndarray<int32_t, nb::ndim<3>, nb::c_contig, nb::device::cpu>>(d["routing"]);
      const int64_t L = int64_t(r.shape(0)), Tt = int64_t(r.shape(1)), K = int64_t(r.shape(2));
      if (K != m.cfg.num_experts_per_tok || Tt != int64_t(x.prompt.size() + T) - 1)
        throw nb::value_error(str("datum ", i, ": 'routing' is [", L, ", ", Tt, ", ", K, "]; need [layers, ",
                                  x.prompt.size() + T - 1, ", ", m.cfg.num_experts_per_tok, "] (the sampler's record)")
                                  .c_str());
      std::vector<Tensor> ids;
      for (int64_t l = 0; l < L; ++l) {
        Tensor t = Tensor::empty({Tt, K}, DType::I32);
        std::copy_n(r.data() + l * Tt * K, Tt * K, t.data<int32_t>());
        ids.push_back(t);
      }
      x.routing = RoutingRecord(L, K, m.cfg.num_experts);
      x.routing.append(ids, 0, Tt);
    }
    out.push_back(std::move(x));
    ++i;
  }
  return out;
}

// Micro-batches of consecutive data of at most `max_tokens` padded tokens (rows x the longest), each at least one.
std::vector<std::pair<size_t, size_t>> chunks(const std::vector<Datum>& data, int64_t max_tokens) {
  std::vector<std::pair<size_t, size_t>> out;
  size_t begin = 0;
  int64_t longest = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    const int64_t len = int64_t(data[i].prompt.size() + data[i].response.size());
    const int64_t grown = std::max(longest, len) * int64_t(i - begin + 1);
    if (i > begin && grown > max_tokens) {
      out.emplace_back(begin, i);
      begin = i;
      longest = len;
    } else {
      longest = std::max(longest, len);
    }
  }
  out.emplace_back(begin, data.size());
  return out;
}

rl::PackedRollouts pack(const Model& m, const std::vector<Datum>& data, size_t b, size_t e) {
  std::vector<rl::RolloutSample> samples;
  for (size_t i = b; i < e; ++i) {
    rl::RolloutSample s;
    s.prompt = data[i].prompt;
    s.response = data[i].response;
    s.logprobs.assign(data[i].response.size(), 0.0f);
    s.model_mask = data[i].mask;
    s.routing = data[i].routing;
    samples.push_back(std::move(s));
  }
  return rl::pack_rollouts(samples, m.cfg.num_experts_per_tok);
}

// L = sum_t c_t logp_t: the gradient of any loss through its d loss / d logp_t (a custom loss's, or cross-entropy's
// -w_t). Token value [0] is c_t.
class LinearObjective : public TokenObjective {
 public:
  double coefficients(const TokenRows& rows, Tensor& dlogp, Tensor* dentropy) const override {
    (void)dentropy;
    const Tensor& c = rows.values.at(0);
    dlogp.copy_from(c.to(dlogp.device()));
    const Tensor lp = rows.logp.to(Device::CPU);
    double loss = 0;
    for (int64_t i = 0; i < rows.rows; ++i)
      if (rows.labels.data<int64_t>()[i] != -100) loss += double(c.data<float>()[i]) * lp.data<float>()[i];
    return loss;
  }
};

void check_pass(const char* what, double temperature, int64_t max_tokens) {
  if (!(temperature > 0))
    throw nb::value_error(str(what, ": temperature = ", temperature, "; need > 0 (the sampler's, for its log-probs)").c_str());
  if (max_tokens < 1) throw nb::value_error(str(what, ": max_tokens = ", max_tokens, "; need >= 1").c_str());
}

nb::list forward(Model& m, const nb::list& batch, bool entropy, double temperature, int64_t max_tokens) {
  check_pass("forward", temperature, max_tokens);
  const std::vector<Datum> data = to_data(m, batch);
  std::vector<std::vector<float>> lps, ents;
  {
    nb::gil_scoped_release release;
    SigintGuard guard;
    for (auto [b, e] : chunks(data, max_tokens)) {
      SigintGuard::poll();
      const rl::PackedRollouts p = pack(m, data, b, e);
      PassOptions po;
      po.token_logprobs = true;
      po.token_entropy = entropy;
      po.temperature = temperature;
      const rl::HeadRows rows = rl::forward_rows(m.s(), p.mb, po);
      for (auto& v : rl::response_values(p, rows.logp)) lps.push_back(std::move(v));
      if (entropy)
        for (auto& v : rl::response_values(p, rows.entropy)) ents.push_back(std::move(v));
    }
  }
  nb::list out;
  for (size_t i = 0; i < lps.size(); ++i) {
    nb::dict d;
    d["logprobs"] = array1(std::move(lps[i]));
    if (entropy)
      d["entropy"] = array1(std::move(ents[i]));
    else
      d["entropy"] = nb::none();
    out.append(d);
  }
  return out;
}

// forward_backward with a built-in loss ("cross_entropy", "ppo", "pg", "gspo") or "linear" (c_t given per token
// in the datum's weights: the custom-loss path). Options: the policy loss's (clip_low, clip_high, dual_clip,
// kl_coef, kl, entropy_coef), aggregation ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
// "constant" with aggregation_constant), temperature, max_tokens.
nb::dict forward_backward(Model& m, const nb::list& batch, const std::string& loss, const nb::dict& options) {
  const std::vector<Datum> data = to_data(m, batch);
  double temperature = 1.0, agg_constant = 0;
  int64_t max_tokens = 8192;
  std::string aggregation = "token-mean";
  rl::PolicyLossConfig pc;
  for (auto [k, v] : options) {
    const std::string key = nb::cast<std::string>(k);
    if (key == "temperature") temperature = nb::cast<double>(v);
    else if (key == "max_tokens") max_tokens = nb::cast<int64_t>(v);
    else if (key == "aggregation") aggregation = nb::cast<std::string>(v);
    else if (key == "aggregation_constant") agg_constant = nb::cast<double>(v);
    else if (key == "clip_low") pc.clip_low = nb::cast<double>(v);
    else if (key == "clip_high") pc.clip_high = nb::cast<double>(v);
    else if (key == "dual_clip") pc.dual_clip = nb::cast<double>(v);
    else if (key == "kl_coef") pc.kl_coef = nb::cast<double>(v);
    else if (key == "kl") pc.kl = rl::parse_kl_estimator(nb::cast<std::string>(v));
    else if (key == "entropy_coef") pc.entropy_coef = nb::cast<double>(v);
    else
      throw nb::value_error(str("forward_backward: unknown option '", key,
                                "'; the options are temperature, max_tokens, aggregation, aggregation_constant, "
                                "clip_low, clip_high, dual_clip, kl_coef, kl, entropy_coef")
                                .c_str());
  }
  check_pass("forward_backward", temperature, max_tokens);
  const bool ce = loss == "cross_entropy", linear = loss == "linear";
  std::optional<rl::PolicyLoss> kind;
  if (!ce && !linear) {
    if (loss != "ppo" && loss != "pg" && loss != "gspo")
      throw nb::value_error(
          str("forward_backward: loss '", loss, "' is unknown; use cross_entropy, ppo, pg, gspo or a function").c_str());
    kind = rl::parse_policy_loss(loss);
    pc.kind = *kind;
    rl::validate(pc);
    for (size_t i = 0; i < data.size(); ++i) {
      if (data[i].advantages.empty())
        throw nb::value_error(str("forward_backward: loss ", loss, " needs 'advantages' in datum ", i).c_str());
      if (data[i].logprobs.empty())
        throw nb::value_error(
            str("forward_backward: loss ", loss, " needs 'logprobs' (the sampler's) in datum ", i).c_str());
      if (pc.kl_coef > 0 && data[i].ref_logprobs.empty())
        throw nb::value_error(str("forward_backward: kl_coef ", pc.kl_coef, " needs 'ref_logprobs' in datum ", i).c_str());
    }
  }
  if (linear)
    for (size_t i = 0; i < data.size(); ++i)
      if (data[i].weights.empty())
        throw nb::value_error(str("forward_backward: the linear loss needs 'weights' in datum ", i).c_str());
  const rl::LossAggregation agg = rl::parse_loss_aggregation(aggregation);
  // Token weights over the whole batch (the normaliser is the batch's, whatever the micro-batches).
  std::vector<std::vector<double>> old_lp, w;
  std::vector<std::vector<uint8_t>> masks;
  int64_t model_tokens = 0;
  for (const Datum& d : data) {
    old_lp.emplace_back(d.logprobs.begin(), d.logprobs.end());
    masks.push_back(d.mask);
    for (size_t t = 0; t < d.response.size(); ++t) model_tokens += d.mask.empty() || d.mask[t] ? 1 : 0;
  }
  if (kind) {
    rl::MiniBatchWeights mw = rl::minibatch_weights(old_lp, old_lp, std::vector<bool>(data.size(), false), agg,
                                                    agg_constant, rl::MismatchConfig{}, masks);
    w = std::move(mw.w);
    for (size_t i = 0; i < data.size(); ++i)
      if (!data[i].weights.empty())
        for (size_t t = 0; t < w[i].size(); ++t) w[i][t] *= data[i].weights[t];
  } else {
    if (model_tokens == 0) throw nb::value_error("forward_backward: no token of the batch is the model's (mask)");
    for (const Datum& d : data) {
      std::vector<double> c(d.response.size());
      for (size_t t = 0; t < c.size(); ++t) {
        const bool mine = d.mask.empty() || d.mask[t];
        // cross-entropy: -w_t (default w = 1 / the batch's model tokens: the mean); linear: c_t as given
        c[t] = !mine ? 0.0 : linear ? double(d.weights[t]) : -(d.weights.empty() ? 1.0 / double(model_tokens) : d.weights[t]);
      }
      w.push_back(std::move(c));
    }
  }
  StepResult total;
  double loss_sum = 0;
  rl::PolicyMetrics pm;
  {
    nb::gil_scoped_release release;
    SigintGuard guard;
    try {
      for (auto [b, e] : chunks(data, max_tokens)) {
        rl::PackedRollouts p = pack(m, data, b, e);
        std::vector<std::vector<float>> v0, v1, v2, v3, v4;
        for (size_t i = b; i < e; ++i) {
          const size_t T = data[i].response.size();
          if (kind) {
            v0.emplace_back(data[i].advantages);
            v1.emplace_back(data[i].logprobs);
            v2.emplace_back(w[i].begin(), w[i].end());
            v3.emplace_back(data[i].ref_logprobs.empty() ? std::vector<float>(T, 0.0f) : data[i].ref_logprobs);
            v4.emplace_back(T, float(i - b));
          } else {
            v0.emplace_back(w[i].begin(), w[i].end());
          }
        }
        rl::set_token_values(p, 0, v0);
        if (kind) {
          rl::set_token_values(p, 1, v1);
          rl::set_token_values(p, 2, v2);
          rl::set_token_values(p, 3, v3);
          rl::set_token_values(p, 4, v4);
        }
        std::unique_ptr<TokenObjective> obj;
        rl::PolicyObjective* policy = nullptr;
        if (kind) {
          auto po = std::make_unique<rl::PolicyObjective>(pc);
          policy = po.get();
          obj = std::move(po);
        } else {
          obj = std::make_unique<LinearObjective>();
        }
        StepOptions so;
        so.objective = obj.get();
        so.temperature = temperature;
        so.on_micro_batch = [](int64_t, int64_t, const LossParts&) { SigintGuard::poll(); };
        SigintGuard::poll();
        const StepResult r = m.s().forward_backward(std::vector<MicroBatch>{p.mb}, so);
        loss_sum += r.objective_sum;
        total.tokens += r.tokens;
        total.targets += r.targets;
        if (policy) {
          const rl::PolicyMetrics& x = policy->metrics();
          pm.pg_loss += x.pg_loss;
          pm.kl_loss += x.kl_loss;
          pm.entropy_loss += x.entropy_loss;
          pm.tokens += x.tokens;
          pm.clipped_region += x.clipped_region;
          pm.approx_kl += x.approx_kl;
        }
      }
    } catch (const Interrupted&) {
      m.s().discard_grads();
      throw;
    }
  }
  nb::dict out;
  out["loss"] = loss_sum;
  out["tokens"] = total.tokens;
  out["targets"] = total.targets;
  if (kind) {
    out["pg_loss"] = pm.pg_loss;
    out["kl_loss"] = pm.kl_loss;
    out["clip_fraction"] = pm.tokens > 0 ? double(pm.clipped_region) / double(pm.tokens) : 0.0;
    out["approx_kl"] = pm.tokens > 0 ? pm.approx_kl / double(pm.tokens) : 0.0;
  }
  return out;
}

nb::dict optim_step(Model& m, double lr, double beta1, double beta2, double eps, double weight_decay,
                    double grad_clip) {
  if (!(lr >= 0)) throw nb::value_error(str("optim_step: learning_rate = ", lr, "; need >= 0").c_str());
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
    throw nb::value_error(str("optim_step: beta1 = ", beta1, ", beta2 = ", beta2, "; need each in [0, 1)").c_str());
  if (!(eps > 0)) throw nb::value_error(str("optim_step: eps = ", eps, "; need > 0").c_str());
  AdamWConfig c;
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.eps = eps;
  c.weight_decay = weight_decay;
  c.max_grad_norm = grad_clip;
  if (m.adam && (m.adam->beta1 != c.beta1 || m.adam->beta2 != c.beta2 || m.adam->eps != c.eps ||
                 m.adam->weight_decay != c.weight_decay || m.adam->max_grad_norm != c.max_grad_norm))
    throw nb::value_error(
        "optim_step: AdamParams other than the first step's (beta1, beta2, eps, weight_decay, grad_clip are fixed "
        "for a run; learning_rate may change)");
  if (!m.s().grads_pending()) throw nb::value_error("optim_step: no gradients; call forward_backward first");
  if (!m.s().optimizer_ready())
    m.s().make_optimizer(c, false);
  else if (!m.adam)
    m.s().optimizer().set_config(c);  // made with the defaults by save_state / load_state
  m.adam = c;
  StepResult r;
  {
    nb::gil_scoped_release release;
    StepOptions so;
    so.lr = lr;
    m.s().optimizer_step(so, r);
  }
  ++m.weights_version;
  nb::dict out;
  out["grad_norm"] = r.opt.grad_norm;
  out["clip_scale"] = r.opt.clip_scale;
  out["skipped"] = r.opt.skipped;
  out["step"] = m.s().steps_done();
  return out;
}

// ---- the trainable values and their gradients as flat arrays (one process: tests, debugging) ----

Tensor& checked_flat(Model& m, bool grads, const char* what) {
  if (m.s().dist().distributed())
    throw nb::value_error(str(what, ": one process only (under several ranks each holds a shard)").c_str());
  return grads ? m.s().trainable_grads() : m.s().trainable_params();
}

nb::ndarray<nb::numpy, float, nb::ndim<1>> flat_values(Model& m, bool grads) {
  const Tensor host = checked_flat(m, grads, grads ? "gradients" : "parameters").to(Device::CPU);
  std::vector<float> v(host.data<float>(), host.data<float>() + host.numel());
  return array1(std::move(v));
}

void set_parameters(Model& m, nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu> values) {
  Tensor& p = checked_flat(m, false, "set_parameters");
  if (int64_t(values.shape(0)) != p.numel())
    throw nb::value_error(str("set_parameters: ", values.shape(0), " values for ", p.numel(), " parameters").c_str());
  Tensor host = Tensor::empty({p.numel()});
  std::copy_n(values.data(), p.numel(), host.data<float>());
  p.copy_from(host.to(p.device()));
  if (!m.s().lora()) m.s().refresh_compute_weights();
  ++m.weights_version;
}

// ---- state ----

std::string save_state_nogil(Model& m, const std::string& dir) {
  if (!m.s().optimizer_ready()) m.s().make_optimizer(m.adam.value_or(AdamWConfig{}), false);
  nlohmann::json st;
  st["format"] = "moetrain-python-state-1";
  st["step"] = m.s().steps_done();
  st["model"] = m.source;
  st["seed"] = m.seed;
  const AdamWConfig& c = m.s().optimizer().config();
  st["adam"] = {{"beta1", c.beta1}, {"beta2", c.beta2}, {"eps", c.eps}, {"weight_decay", c.weight_decay},
                {"grad_clip", c.max_grad_norm}, {"set", m.adam.has_value()}};
  const std::string& tok = m.tokenizer_path;
  return rl::save_grpo_checkpoint(dir, m.s().steps_done(), m.s(), nullptr, tok, std::move(st), 0);
}

std::string save_state(Model& m, const std::string& dir) {
  nb::gil_scoped_release release;
  return save_state_nogil(m, dir);
}

void load_state(Model& m, const std::string& ckpt) {
  nb::gil_scoped_release release;
  const fs::path p(ckpt);
  if (!fs::exists(p / "train_state.json"))
    throw nb::value_error(str("load_state: ", ckpt, " has no train_state.json (save_state's checkpoint-N directory)").c_str());
  std::ifstream f(p / "train_state.json");
  const nlohmann::json st = nlohmann::json::parse(f);
  if (!m.s().optimizer_ready()) m.s().make_optimizer(m.adam.value_or(AdamWConfig{}), false);
  restore_checkpoint_state(m.s(), ckpt, st, "load_state: ");
  AdamW& opt = m.s().optimizer();
  opt.set_state(st.value("optimizer_steps", int64_t(0)), st.value("skipped_steps", int64_t(0)));
  if (st.contains("adam") && st["adam"].value("set", false)) {  // the saved run's AdamParams
    const nlohmann::json& a = st["adam"];
    AdamWConfig c;
    c.beta1 = a.at("beta1").get<double>();
    c.beta2 = a.at("beta2").get<double>();
    c.eps = a.at("eps").get<double>();
    c.weight_decay = a.at("weight_decay").get<double>();
    c.max_grad_norm = a.at("grad_clip").get<double>();
    opt.set_config(c);
    m.adam = c;
  }
  m.s().set_steps_done(st.value("step", int64_t(0)));
  m.s().discard_grads();
  ++m.weights_version;
}

std::string export_hf(Model& m, const std::string& dir, bool merge, const std::string& dtype) {
  if (dtype != "bf16" && dtype != "f32") throw nb::value_error(str("export_hf: dtype '", dtype, "'; use bf16 or f32").c_str());
  nb::gil_scoped_release release;
  const std::string tmp = dir + ".state.tmp";
  fs::remove_all(tmp);
  const std::string ckpt = save_state_nogil(m, tmp);
  ConvertOptions co;
  co.from = ckpt;
  co.to = dir;
  co.dtype = dtype == "f32" ? DType::F32 : DType::BF16;
  if (m.s().lora()) {
    co.adapter = !merge;
    co.merge = merge;
    if (m.preset) co.base = m.source;
    convert_lora(co);
  } else {
    convert_checkpoint(co);
  }
  fs::remove_all(tmp);
  return dir;
}

// ---- text ----

std::vector<int32_t> encode(const Model& m, const std::string& text) {
  std::vector<int32_t> out;
  if (m.tok) {
    for (uint32_t id : m.tok->encode(text)) out.push_back(int32_t(id));
  } else if (m.char_vocab) {
    for (int64_t id : CharTokenizer().encode(text)) out.push_back(int32_t(id));
  } else {
    throw nb::value_error(str("encode: ", m.source, " has no tokenizer.json").c_str());
  }
  return out;
}

std::string decode(const Model& m, const std::vector<int32_t>& ids, bool skip_special) {
  if (m.tok) {
    std::vector<uint32_t> u;
    for (int32_t id : ids) {
      if (id < 0) throw nb::value_error(str("decode: id ", id, " is negative").c_str());
      u.push_back(uint32_t(id));
    }
    return m.tok->decode(u, skip_special);
  }
  if (m.char_vocab) {  // the demo's characters; an id of the padded vocabulary beyond them has none (U+FFFD)
    std::string out;
    const CharTokenizer ct;
    for (int32_t id : ids)
      out += id >= 0 && id < CharTokenizer::kVocabSize ? ct.decode({int64_t(id)}, skip_special) : "\xEF\xBF\xBD";
    return out;
  }
  throw nb::value_error(str("decode: ", m.source, " has no tokenizer.json").c_str());
}

// ---- the GRPO loop: `moetrain grpo` with Python's reward function and environment in-process ----

// An Environment over a Python object with init(episodes) and step(turns), both batched (lists of dicts): the
// protocol's requests and replies (rl/env/env_program.h) as Python objects, checked as a program's are. Kept
// from before the shared checks: a step without "done" ends the episode, and observations may be one string
// (the user's turn).
class PyEnvironment : public rl::Environment {
 public:
  explicit PyEnvironment(nb::object obj) : obj_(std::move(obj)) {}
  std::string name() const override { return "python"; }
  std::vector<rl::EnvInitResult> init(const std::vector<rl::EnvEpisode>& episodes) override {
    nb::gil_scoped_acquire gil;
    std::vector<rl::EnvInitResult> out(episodes.size());
    try {
      nb::list eps;
      for (const rl::EnvEpisode& e : episodes) eps.append(request(rl::init_request(e)));
      size_t i = 0;
      for (nb::handle x : obj_.attr("init")(eps)) {
        if (i >= out.size()) break;
        if (!x.is_none()) {
          nlohmann::json reply = nlohmann::json::object();
          reply["observations"] = observations(py_to_json(x));
          out[i].error = rl::parse_observations(reply, out[i].observations);
        }
        ++i;
      }
      if (i != out.size())
        for (auto& o : out) o.error = str("init returned ", i, " results for ", episodes.size(), " episodes");
    } catch (const std::exception& e) {
      for (auto& o : out) o.error = str("init raised: ", e.what());
    }
    return out;
  }
  std::vector<rl::EnvStepResult> step(const std::vector<rl::EnvTurn>& turns) override {
    nb::gil_scoped_acquire gil;
    std::vector<rl::EnvStepResult> out(turns.size());
    try {
      nb::list ts;
      for (const rl::EnvTurn& t : turns) ts.append(request(rl::step_request(t)));
      size_t i = 0;
      for (nb::handle x : obj_.attr("step")(ts)) {
        if (i >= out.size()) break;
        rl::EnvStepResult& s = out[i++];
        nlohmann::json reply = py_to_json(x);
        if (reply.is_object()) {
          if (!reply.contains("done")) reply["done"] = true;
          if (reply.contains("observations")) reply["observations"] = observations(reply["observations"]);
        }
        s.error = reply.is_object() ? rl::parse_step_reply(reply, s)
                                    : str("the step result is ", reply.dump(), ", not a dict");
      }
      if (i != out.size())
        for (auto& o : out) o.error = str("step returned ", i, " results for ", turns.size(), " turns");
    } catch (const std::exception& e) {
      for (auto& o : out) o.error = str("step raised: ", e.what());
    }
    return out;
  }
  void close(const std::vector<int64_t>& ids) override {
    nb::gil_scoped_acquire gil;
    if (!nb::hasattr(obj_, "close")) return;
    try {
      obj_.attr("close")(ids);
    } catch (const std::exception&) {
    }
  }

  static nb::object json_to_py(const nlohmann::json& j) {
    return nb::module_::import_("json").attr("loads")(j.dump());
  }
  static nlohmann::json py_to_json(nb::handle h) {
    return nlohmann::json::parse(nb::cast<std::string>(nb::module_::import_("json").attr("dumps")(h)));
  }

 private:
  // A request as the object's argument: the protocol's fields but "type" (the method says it).
  static nb::object request(nlohmann::json j) {
    j.erase("type");
    return json_to_py(j);
  }
  // One string is the user's turn.
  static nlohmann::json observations(const nlohmann::json& o) {
    return o.is_string() ? nlohmann::json::array({{{"role", "user"}, {"content", o}}}) : o;
  }
  nb::object obj_;
};

int run_grpo(const std::vector<std::string>& args, nb::object reward_fn, nb::object env) {
  GrpoHooks hooks;
  std::unique_ptr<PyEnvironment> py_env;
  if (!reward_fn.is_none()) {
    // A borrowed handle (reward_fn outlives the run): copies of the std::function then touch no reference count
    // without the GIL.
    const nb::handle fn = reward_fn;
    hooks.reward = [fn](const std::vector<rl::RewardRequest>& batch) {
      nb::gil_scoped_acquire gil;
      try {
        nb::list prompts, responses, metadata;
        for (const rl::RewardRequest& r : batch) {
          prompts.append(r.prompt);
          responses.append(r.response);
          metadata.append(PyEnvironment::json_to_py(r.metadata));
        }
        nb::object out = fn(prompts, responses, metadata);
        std::vector<double> rewards;
        for (nb::handle x : out) rewards.push_back(nb::cast<double>(x));
        return rewards;
      } catch (const nb::python_error& e) {
        throw Error(e.what());
      } catch (const nb::cast_error&) {
        throw Error("the reward function must return a sequence of numbers, one per sample");
      }
    };
  }
  if (!env.is_none()) {
    py_env = std::make_unique<PyEnvironment>(env);
    hooks.env = py_env.get();
  }
  int rc = 0;
  {
    nb::gil_scoped_release release;
    // grpo's own stop: the first Ctrl-C ends the run after its step, saved (core/interrupt.h); Python's handler
    // is put back after.
    struct sigaction old_int {}, old_term {};
    sigaction(SIGINT, nullptr, &old_int);
    sigaction(SIGTERM, nullptr, &old_term);
    try {
      rc = grpo_main(args, hooks);
    } catch (...) {
      sigaction(SIGINT, &old_int, nullptr);
      sigaction(SIGTERM, &old_term, nullptr);
      reset_stop_for_tests();
      throw;
    }
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
    reset_stop_for_tests();
  }
  return rc;  // 128 + the signal when a stop signal ended it (the Python side raises KeyboardInterrupt)
}

// ---- the demo's task: addition problems in the demo's vocabulary (moetrain.tasks) ----

struct AdditionTask {
  rl::addition::Task task;
  Rng rng;
  AdditionTask(int lo, int hi, bool longest, uint64_t seed) : rng(seed) {
    if (lo < 1 || hi < lo || hi > 9)
      throw nb::value_error(str("addition: digits ", lo, "..", hi, "; need 1 <= lo <= hi <= 9").c_str());
    task.lo = lo;
    task.hi = hi;
    task.longest = longest;
  }
};

nb::tuple problem_tuple(const Problem& p) {
  return nb::make_tuple(rl::addition::ids32(p.prompt_ids), rl::addition::ids32(p.answer_ids), p.text());
}

}  // namespace

NB_MODULE(_moetrain, m) {
  m.doc() = "moetrain's engine (C++): models, the sampler, the trainer and the GRPO loop";
  m.attr("__version__") = "0.1.0";
  static nb::exception<Error> error(m, "Error", PyExc_RuntimeError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Interrupted&) {
      PyErr_SetNone(PyExc_KeyboardInterrupt);
    }
  });

  nb::class_<Model>(m, "_Model")
      .def_prop_ro("device", [](const Model& x) { return std::string(x.device == Device::CUDA ? "cuda" : "cpu"); })
      .def_prop_ro("source", [](const Model& x) { return x.source; })
      .def_prop_ro("vocab_size", [](const Model& x) { return x.cfg.vocab_size; })
      .def_prop_ro("eos_token_id", [](const Model& x) { return x.cfg.eos_token_id; })
      .def_prop_ro("num_layers", [](const Model& x) { return x.cfg.num_hidden_layers; })
      .def_prop_ro("num_experts", [](const Model& x) { return x.cfg.num_experts; })
      .def_prop_ro("experts_per_token", [](const Model& x) { return x.cfg.num_experts_per_tok; })
      .def_prop_ro("max_position_embeddings", [](const Model& x) { return x.cfg.max_position_embeddings; })
      .def_prop_ro("has_tokenizer", [](const Model& x) { return x.tok.has_value() || x.char_vocab; })
      .def_prop_ro("lora", [](Model& x) { return x.s().lora() != nullptr; })
      .def_prop_ro("rank", [](Model& x) { return x.s().dist().rank(); })
      .def_prop_ro("world_size", [](Model& x) { return x.s().dist().world_size(); })
      .def_prop_ro("step", [](Model& x) { return x.s().steps_done(); })
      .def("sample", &sample, nb::arg("prompts"), nb::arg("n"), nb::arg("max_new_tokens"), nb::arg("temperature"),
           nb::arg("top_p"), nb::arg("top_k"), nb::arg("min_p"), nb::arg("seed"), nb::arg("stop"), nb::arg("routing"))
      .def("forward", &forward, nb::arg("batch"), nb::arg("entropy"), nb::arg("temperature"), nb::arg("max_tokens"))
      .def("forward_backward", &forward_backward, nb::arg("batch"), nb::arg("loss"), nb::arg("options"))
      .def("optim_step", &optim_step, nb::arg("lr"), nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"),
           nb::arg("weight_decay"), nb::arg("grad_clip"))
      .def("parameters", [](Model& x) { return flat_values(x, false); })
      .def("gradients", [](Model& x) { return flat_values(x, true); })
      .def("set_parameters", &set_parameters, nb::arg("values"))
      .def("save_state", &save_state, nb::arg("dir"))
      .def("load_state", &load_state, nb::arg("checkpoint"))
      .def("export_hf", &export_hf, nb::arg("dir"), nb::arg("merge"), nb::arg("dtype"))
      .def("encode", &encode, nb::arg("text"))
      .def("decode", &decode, nb::arg("ids"), nb::arg("skip_special"));
  m.def("_load_model", &make_model, nb::arg("path"), nb::arg("device"), nb::arg("lora_rank"), nb::arg("lora_alpha"),
        nb::arg("lora_targets"), nb::arg("seed"), nb::arg("mesh"), nb::arg("tokenizer"));
  m.def("_run_grpo", &run_grpo, nb::arg("args"), nb::arg("reward_fn").none(), nb::arg("env").none());
  m.def("_presets", &preset_names);

  nb::class_<AdditionTask>(m, "_AdditionTask")
      .def(nb::init<int, int, bool, uint64_t>(), nb::arg("lo"), nb::arg("hi"), nb::arg("longest"), nb::arg("seed"))
      .def("train", [](AdditionTask& t, int64_t count) {
        nb::list out;
        for (int64_t i = 0; i < count; ++i) out.append(problem_tuple(t.task.train(t.rng)));
        return out;
      })
      .def("eval", [](AdditionTask& t, int64_t n, uint64_t seed) {
        nb::list out;
        for (const Problem& p : t.task.eval(n, seed)) out.append(problem_tuple(p));
        return out;
      });
  m.def("_task_start", [](const std::string& name, const std::string& device) {
    nb::gil_scoped_release release;
    return rl::addition::ensure_task_start(rl::addition::task_preset(name), device);
  });
}
