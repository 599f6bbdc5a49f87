// One GRPO step (grpo.h).
#include "rl/grpo.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <string>

#include "comm/communicator.h"
#include "comm/gather_words.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "model/micro_batch.h"
#include "model/params.h"
#include "parallel/fsdp.h"
#include "rl/rollout_batch.h"
#include "rl/shaping.h"
#include "rl/value_loss.h"

namespace mt::rl {

namespace {

// The prompt + response tokens of a packed micro-batch, padding left out: what the phases' tokens/s count.
int64_t sequence_tokens(const PackedRollouts& p) {
  int64_t t = 0;
  for (size_t i = 0; i < p.prompt_len.size(); ++i) t += p.prompt_len[i] + p.response_len[i];
  return t;
}

// Tokens over seconds, 0 for a phase that did not run.
double per_second(int64_t tokens, double seconds) {
  return seconds > 0 ? double(tokens) / seconds : 0.0;
}

// One kept sample and what the update needs of it.
struct Kept {
  RolloutSample s;
  std::vector<double> step_rewards;     // process supervision
  std::vector<double> advantage;        // per response token
  std::vector<double> values, returns;  // PPO: the critic's values before the update, GAE returns
  bool filtered = false;                // overlong filtering: token weight 0
  // Multi-turn: the environment's reward per model turn and each response token's turn (per-turn credit).
  std::vector<double> turn_rewards;
  std::vector<int64_t> token_turn;
  // The trainer's log-probs and entropies and the reference's log-probs before the update, per response
  // token; filled before the advantages when the KL goes into the reward, else by the update.
  std::vector<float> old_lp, entropy, ref_lp;
};

// Whether response token j of a sample is the model's (not an observation an environment appended).
bool model_token(const RolloutSample& s, size_t j) {
  return s.model_mask.empty() || s.model_mask[j] != 0;
}

// A micro-batch of the update: its samples packed, their per-token values set.
struct UpdateMicroBatch {
  PackedRollouts p;
  std::vector<size_t> samples;  // indices into the kept samples
  PackedRollouts critic;        // PPO: the same rows for the critic (returns, old values, weights; no replay)
};

// The policy's layout, shared by its reference and critic (each rank's rows and shards must line up).
void check_same_layout(TrainSession& policy, TrainSession& other, const char* what) {
  for (Axis ax : {Axis::DpReplicate, Axis::DpShard, Axis::Sp, Axis::Tp, Axis::Ep}) {
    const int a = policy.dist().mesh().size(ax), b = other.dist().mesh().size(ax);
    if (a != b)
      MT_THROW("grpo: the ", what, " session has ", axis_name(ax), " ", b, ", the policy ", a, "; the ", what,
               " must be laid out like the policy");
  }
}

// What every entry point checks before any collective (the same on every rank).
void check_sessions(TrainSession& session, const GrpoOptions& o, TrainSession* reference, TrainSession* critic) {
  if (critic && !critic->config().value_head)
    MT_THROW("grpo: the critic session's model has an LM head; PPO's critic needs ModelConfig::value_head");
  if (o.loss.kl_coef > 0 && !reference)
    MT_THROW("grpo: kl_coef ", o.loss.kl_coef, " needs a reference model (a frozen copy of the initial policy)");
  if (o.kl_reward_coef > 0 && !reference)
    MT_THROW("grpo: kl_reward_coef ", o.kl_reward_coef,
             " needs a reference model (a frozen copy of the initial policy)");
  if (reference) check_same_layout(session, *reference, "reference");
  if (critic) check_same_layout(session, *critic, "critic");
  // GSPO's sequence ratio is the mean over a sample's every token, taken in the objective from the rows it
  // holds; under tp and sp a rank holds a slice of a sample's tokens, and the ratio would be a slice's.
  const int tp = session.dist().mesh().size(Axis::Tp), sp = session.dist().mesh().size(Axis::Sp);
  if (o.loss.kind == PolicyLoss::Gspo && (tp > 1 || sp > 1))
    MT_THROW("grpo: the gspo loss under ", tp > 1 ? "tp " : "sp ", tp > 1 ? tp : sp,
             " is not supported: its sequence ratio needs each sample's tokens on one rank, and a ",
             tp > 1 ? "tp" : "sp", " rank holds a slice of them; use ppo or pg, or a layout without tp and sp");
}

// A micro-batch of whole sequences grown to a multiple of `multiple` rows with empty rows (token 0, every
// label -100, values 0, routed to experts 0..K-1): every data-parallel rank gets rows, and the empty ones
// carry no target, so the loss and the gradients are those of the real rows.
MicroBatch pad_rows(const MicroBatch& mb, int multiple, int64_t K) {
  const int64_t B = mb.input_ids.size(0), S = mb.input_ids.size(1);
  const int64_t Bp = (B + multiple - 1) / multiple * multiple;
  if (Bp == B) return mb;
  MT_CHECK(!mb.segments.defined() && !mb.plan, "pad_rows: a packed or planned micro-batch");
  MicroBatch out;
  out.input_ids = Tensor::zeros({Bp, S}, DType::I64);
  out.input_ids.rows(0, B).copy_from(mb.input_ids);
  out.labels = Tensor::empty({Bp, S}, DType::I64);
  std::fill_n(out.labels.data<int64_t>(), Bp * S, int64_t(-100));
  out.labels.rows(0, B).copy_from(mb.labels);
  for (const Tensor& v : mb.token_values) {
    Tensor t = Tensor::zeros({Bp, S});
    t.rows(0, B).copy_from(v);
    out.token_values.push_back(t);
  }
  for (const Tensor& r : mb.routing) {
    Tensor t = Tensor::empty({Bp * S, K}, DType::I32);
    for (int64_t i = B * S; i < Bp * S; ++i)
      for (int64_t k = 0; k < K; ++k) t.data<int32_t>()[i * K + k] = int32_t(k);
    t.rows(0, B * S).copy_from(r);
    out.routing.push_back(t);
  }
  return out;
}

// The head's per-target rows (log-probs, entropies, values) of a micro-batch of whole sequences, every row
// on every rank: each data-parallel rank runs the forward on its rows (under tp each rank holds a slice of
// them), then one all-gather per tensor over the ranks with rows of their own, in rank order (dp-major, tp
// within). Host f32 [B S], the layout of a one-process forward. Collective over the world.
}  // namespace

HeadRows forward_rows(TrainSession& s, const MicroBatch& whole, const PassOptions& po) {
  DistContext& d = s.dist();
  const int dp = d.dp_size(), sp = d.mesh().size(Axis::Sp);
  const int64_t B = whole.input_ids.size(0), S = whole.input_ids.size(1);
  const MicroBatch padded = pad_rows(whole, dp, s.config().num_experts_per_tok);
  MicroBatch mine = padded;
  if (dp > 1) {
    auto [r0, rows] = dp_rows(padded.input_ids.size(0), d.dp_rank(), dp);
    mine = micro_batch_rows(padded, r0, rows);
  }
  const int64_t Bl = mine.input_ids.size(0);
  const int tp = d.mesh().size(Axis::Tp);
  // Sequence parallelism: this rank's chunk of every row's positions (the model runs planned chunks; under
  // tp too, each tp rank then holds a contiguous slice of the chunk's Bl x C tokens).
  if (sp > 1) mine = plan_micro_batch(mine, sp, d.sp_rank(), tp);
  const LossParts lp = s.model().forward(mine, po);
  comm::Communicator* rows_comm = s.parallel().tp ? d.world() : d.dp();
  const int64_t Sp = sp > 1 ? mine.plan->padded_len : s.model().padded_seq_len();  // S, or S' >= S (tp, sp)
  auto full = [&](const Tensor& t) -> Tensor {
    if (!t.defined()) return t;
    Tensor h;
    if (sp > 1) {
      // Every rank's piece over the world, placed by its mesh coordinates: data-parallel rank -> its rows,
      // sp rank k -> positions [k C, (k + 1) C) of them, tp rank -> its slice of that chunk's tokens.
      const int64_t C = mine.plan->chunk, P = t.numel();
      MT_CHECK(P * tp == Bl * C, "forward_rows: a piece of ", P, " tokens for ", Bl, " rows x ", C, " / tp ", tp);
      comm::Communicator& world = *d.world();
      Tensor all = Tensor::empty({int64_t(world.size()) * P}, DType::F32, t.device());
      world.all_gather(t, all)->wait();
      const Tensor a = all.to(Device::CPU);
      const DeviceMesh& mesh = d.mesh();
      h = Tensor::empty({int64_t(dp) * Bl * Sp});
      for (int w = 0; w < world.size(); ++w) {
        const int64_t dpi = int64_t(mesh.coord(Axis::DpReplicate, w)) * mesh.size(Axis::DpShard) +
                            mesh.coord(Axis::DpShard, w),
                      k = mesh.coord(Axis::Sp, w), ti = mesh.coord(Axis::Tp, w);
        for (int64_t j = 0; j < P; ++j) {
          const int64_t flat = ti * P + j, b = flat / C, c = flat % C;
          h.data<float>()[(dpi * Bl + b) * Sp + k * C + c] = a.data<float>()[int64_t(w) * P + j];
        }
      }
    } else {
      Tensor all = t;
      if (rows_comm && rows_comm->size() > 1) {
        all = Tensor::empty({int64_t(rows_comm->size()) * t.numel()}, DType::F32, t.device());
        rows_comm->all_gather(t, all)->wait();
      }
      h = all.to(Device::CPU);
    }
    MT_CHECK(h.numel() >= B * Sp, "forward_rows: ", h.numel(), " gathered rows for ", B, " x ", Sp);
    Tensor out = Tensor::empty({B * S});
    for (int64_t b = 0; b < B; ++b) std::copy_n(h.data<float>() + b * Sp, S, out.data<float>() + b * S);
    return out;
  };
  return HeadRows{full(lp.logp), full(lp.entropy), full(lp.value)};
}

namespace {

// The exchange of one generate round. Each rank's words: its data-parallel rank, a hash of the round's
// prompts, its error (if any), then its samples (global prompt index, sample index, finish, tokens,
// log-prob bits, reward bits, token reward bits, routing ids). All-gathered (lengths, then the words
// padded to the longest) over the world, so every rank decodes the same bytes and takes the same branch:
// an error on any rank is raised on all of them, naming the rank.
void put_u64(std::vector<int32_t>& w, uint64_t v) {
  w.push_back(int32_t(uint32_t(v)));
  w.push_back(int32_t(uint32_t(v >> 32)));
}
uint64_t get_u64(const int32_t*& p) {
  const uint64_t lo = uint32_t(p[0]), hi = uint32_t(p[1]);
  p += 2;
  return lo | (hi << 32);
}

// Text as words, four bytes each (the length first); read back by get_text.
void put_text(std::vector<int32_t>& w, const std::string& s) {
  w.push_back(int32_t(s.size()));
  for (size_t i = 0; i < s.size(); i += 4) {
    uint32_t v = 0;
    for (size_t b = 0; b < 4 && i + b < s.size(); ++b) v |= uint32_t(static_cast<unsigned char>(s[i + b])) << (8 * b);
    w.push_back(int32_t(v));
  }
}
std::string get_text(const int32_t*& p) {
  const size_t len = size_t(uint32_t(*p++));
  std::string s(len, '\0');
  for (size_t i = 0; i < len; ++i) s[i] = char((uint32_t(p[i / 4]) >> (8 * (i % 4))) & 0xff);
  p += (len + 3) / 4;
  return s;
}

// A multi-turn round's share of a rank as JSON: the prompts its init calls extended, its episodes (turn
// rewards, error, done, observation tokens, the steps' metadata), each sample's model mask and turn starts,
// its error count and first error, and its environment metric sums.
nlohmann::json episodes_to_json(const MultiTurnRound& round, const std::vector<GeneratedSample>& samples,
                                const std::vector<GenerateRequest>& mine) {
  nlohmann::json j;
  j["prompts"] = nlohmann::json::array();
  for (const GenerateRequest& r : mine) j["prompts"].push_back(r.prompt);
  j["episodes"] = nlohmann::json::array();
  for (size_t i = 0; i < round.episodes.size(); ++i) {
    const EpisodeResult& e = round.episodes[i];
    const GeneratedSample& g = samples.at(i);
    j["episodes"].push_back({{"id", e.id},
                             {"turn_rewards", e.turn_rewards},
                             {"error", e.error},
                             {"done", e.done},
                             {"observation_tokens", e.observation_tokens},
                             {"metadata", e.metadata},
                             {"model_mask", g.model_mask},
                             {"turn_starts", g.turn_starts}});
  }
  j["errors"] = round.errors;
  j["first_error"] = round.first_error;
  j["env_metrics"] = nlohmann::json::object();
  for (const auto& [k, v] : round.env_metrics) j["env_metrics"][k] = {v.first, v.second};
  return j;
}

// The round's episodes from every data-parallel rank's share, in rank order (the order of the samples);
// the rank's extended prompts placed at its groups.
void merge_episodes(const nlohmann::json& share, int64_t g0, std::vector<std::vector<int32_t>>& prompts,
                    MultiTurnRound& round, std::vector<std::pair<std::vector<uint8_t>, std::vector<int64_t>>>& masks) {
  const nlohmann::json& ps = share.at("prompts");
  for (size_t i = 0; i < ps.size(); ++i) prompts[size_t(g0) + i] = ps[i].get<std::vector<int32_t>>();
  for (const nlohmann::json& e : share.at("episodes")) {
    EpisodeResult r;
    r.id = e.at("id").get<int64_t>();
    r.turn_rewards = e.at("turn_rewards").get<std::vector<double>>();
    r.error = e.at("error").get<std::string>();
    r.done = e.at("done").get<bool>();
    r.observation_tokens = e.at("observation_tokens").get<int64_t>();
    r.metadata = e.at("metadata").get<std::vector<nlohmann::json>>();
    round.episodes.push_back(std::move(r));
    masks.emplace_back(e.at("model_mask").get<std::vector<uint8_t>>(), e.at("turn_starts").get<std::vector<int64_t>>());
  }
  round.errors += share.at("errors").get<int64_t>();
  if (round.first_error.empty()) round.first_error = share.at("first_error").get<std::string>();
  for (const auto& [k, v] : share.at("env_metrics").items()) {
    round.env_metrics[k].first += v[0].get<double>();
    round.env_metrics[k].second += v[1].get<int64_t>();
  }
}

// `episodes` (multi-turn, else null): this rank's episodes in, the whole round's out (in the order of the
// samples), and `requests` (every prompt of the round) get every rank's init-extended prompts.
void exchange_round(DistContext& dist, const ModelConfig& cfg, const std::vector<std::vector<int32_t>>& prompts,
                    const std::string& error, std::vector<GeneratedSample>& gen, std::vector<double>& rewards,
                    std::vector<std::vector<double>>& steps, bool with_steps, MultiTurnRound* episodes = nullptr,
                    std::vector<GenerateRequest>* requests = nullptr, int64_t groups_per_rank = 0) {
  uint64_t hash = 0x5eed;
  for (const std::vector<int32_t>& p : prompts) {
    hash = mix64(hash ^ p.size());
    for (int32_t t : p) hash = mix64(hash ^ uint32_t(t));
  }
  const int64_t K = cfg.num_experts_per_tok;
  std::vector<int32_t> w{dist.dp_rank()};
  put_u64(w, hash);
  const std::string msg = error.substr(0, 2000);
  w.push_back(int32_t(msg.size()));
  for (char c : msg) w.push_back(int32_t(static_cast<unsigned char>(c)));
  if (msg.empty()) {
    if (episodes) {
      const std::vector<GenerateRequest> mine(requests->begin() + int64_t(dist.dp_rank()) * groups_per_rank,
                                              requests->begin() + int64_t(dist.dp_rank() + 1) * groups_per_rank);
      put_text(w, episodes_to_json(*episodes, gen, mine).dump());
    }
    w.push_back(int32_t(gen.size()));
    for (size_t i = 0; i < gen.size(); ++i) {
      const GeneratedSample& g = gen[i];
      w.insert(w.end(), {int32_t(g.prompt_index), int32_t(g.sample_index), g.finish_reason == "stop" ? 1 : 0,
                         int32_t(g.tokens.size())});
      w.insert(w.end(), g.tokens.begin(), g.tokens.end());
      for (float lp : g.logprobs) w.push_back(std::bit_cast<int32_t>(lp));
      put_u64(w, std::bit_cast<uint64_t>(rewards[i]));
      if (with_steps)
        for (double v : steps[i]) put_u64(w, std::bit_cast<uint64_t>(v));
      w.push_back(int32_t(g.routing.layers()));
      if (!g.routing.empty()) {
        w.push_back(int32_t(g.routing.tokens()));
        for (const Tensor& ids : g.routing.tensors())
          w.insert(w.end(), ids.data<int32_t>(), ids.data<int32_t>() + ids.numel());
      }
    }
  }
  const std::vector<std::vector<int32_t>> all = comm::all_gather_words(*dist.world(), w);
  // Errors and disagreements first, decided from the same bytes on every rank.
  uint64_t hash0 = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    const int32_t* p = all[r].data() + 1;
    const uint64_t h = get_u64(p);
    const int32_t len = *p++;
    if (len > 0) {
      std::string e;
      for (int32_t i = 0; i < len; ++i) e.push_back(char(p[i]));
      MT_THROW("grpo: rank ", r, " failed in its share of the round: ", e);
    }
    if (r == 0) hash0 = h;
    if (h != hash0)
      MT_THROW("grpo: rank ", r,
               " drew other prompts than rank 0 in this round; the prompt source must give every "
               "rank the same list (the same seed, the same position in the file)");
  }
  // One rank per data-parallel rank (the tp ranks of a data-parallel rank hold the same share).
  struct Row {
    GeneratedSample g;
    double reward;
    std::vector<double> steps;
    EpisodeResult episode;  // multi-turn
  };
  std::vector<Row> rows;
  std::vector<const int32_t*> share_of(size_t(dist.dp_size()), nullptr);  // one rank per data-parallel rank
  for (size_t r = 0; r < all.size(); ++r) {
    const int32_t dp_rank = all[r][0];
    if (!share_of[size_t(dp_rank)]) share_of[size_t(dp_rank)] = all[r].data() + 4;  // past hash, error length 0
  }
  MultiTurnRound merged;  // episodes left empty: they travel in the rows
  std::vector<std::pair<std::vector<uint8_t>, std::vector<int64_t>>> masks;
  std::vector<std::vector<int32_t>> extended;
  size_t next_episode = 0;
  if (episodes) {
    for (const GenerateRequest& q : *requests) extended.push_back(q.prompt);
  }
  for (int dp_rank = 0; dp_rank < dist.dp_size(); ++dp_rank) {
    const int32_t* p = share_of[size_t(dp_rank)];
    MT_CHECK(p, "grpo: no rank of data-parallel rank ", dp_rank, " in the round's exchange");
    if (episodes)
      merge_episodes(nlohmann::json::parse(get_text(p)), int64_t(dp_rank) * groups_per_rank, extended, merged, masks);
    const int32_t count = *p++;
    for (int32_t s = 0; s < count; ++s) {
      Row row;
      row.g.prompt_index = p[0];
      row.g.sample_index = p[1];
      row.g.finish_reason = p[2] ? "stop" : "length";
      if (episodes) {
        row.episode = std::move(merged.episodes.at(next_episode));
        row.g.model_mask = std::move(masks.at(next_episode).first);
        row.g.turn_starts = std::move(masks.at(next_episode).second);
        ++next_episode;
      }
      const int32_t T = p[3];
      p += 4;
      row.g.tokens.assign(p, p + T);
      p += T;
      for (int32_t i = 0; i < T; ++i) row.g.logprobs.push_back(std::bit_cast<float>(p[i]));
      p += T;
      row.reward = std::bit_cast<double>(get_u64(p));
      if (with_steps)
        for (int32_t i = 0; i < T; ++i) row.steps.push_back(std::bit_cast<double>(get_u64(p)));
      const int32_t layers = *p++;
      if (layers > 0) {
        const int32_t tokens = *p++;
        std::vector<Tensor> ids;
        for (int32_t l = 0; l < layers; ++l) {
          Tensor t = Tensor::empty({tokens, K}, DType::I32);
          std::copy_n(p, int64_t(tokens) * K, t.data<int32_t>());
          p += int64_t(tokens) * K;
          ids.push_back(t);
        }
        row.g.routing = RoutingRecord(layers, K, cfg.num_experts);
        row.g.routing.append(ids, 0, tokens);
      }
      rows.push_back(std::move(row));
    }
  }
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    return a.g.prompt_index != b.g.prompt_index ? a.g.prompt_index < b.g.prompt_index
                                                : a.g.sample_index < b.g.sample_index;
  });
  gen.clear();
  rewards.clear();
  steps.clear();
  for (Row& r : rows) {
    gen.push_back(std::move(r.g));
    rewards.push_back(r.reward);
    if (with_steps) steps.push_back(std::move(r.steps));
  }
  if (episodes) {
    MT_CHECK(next_episode == merged.episodes.size(), "grpo: ", merged.episodes.size(), " episodes exchanged for ",
             next_episode, " samples");
    merged.episodes.clear();
    for (Row& r : rows) merged.episodes.push_back(std::move(r.episode));
    *episodes = std::move(merged);
    for (size_t i = 0; i < extended.size(); ++i) (*requests)[i].prompt = std::move(extended[i]);
  }
}

