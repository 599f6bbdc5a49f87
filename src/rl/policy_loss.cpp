// Policy losses (policy_loss.h); fp64 on the host, per token.
#include "rl/policy_loss.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.h"

namespace mt::rl {

PolicyLoss parse_policy_loss(const std::string& s) {
  if (s == "ppo") return PolicyLoss::PpoClip;
  if (s == "gspo") return PolicyLoss::Gspo;
  if (s == "pg") return PolicyLoss::PolicyGradient;
  MT_THROW("unknown policy loss '", s, "'; allowed: ppo, gspo, pg");
}

KlEstimator parse_kl_estimator(const std::string& s) {
  if (s == "k1") return KlEstimator::K1;
  if (s == "k2") return KlEstimator::K2;
  if (s == "k3") return KlEstimator::K3;
  MT_THROW("unknown KL estimator '", s, "'; allowed: k1, k2, k3");
}

LossAggregation parse_loss_aggregation(const std::string& s) {
  if (s == "token-mean") return LossAggregation::TokenMean;
  if (s == "seq-mean-token-sum") return LossAggregation::SeqMeanTokenSum;
  if (s == "seq-mean-token-mean") return LossAggregation::SeqMeanTokenMean;
  if (s == "constant") return LossAggregation::Constant;
  MT_THROW("unknown loss aggregation '", s,
           "'; allowed: token-mean, seq-mean-token-sum, seq-mean-token-mean, constant");
}

void validate(const PolicyLossConfig& c) {
  if (!(c.clip_low >= 0 && c.clip_low < 1)) MT_THROW("clip_low (", c.clip_low, ") must be in [0, 1)");
  if (!(c.clip_high >= 0) || !std::isfinite(c.clip_high))
    MT_THROW("clip_high (", c.clip_high, ") must be finite and >= 0");
  if (c.dual_clip != 0 && (!(c.dual_clip > 1) || !std::isfinite(c.dual_clip)))
    MT_THROW("dual_clip (", c.dual_clip, ") must be > 1 and finite, or 0 (off)");
  if (!(c.kl_coef >= 0) || !std::isfinite(c.kl_coef)) MT_THROW("kl_coef (", c.kl_coef, ") must be finite and >= 0");
  if (!std::isfinite(c.entropy_coef)) MT_THROW("entropy_coef (", c.entropy_coef, ") must be finite");
}

TokenTerm policy_term(const PolicyLossConfig& c, double log_ratio, double A) {
  TokenTerm t;
  const double r = std::exp(log_ratio);
  if (c.kind == PolicyLoss::PolicyGradient) {
    t.loss = -A * r;
    t.dlogp = -A * r;
    return t;
  }
  const double lo = 1 - c.clip_low, hi = 1 + c.clip_high;
  const double unclipped = -A * r, clipped = -A * std::clamp(r, lo, hi);
  // max(-A r, -A clip(r)): the clipped term wins only where the clamp is active and pessimistic.
  if (clipped > unclipped) {
    t.loss = clipped;
    t.dlogp = 0;
    t.clipped_high = r > hi;  // A > 0 and the ratio above the range
    t.clipped_low = r < lo;   // A < 0 and the ratio below it
  } else {
    t.loss = unclipped;
    t.dlogp = -A * r;
  }
  if (c.dual_clip > 0 && A < 0 && -A * c.dual_clip < t.loss) {  // the ratio far above 1 with A < 0
    t.loss = -A * c.dual_clip;
    t.dlogp = 0;
    t.dual_clipped = true;
  }
  return t;
}

double kl_value(KlEstimator k, double logp, double ref) {
  const double d = ref - logp;
  switch (k) {
    case KlEstimator::K1:
      return -d;
    case KlEstimator::K2:
      return 0.5 * d * d;
    case KlEstimator::K3:
      return std::exp(d) - d - 1;
  }
  return 0;
}

double kl_grad(KlEstimator k, double logp, double ref) {
  const double d = ref - logp;
  switch (k) {
    case KlEstimator::K1:
      return 1;
    case KlEstimator::K2:
      return -d;
    case KlEstimator::K3:
      return 1 - std::exp(d);
  }
  return 0;
}

namespace {
// The mismatch corrections of one sample's tokens: the TIS weight, 0 where a mask takes the token (`kept`
// false there).
std::vector<double> corrections(std::span<const double> old_logp, std::span<const double> rollout_logp,
                                const MismatchConfig& m, std::vector<bool>& kept) {
  if (old_logp.size() != rollout_logp.size())
    MT_THROW("token_weights: ", old_logp.size(), " trainer log-probs but ", rollout_logp.size(), " rollout log-probs");
  const size_t T = old_logp.size();
  std::vector<double> w(T, 1.0);
  kept.assign(T, true);
  double sum = 0;
  for (size_t t = 0; t < T; ++t) sum += old_logp[t] - rollout_logp[t];
  const bool seq_on = m.seq_mask_high > 0 && T > 0;
  const double geo = T > 0 ? std::exp(sum / double(T)) : 1.0;
  if (seq_on && (geo < m.seq_mask_low || geo > m.seq_mask_high)) {
    std::fill(w.begin(), w.end(), 0.0);
    kept.assign(T, false);
    return w;
  }
  const double seq_tis = m.tis_cap > 0 && m.tis_sequence ? std::min(std::exp(sum), m.tis_cap) : 1.0;
  for (size_t t = 0; t < T; ++t) {
    const double ratio = std::exp(old_logp[t] - rollout_logp[t]);
    if (m.token_mask_high > 0 && (ratio < m.token_mask_low || ratio > m.token_mask_high)) {
      w[t] = 0;
      kept[t] = false;
      continue;
    }
    w[t] = m.tis_cap > 0 ? (m.tis_sequence ? seq_tis : std::min(ratio, m.tis_cap)) : 1.0;
  }
  return w;
}
}  // namespace

std::vector<double> token_weights(std::span<const double> old_logp, std::span<const double> rollout_logp, double norm,
                                  const MismatchConfig& m, int64_t* masked) {
  std::vector<bool> kept;
  std::vector<double> w = corrections(old_logp, rollout_logp, m, kept);
  for (double& x : w) x *= norm;
  if (masked) *masked = int64_t(std::count(kept.begin(), kept.end(), false));
  return w;
}

MiniBatchWeights minibatch_weights(const std::vector<std::vector<double>>& old_logp,
                                   const std::vector<std::vector<double>>& rollout_logp,
                                   const std::vector<bool>& filtered, LossAggregation a, double constant,
                                   const MismatchConfig& m, const std::vector<std::vector<uint8_t>>& model_mask) {
  const size_t B = old_logp.size();
  if (rollout_logp.size() != B || filtered.size() != B)
    MT_THROW("minibatch_weights: ", B, " samples of trainer log-probs, ", rollout_logp.size(),
             " of rollout log-probs and ", filtered.size(), " filter flags; need one each per sample");
  if (!model_mask.empty() && model_mask.size() != B)
    MT_THROW("minibatch_weights: ", model_mask.size(), " model masks for ", B, " samples; need one per sample or none");
  MiniBatchWeights out;
  out.w.resize(B);
  std::vector<int64_t> length(B, 0);
  for (size_t i = 0; i < B; ++i) {
    std::vector<bool> kept;
    const std::vector<uint8_t>* mask = model_mask.empty() || model_mask[i].empty() ? nullptr : &model_mask[i];
    if (mask) {
      // The corrections over the model's tokens alone, scattered back; observations get 0 and count nowhere.
      if (mask->size() != old_logp[i].size() || rollout_logp[i].size() != old_logp[i].size())
        MT_THROW("minibatch_weights: sample ", i, " has ", mask->size(), " model-mask entries, ", old_logp[i].size(),
                 " trainer and ", rollout_logp[i].size(), " rollout log-probs; need one of each per response token");
      std::vector<double> o_m, r_m;
      for (size_t t = 0; t < mask->size(); ++t)
        if ((*mask)[t]) {
          o_m.push_back(old_logp[i][t]);
          r_m.push_back(rollout_logp[i][t]);
        }
      std::vector<bool> kept_m;
      const std::vector<double> w_m = corrections(o_m, r_m, m, kept_m);
      out.w[i].assign(mask->size(), 0.0);
      for (size_t t = 0, k = 0; t < mask->size(); ++t)
        if ((*mask)[t]) {
          out.w[i][t] = w_m[k];
          kept.push_back(kept_m[k++]);
        }
    } else {
      out.w[i] = corrections(old_logp[i], rollout_logp[i], m, kept);
    }
    if (filtered[i]) {
      std::fill(out.w[i].begin(), out.w[i].end(), 0.0);
      continue;
    }
    length[i] = int64_t(std::count(kept.begin(), kept.end(), true));
    out.masked += int64_t(kept.size()) - length[i];
    out.tokens += length[i];
    out.samples += length[i] > 0 ? 1 : 0;
  }
  for (size_t i = 0; i < B; ++i) {
    const double norm = length[i] > 0 ? aggregation_norm(a, length[i], out.tokens, out.samples, constant) : 0.0;
    for (double& x : out.w[i]) x *= norm;
  }
  return out;
}

double aggregation_norm(LossAggregation a, int64_t length, int64_t step_tokens, int64_t step_samples, double constant) {
  if (length < 1 || step_tokens < 1 || step_samples < 1)
    MT_THROW("aggregation_norm: length ", length, ", step tokens ", step_tokens, " and step samples ", step_samples,
             " must be >= 1");
  switch (a) {
    case LossAggregation::TokenMean:
      return 1.0 / double(step_tokens);
    case LossAggregation::SeqMeanTokenSum:
      return 1.0 / double(step_samples);
    case LossAggregation::SeqMeanTokenMean:
      return 1.0 / (double(step_samples) * double(length));
    case LossAggregation::Constant:
      if (!(constant > 0)) MT_THROW("aggregation_norm: the constant normaliser ", constant, " must be > 0");
      return 1.0 / (double(step_samples) * constant);
  }
  return 0;
}

PolicyObjective::PolicyObjective(const PolicyLossConfig& c, bool on_policy) : PolicyObjective(c, on_policy, on_policy) {}

PolicyObjective::PolicyObjective(const PolicyLossConfig& c, bool on_policy, bool measure_rows)
    : cfg_(c), on_policy_(on_policy), measure_rows_(measure_rows) {
  validate(c);
}

double PolicyObjective::coefficients(const TokenRows& rows, Tensor& dlogp, Tensor* dentropy) const {
  const int64_t n = rows.rows;
  const size_t need = cfg_.kind == PolicyLoss::Gspo ? kSample + 1 : cfg_.kl_coef > 0 ? kRefLogp + 1 : kWeight + 1;
  if (rows.values.size() < need)
    MT_THROW("PolicyObjective: the micro-batch carries ", rows.values.size(), " token values; this loss needs ", need,
             " (advantage, old log-prob, weight", cfg_.kl_coef > 0 ? ", reference log-prob" : "",
             cfg_.kind == PolicyLoss::Gspo ? ", sample id" : "", ")");
  const Tensor logp_h = rows.logp.to(Device::CPU);
  Tensor ent_h;
  if (rows.entropy.defined()) ent_h = rows.entropy.to(Device::CPU);
  const float* lp = logp_h.data<float>();
  const int64_t* lab = rows.labels.data<int64_t>();
  auto val = [&](int k, int64_t t) { return double(rows.values[size_t(k)].data<float>()[t]); };
  // The old log-prob of row t: the slot's, or on-policy the row's own (the slot then holds the engine's).
  auto old_of = [&](int64_t t) { return on_policy_ ? double(lp[t]) : val(kOldLogp, t); };
  if (measure_rows_) {
    const bool has_ref = rows.values.size() > size_t(kRefLogp);
    for (int64_t t = 0; t < n; ++t) {
      if (lab[t] == -100) continue;
      const double d = double(lp[t]) - val(kOldLogp, t), w = std::exp(d);
      if (metrics_.rows == 0) metrics_.weight_min = metrics_.weight_max = w;
      ++metrics_.rows;
      metrics_.diff_sum += std::abs(d);
      metrics_.diff_max = std::max(metrics_.diff_max, std::abs(d));
      metrics_.weight_sum += w;
      metrics_.weight_min = std::min(metrics_.weight_min, w);
      metrics_.weight_max = std::max(metrics_.weight_max, w);
      if (ent_h.defined()) metrics_.row_entropy += double(ent_h.data<float>()[t]);
      if (has_ref) metrics_.row_ref_kl += kl_value(cfg_.kl, double(lp[t]), val(kRefLogp, t));
    }
  }
  // GSPO: each sample's mean log ratio over its tokens in these rows, those of weight 0 (masked) left out.
  std::map<int64_t, std::pair<double, int64_t>> seq;
  if (cfg_.kind == PolicyLoss::Gspo)
    for (int64_t t = 0; t < n; ++t)
      if (lab[t] != -100 && val(kWeight, t) != 0) {
        auto& s = seq[int64_t(val(kSample, t))];
        s.first += double(lp[t]) - old_of(t);
        ++s.second;
      }
  Tensor g = Tensor::zeros({n}), h = Tensor::zeros({n});
  double loss = 0;
  for (int64_t t = 0; t < n; ++t) {
    // Weight 0 (overlong-filtered, masked): no loss, no gradient, and not a trained token of the metrics.
    if (lab[t] == -100 || val(kWeight, t) == 0) continue;
    const double w = val(kWeight, t), A = val(kAdvantage, t), old = old_of(t), logp = double(lp[t]);
    double log_ratio = logp - old;
    if (cfg_.kind == PolicyLoss::Gspo) {
      const auto& s = seq[int64_t(val(kSample, t))];
      log_ratio = s.second > 0 ? s.first / double(s.second) : 0.0;  // a masked token of a wholly masked sample
    }
    const TokenTerm term = policy_term(cfg_, log_ratio, A);
    double dl = term.dlogp, l = term.loss;
    metrics_.pg_loss += w * term.loss;
    if (cfg_.kl_coef > 0) {
      const double ref = val(kRefLogp, t), k = kl_value(cfg_.kl, logp, ref);
      l += cfg_.kl_coef * k;
      dl += cfg_.kl_coef * kl_grad(cfg_.kl, logp, ref);
      metrics_.kl_loss += w * cfg_.kl_coef * k;
      metrics_.ref_kl += k;
    }
    if (needs_entropy()) {
      const double H = double(ent_h.data<float>()[t]);
      l -= cfg_.entropy_coef * H;
      h.data<float>()[t] = float(-cfg_.entropy_coef * w);
      metrics_.entropy_loss -= w * cfg_.entropy_coef * H;
      metrics_.entropy += H;
    }
    g.data<float>()[t] = float(w * dl);
    loss += w * l;
    ++metrics_.tokens;
    metrics_.clipped_low += term.clipped_low;
    metrics_.clipped_high += term.clipped_high;
    metrics_.clipped_region += term.clipped_low || term.clipped_high;
    metrics_.dual_clipped += term.dual_clipped;
    metrics_.approx_kl += old - logp;
  }
  dlogp.copy_from(g.to(dlogp.device()));
  if (dentropy) dentropy->copy_from(h.to(dentropy->device()));
  return loss;
}

}  // namespace mt::rl
