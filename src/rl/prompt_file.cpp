// A prompt file for RL: reading and checking it, the sampler, the rewards (prompt_file.h).
#include "rl/prompt_file.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <utility>

#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"

namespace mt::rl {

using json = nlohmann::json;

PromptFile load_prompt_file(const std::string& path, const ModelConfig& cfg, int64_t max_new_tokens,
                            const Tokenizer* tok, FileReward reward) {
  const int64_t room = cfg.max_position_embeddings - max_new_tokens;
  if (room < 1)
    MT_THROW("grpo: --max-new-tokens ", max_new_tokens, " leaves no room for a prompt in the model's ",
             cfg.max_position_embeddings, " positions");
  PromptFile f;
  f.path = path;
  f.prompts = read_prompts(path, cfg.vocab_size, room, tok);  // errors name the line (and the tokenizer's absence)
  const bool needs_answer = reward == FileReward::Exact || reward == FileReward::Math;
  for (const Prompt& p : f.prompts) {
    const std::string where = path + ":" + std::to_string(p.line);
    auto it = p.meta.find("answer");
    if (it == p.meta.end()) {
      if (needs_answer)
        MT_THROW(where, ": no \"answer\"; the ", reward == FileReward::Exact ? "exact" : "math",
                 " reward compares the response with it (add \"answer\" or use --reward program:CMD)");
      f.answers.emplace_back();
      f.answer_ids.emplace_back();
      continue;
    }
    const json& a = *it;
    std::vector<int32_t> ids;
    std::string text;
    if (a.is_string())
      text = a.get<std::string>();
    else if (a.is_number())
      text = a.dump();
    else if (a.is_array() && !tok && reward == FileReward::Exact) {
      for (size_t i = 0; i < a.size(); ++i) {
        if (!a[i].is_number_integer() || a[i].get<int64_t>() < 0 || a[i].get<int64_t>() >= cfg.vocab_size)
          MT_THROW(where, ": answer[", i, "] is ", a[i].dump(), ", not a token id in [0, ", cfg.vocab_size, ")");
        ids.push_back(int32_t(a[i].get<int64_t>()));
      }
    } else if (needs_answer) {
      MT_THROW(
          where, ": \"answer\" is ", a.dump().substr(0, 80), "; ",
          tok ? "use a string or a number" : "without a tokenizer, exact match compares token ids: use a list of ids");
    }
    if (needs_answer && !tok && ids.empty())
      MT_THROW(where, ": \"answer\" is ", a.dump().substr(0, 80),
               "; the model directory has no tokenizer.json, so responses have no text: exact match then "
               "compares token ids (give \"answer\" as a list of ids), and math needs the tokenizer");
    f.answers.push_back(std::move(text));
    f.answer_ids.push_back(std::move(ids));
  }
  return f;
}

int64_t PromptSampler::next() {
  const int64_t epoch = pos_ / size_;
  if (epoch != epoch_) {
    order_.resize(size_t(size_));
    for (int64_t i = 0; i < size_; ++i) order_[size_t(i)] = i;
    Rng rng{mix64(seed_ ^ mix64(uint64_t(epoch) + 0x70726f6d7074ull))};
    for (int64_t i = size_ - 1; i > 0; --i) std::swap(order_[size_t(i)], order_[size_t(rng.randint(0, i + 1))]);
    epoch_ = epoch;
  }
  return order_[size_t(pos_++ % size_)];
}

// The response without its final stop token (the EOS or a stop token, which the engine includes).
std::vector<int32_t> response_ids(const GeneratedSample& g) {
  std::vector<int32_t> ids = g.tokens;
  if (g.finish_reason == "stop" && !ids.empty()) ids.pop_back();
  return ids;
}

std::string decode_text(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::vector<uint32_t> u;  // ids the tokenizer lacks (a padded vocabulary) have no text
  for (int32_t t : ids)
    if (t >= 0 && uint32_t(t) < tok.vocab_size()) u.push_back(uint32_t(t));
  return tok.decode(u, true);
}

std::vector<double> FileRewarder::operator()(const PromptFile& f, const std::vector<int64_t>& which,
                                             const std::vector<GeneratedSample>& gen) const {
  if (kind == FileReward::Environment)
    MT_THROW("grpo: the prompt file's rewarder was asked for rewards the environment gives (--env)");
  std::vector<double> r(gen.size(), 0.0);
  std::vector<RewardRequest> reqs;
  for (size_t i = 0; i < gen.size(); ++i) {
    const int64_t k = which.at(size_t(gen[i].prompt_index));
    const Prompt& p = f.prompts[size_t(k)];
    const std::vector<int32_t> ids = response_ids(gen[i]);
    if (kind == FileReward::Exact && !tok) {
      r[i] = ids == f.answer_ids[size_t(k)] ? 1.0 : 0.0;
    } else if (kind == FileReward::Exact) {
      r[i] = exact_match_reward(decode_text(*tok, ids), f.answers[size_t(k)]);
    } else if (kind == FileReward::Math) {
      r[i] = math_reward(decode_text(*tok, ids), f.answers[size_t(k)]);
    } else {
      RewardRequest q;
      auto pt = p.meta.find("prompt");
      q.prompt = pt != p.meta.end() && pt->is_string()
                     ? pt->get<std::string>()
                     : (tok ? tok->decode(std::vector<uint32_t>(p.ids.begin(), p.ids.end())) : json(p.ids).dump());
      q.response = tok ? decode_text(*tok, ids) : json(ids).dump();
      q.metadata = p.meta;
      reqs.push_back(std::move(q));
    }
  }
  if (kind == FileReward::Program) {
    const RewardBatch b = program->score(reqs);
    r = b.rewards;
  }
  return r;
}

std::unique_ptr<PromptRun> open_prompt_run(const std::string& train_path, const std::string& eval_path,
                                           const std::string& model_dir, const ModelConfig& cfg, int64_t max_new_tokens,
                                           FileReward reward, const RewardProgramOptions& program) {
  auto run = std::make_unique<PromptRun>();
  const std::string tokenizer_path = model_dir + "/tokenizer.json";
  if (std::filesystem::exists(tokenizer_path)) run->tokenizer = Tokenizer::from_file(tokenizer_path);
  const Tokenizer* tok = run->tokenizer ? &*run->tokenizer : nullptr;
  if (!tok && reward == FileReward::Math)
    MT_THROW("grpo: --reward math reads the response's text, and ", model_dir,
             " has no tokenizer.json to decode it; add the tokenizer or use exact (token ids)");
  run->train = load_prompt_file(train_path, cfg, max_new_tokens, tok, reward);
  if (!eval_path.empty()) run->eval = load_prompt_file(eval_path, cfg, max_new_tokens, tok, reward);
  if (reward == FileReward::Program)
    run->program = std::make_unique<RewardProgram>(program);  // an error naming a missing or non-executable one
  run->rewarder.kind = reward;
  run->rewarder.tok = tok;
  run->rewarder.program = run->program.get();
  // Stops: the model's EOS (the engine's own), and the chat template's ends when the tokenizer has them.
  if (tok)
    for (const char* s : {"<|im_end|>", "<|endoftext|>"}) {
      const int64_t id = tok->token_to_id(s);
      if (id >= 0 && id < cfg.vocab_size && id != cfg.eos_token_id) run->stop_token_ids.push_back(int32_t(id));
    }
  log_info(
      "grpo: ", run->train.prompts.size(), " prompts from ", train_path,
      run->eval.prompts.empty() ? std::string() : str(", ", run->eval.prompts.size(), " held-out from ", eval_path),
      "; reward ",
      reward == FileReward::Exact  ? (tok ? "exact match (text)" : "exact match (token ids)")
      : reward == FileReward::Math        ? "math"
      : reward == FileReward::Environment ? "the environment's (--env)"
                                          : "program: " + program.command,
      tok ? "; tokenizer " + tokenizer_path : std::string("; no tokenizer"));
  return run;
}

}  // namespace mt::rl