// The forward's options for the log-probs at the sampled tokens, at the sampling temperature (the
// trainer's with the entropy, the reference's without).
PassOptions log_prob_pass(const GrpoOptions& o, bool entropy) {
  PassOptions po;
  po.token_logprobs = true;
  po.token_entropy = entropy;
  po.temperature = o.sampling.temperature;
  return po;
}

// The update on the kept samples (group-major, n each; the same on every rank), in its phases: the KL in
// the reward (when asked), the advantages, the packing with the old and reference log-probs, the policy's
// optimizer steps, the critic's (PPO), the metrics. update() runs them in that order.
struct UpdatePhases {
  UpdatePhases(TrainSession& session_, std::vector<Kept>& kept_, std::vector<double>& kept_rewards_,
               int64_t kept_groups_, const GrpoOptions& o_, int64_t step_, TrainSession* reference_,
               TrainSession* critic_, GrpoMetrics& m_)
      : session(session_),
        kept(kept_),
        kept_rewards(kept_rewards_),
        kept_groups(kept_groups_),
        o(o_),
        step(step_),
        reference(reference_),
        critic(critic_),
        m(m_) {}

  TrainSession& session;
  std::vector<Kept>& kept;
  std::vector<double>& kept_rewards;
  const int64_t kept_groups;
  const GrpoOptions& o;
  const int64_t step;
  TrainSession* reference;
  TrainSession* critic;
  GrpoMetrics& m;
  DistContext& dist = session.dist();
  const int dp = dist.dp_size(), rank = dist.rank();
  const int64_t K = session.config().num_experts_per_tok;
  const int64_t n = o.n;
  PassOptions po = log_prob_pass(o, true), ref_po = log_prob_pass(o, false), nr_po = ref_po;
  int64_t logprob_tokens = 0, ref_tokens = 0;  // through the forwards, for the phases' tokens/s
  // On-policy, the update's forward gives the old log-probs (and the entropies and the mismatch metrics):
  // no forward of the policy before it, only the reference's.
  const bool mismatch_on = o.mismatch.tis_cap > 0 || o.mismatch.token_mask_high > 0 || o.mismatch.seq_mask_high > 0;
  const bool on_policy = !o.old_logprob_forward && o.epochs == 1 && std::min(o.mini_batches, kept_groups) == 1 &&
                         o.kl_reward_coef <= 0 && !mismatch_on;
  // Off-policy with the rollout's log-probs exactly the trainer's (GrpoOptions::rollout_logprobs_exact): they are
  // the old ones, and no forward runs before the update either. Either way the update measures the row metrics.
  const bool rollout_old = !on_policy && !o.old_logprob_forward && o.rollout_logprobs_exact;
  const bool in_update = on_policy || rollout_old;
  // The mismatch the replay removes: the same log-probs with the trainer's own routing, every
  // mismatch_every steps (an extra forward per micro-batch).
  const bool no_replay_check = o.replay_routing && o.mismatch_every > 0 && step % o.mismatch_every == 0;
  // Per kept sample, per token: the KL's share of the reward (no tokens without the KL in the reward).
  std::vector<std::vector<double>> kl_pen = std::vector<std::vector<double>>(kept.size());
  std::vector<std::vector<UpdateMicroBatch>> minis;
  // Sums for the metrics: before the update (or on-policy, during it) and of the objectives.
  double dsum = 0, wsum = 0, ent_sum = 0, ref_kl_sum = 0, adv_sum = 0, adv_sq = 0, nr_sum = 0;
  double w_min = std::numeric_limits<double>::infinity(), w_max = 0;
  int64_t tokens_all = 0, masked_tokens = 0, critic_value_tokens = 0;
  int64_t train_tokens = 0, clip_low = 0, clip_high = 0, clip_region = 0, clip_dual = 0, trained = 0;
  int64_t c_tokens = 0, c_clipped = 0, c_train_tokens = 0;  // the critic's
  double approx_kl = 0, pg_sum = 0, kl_sum = 0, ref_kl_sum_update = 0;
  int64_t op_rows = 0;  // on-policy: the rows the objective measured the mismatch, entropy and KL on

