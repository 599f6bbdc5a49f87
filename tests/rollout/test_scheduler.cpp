// The rollout scheduler alone (no model): admission stops at the KV block budget and at the token and
// running limits, in request order (a later, smaller prompt does not overtake); running sequences decode
// every step whatever waits, and are never preempted when blocks run out; an admitted prompt's samples
// fork its blocks (copy-on-write of the shared partial block at the next step); a finished sequence frees
// its blocks at once and a waiting prompt takes them in the next step.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "core/error.h"
#include "rollout/scheduler.h"

using namespace mt;

namespace {

constexpr int32_t kStop = 99, kToken = 1;

GenerateRequest request(int64_t prompt_len, int64_t max_new_tokens, int64_t n = 1) {
  GenerateRequest r;
  for (int64_t i = 0; i < prompt_len; ++i) r.prompt.push_back(int32_t(10 + i));
  r.max_new_tokens = max_new_tokens;
  r.n = n;
  r.stop_token_ids = {kStop};
  return r;
}

// The requests of the plan's entries, in plan order.
std::vector<int64_t> reqs_of(const StepPlan& plan) {
  std::vector<int64_t> out;
  for (const ScheduledSeq& e : plan.seqs) out.push_back(e.seq->req);
  return out;
}

// Every draw gets kToken, except those `stop` picks (by the drawing sequence and its draw row).
StepDraws draws(const StepPlan& plan, const std::function<bool(const ScheduledSeq&, int64_t)>& stop = {}) {
  StepDraws d;
  for (const ScheduledSeq& e : plan.seqs)
    for (int64_t j = 0; j < e.num_draws; ++j) {
      d.tokens.push_back(stop && stop(e, j) ? kStop : kToken);
      d.logprobs.push_back(-0.5f);
    }
  return d;
}

}  // namespace

TEST(RolloutScheduler, AdmissionStopsAtTheBlockBudget) {
  // 4-token blocks; each request may hold 8 + 8 tokens: 4 blocks. A pool of 9 holds two of them.
  KvBlockManager blocks(9, 4);
  const std::vector<GenerateRequest> reqs{request(8, 8), request(8, 8), request(8, 8)};
  Scheduler s(blocks, reqs, {});
  StepPlan p = s.schedule();
  EXPECT_EQ(reqs_of(p), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(p.num_prefills, 2);
  EXPECT_EQ(p.num_prefill_tokens, 16);
  EXPECT_EQ(s.num_waiting(), 1);
  EXPECT_EQ(blocks.stats().available_blocks, 1) << "both admitted prompts reserve their worst case";
  s.update(p, draws(p));
  // The third still does not fit while both run.
  for (int step = 0; step < 3; ++step) {
    p = s.schedule();
    EXPECT_EQ(p.num_prefills, 0) << "step " << step;
    EXPECT_EQ(s.num_waiting(), 1);
    s.update(p, draws(p));
  }
  blocks.check_invariants();
  EXPECT_EQ(s.num_running(), 2);
}

TEST(RolloutScheduler, AdmissionCountsEverySampleOfAPrompt) {
  // n = 3 samples of 8 + 8 tokens: 4 blocks for the first, 2 future blocks for each fork: 8 in all.
  KvBlockManager blocks(9, 4);
  const std::vector<GenerateRequest> reqs{request(8, 8, 3), request(2, 2)};
  Scheduler s(blocks, reqs, {.max_running = 4});
  StepPlan p = s.schedule();
  ASSERT_EQ(p.seqs.size(), 2u) << "8 + 1 blocks fit, 3 + 1 sequences fit max_running 4";
  EXPECT_EQ(p.seqs[0].num_draws, 3);
  EXPECT_EQ(p.num_draws, 4);
  s.update(p, draws(p));
  EXPECT_EQ(s.num_running(), 4);

  KvBlockManager tight(8, 4);
  Scheduler t(tight, reqs, {.max_running = 4});
  p = t.schedule();
  EXPECT_EQ(reqs_of(p), (std::vector<int64_t>{0})) << "the forks' blocks leave none for the second prompt";

  KvBlockManager roomy(64, 4);
  Scheduler u(roomy, reqs, {.max_running = 3});
  p = u.schedule();
  EXPECT_EQ(reqs_of(p), (std::vector<int64_t>{0})) << "a prompt counts as its n samples against max_running";
}

TEST(RolloutScheduler, DecodeSequencesKeepRunningWhilePromptsWait) {
  // A token budget of 1: a prompt joins only a step of its own, so once anything runs, prompts wait and
  // every running sequence still decodes its token each step.
  KvBlockManager blocks(64, 4);
  std::vector<GenerateRequest> reqs{request(6, 4, 2), request(6, 4), request(3, 4)};
  Scheduler s(blocks, reqs, {.max_step_tokens = 1});
  StepPlan p = s.schedule();
  EXPECT_EQ(reqs_of(p), (std::vector<int64_t>{0})) << "alone in its step, a prompt always fits";
  EXPECT_EQ(p.num_tokens, 6);
  s.update(p, draws(p));
  ASSERT_EQ(s.num_running(), 2);
  const SeqId a = s.running()[0]->id, b = s.running()[1]->id;
  for (int step = 0; step < 3; ++step) {
    p = s.schedule();
    ASSERT_EQ(p.seqs.size(), 2u) << "step " << step << ": decodes only, the prompts wait";
    EXPECT_EQ(p.num_decodes, 2);
    EXPECT_EQ(p.num_tokens, 2) << "decodes run past the token budget";
    EXPECT_TRUE(p.decode_only());
    EXPECT_EQ(p.seqs[0].seq->id, a) << "decodes in the order the sequences joined";
    EXPECT_EQ(p.seqs[1].seq->id, b);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_FALSE(p.seqs[i].prefill);
      EXPECT_EQ(p.seqs[i].first_token, int64_t(i));
      EXPECT_EQ(p.seqs[i].num_tokens, 1);
      EXPECT_EQ(p.seqs[i].first_draw, int64_t(i));
    }
    EXPECT_EQ(s.num_waiting(), 2);
    s.update(p, draws(p));
  }
  EXPECT_EQ(s.num_running(), 0) << "4 new tokens each: finished";
  EXPECT_EQ(s.num_finished(), 2);
  p = s.schedule();
  EXPECT_EQ(reqs_of(p), (std::vector<int64_t>{1})) << "the next prompt once nothing runs";
}

