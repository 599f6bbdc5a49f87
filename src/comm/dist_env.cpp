// Reads the distributed environment (see dist_env.h for the sources and their order).
#include "comm/dist_env.h"

#include <charconv>
#include <cstdlib>

#include "core/error.h"

namespace mt::comm {

std::string DistEnv::str() const {
  return mt::str("rank ", rank, " of ", world_size, " (local ", local_rank, " of ", local_world_size, ", node ",
                 node_rank, "), master ", master_addr, ":", master_port, ", from ", source);
}

namespace {

bool parse_int(const std::string& s, int* out) {
  auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  return !s.empty() && r.ec == std::errc() && r.ptr == s.data() + s.size();
}

// Reads a variable as an integer; `fallback` when it is unset and not required.
struct Reader {
  const EnvLookup& env;
  std::optional<std::string> raw(const std::string& name) const { return env(name); }
  bool has(const std::string& name) const { return env(name).has_value(); }
  int integer(const std::string& name) const {
    std::optional<std::string> v = env(name);
    if (!v) MT_THROW(name, " is not set");
    int x = 0;
    if (!parse_int(*v, &x)) MT_THROW(name, " ('", *v, "') is not an integer");
    return x;
  }
  int integer_or(const std::string& name, int fallback) const { return has(name) ? integer(name) : fallback; }
};

// The values must describe a consistent layout; `names` says which variable each field came from.
struct Names {
  const char *rank, *world, *local_rank, *local_world, *node_rank, *port;
};

void validate(const DistEnv& d, const Names& n) {
  if (d.world_size < 1) MT_THROW(n.world, " (", d.world_size, ") must be at least 1");
  if (d.rank < 0 || d.rank >= d.world_size)
    MT_THROW(n.rank, " (", d.rank, ") must be in [0, ", n.world, " = ", d.world_size, ")");
  if (d.local_world_size < 1 || d.local_world_size > d.world_size)
    MT_THROW(n.local_world, " (", d.local_world_size, ") must be in [1, ", n.world, " = ", d.world_size, "]");
  if (d.local_rank < 0 || d.local_rank >= d.local_world_size)
    MT_THROW(n.local_rank, " (", d.local_rank, ") must be in [0, ", n.local_world, " = ", d.local_world_size, ")");
  if (d.node_rank < 0 || d.node_rank >= d.world_size)
    MT_THROW(n.node_rank, " (", d.node_rank, ") must be in [0, ", n.world, " = ", d.world_size, ")");
  if (d.world_size > 1) {
    if (d.master_addr.empty()) MT_THROW("MASTER_ADDR is empty (needed to rendezvous ", d.world_size, " ranks)");
    if (d.master_port < 1 || d.master_port > 65535)
      MT_THROW(n.port, " (", d.master_port, ") must be in [1, 65535] when ", n.world, " (", d.world_size, ") > 1");
  } else if (d.master_port < 0 || d.master_port > 65535) {
    MT_THROW(n.port, " (", d.master_port, ") must be in [0, 65535]");
  }
}

DistEnv from_torchrun(const Reader& r) {
  DistEnv d;
  d.source = "env";
  if (!r.has("RANK") || !r.has("WORLD_SIZE"))
    MT_THROW(r.has("RANK") ? "RANK is set but WORLD_SIZE is not" : "WORLD_SIZE is set but RANK is not",
             " (a launcher sets both)");
  d.rank = r.integer("RANK");
  d.world_size = r.integer("WORLD_SIZE");
  // Without the local variables assume one node: every rank is local.
  d.local_world_size = r.integer_or("LOCAL_WORLD_SIZE", d.world_size);
  d.local_rank = r.integer_or("LOCAL_RANK", d.local_world_size > 0 ? d.rank % d.local_world_size : 0);
  const char* node_var = r.has("NODE_RANK") ? "NODE_RANK" : "GROUP_RANK";
  d.node_rank = r.integer_or(node_var, d.local_world_size > 0 ? d.rank / d.local_world_size : 0);
  if (auto a = r.raw("MASTER_ADDR"))
    d.master_addr = *a;
  else if (d.world_size > 1)
    MT_THROW("MASTER_ADDR is not set (needed with WORLD_SIZE = ", d.world_size, ")");
  if (r.has("MASTER_PORT"))
    d.master_port = r.integer("MASTER_PORT");
  else if (d.world_size > 1)
    MT_THROW("MASTER_PORT is not set (needed with WORLD_SIZE = ", d.world_size, ")");
  validate(d, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", node_var, "MASTER_PORT"});
  // torchrun's agent serves its own store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE): ours takes the next port.
  if (r.raw("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True" && d.world_size > 1) {
    if (d.master_port >= 65535)
      MT_THROW("MASTER_PORT (", d.master_port, ") leaves no port after torchrun's store for moetrain's (port + 1)");
    d.master_port += 1;
    d.source = "torchrun";
  }
  return d;
}

DistEnv from_slurm(const Reader& r) {
  DistEnv d;
  d.source = "slurm";
  d.rank = r.integer("SLURM_PROCID");
  d.world_size = r.integer("SLURM_NTASKS");
  d.node_rank = r.integer_or("SLURM_NODEID", 0);
  const char* local_world_var = "SLURM_NTASKS_PER_NODE";
  if (r.has("SLURM_NTASKS_PER_NODE")) {
    d.local_world_size = r.integer("SLURM_NTASKS_PER_NODE");
  } else if (auto t = r.raw("SLURM_TASKS_PER_NODE")) {
    local_world_var = "SLURM_TASKS_PER_NODE";
    try {
      d.local_world_size = slurm_tasks_on_node(*t, d.node_rank);
    } catch (const Error& e) {
      MT_THROW("SLURM_TASKS_PER_NODE ('", *t, "'): ", e.what());
    }
  } else {
    d.local_world_size = d.world_size;
  }
  d.local_rank = r.integer_or("SLURM_LOCALID", 0);
  if (auto a = r.raw("MASTER_ADDR")) {
    d.master_addr = *a;
  } else {
    const char* var = r.has("SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST" : "SLURM_NODELIST";
    std::optional<std::string> list = r.raw(var);
    if (!list) {
      if (d.world_size > 1)
        MT_THROW("neither MASTER_ADDR nor SLURM_JOB_NODELIST / SLURM_NODELIST is set (needed with SLURM_NTASKS = ",
                 d.world_size, ")");
    } else {
      std::vector<std::string> hosts;
      try {
        hosts = expand_slurm_nodelist(*list);
      } catch (const Error& e) {
        MT_THROW(var, ": ", e.what());
      }
      if (hosts.empty()) MT_THROW(var, " ('", *list, "') names no host");
      d.master_addr = hosts[0];
    }
  }
  if (r.has("MASTER_PORT")) {
    d.master_port = r.integer("MASTER_PORT");
  } else if (r.has("SLURM_JOB_ID")) {
    // The same job id on every node gives every rank the same port without talking.
    int job = r.integer("SLURM_JOB_ID");
    if (job < 0) MT_THROW("SLURM_JOB_ID (", job, ") must not be negative");
    d.master_port = 10000 + job % 20000;
  } else if (d.world_size > 1) {
    MT_THROW("neither MASTER_PORT nor SLURM_JOB_ID is set (needed with SLURM_NTASKS = ", d.world_size, ")");
  }
  validate(d, {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local_world_var, "SLURM_NODEID", "MASTER_PORT"});
  return d;
}

DistEnv from_openmpi(const Reader& r) {
  DistEnv d;
  d.source = "openmpi";
  d.rank = r.integer("OMPI_COMM_WORLD_RANK");
  d.world_size = r.integer("OMPI_COMM_WORLD_SIZE");
  d.local_world_size = r.integer_or("OMPI_COMM_WORLD_LOCAL_SIZE", d.world_size);
  d.local_rank = r.integer_or("OMPI_COMM_WORLD_LOCAL_RANK", 0);
  // Block mapping (mpirun's default --map-by slot) puts ranks [n * L, (n + 1) * L) on node n.
  d.node_rank = d.local_world_size > 0 ? d.rank / d.local_world_size : 0;
  if (auto a = r.raw("MASTER_ADDR"))
    d.master_addr = *a;
  else if (d.world_size > 1)
    MT_THROW(
        "MASTER_ADDR is not set (OpenMPI does not provide one; pass it with mpirun -x MASTER_ADDR=<host of "
        "rank 0>, needed with OMPI_COMM_WORLD_SIZE = ",
        d.world_size, ")");
  if (r.has("MASTER_PORT"))
    d.master_port = r.integer("MASTER_PORT");
  else if (d.world_size > 1)
    MT_THROW("MASTER_PORT is not set (pass it with mpirun -x MASTER_PORT=<port>, needed with OMPI_COMM_WORLD_SIZE = ",
             d.world_size, ")");
  validate(d, {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_LOCAL_SIZE", "MASTER_PORT"});
  return d;
}

// Splits at commas that are not inside brackets.
std::vector<std::string> split_top(const std::string& s, const std::string& whole) {
  std::vector<std::string> out;
  int depth = 0;
  std::string cur;
  for (char c : s) {
    if (c == '[') ++depth;
    if (c == ']' && --depth < 0) MT_THROW("host list '", whole, "' has an unmatched ']'");
    if (c == ',' && depth == 0) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (depth != 0) MT_THROW("host list '", whole, "' has an unmatched '['");
  out.push_back(cur);
  return out;
}

// "01-04,07" -> 01 02 03 04 07, keeping the width of the lower bound.
std::vector<std::string> expand_range(const std::string& body, const std::string& whole) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    std::string part = body.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    size_t dash = part.find('-');
    std::string lo = part.substr(0, dash), hi = dash == std::string::npos ? lo : part.substr(dash + 1);
    long long a = 0, b = 0;
    auto num = [&](const std::string& t, long long* v) {
      auto r = std::from_chars(t.data(), t.data() + t.size(), *v);
      return !t.empty() && r.ec == std::errc() && r.ptr == t.data() + t.size() && *v >= 0;
    };
    if (!num(lo, &a) || !num(hi, &b) || b < a || b - a > 1000000)
      MT_THROW("host list '", whole, "' has a bad range '", part, "' (expected N or N-M with N <= M)");
    for (long long i = a; i <= b; ++i) {
      std::string v = std::to_string(i);
      if (v.size() < lo.size()) v.insert(0, lo.size() - v.size(), '0');
      out.push_back(v);
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// One item: text with any number of bracket groups, expanded as a cartesian product in order.
void expand_item(const std::string& item, const std::string& whole, std::vector<std::string>* out) {
  size_t open = item.find('[');
  if (open == std::string::npos) {
    if (!item.empty()) out->push_back(item);
    return;
  }
  size_t close = item.find(']', open);
  if (close == std::string::npos) MT_THROW("host list '", whole, "' has an unmatched '['");
  std::string head = item.substr(0, open), tail = item.substr(close + 1);
  for (const std::string& v : expand_range(item.substr(open + 1, close - open - 1), whole))
    expand_item(head + v + tail, whole, out);
}

}  // namespace

std::vector<std::string> expand_slurm_nodelist(const std::string& list) {
  std::vector<std::string> out;
  for (const std::string& item : split_top(list, list)) expand_item(item, list, &out);
  return out;
}

int slurm_tasks_on_node(const std::string& tasks_per_node, int node_id) {
  if (node_id < 0) MT_THROW("node index (", node_id, ") must not be negative");
  int node = 0;
  size_t start = 0;
  while (start < tasks_per_node.size()) {
    size_t comma = tasks_per_node.find(',', start);
    std::string part = tasks_per_node.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    int count = 0, repeat = 1;
    size_t paren = part.find('(');
    bool ok = parse_int(part.substr(0, paren), &count) && count >= 1;
    if (ok && paren != std::string::npos) {
      // "(xN)"
      ok = part.size() > paren + 3 && part[paren + 1] == 'x' && part.back() == ')' &&
           parse_int(part.substr(paren + 2, part.size() - paren - 3), &repeat) && repeat >= 1;
    }
    if (!ok) MT_THROW("'", part, "' is not a task count like 4 or 4(x2)");
    if (node_id < node + repeat) return count;
    node += repeat;
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  MT_THROW("lists ", node, " nodes, but this is node ", node_id);
}

DistEnv detect_dist_env(const EnvLookup& env) {
  Reader r{env};
  if (r.has("RANK") || r.has("WORLD_SIZE")) return from_torchrun(r);
  if (r.has("SLURM_PROCID") && r.has("SLURM_NTASKS")) return from_slurm(r);
  if (r.has("OMPI_COMM_WORLD_RANK") && r.has("OMPI_COMM_WORLD_SIZE")) return from_openmpi(r);
  DistEnv d;
  if (auto a = r.raw("MASTER_ADDR")) d.master_addr = *a;
  if (r.has("MASTER_PORT")) d.master_port = r.integer("MASTER_PORT");
  validate(d, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_PORT"});
  return d;
}

DistEnv detect_dist_env() {
  return detect_dist_env([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  });
}

}  // namespace mt::comm