  // The trainer's rows of a micro-batch of kept samples (old log-probs with the routing replayed,
  // entropies) and the reference's log-probs, into each sample's Kept: once per sample, before the
  // advantages when the KL goes into the reward, else while packing.
  void trainer_rows(const PackedRollouts& p, const std::vector<size_t>& which) {
    auto t = Clock::now();
    std::vector<std::vector<float>> old, ent;
    if (!in_update) {
      const HeadRows lp = forward_rows(session, p.mb, po);
      old = response_values(p, lp.logp);
      ent = response_values(p, lp.entropy);
      m.logprob_s += seconds_since(t);
      logprob_tokens += sequence_tokens(p);
    }
    std::vector<std::vector<float>> ref;
    if (reference) {
      t = Clock::now();
      PassOptions base_po = ref_po;
      base_po.adapters = false;  // a LoRA policy is its own reference: its frozen base, adapters off
      ref = response_values(p, forward_rows(*reference, p.mb, base_po).logp);
      m.ref_logprob_s += seconds_since(t);
      ref_tokens += sequence_tokens(p);
    }
    for (size_t k = 0; k < which.size(); ++k) {
      Kept& x = kept[which[k]];
      if (rollout_old) {
        x.old_lp = x.s.logprobs;
      } else if (!on_policy) {
        x.old_lp = old[k];
        x.entropy = ent[k];
      }
      if (reference) x.ref_lp = ref[k];
    }
  }

  // 1. KL in the reward: each kept response token's k(old, ref) before the advantages; then -coef k_t joins
  // the token's or the sample's reward. Only with kl_reward_coef > 0.
  void kl_in_reward() {
    const size_t per = o.micro_batch_samples > 0 ? size_t(o.micro_batch_samples) : kept.size();
    for (size_t c0 = 0; c0 < kept.size(); c0 += per) {
      std::vector<RolloutSample> ss;
      std::vector<size_t> which;
      for (size_t i = c0; i < std::min(kept.size(), c0 + per); ++i) {
        ss.push_back(kept[i].s);
        which.push_back(i);
      }
      trainer_rows(pack_rollouts(ss, K), which);
    }
    double pen_sum = 0;
    int64_t pen_tokens = 0;
    for (size_t i = 0; i < kept.size(); ++i)
      for (size_t j = 0; j < kept[i].old_lp.size(); ++j) {
        if (!model_token(kept[i].s, j)) {  // an observation: no KL, as a prompt token
          kl_pen[i].push_back(0);
          continue;
        }
        const double pen = -o.kl_reward_coef * kl_value(o.loss.kl, kept[i].old_lp[j], kept[i].ref_lp[j]);
        kl_pen[i].push_back(pen);
        pen_sum += pen;
        ++pen_tokens;
      }
    m.kl_reward = pen_tokens > 0 ? pen_sum / double(pen_tokens) : 0;
  }