TEST(RolloutScheduler, TokenAndRunningLimitsAdmitInRequestOrder) {
  KvBlockManager blocks(64, 4);
  std::vector<GenerateRequest> reqs{request(6, 8), request(6, 8), request(3, 8), request(1, 8)};
  Scheduler s(blocks, reqs, {.max_step_tokens = 10, .max_running = 3});
  StepPlan p = s.schedule();
  EXPECT_EQ(reqs_of(p), (std::vector<int64_t>{0})) << "6 + 6 > 10; the 3-token prompt does not overtake";
  s.update(p, draws(p));
  p = s.schedule();
  EXPECT_EQ(reqs_of(p), (std::vector<int64_t>{0, 1, 2})) << "1 decode + 6 + 3 = 10 tokens";
  EXPECT_EQ(p.num_decodes, 1);
  EXPECT_EQ(p.seqs[1].first_token, 1);
  EXPECT_EQ(p.seqs[2].first_token, 7);
  EXPECT_EQ(p.seqs[2].first_draw, 2);
  s.update(p, draws(p));
  p = s.schedule();
  EXPECT_EQ(p.num_prefills, 0) << "3 running: max_running reached";
  EXPECT_EQ(s.num_waiting(), 1);
}

TEST(RolloutScheduler, WhenBlocksRunOutPromptsWaitInOrderAndNothingIsPreempted) {
  // 4-token blocks. Request 0 and 1 each reserve 4 blocks (4 + 12 tokens); request 2 needs 1. A pool of
  // 6: request 0 runs, request 1 must wait, and request 2, which would fit, waits behind it.
  KvBlockManager blocks(6, 4);
  const std::vector<GenerateRequest> reqs{request(4, 12), request(4, 12), request(1, 3)};
  Scheduler s(blocks, reqs, {});
  StepPlan p = s.schedule();
  EXPECT_EQ(reqs_of(p), (std::vector<int64_t>{0}));
  EXPECT_EQ(s.num_waiting(), 2);
  s.update(p, draws(p));
  const SeqId first = s.running()[0]->id;
  // Request 0 appends a block every 4 tokens, taking the pool's free blocks; it is never evicted or
  // recomputed, its earlier blocks stay in place, and the prompts keep waiting.
  std::vector<BlockId> table = blocks.block_table(first);
  for (int step = 1; step < 12; ++step) {
    p = s.schedule();
    ASSERT_EQ(p.seqs.size(), 1u) << "step " << step;
    EXPECT_EQ(p.seqs[0].seq->id, first);
    EXPECT_FALSE(p.seqs[0].prefill) << "never prefilled again";
    EXPECT_EQ(p.seqs[0].seq->cached, 3 + step) << "its cache is kept";
    const std::vector<BlockId>& now = blocks.block_table(first);
    ASSERT_GE(now.size(), table.size());
    EXPECT_TRUE(std::equal(table.begin(), table.end(), now.begin())) << "step " << step;
    table = now;
    EXPECT_EQ(s.num_waiting(), 2);
    s.update(p, draws(p));
  }
  EXPECT_EQ(s.num_finished(), 1) << "12 new tokens";
  EXPECT_FALSE(blocks.contains(first));
  p = s.schedule();
  EXPECT_EQ(reqs_of(p), (std::vector<int64_t>{1, 2})) << "the waiting prompts in request order";
  blocks.check_invariants();
}

