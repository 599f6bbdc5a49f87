// Tests of detect_dist_env with fake environments: each launcher's variables, the order in which
// sources win, Slurm's compressed lists, and the errors (variable, value, what is allowed).
#include <map>

#include "comm/dist_env.h"
#include "test_util.h"

namespace mt::comm {
namespace {

using testutil::error_of;
using Env = std::map<std::string, std::string>;

DistEnv detect(const Env& env) {
  return detect_dist_env([&](const std::string& k) -> std::optional<std::string> {
    auto it = env.find(k);
    if (it == env.end()) return std::nullopt;
    return it->second;
  });
}

TEST(DistEnv, NothingSetIsRankZeroOfOne) {
  DistEnv d = detect({});
  EXPECT_EQ(d.rank, 0);
  EXPECT_EQ(d.world_size, 1);
  EXPECT_EQ(d.local_rank, 0);
  EXPECT_EQ(d.local_world_size, 1);
  EXPECT_EQ(d.source, "single");
  EXPECT_EQ(d.str(), "rank 0 of 1 (local 0 of 1, node 0), master 127.0.0.1:0, from single");
}

TEST(DistEnv, TorchrunStyle) {
  DistEnv d = detect({{"RANK", "5"},
                      {"WORLD_SIZE", "8"},
                      {"LOCAL_RANK", "1"},
                      {"LOCAL_WORLD_SIZE", "4"},
                      {"NODE_RANK", "1"},
                      {"MASTER_ADDR", "10.0.0.1"},
                      {"MASTER_PORT", "29500"}});
  EXPECT_EQ(d.str(), "rank 5 of 8 (local 1 of 4, node 1), master 10.0.0.1:29500, from env");
  // torchrun names the node GROUP_RANK; without local variables all ranks are on one node.
  d = detect({{"RANK", "2"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_EQ(d.str(), "rank 2 of 4 (local 2 of 4, node 0), master h:1, from env");
  d = detect({{"RANK", "6"},
              {"WORLD_SIZE", "8"},
              {"LOCAL_WORLD_SIZE", "4"},
              {"GROUP_RANK", "1"},
              {"MASTER_ADDR", "h"},
              {"MASTER_PORT", "1"}});
  EXPECT_EQ(d.local_rank, 2);
  EXPECT_EQ(d.node_rank, 1);
}

// Under torchrun the agent's own store listens on MASTER_PORT; the ranks rendezvous on the next port.
TEST(DistEnv, UnderTorchrunTheStoreTakesTheNextPort) {
  Env e = {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"},
           {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
  EXPECT_EQ(detect(e).str(), "rank 1 of 2 (local 1 of 2, node 0), master h:29501, from torchrun");
  e["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  EXPECT_EQ(detect(e).master_port, 29500);
  e["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  e["MASTER_PORT"] = "65535";
  EXPECT_NE(error_of([&] { detect(e); }).find("MASTER_PORT (65535) leaves no port"), std::string::npos);
}

TEST(DistEnv, TorchrunStyleWinsOverSlurmAndMpi) {
  Env e = {{"RANK", "1"},         {"WORLD_SIZE", "2"},   {"MASTER_ADDR", "a"},          {"MASTER_PORT", "9"},
           {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}};
  EXPECT_EQ(detect(e).source, "env");
  e.erase("RANK");
  e.erase("WORLD_SIZE");
  EXPECT_EQ(detect(e).source, "slurm");
  e.erase("SLURM_PROCID");
  EXPECT_EQ(detect(e).source, "openmpi");
}

TEST(DistEnv, TorchrunStyleErrorsNameTheVariable) {
  Env ok = {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}};
  auto with = [&](const std::string& k, const std::string& v) {
    Env e = ok;
    e[k] = v;
    return error_of([&] { detect(e); });
  };
  auto without = [&](const std::string& k) {
    Env e = ok;
    e.erase(k);
    return error_of([&] { detect(e); });
  };
  EXPECT_EQ(with("RANK", "4"), "RANK (4) must be in [0, WORLD_SIZE = 4)");
  EXPECT_EQ(with("RANK", "-1"), "RANK (-1) must be in [0, WORLD_SIZE = 4)");
  EXPECT_EQ(with("RANK", "one"), "RANK ('one') is not an integer");
  EXPECT_EQ(with("RANK", "1x"), "RANK ('1x') is not an integer");
  EXPECT_EQ(with("WORLD_SIZE", "0"), "WORLD_SIZE (0) must be at least 1");
  EXPECT_EQ(with("LOCAL_WORLD_SIZE", "8"), "LOCAL_WORLD_SIZE (8) must be in [1, WORLD_SIZE = 4]");
  EXPECT_EQ(with("LOCAL_RANK", "4"), "LOCAL_RANK (4) must be in [0, LOCAL_WORLD_SIZE = 4)");
  EXPECT_EQ(with("NODE_RANK", "4"), "NODE_RANK (4) must be in [0, WORLD_SIZE = 4)");
  EXPECT_EQ(with("MASTER_PORT", "0"), "MASTER_PORT (0) must be in [1, 65535] when WORLD_SIZE (4) > 1");
  EXPECT_EQ(with("MASTER_PORT", "70000"), "MASTER_PORT (70000) must be in [1, 65535] when WORLD_SIZE (4) > 1");
  EXPECT_EQ(without("MASTER_ADDR"), "MASTER_ADDR is not set (needed with WORLD_SIZE = 4)");
  EXPECT_EQ(without("MASTER_PORT"), "MASTER_PORT is not set (needed with WORLD_SIZE = 4)");
  EXPECT_EQ(without("WORLD_SIZE"), "RANK is set but WORLD_SIZE is not (a launcher sets both)");
  EXPECT_EQ(without("RANK"), "WORLD_SIZE is set but RANK is not (a launcher sets both)");
  // One rank needs no rendezvous address.
  DistEnv d = detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_EQ(d.world_size, 1);
  EXPECT_EQ(d.master_port, 0);
}

TEST(DistEnv, Slurm) {
  DistEnv d = detect({{"SLURM_PROCID", "6"},
                      {"SLURM_NTASKS", "11"},
                      {"SLURM_LOCALID", "2"},
                      {"SLURM_NODEID", "1"},
                      {"SLURM_TASKS_PER_NODE", "4(x2),3"},
                      {"SLURM_JOB_NODELIST", "gpu[07-08,10]"},
                      {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(d.str(), "rank 6 of 11 (local 2 of 4, node 1), master gpu07:13456, from slurm");
  d = detect({{"SLURM_PROCID", "9"},
              {"SLURM_NTASKS", "11"},
              {"SLURM_LOCALID", "1"},
              {"SLURM_NODEID", "2"},
              {"SLURM_TASKS_PER_NODE", "4(x2),3"},
              {"SLURM_NODELIST", "a,b,c"},
              {"MASTER_PORT", "29500"}});
  EXPECT_EQ(d.str(), "rank 9 of 11 (local 1 of 3, node 2), master a:29500, from slurm");
  // SLURM_NTASKS_PER_NODE and MASTER_ADDR from the environment win.
  d = detect({{"SLURM_PROCID", "3"},
              {"SLURM_NTASKS", "8"},
              {"SLURM_LOCALID", "3"},
              {"SLURM_NODEID", "0"},
              {"SLURM_NTASKS_PER_NODE", "4"},
              {"SLURM_TASKS_PER_NODE", "garbage"},
              {"SLURM_JOB_NODELIST", "n[1-2]"},
              {"MASTER_ADDR", "10.1.1.1"},
              {"MASTER_PORT", "1234"}});
  EXPECT_EQ(d.str(), "rank 3 of 8 (local 3 of 4, node 0), master 10.1.1.1:1234, from slurm");
}

TEST(DistEnv, SlurmErrors) {
  Env ok = {{"SLURM_PROCID", "1"},         {"SLURM_NTASKS", "2"},        {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "0"},
            {"SLURM_TASKS_PER_NODE", "2"}, {"SLURM_JOB_NODELIST", "n1"}, {"SLURM_JOB_ID", "7"}};
  auto with = [&](const std::string& k, const std::string& v) {
    Env e = ok;
    e[k] = v;
    return error_of([&] { detect(e); });
  };
  EXPECT_EQ(with("SLURM_PROCID", "2"), "SLURM_PROCID (2) must be in [0, SLURM_NTASKS = 2)");
  EXPECT_EQ(with("SLURM_LOCALID", "2"), "SLURM_LOCALID (2) must be in [0, SLURM_TASKS_PER_NODE = 2)");
  EXPECT_EQ(with("SLURM_TASKS_PER_NODE", "2(y3)"),
            "SLURM_TASKS_PER_NODE ('2(y3)'): '2(y3)' is not a task count like 4 or 4(x2)");
  EXPECT_EQ(with("SLURM_NODEID", "1"), "SLURM_TASKS_PER_NODE ('2'): lists 1 nodes, but this is node 1");
  EXPECT_EQ(with("SLURM_JOB_NODELIST", "n[3-1]"),
            "SLURM_JOB_NODELIST: host list 'n[3-1]' has a bad range '3-1' (expected N or N-M with N <= M)");
  Env e = ok;
  e.erase("SLURM_JOB_NODELIST");
  EXPECT_EQ(error_of([&] { detect(e); }),
            "neither MASTER_ADDR nor SLURM_JOB_NODELIST / SLURM_NODELIST is set (needed with SLURM_NTASKS = 2)");
  e = ok;
  e.erase("SLURM_JOB_ID");
  EXPECT_EQ(error_of([&] { detect(e); }), "neither MASTER_PORT nor SLURM_JOB_ID is set (needed with SLURM_NTASKS = 2)");
}

TEST(DistEnv, OpenMpi) {
  DistEnv d = detect({{"OMPI_COMM_WORLD_RANK", "5"},
                      {"OMPI_COMM_WORLD_SIZE", "8"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                      {"OMPI_COMM_WORLD_NODE_RANK", "1"},
                      {"MASTER_ADDR", "head"},
                      {"MASTER_PORT", "29500"}});
  EXPECT_EQ(d.str(), "rank 5 of 8 (local 1 of 4, node 1), master head:29500, from openmpi");
  std::string e = error_of([&] { detect({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}}); });
  EXPECT_NE(e.find("MASTER_ADDR is not set (OpenMPI does not provide one; pass it with mpirun -x"), std::string::npos)
      << e;
  EXPECT_EQ(error_of([&] {
              detect({{"OMPI_COMM_WORLD_RANK", "0"},
                      {"OMPI_COMM_WORLD_SIZE", "2"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                      {"MASTER_ADDR", "h"},
                      {"MASTER_PORT", "1"}});
            }),
            "OMPI_COMM_WORLD_LOCAL_RANK (2) must be in [0, OMPI_COMM_WORLD_LOCAL_SIZE = 2)");
}

TEST(DistEnv, SlurmNodelists) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expand_slurm_nodelist("node01"), V{"node01"});
  EXPECT_EQ(expand_slurm_nodelist("node[01-04,07]"), (V{"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(expand_slurm_nodelist("a[8-10],login"), (V{"a8", "a9", "a10", "login"}));
  EXPECT_EQ(expand_slurm_nodelist("r[1-2]-n[01-02]"), (V{"r1-n01", "r1-n02", "r2-n01", "r2-n02"}));
  EXPECT_EQ(expand_slurm_nodelist("gpu[098-101].cluster,x"),
            (V{"gpu098.cluster", "gpu099.cluster", "gpu100.cluster", "gpu101.cluster", "x"}));
  EXPECT_EQ(error_of([] { expand_slurm_nodelist("n[1-2"); }), "host list 'n[1-2' has an unmatched '['");
  EXPECT_EQ(error_of([] { expand_slurm_nodelist("n1-2]"); }), "host list 'n1-2]' has an unmatched ']'");
  EXPECT_EQ(error_of([] { expand_slurm_nodelist("n[a-b]"); }),
            "host list 'n[a-b]' has a bad range 'a-b' (expected N or N-M with N <= M)");
}

TEST(DistEnv, SlurmTasksPerNode) {
  EXPECT_EQ(slurm_tasks_on_node("8", 0), 8);
  EXPECT_EQ(slurm_tasks_on_node("4(x2),3", 0), 4);
  EXPECT_EQ(slurm_tasks_on_node("4(x2),3", 1), 4);
  EXPECT_EQ(slurm_tasks_on_node("4(x2),3", 2), 3);
  EXPECT_EQ(slurm_tasks_on_node("2,1(x3)", 3), 1);
  EXPECT_EQ(error_of([] { slurm_tasks_on_node("4(x2)", 2); }), "lists 2 nodes, but this is node 2");
  EXPECT_EQ(error_of([] { slurm_tasks_on_node("0", 0); }), "'0' is not a task count like 4 or 4(x2)");
}

}  // namespace
}  // namespace mt::comm