  std::vector<double> with_kl(size_t i, std::vector<double> r) const {
    if (!kl_pen[i].empty())
      for (size_t j = 0; j < r.size(); ++j) r[j] += kl_pen[i][j];
    return r;
  }

  // 2. Advantages, per kept group; with a critic, GAE per sample from its values.
  void advantages() {
    if (critic) {
      auto t = Clock::now();
      const size_t per = o.micro_batch_samples > 0 ? size_t(o.micro_batch_samples) : kept.size();
      for (size_t c0 = 0; c0 < kept.size(); c0 += per) {
        std::vector<RolloutSample> ss;
        for (size_t i = c0; i < std::min(kept.size(), c0 + per); ++i) {
          ss.push_back(kept[i].s);
          ss.back().routing = RoutingRecord();  // the critic routes with its own router
        }
        const PackedRollouts p = pack_rollouts(ss, K);
        const std::vector<std::vector<float>> v = response_values(p, forward_rows(*critic, p.mb, PassOptions{}).value);
        critic_value_tokens += sequence_tokens(p);
        for (size_t k = 0; k < ss.size(); ++k) {
          Kept& x = kept[c0 + k];
          x.values.assign(v[k].begin(), v[k].end());
          std::vector<double> r(x.s.response.size(), 0.0);
          if (o.token_reward)
            r = x.step_rewards;
          else
            r.back() = kept_rewards[c0 + k];
          r = with_kl(c0 + k, std::move(r));
          Gae g = gae(r, x.values, o.gamma, o.lam);
          x.advantage = std::move(g.advantages);
          x.returns = std::move(g.returns);
        }
      }
      m.critic_value_s = seconds_since(t);
      // Whitened over the trained tokens; value metrics against the returns.
      double n_tok = 0, a_sum = 0, a_sq = 0, v_sum = 0, r_sum2 = 0, r_sq2 = 0, e_sum = 0, e_sq = 0;
      for (const Kept& x : kept)
        if (!x.filtered)
          for (size_t j = 0; j < x.advantage.size(); ++j) {
            n_tok += 1;
            a_sum += x.advantage[j];
            a_sq += x.advantage[j] * x.advantage[j];
            v_sum += x.values[j];
            r_sum2 += x.returns[j];
            r_sq2 += x.returns[j] * x.returns[j];
            const double e = x.returns[j] - x.values[j];
            e_sum += e;
            e_sq += e * e;
          }
      if (n_tok > 0) {
        const double mean = a_sum / n_tok, sd = std::sqrt(std::max(0.0, a_sq / n_tok - mean * mean));
        for (Kept& x : kept)
          for (double& a : x.advantage) a = (a - mean) / (sd + 1e-6);
        m.value_mean = v_sum / n_tok;
        const double var_r = r_sq2 / n_tok - (r_sum2 / n_tok) * (r_sum2 / n_tok);
        const double var_e = e_sq / n_tok - (e_sum / n_tok) * (e_sum / n_tok);
        m.explained_variance = var_r > 1e-12 ? 1.0 - var_e / var_r : 0.0;
      }
    } else if (o.token_reward) {
      std::vector<std::vector<double>> steps;
      for (size_t i = 0; i < kept.size(); ++i) steps.push_back(with_kl(i, kept[i].step_rewards));
      const std::vector<std::vector<double>> adv = o.per_position ? position_advantages(steps, n, o.normalize_std)
                                                                  : process_advantages(steps, n, o.normalize_std);
      for (size_t i = 0; i < kept.size(); ++i) kept[i].advantage = adv[i];
    } else if (o.env && per_turn_credit(o.multi_turn.credit)) {
      // Each turn's return against the group's turns (of its index with per-turn-index); the KL in the reward
      // joins the turn it falls in.
      std::vector<std::vector<double>> turn_r;
      for (size_t i = 0; i < kept.size(); ++i) {
        std::vector<double> r = kept[i].turn_rewards;
        if (r.empty()) r.push_back(0);
        for (size_t j = 0; j < kl_pen[i].size(); ++j)
          r[std::min(size_t(kept[i].token_turn[j]), r.size() - 1)] += kl_pen[i][j];
        turn_r.push_back(std::move(r));
      }
      const std::vector<std::vector<double>> adv =
          turn_advantages(turn_r, n, o.normalize_std, 1e-6, o.multi_turn.credit == TurnCredit::PerTurnIndex);
      for (size_t i = 0; i < kept.size(); ++i) {
        kept[i].advantage.clear();
        for (int64_t k : kept[i].token_turn)
          kept[i].advantage.push_back(adv[i][std::min(size_t(k), adv[i].size() - 1)]);
      }
    } else {
      std::vector<double> rewards = kept_rewards;
      for (size_t i = 0; i < kept.size(); ++i)
        for (double pen : kl_pen[i]) rewards[i] += pen;
      const std::vector<double> adv = grpo_advantages(rewards, n, o.normalize_std);
      for (size_t i = 0; i < kept.size(); ++i) kept[i].advantage.assign(kept[i].s.response.size(), adv[i]);
    }
    // Observation tokens carry no advantage (their weight is 0 as well: the same as a prompt token's).
    for (Kept& x : kept)
      for (size_t j = 0; j < x.advantage.size(); ++j)
        if (!model_token(x.s, j)) x.advantage[j] = 0;
  }

  // 3. Mini-batches of whole groups, micro-batches of samples; each packed once, and the old (and
  //    reference) log-probs computed before the first epoch.
  void pack() {
    const int64_t mini = std::min(o.mini_batches, kept_groups);
    minis.resize(static_cast<size_t>(mini));
    // The mismatch the replay removes: the same log-probs with the trainer's own routing, every
    // mismatch_every steps (an extra forward per micro-batch).
    PassOptions nr_po = ref_po;
    for (int64_t b = 0; b < mini; ++b) {
      const size_t g0 = size_t(b * kept_groups / mini), g1 = size_t((b + 1) * kept_groups / mini);
      const size_t s0 = g0 * size_t(n), s1 = g1 * size_t(n);
      // The critic's normaliser: the mini-batch's tokens of unfiltered samples (the policy's token weights are
      // set below, once the mini-batch's old log-probs are known: the masks decide its normalisers).
      int64_t mb_tokens = 0;
      for (size_t i = s0; i < s1; ++i)
        if (!kept[i].filtered)
          for (size_t j = 0; j < kept[i].s.response.size(); ++j) mb_tokens += model_token(kept[i].s, j);
      const size_t per = o.micro_batch_samples > 0 ? size_t(o.micro_batch_samples) : s1 - s0;
      for (size_t c0 = s0; c0 < s1; c0 += per) {
        UpdateMicroBatch u;
        std::vector<RolloutSample> ss;
        for (size_t i = c0; i < std::min(s1, c0 + per); ++i) {
          u.samples.push_back(i);
          ss.push_back(kept[i].s);
        }
        u.p = pack_rollouts(ss, K);
        if (o.kl_reward_coef <= 0) trainer_rows(u.p, u.samples);  // else done before the advantages
        // The old log-probs' slot: the trainer's, or on-policy the engine's (for the objective's mismatch metrics).
        std::vector<std::vector<float>> old, ent, ref;
        for (size_t i : u.samples) {
          old.push_back(on_policy ? kept[i].s.logprobs : kept[i].old_lp);
          ent.push_back(kept[i].entropy);
          if (reference) ref.push_back(kept[i].ref_lp);
        }
        std::vector<std::vector<float>> own;  // without the replay
        if (no_replay_check && !u.p.mb.routing.empty()) {
          auto t = Clock::now();
          MicroBatch mb = u.p.mb;
          mb.routing.clear();
          own = response_values(u.p, forward_rows(session, mb, nr_po).logp);
          m.logprob_s += seconds_since(t);
          logprob_tokens += sequence_tokens(u.p);
        }
        std::vector<std::vector<float>> adv_t;
        for (size_t k = 0; k < u.samples.size(); ++k) {
          const Kept& x = kept[u.samples[k]];
          const int64_t len = int64_t(x.s.response.size());
          for (int64_t j = 0; j < len; ++j) {
            if (!model_token(x.s, size_t(j))) continue;  // observations: in no metric, as prompt tokens
            ++tokens_all;
            adv_sum += x.advantage[size_t(j)];
            adv_sq += x.advantage[size_t(j)] * x.advantage[size_t(j)];
            if (!own.empty()) {
              const double dn = double(own[k][size_t(j)]) - double(x.s.logprobs[size_t(j)]);
              nr_sum += std::abs(dn);
              m.logprob_diff_max_no_replay = std::max(m.logprob_diff_max_no_replay, std::abs(dn));
            }
            if (in_update) continue;  // the objective measures the rest during the update
            const double d = double(old[k][size_t(j)]) - double(x.s.logprobs[size_t(j)]);
            const double w = std::exp(d);
            dsum += std::abs(d);
            wsum += w;
            w_min = std::min(w_min, w);
            w_max = std::max(w_max, w);
            m.logprob_diff_max = std::max(m.logprob_diff_max, std::abs(d));
            ent_sum += ent[k][size_t(j)];
            if (reference) ref_kl_sum += kl_value(o.loss.kl, old[k][size_t(j)], ref[k][size_t(j)]);
          }
          adv_t.emplace_back(x.advantage.begin(), x.advantage.end());
        }
        set_token_values(u.p, PolicyObjective::kAdvantage, adv_t);
        set_token_values(u.p, PolicyObjective::kOldLogp, old);
        if (reference) set_token_values(u.p, PolicyObjective::kRefLogp, ref);
        if (o.loss.kind == PolicyLoss::Gspo) {  // the sequence ratio's grouping: each token's sample
          std::vector<std::vector<float>> sample_id;
          for (size_t k = 0; k < u.samples.size(); ++k)
            sample_id.emplace_back(kept[u.samples[k]].s.response.size(), float(k));
          set_token_values(u.p, PolicyObjective::kSample, sample_id);
        }
        if (critic) {
          std::vector<RolloutSample> cs;
          std::vector<std::vector<float>> ret_t, val_t, cw_t;
          for (size_t i : u.samples) {
            const Kept& x = kept[i];
            cs.push_back(x.s);
            cs.back().routing = RoutingRecord();
            ret_t.emplace_back(x.returns.begin(), x.returns.end());
            val_t.emplace_back(x.values.begin(), x.values.end());
            // The value loss's token mean over the mini-batch's trained tokens.
            cw_t.emplace_back(x.s.response.size(),
                              x.filtered ? 0.0f : float(1.0 / double(std::max<int64_t>(mb_tokens, 1))));
          }
          u.critic = pack_rollouts(cs, K);
          set_token_values(u.critic, ValueLossObjective::kReturn, ret_t);
          set_token_values(u.critic, ValueLossObjective::kOldValue, val_t);
          set_token_values(u.critic, ValueLossObjective::kWeight, cw_t);
        }
        minis[size_t(b)].push_back(std::move(u));
      }
      // The token weights (policy_loss.h minibatch_weights): the rollout/trainer mismatch masks and truncated
      // importance sampling on the trainer's old log-probs against the engine's, and the aggregation's
      // normaliser over the mini-batch's tokens and samples that neither overlong filtering nor a mask left out.
      std::vector<std::vector<double>> old_d, roll_d;
      std::vector<bool> filtered;
      std::vector<std::vector<uint8_t>> masks;
      for (size_t i = s0; i < s1; ++i) {
        masks.push_back(kept[i].s.model_mask);
        roll_d.emplace_back(kept[i].s.logprobs.begin(), kept[i].s.logprobs.end());
        // On-policy there is no mismatch correction: the weights need only the lengths.
        old_d.push_back(on_policy ? roll_d.back() : std::vector<double>(kept[i].old_lp.begin(), kept[i].old_lp.end()));
        filtered.push_back(kept[i].filtered);
      }
      const MiniBatchWeights mw =
          minibatch_weights(old_d, roll_d, filtered, o.aggregation, double(o.max_new_tokens), o.mismatch, masks);
      masked_tokens += mw.masked;
      for (UpdateMicroBatch& u : minis[size_t(b)]) {
        std::vector<std::vector<float>> w_t;
        for (size_t i : u.samples) w_t.emplace_back(mw.w[i - s0].begin(), mw.w[i - s0].end());
        set_token_values(u.p, PolicyObjective::kWeight, w_t);
      }
    }
    m.masked_fraction = double(masked_tokens) / double(tokens_all);
    m.logprob_diff_mean_no_replay = no_replay_check ? nr_sum / double(tokens_all) : -1;
    if (!no_replay_check) m.logprob_diff_max_no_replay = -1;
    m.advantage_mean = adv_sum / double(tokens_all);
    m.advantage_std = std::sqrt(std::max(0.0, adv_sq / double(tokens_all) - m.advantage_mean * m.advantage_mean));
  }