TEST(RolloutScheduler, SamplesForkThePromptAndCopyTheSharedPartialBlock) {
  KvBlockManager blocks(64, 4);
  const std::vector<GenerateRequest> reqs{request(5, 4, 3)};
  Scheduler s(blocks, reqs, {});
  StepPlan p = s.schedule();
  ASSERT_EQ(p.seqs.size(), 1u);
  EXPECT_TRUE(p.seqs[0].prefill);
  EXPECT_EQ(p.seqs[0].num_tokens, 5);
  EXPECT_EQ(p.seqs[0].num_draws, 3);
  EXPECT_TRUE(p.copies.empty());
  s.update(p, draws(p));
  ASSERT_EQ(s.num_running(), 3);
  const std::vector<BlockId> parent = blocks.block_table(s.running()[0]->id);
  for (int64_t j = 0; j < 3; ++j) {
    const Sequence& q = *s.running()[size_t(j)];
    EXPECT_EQ(q.sample, j);
    EXPECT_EQ(q.tokens.size(), 6u) << "the prompt and its first token";
    EXPECT_EQ(q.cached, 5);
    EXPECT_EQ(blocks.block_table(q.id), parent) << "forks share the prompt's blocks";
  }
  // The partial last block (1 of its 4 slots filled) is shared by the three: the first two appenders copy
  // it, the last writes in place.
  p = s.schedule();
  EXPECT_EQ(p.copies.size(), 2u);
  EXPECT_EQ(p.num_decodes, 3);
  blocks.check_invariants();
}

TEST(RolloutScheduler, FinishedSequencesFreeTheirBlocks) {
  // Two samples of one prompt and a second prompt that needs the whole pool once they are gone.
  KvBlockManager blocks(8, 4);
  const std::vector<GenerateRequest> reqs{request(4, 8, 2), request(8, 24)};
  Scheduler s(blocks, reqs, {});
  StepPlan p = s.schedule();
  EXPECT_EQ(reqs_of(p), (std::vector<int64_t>{0}));
  s.update(p, draws(p));
  const SeqId s0 = s.running()[0]->id, s1 = s.running()[1]->id;
  // Sample 1 draws a stop token: it finishes now and its blocks go back; sample 0 runs on.
  const int64_t before = blocks.stats().available_blocks;
  p = s.schedule();
  s.update(p, draws(p, [&](const ScheduledSeq& e, int64_t) { return e.seq->id == s1; }));
  EXPECT_FALSE(blocks.contains(s1));
  EXPECT_TRUE(blocks.contains(s0));
  EXPECT_GT(blocks.stats().available_blocks, before) << "the stopped sample's reservation and block came back";
  ASSERT_EQ(s.num_finished(), 1);
  EXPECT_EQ(s.finished()[0]->finish_reason, "stop");
  EXPECT_EQ(s.finished()[0]->tokens.back(), kStop) << "the stop token is kept";
  EXPECT_EQ(s.num_waiting(), 1) << "request 1 needs all 8 blocks";
  // Sample 0 reaches max_new_tokens: "length", and request 1 is admitted in the very next step.
  while (s.num_running() > 0) {
    p = s.schedule();
    EXPECT_EQ(p.num_prefills, 0);
    s.update(p, draws(p));
  }
  EXPECT_EQ(s.finished()[1]->finish_reason, "length");
  EXPECT_EQ(s.finished()[1]->tokens.size(), 4u + 8u);
  EXPECT_EQ(blocks.stats().available_blocks, 8);
  EXPECT_EQ(blocks.stats().num_sequences, 0);
  p = s.schedule();
  EXPECT_EQ(reqs_of(p), (std::vector<int64_t>{1}));
  blocks.check_invariants();
}

TEST(RolloutScheduler, EosStopsUnlessIgnored) {
  KvBlockManager blocks(16, 4);
  std::vector<GenerateRequest> reqs{request(2, 8), request(2, 8)};
  reqs[1].ignore_eos = true;
  Scheduler s(blocks, reqs, {.eos_token_id = kToken});
  StepPlan p = s.schedule();
  s.update(p, draws(p));  // every draw is kToken, the EOS
  ASSERT_EQ(s.num_finished(), 1);
  EXPECT_EQ(s.finished()[0]->req, 0);
  EXPECT_EQ(s.finished()[0]->finish_reason, "stop");
  EXPECT_EQ(s.num_running(), 1);
}

TEST(RolloutScheduler, NothingToScheduleIsAnError) {
  KvBlockManager blocks(2, 4);
  const std::vector<GenerateRequest> reqs{request(8, 8)};  // 4 blocks: more than the pool
  Scheduler s(blocks, reqs, {});
  try {
    s.schedule();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nothing could be scheduled (1 waiting, 2 KV blocks available)"),
              std::string::npos)
        << e.what();
  }
  KvBlockManager empty(2, 4);
  const std::vector<GenerateRequest> none;
  Scheduler idle(empty, none, {});
  EXPECT_FALSE(idle.has_work());
  EXPECT_TRUE(idle.schedule().idle) << "an expert-parallel rank steps with nothing to run";
}
