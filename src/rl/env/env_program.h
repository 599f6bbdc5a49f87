// An environment that is a child process speaking JSON lines (docs/rl.md "Environments" specifies the
// protocol): one request line per episode and call, {"id": episode, "type": "init" | "step" | "close", ...},
// and one reply line per init or step request, {"id": episode, "observations": [...], "reward": x, "done": b},
// matched by id, so the program may answer in any order and keep many episodes in flight.
//
// Promises: a call writes its whole batch, then reads until every episode is answered, the program ends or
// the call's deadline (timeout_s) passes; nothing waits longer. A line that is not JSON, a reply without an
// id or with an id that is not in the call, a second reply for an episode and a reply missing a required
// field are errors that quote the line; the episode named by the line (when one is) fails. A crash or a missed
// deadline fails every episode not yet answered, naming what happened, and the program is started again for
// the next call. Per-episode failures are results (EnvInitResult/EnvStepResult::error), not exceptions, unless
// stop_on_error. A reward program (rewards.h) is the one-step case: reward_only runs one as an environment
// whose single step is scored by it and done.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "rl/env/child_process.h"
#include "rl/env/environment.h"
#include "rl/rewards/rewards.h"

namespace mt::rl {

struct EnvProgramOptions {
  std::string command;         // run with /bin/sh -c; its first word must name an executable
  double timeout_s = 60;       // per call (init or step), for the whole batch
  bool stop_on_error = false;  // a failed episode throws (with the first error) instead of being a result
  bool reward_only = false;    // the command is a reward program: init is local, step sends a reward request
};

// The protocol's messages (docs/rl.md "Environments"), shared by EnvProgram and the Python API's in-process
// environments: the init and step requests of an episode and a turn, and the replies' checks, each returning ""
// or what is wrong with the reply (filling the result as it goes).
nlohmann::json init_request(const EnvEpisode& e);
nlohmann::json step_request(const EnvTurn& t);
std::string parse_observations(const nlohmann::json& reply, std::vector<EnvObservation>& out);
std::string parse_step_reply(const nlohmann::json& reply, EnvStepResult& r);

class EnvProgram : public Environment {
 public:
  // Checks the options and that the command's program exists and is executable (an error naming it
  // otherwise), then starts it.
  explicit EnvProgram(EnvProgramOptions opt);
  ~EnvProgram() override;

  std::string name() const override { return "program:" + opt_.command; }
  std::vector<EnvInitResult> init(const std::vector<EnvEpisode>& episodes) override;
  std::vector<EnvStepResult> step(const std::vector<EnvTurn>& turns) override;
  void close(const std::vector<int64_t>& ids) override;

  // Over the program's life: episodes (items), the episodes that failed in any call (failures), the calls
  // and the stray lines. With reward_only: the reward program's samples.
  const FailureTally& tally() const;
  int64_t restarts() const;

 private:
  // One call: a request line per episode (ids in order), each reply handed to `parse` (which fills the
  // episode's result and returns "" or what is wrong with the reply); returns each episode's error ("" if
  // none) and reports, counts and (stop_on_error) throws failures and stray lines.
  std::vector<std::string> call(const char* kind, const std::vector<int64_t>& ids, const std::string& send,
                                const std::function<std::string(size_t, const nlohmann::json&)>& parse);
  EnvProgramOptions opt_;
  std::unique_ptr<ChildProcess> proc_;      // the environment program
  std::unique_ptr<RewardProgram> reward_;   // reward_only: the reward program
  std::map<int64_t, EnvEpisode> episodes_;  // reward_only: what a step's reward request needs
  FailureTally tally_;
  std::map<int64_t, bool> failed_;  // the episodes in flight: whether one of their calls failed
};

}  // namespace mt::rl