  // 4. The update: epochs x mini-batches optimizer steps, each over its micro-batches.
  void policy_steps() {
    const auto t = Clock::now();
    int64_t total_mbs = 0, done_mbs = 0;
    for (const auto& mb : minis) total_mbs += int64_t(mb.size());
    total_mbs *= o.epochs;
    auto last_line = Clock::now();
    for (int64_t e = 0; e < o.epochs; ++e)
      for (const std::vector<UpdateMicroBatch>& mb : minis) {
        std::vector<MicroBatch> batches;
        for (const UpdateMicroBatch& u : mb) {
          batches.push_back(pad_rows(u.p.mb, dp, K));
          train_tokens += sequence_tokens(u.p);
        }
        // The row metrics: on-policy, or from the first epoch's passes with the rollout's log-probs as the old ones
        // (the mismatch only from the first mini-batch, before the policy moves).
        const bool measure = in_update && e == 0, first = measure && &mb == &minis.front();
        PolicyObjective obj(o.loss, on_policy, measure);
        StepOptions so;
        so.lr = o.lr;
        so.objective = &obj;
        so.temperature = o.sampling.temperature;
        so.token_entropy = measure;  // the entropy metric
        so.aux_loss_coef = o.aux_loss_coef;
        so.router_z_loss_coef = o.router_z_loss_coef;
        if (o.freeze_router) so.frozen = is_router_weight;
        so.on_micro_batch = [&](int64_t, int64_t, const LossParts&) {
          ++done_mbs;
          if (o.progress_every_s > 0 && rank == 0 && seconds_since(last_line) >= o.progress_every_s &&
              done_mbs < total_mbs) {
            const double el = seconds_since(t);
            log_info("grpo: step ", step, " update: micro-batch ", done_mbs, "/", total_mbs, " (epoch ", e + 1, "/",
                     o.epochs, "), ", el, " s, ETA ", std::round(el / double(done_mbs) * double(total_mbs - done_mbs)),
                     " s");
            last_line = Clock::now();
          }
        };
        const StepResult r = session.train_step(batches, so);
        ++m.updates;
        m.micro_batches += int64_t(batches.size());
        m.loss += r.loss;
        m.grad_norm += r.opt.grad_norm;
        m.grad_norm_max = std::max(m.grad_norm_max, r.opt.grad_norm);
        const PolicyMetrics& pm = obj.metrics();
        pg_sum += pm.pg_loss;
        kl_sum += pm.kl_loss;
        clip_low += pm.clipped_low;
        clip_high += pm.clipped_high;
        clip_region += pm.clipped_region;
        clip_dual += pm.dual_clipped;
        approx_kl += pm.approx_kl;
        ref_kl_sum_update += pm.ref_kl;
        trained += pm.tokens;
        if (measure) {
          op_rows += pm.rows;
          ent_sum += pm.row_entropy;
          ref_kl_sum += pm.row_ref_kl;
          if (on_policy || first) {  // the mismatch, measured
            if (pm.rows > 0) {
              w_min = std::min(w_min, pm.weight_min);
              w_max = std::max(w_max, pm.weight_max);
            }
            dsum += pm.diff_sum;
            m.logprob_diff_max = std::max(m.logprob_diff_max, pm.diff_max);
            wsum += pm.weight_sum;
          } else {  // after the policy moved: the rollout's are the old log-probs, the weight 1
            wsum += double(pm.rows);
          }
        }
      }
    m.update_s = seconds_since(t);
  }

  // 5. PPO: the critic's update on the returns, the same epochs and mini-batches.
  void critic_steps() {
    const auto tc = Clock::now();
    int64_t c_updates = 0;
    for (int64_t e = 0; e < o.epochs; ++e)
      for (const std::vector<UpdateMicroBatch>& mb : minis) {
        std::vector<MicroBatch> batches;
        for (const UpdateMicroBatch& u : mb) {
          batches.push_back(pad_rows(u.critic.mb, dp, K));
          c_train_tokens += sequence_tokens(u.critic);
        }
        ValueLossObjective vobj(o.value_clip);
        StepOptions so;
        so.lr = o.critic_lr;
        so.objective = &vobj;
        const StepResult r = critic->train_step(batches, so);
        ++c_updates;
        m.value_loss += r.objective_sum;
        m.critic_grad_norm += r.opt.grad_norm;
        c_tokens += vobj.metrics().tokens;
        c_clipped += vobj.metrics().clipped;
      }
    m.value_loss /= double(c_updates);
    m.critic_grad_norm /= double(c_updates);
    m.critic_update_s = seconds_since(tc);
  }

  // 6. The metrics of the step.
  void finish_metrics() {
    // The objectives' own metrics are sums over this rank's rows: one all-gather after the update adds them
    // up over the ranks (every rank holds rows of its own; train_step reduced the loss and the norms).
    if (dist.distributed()) {
      const std::vector<double> all = comm::all_gather_doubles(
          *dist.world(),
          {pg_sum, kl_sum, double(clip_low), double(clip_high), approx_kl, double(trained), double(c_tokens),
           double(c_clipped), double(clip_region), double(clip_dual), ref_kl_sum_update, double(op_rows), dsum, wsum,
           ent_sum, ref_kl_sum, m.logprob_diff_max, w_min, w_max});
      pg_sum = kl_sum = approx_kl = ref_kl_sum_update = 0;
      clip_low = clip_high = clip_region = clip_dual = trained = c_tokens = c_clipped = 0;
      if (in_update) {  // else the rank's own sums below were over every sample already
        op_rows = 0;
        dsum = wsum = ent_sum = ref_kl_sum = 0;
      }
      constexpr size_t kStride = 19;
      for (size_t k = 0; k < all.size(); k += kStride) {
        if (in_update) {
          op_rows += int64_t(all[k + 11]);
          dsum += all[k + 12];
          wsum += all[k + 13];
          ent_sum += all[k + 14];
          ref_kl_sum += all[k + 15];
          m.logprob_diff_max = std::max(m.logprob_diff_max, all[k + 16]);
          if (all[k + 11] > 0) {
            w_min = std::min(w_min, all[k + 17]);
            w_max = std::max(w_max, all[k + 18]);
          }
        }
        pg_sum += all[k];
        kl_sum += all[k + 1];
        clip_low += int64_t(all[k + 2]);
        clip_high += int64_t(all[k + 3]);
        approx_kl += all[k + 4];
        trained += int64_t(all[k + 5]);
        c_tokens += int64_t(all[k + 6]);
        c_clipped += int64_t(all[k + 7]);
        clip_region += int64_t(all[k + 8]);
        clip_dual += int64_t(all[k + 9]);
        ref_kl_sum_update += all[k + 10];
      }
    }
    // The rollout/trainer mismatch, entropy and reference KL over the kept samples' response tokens: from the
    // forward before the update, or on-policy from the update's own (every target row, on some rank).
    const double measured = in_update ? double(std::max<int64_t>(op_rows, 1)) : double(tokens_all);
    m.logprob_diff_mean = dsum / measured;
    m.importance_weight_mean = wsum / measured;
    m.importance_weight_min = w_min;
    m.importance_weight_max = w_max;
    m.entropy = ent_sum / measured;
    m.ref_kl = reference ? ref_kl_sum / measured : 0;
    m.value_clip_frac = c_tokens > 0 ? double(c_clipped) / double(c_tokens) : 0.0;
    m.logprob_tokens_per_s = per_second(logprob_tokens, m.logprob_s);
    m.ref_logprob_tokens_per_s = per_second(ref_tokens, m.ref_logprob_s);
    m.train_tokens_per_s = per_second(train_tokens, m.update_s);
    m.critic_values_tokens_per_s = per_second(critic_value_tokens, m.critic_value_s);
    m.critic_update_tokens_per_s = per_second(c_train_tokens, m.critic_update_s);
    m.loss /= double(m.updates);
    m.grad_norm /= double(m.updates);
    m.policy_loss = pg_sum / double(m.updates);
    m.kl_loss = kl_sum / double(m.updates);
    if (trained > 0) {
      m.clip_low = double(clip_low) / double(trained);
      m.clip_high = double(clip_high) / double(trained);
      m.clip_region = double(clip_region) / double(trained);
      m.clip_dual = double(clip_dual) / double(trained);
      m.approx_kl = approx_kl / double(trained);
      m.ref_kl_update = ref_kl_sum_update / double(trained);
    }
  }
};

void update(TrainSession& session, std::vector<Kept>& kept, std::vector<double>& kept_rewards, int64_t kept_groups,
            const GrpoOptions& o, int64_t step, TrainSession* reference, TrainSession* critic, GrpoMetrics& m) {
  UpdatePhases u(session, kept, kept_rewards, kept_groups, o, step, reference, critic, m);
  if (o.kl_reward_coef > 0) u.kl_in_reward();
  u.advantages();
  u.pack();
  u.policy_steps();
  if (critic) u.critic_steps();
  u.finish_metrics();
}

}  // namespace

void validate(const GrpoOptions& o) {
  if (o.n < 2) MT_THROW("grpo: n = ", o.n, " samples per prompt; group advantages need n >= 2");
  if (o.max_new_tokens < 1) MT_THROW("grpo: max_new_tokens = ", o.max_new_tokens, "; need >= 1");
  if (!(o.sampling.temperature > 0) || !std::isfinite(o.sampling.temperature))
    MT_THROW("grpo: temperature ", o.sampling.temperature,
             "; need a finite value > 0 (sampled log-probs; 0 is greedy decoding, which has none)");
  if (!(o.lr >= 0) || !std::isfinite(o.lr)) MT_THROW("grpo: lr ", o.lr, "; need a finite value >= 0");
  if (o.max_generate_rounds < 1) MT_THROW("grpo: max_generate_rounds = ", o.max_generate_rounds, "; need >= 1");
  if (o.mismatch_every < 0) MT_THROW("grpo: mismatch_every = ", o.mismatch_every, "; need >= 0 (0: never)");
  if (!(o.kl_reward_coef >= 0) || !std::isfinite(o.kl_reward_coef))
    MT_THROW("grpo: kl_reward_coef ", o.kl_reward_coef, "; need a finite value >= 0 (0: off)");
  const MismatchConfig& mc = o.mismatch;
  if (!(mc.tis_cap >= 0) || !std::isfinite(mc.tis_cap))
    MT_THROW("grpo: mismatch.tis_cap ", mc.tis_cap, "; need a finite cap > 0 (0: off)");
  if (mc.token_mask_high > 0 && !(mc.token_mask_low >= 0 && mc.token_mask_low < mc.token_mask_high))
    MT_THROW("grpo: token mask [", mc.token_mask_low, ", ", mc.token_mask_high, "]; need 0 <= low < high");
  if (mc.seq_mask_high > 0 && !(mc.seq_mask_low >= 0 && mc.seq_mask_low < mc.seq_mask_high))
    MT_THROW("grpo: sequence mask [", mc.seq_mask_low, ", ", mc.seq_mask_high, "]; need 0 <= low < high");
  if (o.overlong_penalty < 0) MT_THROW("grpo: overlong_penalty ", o.overlong_penalty, "; need >= 0 (0 = off)");
  if (o.overlong_penalty > 0 && (o.overlong_buffer < 1 || o.overlong_buffer > o.max_new_tokens))
    MT_THROW("grpo: overlong_buffer ", o.overlong_buffer, " with max_new_tokens ", o.max_new_tokens,
             "; the soft overlong penalty needs 1 <= buffer <= max_new_tokens");
  if (o.epochs < 1) MT_THROW("grpo: epochs = ", o.epochs, "; need >= 1");
  if (o.mini_batches < 1) MT_THROW("grpo: mini_batches = ", o.mini_batches, "; need >= 1");
  if (o.micro_batch_samples < 0)
    MT_THROW("grpo: micro_batch_samples = ", o.micro_batch_samples, "; need >= 0 (0: one)");
  if (!(o.gamma >= 0 && o.gamma <= 1)) MT_THROW("grpo: gamma ", o.gamma, "; need a value in [0, 1]");
  if (!(o.lam >= 0 && o.lam <= 1)) MT_THROW("grpo: lam ", o.lam, "; need a value in [0, 1]");
  if (!std::isfinite(o.value_clip)) MT_THROW("grpo: value_clip ", o.value_clip, "; need a finite value (<= 0: off)");
  if (!(o.critic_lr >= 0) || !std::isfinite(o.critic_lr))
    MT_THROW("grpo: critic_lr ", o.critic_lr, "; need a finite value >= 0");
  for (const auto& [name, v] :
       {std::pair<const char*, double>{"aux_loss_coef", o.aux_loss_coef}, {"router_z_loss_coef", o.router_z_loss_coef}})
    if (!(v >= 0) || !std::isfinite(v)) MT_THROW("grpo: ", name, " ", v, "; need a finite value >= 0 (0: off)");
  validate(o.loss);
  if (o.env) {
    validate(o.multi_turn);
    if (!o.codec.decode || !o.codec.encode)
      MT_THROW("grpo: an environment needs a turn codec (GrpoOptions::codec: decode and encode)");
    if (per_turn_credit(o.multi_turn.credit) && o.overlong_penalty > 0)
      MT_THROW("grpo: overlong_penalty ", o.overlong_penalty,
               " shapes the episode's reward, which per-turn credit does not train on (it takes the turns' "
               "rewards); use final credit or no penalty");
  }
}

bool is_router_weight(const std::string& name) {
  const std::string suffix = ".mlp.gate.weight";
  return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

TpGenerator::TpGenerator(TrainSession& policy)
    : policy_(policy), model_(policy.config(), policy.device(), nullptr, Weights::Frozen) {
  if (policy.config().value_head) MT_THROW("TpGenerator: a value-head model has no next-token logits to sample from");
  if (const LoraAdapters* l = policy.lora()) {
    lora_ = std::make_unique<LoraAdapters>(policy.config(), l->spec(), policy.device(), 0);
    model_.attach_lora(lora_.get());
  }
  refresh();
}

double TpGenerator::refresh() {
  const auto t = Clock::now();
  if (lora_) lora_->load(policy_.lora()->params());    // whole on every rank, the same after each update
  if (lora_ && base_copied_) return seconds_since(t);  // a LoRA policy's base is frozen
  base_copied_ = true;
  // The copy's masters are host memory on CUDA too (a frozen model: LocalParams::host_masters).
  Tensor& flat = model_.params();
  if (policy_.fsdp() == nullptr) {
    flat.copy_from(policy_.master());  // the whole flat layout, from whichever device holds it
  } else {
    for (const ParamEntry& e : policy_.table().entries()) {
      const Tensor full = policy_.parallel().gather_param_host(e, /*grads=*/false);
      view_at(flat, e.offset, e.shape).copy_from(full);
    }
  }
  model_.refresh_compute_weights();
  return seconds_since(t);
}

void init_critic_from_policy(TrainSession& critic, TrainSession& policy) {
  if (!critic.config().value_head)
    MT_THROW("init_critic_from_policy: the critic's config has no value_head (it needs score.weight [1, D])");
  check_same_layout(policy, critic, "critic");
  const ParamTable& ct = critic.table();
  const ParamTable& pt = policy.table();
  const ParamEntry* score = ct.find("score.weight");
  MT_CHECK(score, "a value-head table without score.weight");
  // The body: the same entries in the same order before the head.
  for (const ParamEntry& e : ct.entries()) {
    if (e.name == "score.weight") continue;
    const ParamEntry* q = pt.find(e.name);
    if (!q || q->shape != e.shape || q->offset != e.offset)
      MT_THROW("init_critic_from_policy: the policy's ", e.name, " ", q ? "has another shape or place" : "is missing",
               "; the critic must be the policy's architecture with a scalar head");
  }
  // Shard by shard: each rank's pieces of the critic's flat layout (global ranges), the body's elements
  // taken from the policy's pieces on this rank (the same layout holds them), the head's zeroed.
  const int64_t body_end = score->offset, head_end = score->offset + score->numel;
  const Tensor pm = policy.master().to(Device::CPU);
  Tensor cm = critic.master().to(Device::CPU);
  const std::vector<FlatRange> pp = policy.parallel().pieces(pt);
  for (const FlatRange& c : critic.parallel().pieces(ct)) {
    const int64_t b = c.begin, e = std::min(c.end, body_end);
    int64_t copied = 0;
    for (const FlatRange& q : pp) {
      const int64_t lo = std::max(b, q.begin), hi = std::min(e, q.end);
      if (lo >= hi) continue;
      cm.rows(c.dst_offset + lo - c.begin, hi - lo).copy_from(pm.rows(q.dst_offset + lo - q.begin, hi - lo));
      copied += hi - lo;
    }
    if (b < e && copied != e - b)
      MT_THROW("init_critic_from_policy: rank ", critic.dist().rank(), " holds the critic's elements [", b, ", ", e,
               ") but only ", copied, " of them in its policy shard; the two sessions' shards differ");
    const int64_t h0 = std::max(c.begin, score->offset), h1 = std::min(c.end, head_end);
    if (h0 < h1) cm.rows(c.dst_offset + h0 - c.begin, h1 - h0).zero_();
  }
  if (critic.master().device() != Device::CPU) critic.master().copy_from(cm);  // else cm is the master itself
  critic.refresh_compute_weights();
}

GrpoMetrics grpo_step(TrainSession& session, RolloutEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                      const RewardFn& reward, const GrpoOptions& o, int64_t step, TrainSession* reference,
                      TrainSession* critic) {
  if (prompts.empty()) MT_THROW("grpo: no prompts");
  const PromptFn same = [&](int64_t count) {
    if (count != int64_t(prompts.size()))
      MT_THROW("grpo: ", count, " prompts asked of a fixed set of ", prompts.size());
    return prompts;
  };
  return grpo_step(session, engine, same, int64_t(prompts.size()), reward, o, step, reference, critic);
}

GrpoMetrics grpo_step(TrainSession& session, RolloutEngine& engine, const PromptFn& prompt_fn, int64_t groups,
                      const RewardFn& reward, const GrpoOptions& o, int64_t step, TrainSession* reference,
                      TrainSession* critic) {
  validate(o);
  if (groups < 1) MT_THROW("grpo: groups = ", groups, " prompts per step; need >= 1");
  if (o.mini_batches > groups)
    MT_THROW("grpo: mini_batches = ", o.mini_batches, " for ", groups, " groups a step; a mini-batch needs a group");
  check_sessions(session, o, reference, critic);
  DistContext& dist = session.dist();
  const int tp = dist.mesh().size(Axis::Tp), sp = dist.mesh().size(Axis::Sp), dp = dist.dp_size(),
            dp_rank = dist.dp_rank();
  if ((tp > 1 || sp > 1) && !o.before_generate)
    MT_THROW("grpo: generation under ", tp > 1 ? "tp " : "sp ", tp > 1 ? tp : sp,
             " needs a one-device generator copy (the engine's forward_cached cannot run on tp or sp shards): build "
             "the engine on TpGenerator(session).model() and set GrpoOptions::before_generate to its refresh");
  if (tp > 1 && o.replay_routing)
    MT_THROW("grpo: routing replay under tp ", tp,
             " is not supported (the model's tensor-parallel layers route for themselves); set replay_routing false");
  if (groups % dp != 0)
    MT_THROW("grpo: groups = ", groups, " prompts per step cannot be split evenly over ", dp,
             " data-parallel ranks (dp_replicate x dp_shard); use a multiple of ", dp);
  if (o.env) {
    if (o.token_reward) MT_THROW("grpo: an environment gives the rewards; token_reward must be unset with it");
    if (critic) MT_THROW("grpo: an environment with PPO's critic is not supported; use grpo or dr-grpo");
  }
  const ModelConfig& cfg = session.config();
  const int64_t n = o.n;
  GrpoMetrics m;
  int64_t episodes = 0, turns_sum = 0, obs_sum = 0, cut = 0;
  std::map<std::string, std::pair<double, int64_t>> env_sums;

  // 1. Generate, reward, keep: rounds of `groups` prompts until `groups` groups are kept. Each rank
  //    generates its share; after the exchange every rank holds the whole round.
  std::vector<Kept> kept;
  std::vector<double> kept_rewards;  // shaped, per kept sample
  double r_sum = 0, r_sq = 0, len_sum = 0, term_len_sum = 0;
  int64_t samples_seen = 0, drawn = 0, gen_tokens = 0, terminated = 0;
  const int64_t max_rounds = o.dynamic_sampling ? o.max_generate_rounds : 1;
  const int64_t g0 = int64_t(dp_rank) * (groups / dp), g1 = g0 + groups / dp;  // this rank's groups
  while (m.groups_kept < groups && m.generate_rounds < max_rounds) {
    auto t = Clock::now();
    const std::vector<std::vector<int32_t>> prompts = prompt_fn(groups);
    if (int64_t(prompts.size()) != groups)
      MT_THROW("grpo: the prompt source gave ", prompts.size(), " prompts for ", groups, " asked");
    // Every prompt checked on every rank, so a bad one stops all ranks before any collective.
    std::vector<GenerateRequest> reqs;
    for (size_t i = 0; i < prompts.size(); ++i) {
      if (prompts[i].empty()) MT_THROW("grpo: prompt ", drawn + int64_t(i), " of step ", step, " is empty");
      for (int32_t tok : prompts[i])
        if (tok < 0 || tok >= cfg.vocab_size)
          MT_THROW("grpo: prompt ", drawn + int64_t(i), " of step ", step, " has token ", tok,
                   " outside the vocabulary [0, ", cfg.vocab_size, ")");
      if (int64_t(prompts[i].size()) + o.max_new_tokens > cfg.max_position_embeddings)
        MT_THROW("grpo: prompt ", drawn + int64_t(i), " of step ", step, " (", prompts[i].size(),
                 " tokens) + max_new_tokens ", o.max_new_tokens, " exceeds max_position_embeddings ",
                 cfg.max_position_embeddings);
      GenerateRequest r;
      r.prompt = prompts[i];
      r.n = n;
      r.max_new_tokens = o.max_new_tokens;
      r.sampling = o.sampling;
      r.sampling.seed = mix64(o.seed ^ mix64(uint64_t(step) * 1000003 + uint64_t(drawn) + i));
      r.stop_token_ids = o.stop_token_ids;
      reqs.push_back(std::move(r));
    }
    drawn += groups;
    std::vector<GenerateRequest> mine(reqs.begin() + g0, reqs.begin() + g1);
    if (o.before_generate) m.weight_sync_s += o.before_generate();
    const double sync_before = engine.stats().weight_sync_seconds;
    std::vector<GeneratedSample> gen;
    MultiTurnRound episode_round;
    if (o.env) {
      // Episode ids unique in the run: the step and the round's first sample.
      const int64_t first_id = (step << 24) + drawn * n + g0 * n;  // one process's ids
      std::vector<nlohmann::json> meta;
      if (o.episode_metadata)
        for (int64_t g = g0; g < g1; ++g) meta.push_back(o.episode_metadata(g));
      episode_round = run_episodes(engine, mine, *o.env, o.codec, o.multi_turn, first_id, meta);
      gen = std::move(episode_round.samples);
      for (size_t i = 0; i < mine.size(); ++i) reqs[size_t(g0) + i].prompt = mine[i].prompt;  // init's observations
    } else {
      gen = engine.generate(mine);  // collective under FSDP and ep
    }
    m.weight_sync_s += engine.stats().weight_sync_seconds - sync_before;
    m.generate_s += seconds_since(t);
    ++m.generate_rounds;
    // This rank's rewards, on its samples indexed into the round's whole list (prompt_index, reqs). A
    // failure here becomes every rank's error at the exchange (no rank waits).
    for (GeneratedSample& x : gen) x.prompt_index += g0;
    t = Clock::now();
    std::vector<double> rewards;
    std::vector<std::vector<double>> steps;
    std::string error;
    try {
      if (int64_t(gen.size()) != (g1 - g0) * n)
        MT_THROW("grpo: the engine returned ", gen.size(), " samples for ", g1 - g0, " prompts x ", n);
      if (o.env) {
        for (const EpisodeResult& e : episode_round.episodes) rewards.push_back(e.final_reward());
      } else {
        rewards = reward(reqs, gen);
      }
      if (rewards.size() != gen.size()) MT_THROW("grpo: ", rewards.size(), " rewards for ", gen.size(), " samples");
      for (size_t i = 0; i < gen.size(); ++i)
        if (!std::isfinite(rewards[i]))
          MT_THROW("grpo: reward ", rewards[i], " for sample ", i % size_t(n), " of prompt ",
                   g0 + int64_t(i / size_t(n)));
      if (o.token_reward) {
        steps = o.token_reward(reqs, gen);
        if (steps.size() != gen.size())
          MT_THROW("grpo: ", steps.size(), " token reward rows for ", gen.size(), " samples");
        for (size_t i = 0; i < gen.size(); ++i)
          if (steps[i].size() != gen[i].tokens.size())
            MT_THROW("grpo: sample ", i % size_t(n), " of prompt ", g0 + int64_t(i / size_t(n)), " has ",
                     gen[i].tokens.size(), " tokens and ", steps[i].size(), " token rewards");
      }
    } catch (const std::exception& e) {
      if (!dist.distributed()) throw;
      error = e.what();
    }
    m.reward_s += seconds_since(t);
    if (dist.distributed())
      exchange_round(dist, cfg, prompts, error, gen, rewards, steps, o.token_reward != nullptr,
                     o.env ? &episode_round : nullptr, &reqs, groups / dp);
    // From here on every rank holds the whole round: what follows is the same computation everywhere.
    // Metrics over everything generated (the policy's behaviour), on the rewards as the function gave them.
    for (size_t i = 0; i < gen.size(); ++i) {
      const double r = rewards[i];
      r_sum += r;
      r_sq += r * r;
      const bool first = samples_seen + int64_t(i) == 0;
      m.reward_max = first ? r : std::max(m.reward_max, r);
      const double len = double(gen[i].tokens.size());
      len_sum += len;
      gen_tokens += int64_t(len);
      m.response_len_min = first ? len : std::min(m.response_len_min, len);
      m.response_len_max = std::max(m.response_len_max, len);
      if (gen[i].finish_reason == "length") {
        m.overlong_fraction += 1;
      } else {
        term_len_sum += len;
        ++terminated;
      }
    }
    samples_seen += int64_t(gen.size());
    if (o.env) {
      for (const EpisodeResult& e : episode_round.episodes) {
        ++episodes;
        turns_sum += int64_t(e.turn_rewards.size());
        obs_sum += e.observation_tokens;
        cut += e.error.empty() && !e.done;
      }
      m.env_errors += episode_round.errors;
      for (const auto& [k, v] : episode_round.env_metrics) {
        env_sums[k].first += v.first;
        env_sums[k].second += v.second;
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      bool any = false, correct = false;
      for (int64_t j = 0; j < n; ++j) {
        any = any || rewards[size_t(g * n + j)] > 0;
        correct = correct || rewards[size_t(g * n + j)] >= o.correct_reward;
      }
      m.groups_with_reward += any;
      m.groups_correct += correct;
    }
    // Shaping, then which groups carry a gradient.
    if (o.overlong_penalty > 0)
      for (size_t i = 0; i < gen.size(); ++i)
        rewards[i] += soft_overlong_penalty(int64_t(gen[i].tokens.size()), o.max_new_tokens, o.overlong_buffer,
                                            o.overlong_penalty);
    std::vector<bool> constant;
    if (o.env && per_turn_credit(o.multi_turn.credit)) {
      // Per-turn credit: a group carries a gradient when its turns' returns (turn_advantages) differ.
      std::vector<std::vector<double>> returns;
      for (const EpisodeResult& e : episode_round.episodes) {
        std::vector<double> ret = e.turn_rewards.empty() ? std::vector<double>{0.0} : e.turn_rewards;
        for (size_t k = ret.size() - 1; k-- > 0;) ret[k] += ret[k + 1];
        returns.push_back(std::move(ret));
      }
      constant = constant_step_groups(returns, n);
    } else {
      constant = o.token_reward ? constant_step_groups(steps, n) : constant_groups(rewards, n);
    }
    for (int64_t g = 0; g < groups; ++g) {
      m.groups_zero_variance += constant[size_t(g)];
      if ((o.dynamic_sampling && constant[size_t(g)]) || m.groups_kept >= groups) continue;
      ++m.groups_kept;
      for (int64_t j = 0; j < n; ++j) {
        const size_t i = size_t(g * n + j);
        const GeneratedSample& x = gen[i];
        if (x.prompt_index != g || x.sample_index != j)
          MT_THROW("grpo: the engine's sample ", i, " is prompt ", x.prompt_index, " sample ", x.sample_index,
                   "; expected prompt ", g, " sample ", j);
        Kept k;
        k.s.prompt = reqs[size_t(g)].prompt;
        k.s.response = x.tokens;
        k.s.logprobs = x.logprobs;
        if (o.replay_routing) k.s.routing = x.routing;
        k.filtered = o.overlong_filter && x.finish_reason == "length";
        if (o.token_reward) k.step_rewards = steps[i];
        if (o.env) {
          k.s.model_mask = x.model_mask;
          k.turn_rewards = episode_round.episodes[i].turn_rewards;
          k.token_turn = token_turns(x);
        }
        kept.push_back(std::move(k));
        kept_rewards.push_back(rewards[i]);
      }
    }
  }
  m.groups_generated = m.generate_rounds * groups;
  m.reward_mean = r_sum / double(samples_seen);
  m.reward_std = std::sqrt(std::max(0.0, r_sq / double(samples_seen) - m.reward_mean * m.reward_mean));
  m.response_len_mean = len_sum / double(samples_seen);
  m.overlong_fraction /= double(samples_seen);
  m.response_len_terminated_mean = terminated > 0 ? term_len_sum / double(terminated) : 0;
  m.groups_with_reward /= double(m.groups_generated);
  m.groups_correct /= double(m.groups_generated);
  m.groups_zero_variance /= double(m.groups_generated);
  m.rollout_tokens_per_s = per_second(gen_tokens, m.generate_s);
  if (episodes > 0) {
    m.turns_mean = double(turns_sum) / double(episodes);
    m.observation_tokens_mean = double(obs_sum) / double(episodes);
    m.env_error_fraction = double(m.env_errors) / double(episodes);
    m.episodes_cut_fraction = double(cut) / double(episodes);
    for (const auto& [k, v] : env_sums) m.env_metrics[k] = v.first / double(std::max<int64_t>(v.second, 1));
  }
  if (kept.empty()) {
    if (dist.rank() == 0)
      log_info("grpo: step ", step, ": no group with differing rewards in ", m.generate_rounds,
               " generate rounds; update skipped");
    return m;
  }
  update(session, kept, kept_rewards, m.groups_kept, o, step, reference, critic, m);
  return m;
}

GrpoMetrics grpo_update(TrainSession& session, const RolloutGroups& r, const GrpoOptions& o, int64_t step,
                        TrainSession* reference, TrainSession* critic) {
  validate(o);
  check_sessions(session, o, reference, critic);
  if (o.env)
    MT_THROW(
        "grpo_update: GrpoOptions::env is set, but the update takes given rollouts (their model_mask marks "
        "the observations); unset it");
  const size_t N = r.samples.size(), n = size_t(o.n);
  if (N == 0 || N % n != 0)
    MT_THROW("grpo_update: ", N, " samples; need whole groups of n = ", o.n, " (a positive multiple of n)");
  if (r.rewards.size() != N) MT_THROW("grpo_update: ", r.rewards.size(), " rewards for ", N, " samples");
  if (!r.token_rewards.empty() && r.token_rewards.size() != N)
    MT_THROW("grpo_update: ", r.token_rewards.size(), " token reward rows for ", N, " samples");
  if (!r.truncated.empty() && r.truncated.size() != N)
    MT_THROW("grpo_update: ", r.truncated.size(), " truncated flags for ", N, " samples");
  if (o.token_reward == nullptr && !r.token_rewards.empty())
    MT_THROW(
        "grpo_update: token rewards given but GrpoOptions::token_reward is unset (process advantages need it "
        "set; its function is not called here)");
  if (o.token_reward != nullptr && r.token_rewards.empty())
    MT_THROW("grpo_update: GrpoOptions::token_reward is set but the rollouts carry no token rewards");
  const int tp = session.dist().mesh().size(Axis::Tp);
  if (tp > 1 && o.replay_routing)
    for (const RolloutSample& s : r.samples)
      if (!s.routing.empty())
        MT_THROW("grpo_update: routing replay under tp ", tp,
                 " is not supported (the model's tensor-parallel layers route for themselves); set "
                 "replay_routing false or drop the samples' routing records");
  const int64_t groups = int64_t(N / n);
  if (o.mini_batches > groups)
    MT_THROW("grpo: mini_batches = ", o.mini_batches, " for ", groups, " groups; a mini-batch needs a group");
  std::vector<Kept> kept;
  std::vector<double> rewards;
  for (size_t i = 0; i < N; ++i) {
    Kept k;
    k.s = r.samples[i];
    if (!o.replay_routing) k.s.routing = RoutingRecord();
    if (k.s.response.empty() || k.s.logprobs.size() != k.s.response.size())
      MT_THROW("grpo_update: sample ", i, " has ", k.s.response.size(), " response tokens and ", k.s.logprobs.size(),
               " log-probs; need as many, at least one");
    if (!std::isfinite(r.rewards[i])) MT_THROW("grpo_update: reward ", r.rewards[i], " for sample ", i);
    if (!r.token_rewards.empty()) {
      if (r.token_rewards[i].size() != k.s.response.size())
        MT_THROW("grpo_update: sample ", i, " has ", k.s.response.size(), " tokens and ", r.token_rewards[i].size(),
                 " token rewards");
      k.step_rewards = r.token_rewards[i];
    }
    k.filtered = o.overlong_filter && !r.truncated.empty() && r.truncated[i];
    kept.push_back(std::move(k));
    rewards.push_back(r.rewards[i]);
  }
  GrpoMetrics m;
  m.groups_kept = groups;
  update(session, kept, rewards, groups, o, step, reference, critic, m);
  return m;
}

}  // namespace mt::rl
