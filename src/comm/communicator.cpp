// The backend-independent half of every communicator: argument checks, the record of every call
// (running hash + the last kHistory ops), the schedule check through the store (periodic or per
// op), split()'s agreement on groups, abort, and errors that name the communicator, rank, op and
// seq. Keys under the communicator's prefix: "sched/<n>/<rank>" (periodic checks), "op/<coll>/<rank>"
// (per-op checks), "split/<seq>/<rank>" (split), "fail/<rank>" (the diagnosis after a failed op).
#include "comm/communicator.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <sstream>

#include "comm/backends.h"

namespace mt::comm {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
  }
  return "?";
}

namespace {

struct DoneWork : Work {
  void wait() override {}
};

bool countless(const std::string& op) {
  return op == "barrier" || op == "split";
}

// FNV-1a over the signature, one op after another.
uint64_t fnv1a(uint64_t h, const std::string& s) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  h ^= 0xff;  // separator, so that "ab"+"c" and "a"+"bc" differ
  return h * 1099511628211ull;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

// A rank's state as published for a schedule comparison: its counters, its hash, and its recent
// collectives, each with the hash of the collectives before it.
struct Snapshot {
  uint64_t seq = 0, coll = 0, hash = 0;
  struct Entry {
    OpRecord rec;
    uint64_t hash_before = 0;
  };
  std::vector<Entry> entries;                     // collectives only, oldest first
  std::vector<int64_t> send_counts, recv_counts;  // per-op check of all_to_all_v
};

std::string op_line(const OpRecord& r) {
  return str(r.seq, ' ', r.coll, ' ', r.op, ' ', r.count, ' ', int(r.dtype), ' ', r.peer);
}

OpRecord parse_op(std::istringstream& in) {
  OpRecord r;
  int dt = 0;
  in >> r.seq >> r.coll >> r.op >> r.count >> dt >> r.peer;
  r.dtype = DType(dt);
  return r;
}

std::string encode(const Snapshot& s) {
  std::ostringstream o;
  o << s.seq << ' ' << s.coll << ' ' << s.hash << ' ' << s.entries.size() << '\n';
  for (const auto& e : s.entries) o << op_line(e.rec) << ' ' << e.hash_before << '\n';
  o << s.send_counts.size();
  for (int64_t c : s.send_counts) o << ' ' << c;
  o << '\n' << s.recv_counts.size();
  for (int64_t c : s.recv_counts) o << ' ' << c;
  o << '\n';
  return o.str();
}

Snapshot decode(const Bytes& b, int rank) {
  std::istringstream in(std::string(b.begin(), b.end()));
  Snapshot s;
  size_t n = 0;
  in >> s.seq >> s.coll >> s.hash >> n;
  for (size_t i = 0; i < n && in; ++i) {
    Snapshot::Entry e;
    e.rec = parse_op(in);
    in >> e.hash_before;
    s.entries.push_back(e);
  }
  size_t m = 0;
  in >> m;
  s.send_counts.resize(m);
  for (auto& c : s.send_counts) in >> c;
  in >> m;
  s.recv_counts.resize(m);
  for (auto& c : s.recv_counts) in >> c;
  MT_CHECK(!in.fail(), "schedule record of rank ", rank, " is malformed (", b.size(), " bytes)");
  return s;
}

// The first collective at which the snapshots disagree, as a sentence; empty when they agree.
std::string find_divergence(const std::vector<Snapshot>& snaps) {
  bool same = true;
  for (const auto& s : snaps) same = same && s.coll == snaps[0].coll && s.hash == snaps[0].hash;
  if (same) return "";
  uint64_t lo = 1, hi = 0;
  for (const auto& s : snaps) {
    hi = std::max(hi, s.coll);
    // Collectives before a rank's oldest entry are not visible for that rank.
    uint64_t oldest = s.entries.empty() ? s.coll + 1 : s.entries.front().rec.coll;
    lo = std::max(lo, oldest);
  }
  auto entry_of = [](const Snapshot& s, uint64_t c) -> const Snapshot::Entry* {
    for (const auto& e : s.entries)
      if (e.rec.coll == c) return &e;
    return nullptr;
  };
  // If the hashes before the first visible collective differ, the divergence is older than what
  // every rank still remembers.
  if (lo > 1 && lo <= hi) {
    std::map<uint64_t, std::vector<int>> before;
    for (size_t r = 0; r < snaps.size(); ++r)
      if (const auto* e = entry_of(snaps[r], lo)) before[e->hash_before].push_back(int(r));
    if (before.size() > 1)
      return str("before op #", lo, " (older than the ", Communicator::kHistory,
                 " ops each rank remembers; the ranks' hashes already differ there)");
  }
  for (uint64_t c = lo; c <= hi; ++c) {
    std::map<std::string, std::vector<int>> groups;  // signature -> ranks
    std::map<std::string, std::string> shown;        // signature -> what to print
    for (size_t r = 0; r < snaps.size(); ++r) {
      const auto* e = entry_of(snaps[r], c);
      std::string sig = e ? e->rec.signature() : "";
      groups[sig].push_back(int(r));
      shown[sig] = e ? str("issued ", e->rec.what())
                     : str(snaps[r].coll + 1 == c ? "had issued only " : "had issued ", snaps[r].coll, " collectives");
    }
    if (groups.size() == 1) continue;
    // Order the groups by their smallest rank so that the message reads rank 0 first.
    std::vector<std::pair<int, std::string>> order;
    for (auto& [sig, ranks] : groups) order.push_back({ranks.front(), sig});
    std::sort(order.begin(), order.end());
    std::string msg = str("at op #", c, ": ");
    for (size_t i = 0; i < order.size(); ++i)
      msg += (i ? ", " : "") + rank_list(groups[order[i].second]) + " " + shown[order[i].second];
    return msg;
  }
  return str("somewhere in ops 1..", hi, " (the hashes differ but the recorded ops agree)");
}

}  // namespace

std::string OpRecord::what() const {
  if (countless(op)) return op;
  std::string s = mt::str(op, ' ', dtype_name(dtype), " x ", count);
  if (peer >= 0) s += mt::str(op == "broadcast" ? " root " : " peer ", peer);
  return s;
}

std::string OpRecord::str() const {
  return mt::str('#', seq, ' ', what());
}

std::string OpRecord::signature() const {
  return mt::str(op, '/', int(dtype), '/', op == "all_to_all_v" ? -1 : count, '/', peer);
}

Communicator::Communicator(int rank, int size, std::string name, Store& root, std::string prefix, CommOptions opt)
    : root_(root),
      prefix_(std::move(prefix)),
      store_owned_(make_prefix_store(root, prefix_)),
      store_(*store_owned_),
      opt_(opt),
      rank_(rank),
      size_(size),
      name_(std::move(name)) {
  MT_CHECK(size >= 1 && rank >= 0 && rank < size, "rank ", rank, " of ", size);
  if (opt_.timeout.count() <= 0)
    MT_THROW("communicator '", name_, "': timeout must be positive, got ", opt_.timeout.count(), " ms");
}

std::string Communicator::where() const {
  return str("communicator '", name_, "' (rank ", rank_, " of ", size_, ", ", backend(), ")");
}

OpRecord Communicator::record(std::string op, int64_t count, DType dtype, int64_t peer, bool collective) {
  OpRecord r;
  r.op = std::move(op);
  r.count = count;
  r.dtype = dtype;
  r.peer = peer;
  r.issued = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  r.seq = ++seq_;
  uint64_t hash_before = hash_;
  if (collective) {
    r.coll = ++coll_;
    hash_ = fnv1a(hash_, r.signature());
  }
  if (ring_.size() < kHistory) {
    ring_.push_back(r);
    ring_hash_.push_back(hash_before);
  } else {
    ring_[(r.seq - 1) % kHistory] = r;
    ring_hash_[(r.seq - 1) % kHistory] = hash_before;
  }
  return r;
}

OpRecord Communicator::last_issued() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (seq_ == 0) return OpRecord{};
  return ring_[(seq_ - 1) % kHistory];
}

std::vector<OpRecord> Communicator::history() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<OpRecord> out;
  uint64_t first = seq_ > ring_.size() ? seq_ - ring_.size() + 1 : 1;
  for (uint64_t s = first; s <= seq_; ++s) out.push_back(ring_[(s - 1) % kHistory]);
  return out;
}

std::vector<std::pair<OpRecord, uint64_t>> Communicator::history_with_hashes() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<OpRecord, uint64_t>> out;
  uint64_t first = seq_ > ring_.size() ? seq_ - ring_.size() + 1 : 1;
  for (uint64_t s = first; s <= seq_; ++s) out.push_back({ring_[(s - 1) % kHistory], ring_hash_[(s - 1) % kHistory]});
  return out;
}

void Communicator::mark_completed(uint64_t seq) {
  uint64_t cur = completed_.load();
  while (cur < seq && !completed_.compare_exchange_weak(cur, seq)) {
  }
}

std::string Communicator::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void Communicator::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.load()) return;
    abort_reason_ = why;
    aborted_.store(true);
  }
  do_abort(why);
}

void Communicator::throw_if_aborted(const char* op) const {
  if (!aborted_.load()) return;
  std::lock_guard<std::mutex> lock(mu_);
  MT_THROW(where(), ": cannot issue ", op, ": the communicator was aborted (", abort_reason_, ")");
}

void Communicator::wait_ranks(const std::string& stem, const std::string& what, Millis timeout) {
  std::vector<std::string> keys;
  for (int r = 0; r < size_; ++r) keys.push_back(stem + std::to_string(r));
  try {
    store_.wait(keys, timeout);
  } catch (const StoreTimeout&) {
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r)
      if (!store_.check({keys[size_t(r)]})) missing.push_back(r);
    if (missing.empty()) throw;
    OpRecord last = last_issued();
    MT_THROW(what, " on ", where(), " timed out after ", timeout.count(), " ms: ", rank_list(missing),
             " never reported (this rank is at ", last.seq ? "op " + last.str() : "its first op", ")");
  }
}

void Communicator::check_schedule() {
  if (opt_.schedule_check == ScheduleCheck::Off || size_ == 1) return;
  throw_if_aborted("check_schedule");
  Snapshot mine;
  uint64_t n;
  {
    std::lock_guard<std::mutex> lock(mu_);
    n = ++checks_;
    mine.seq = seq_;
    mine.coll = coll_;
    mine.hash = hash_;
  }
  for (const auto& [r, h] : history_with_hashes())
    if (r.coll) mine.entries.push_back({r, h});
  std::string stem = str("sched/", n, "/");
  std::string enc = encode(mine);
  store_.set(stem + std::to_string(rank_), Bytes(enc.begin(), enc.end()));
  wait_ranks(stem, str("schedule check #", n), opt_.timeout);
  std::vector<Snapshot> snaps;
  for (int r = 0; r < size_; ++r) snaps.push_back(decode(store_.get(stem + std::to_string(r), opt_.timeout), r));
  if (n > 1) store_.erase(str("sched/", n - 1, "/", rank_));  // every rank has read it: they all wrote #n
  std::string d = find_divergence(snaps);
  if (!d.empty()) MT_THROW("collective schedule diverged on communicator '", name_, "' ", d);
}

void Communicator::check_op(const OpRecord& rec, const std::vector<int64_t>* send_counts,
                            const std::vector<int64_t>* recv_counts) {
  if (opt_.schedule_check != ScheduleCheck::PerOp || size_ == 1) return;
  Snapshot mine;
  mine.seq = rec.seq;
  mine.coll = rec.coll;
  mine.hash = 0;
  mine.entries.push_back({rec, 0});
  if (send_counts) mine.send_counts = *send_counts;
  if (recv_counts) mine.recv_counts = *recv_counts;
  std::string stem = str("op/", rec.coll, "/");
  std::string enc = encode(mine);
  store_.set(stem + std::to_string(rank_), Bytes(enc.begin(), enc.end()));
  wait_ranks(stem, str("per-op schedule check of op ", rec.str()), opt_.timeout);
  std::vector<Snapshot> snaps;
  for (int r = 0; r < size_; ++r) snaps.push_back(decode(store_.get(stem + std::to_string(r), opt_.timeout), r));
  if (rec.coll > 1) store_.erase(str("op/", rec.coll - 1, "/", rank_));
  // Compare the records themselves (the per-op check has no history to look back on: every earlier
  // op was already compared).
  for (auto& s : snaps) s.hash = fnv1a(0, s.entries.at(0).rec.signature());
  std::string d = find_divergence(snaps);
  if (!d.empty()) MT_THROW("collective schedule diverged on communicator '", name_, "' ", d, " (caught before it ran)");
  if (send_counts) {
    for (int r = 0; r < size_; ++r)
      for (int j = 0; j < size_; ++j) {
        int64_t sent = snaps[size_t(r)].send_counts.at(size_t(j)),
                expected = snaps[size_t(j)].recv_counts.at(size_t(r));
        if (sent != expected)
          MT_THROW("all_to_all_v counts disagree on communicator '", name_, "' at op #", rec.coll, ": rank ", r,
                   " sends ", sent, " elements to rank ", j, ", rank ", j, " expects ", expected, " from rank ", r,
                   " (caught before it ran)");
      }
  }
}

void Communicator::fail_op(const OpRecord& rec, const std::exception& e) {
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - rec.issued).count();
  char secs_text[32];
  std::snprintf(secs_text, sizeof(secs_text), "%.3f", secs);
  std::string msg = str(where(), ": op ", rec.str(), " failed after ", secs_text, " s (timeout ", opt_.timeout.count(),
                        " ms): ", e.what());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.load() == 0) {
      failure_ = e.what();
      failed_.store(rec.seq);
    }
  }
  // The backend's state is unknown after a failure (Gloo closes its connections on a timeout, NCCL
  // must be aborted), so no later call may use it.
  abort(str("op ", rec.str(), " failed"));
  // Best effort: learn where the other ranks are, so that the message says whether the schedules
  // diverged or a rank is gone. Bounded, so that a dead store cannot hold the error back.
  if (size_ > 1 && opt_.schedule_check != ScheduleCheck::Off) {
    try {
      Snapshot mine;
      {
        std::lock_guard<std::mutex> lock(mu_);
        mine.seq = seq_;
        mine.coll = coll_;
        mine.hash = hash_;
      }
      for (const auto& [r, h] : history_with_hashes())
        if (r.coll) mine.entries.push_back({r, h});
      std::string enc = encode(mine);
      store_.set(str("fail/", rank_), Bytes(enc.begin(), enc.end()));
      // Ranks failing for the same cause (a lost peer, a divergence that timed out) do so within a
      // short window; a rank that never reports by then is gone or stuck elsewhere.
      Millis wait = std::min(opt_.timeout, Millis(3000));
      auto deadline = std::chrono::steady_clock::now() + wait;
      std::vector<int> missing;
      std::vector<Snapshot> snaps(static_cast<size_t>(size_));
      for (int r = 0; r < size_; ++r) {
        auto left = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
        std::string key = str("fail/", r);
        bool ok = store_.check({key});
        if (!ok && left.count() > 0) {
          try {
            store_.wait({key}, left);
            ok = true;
          } catch (const Error&) {
          }
        }
        if (ok)
          snaps[size_t(r)] = decode(store_.get(key, opt_.timeout), r);
        else
          missing.push_back(r);
      }
      std::vector<Snapshot> present;
      for (int r = 0; r < size_; ++r)
        if (std::find(missing.begin(), missing.end(), r) == missing.end()) present.push_back(snaps[size_t(r)]);
      if (missing.empty()) {
        std::string d = find_divergence(present);
        msg += d.empty() ? "; every rank had issued the same collectives" : "; the collective schedules diverged " + d;
      } else {
        msg += str("; ", rank_list(missing), " did not report within ", wait.count(),
                   " ms (exited, or blocked elsewhere)");
      }
    } catch (const std::exception& d) {
      msg += str("; no diagnosis through the store (", d.what(), ")");
    }
  }
  throw Error(msg);
}

namespace {
void check_dev(const Communicator& c, const Tensor& t, const char* op, const char* role) {
  if (!t.defined())
    MT_THROW(op, " on communicator '", c.name(), "' (rank ", c.rank(), "): ", role, " is an undefined tensor");
  if (t.device() != c.device())
    MT_THROW(op, " on communicator '", c.name(), "' (rank ", c.rank(), "): ", role, " is ", t.desc(),
             ", the communicator is on ", device_name(c.device()));
}
void check_same_dtype(const Communicator& c, const Tensor& a, const Tensor& b, const char* op) {
  if (a.dtype() != b.dtype())
    MT_THROW(op, " on communicator '", c.name(), "' (rank ", c.rank(), "): in is ", a.desc(), ", out is ", b.desc(),
             "; they must have the same dtype");
}
}  // namespace

#define MT_COMM_DISPATCH(rec, call)    \
  try {                                \
    return call;                       \
  } catch (const std::exception& e_) { \
    fail_op(rec, e_);                  \
  }

std::shared_ptr<Work> Communicator::all_gather(const Tensor& in, Tensor& out) {
  check_dev(*this, in, "all_gather", "in");
  check_dev(*this, out, "all_gather", "out");
  check_same_dtype(*this, in, out, "all_gather");
  if (out.numel() != size_ * in.numel())
    MT_THROW("all_gather on communicator '", name_, "' (rank ", rank_, "): out has ", out.numel(),
             " elements, expected size ", size_, " x in ", in.numel(), " = ", size_ * in.numel());
  throw_if_aborted("all_gather");
  OpRecord rec = record("all_gather", in.numel(), in.dtype(), -1, true);
  check_op(rec);
  MT_COMM_DISPATCH(rec, do_all_gather(in, out, rec));
}

std::shared_ptr<Work> Communicator::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  check_dev(*this, in, "reduce_scatter", "in");
  check_dev(*this, out, "reduce_scatter", "out");
  check_same_dtype(*this, in, out, "reduce_scatter");
  if (in.numel() != size_ * out.numel())
    MT_THROW("reduce_scatter on communicator '", name_, "' (rank ", rank_, "): in has ", in.numel(),
             " elements, expected size ", size_, " x out ", out.numel(), " = ", size_ * out.numel());
  throw_if_aborted("reduce_scatter");
  std::string name = op == ReduceOp::Sum ? "reduce_scatter" : str("reduce_scatter(", reduce_op_name(op), ")");
  OpRecord rec = record(name, out.numel(), out.dtype(), -1, true);
  check_op(rec);
  MT_COMM_DISPATCH(rec, do_reduce_scatter(in, out, op, rec));
}

std::shared_ptr<Work> Communicator::all_reduce(Tensor& t, ReduceOp op) {
  check_dev(*this, t, "all_reduce", "t");
  throw_if_aborted("all_reduce");
  std::string name = op == ReduceOp::Sum ? "all_reduce" : str("all_reduce(", reduce_op_name(op), ")");
  OpRecord rec = record(name, t.numel(), t.dtype(), -1, true);
  check_op(rec);
  MT_COMM_DISPATCH(rec, do_all_reduce(t, op, rec));
}

std::shared_ptr<Work> Communicator::broadcast(Tensor& t, int root) {
  check_dev(*this, t, "broadcast", "t");
  if (root < 0 || root >= size_)
    MT_THROW("broadcast on communicator '", name_, "' (rank ", rank_, "): root ", root, " is not a rank of 0..",
             size_ - 1);
  throw_if_aborted("broadcast");
  OpRecord rec = record("broadcast", t.numel(), t.dtype(), root, true);
  check_op(rec);
  MT_COMM_DISPATCH(rec, do_broadcast(t, root, rec));
}

std::shared_ptr<Work> Communicator::all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                                                 const std::vector<int64_t>& recv_counts) {
  check_dev(*this, in, "all_to_all_v", "in");
  check_dev(*this, out, "all_to_all_v", "out");
  check_same_dtype(*this, in, out, "all_to_all_v");
  auto check_counts = [&](const std::vector<int64_t>& counts, const Tensor& t, const char* what, const char* role) {
    if (int64_t(counts.size()) != size_)
      MT_THROW("all_to_all_v on communicator '", name_, "' (rank ", rank_, "): ", what, " has ", counts.size(),
               " entries, expected one per rank (", size_, ")");
    int64_t total = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
      if (counts[r] < 0)
        MT_THROW("all_to_all_v on communicator '", name_, "' (rank ", rank_, "): ", what, "[", r, "] is ", counts[r],
                 ", counts must be >= 0");
      total += counts[r];
    }
    if (total != t.numel())
      MT_THROW("all_to_all_v on communicator '", name_, "' (rank ", rank_, "): ", what, " sum to ", total, " but ",
               role, " has ", t.numel(), " elements");
  };
  check_counts(send_counts, in, "send_counts", "in");
  check_counts(recv_counts, out, "recv_counts", "out");
  if (send_counts[size_t(rank_)] != recv_counts[size_t(rank_)])
    MT_THROW("all_to_all_v on communicator '", name_, "' (rank ", rank_, "): send_counts[", rank_,
             "] = ", send_counts[size_t(rank_)], " but recv_counts[", rank_, "] = ", recv_counts[size_t(rank_)],
             "; the block a rank sends itself must match what it receives from itself");
  throw_if_aborted("all_to_all_v");
  OpRecord rec = record("all_to_all_v", in.numel(), in.dtype(), -1, true);
  check_op(rec, &send_counts, &recv_counts);
  MT_COMM_DISPATCH(rec, do_all_to_all_v(in, send_counts, out, recv_counts, rec));
}

void Communicator::send(const Tensor& t, int peer) {
  check_dev(*this, t, "send", "t");
  if (peer < 0 || peer >= size_ || peer == rank_)
    MT_THROW("send on communicator '", name_, "' (rank ", rank_, "): peer ", peer, " must be another rank of 0..",
             size_ - 1);
  throw_if_aborted("send");
  OpRecord rec = record("send", t.numel(), t.dtype(), peer, false);
  try {
    do_send(t, peer, rec);
  } catch (const std::exception& e) {
    fail_op(rec, e);
  }
}

void Communicator::recv(Tensor& t, int peer) {
  check_dev(*this, t, "recv", "t");
  if (peer < 0 || peer >= size_ || peer == rank_)
    MT_THROW("recv on communicator '", name_, "' (rank ", rank_, "): peer ", peer, " must be another rank of 0..",
             size_ - 1);
  throw_if_aborted("recv");
  OpRecord rec = record("recv", t.numel(), t.dtype(), peer, false);
  try {
    do_recv(t, peer, rec);
  } catch (const std::exception& e) {
    fail_op(rec, e);
  }
}

void Communicator::barrier() {
  throw_if_aborted("barrier");
  OpRecord rec = record("barrier", 0, DType::I32, -1, true);
  check_op(rec);
  try {
    do_barrier(rec);
  } catch (const std::exception& e) {
    fail_op(rec, e);
  }
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, const std::string& name) {
  throw_if_aborted("split");
  OpRecord rec = record("split", 0, DType::I32, -1, true);
  check_op(rec);
  uint64_t s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = ++splits_;
  }
  // Every rank publishes (color, key); all agree on the groups from the same table.
  std::string stem = str("split/", s, "/");
  store_.set_str(stem + std::to_string(rank_), str(color, ' ', key));
  std::vector<std::pair<int, int>> table(static_cast<size_t>(size_));  // rank -> (color, key)
  try {
    wait_ranks(stem, str("split into '", name, "'"), opt_.timeout);
    for (int r = 0; r < size_; ++r) {
      std::istringstream in(store_.get_str(stem + std::to_string(r), opt_.timeout));
      in >> table[size_t(r)].first >> table[size_t(r)].second;
    }
  } catch (const std::exception& e) {
    fail_op(rec, e);
  }
  if (s > 1) store_.erase(str("split/", s - 1, "/", rank_));
  SplitPlan plan;
  plan.color = color;
  plan.key = key;
  plan.name = name;
  plan.root = &root_;
  std::vector<std::pair<int, int>> members;  // (key, parent rank); none for a negative color
  for (int r = 0; r < size_ && color >= 0; ++r)
    if (table[size_t(r)].first == color) members.push_back({table[size_t(r)].second, r});
  std::sort(members.begin(), members.end());
  for (size_t i = 0; i < members.size(); ++i) {
    plan.members.push_back(members[i].second);
    if (members[i].second == rank_) plan.new_rank = int(i);
  }
  plan.new_size = int(members.size());
  plan.prefix = str(prefix_, "/split", s, ".c", color);
  std::unique_ptr<Communicator> child;
  try {
    child = do_split(std::move(plan));
  } catch (const std::exception& e) {
    fail_op(rec, e);
  }
  mark_completed(rec.seq);
  if (color < 0) return nullptr;
  return child;
}

namespace detail {
void check_world(int rank, int size, const char* what) {
  if (size < 1) MT_THROW(what, ": world size must be >= 1, got ", size);
  if (rank < 0 || rank >= size)
    MT_THROW(what, ": rank ", rank, " is outside 0..", size - 1, " (world size ", size, ")");
}
}  // namespace detail

std::unique_ptr<Communicator> make_world(Device device, int rank, int size, Store& store, CommOptions opt,
                                         int cuda_device) {
  detail::check_world(rank, size, "make_world");
  // A fresh namespace per world this process makes: every rank makes its worlds in the same order,
  // so the k-th world of every rank shares the prefix.
  int64_t k = store.add(str("mt_comm/worlds/", device_name(device), "/", rank), 1);
  std::string prefix = str("mt_comm/", device_name(device), "_world", k);
  if (device == Device::CUDA) return detail::make_nccl_comm(rank, size, "world", store, prefix, opt, cuda_device);
  if (size == 1) return detail::make_self_comm("world", store, prefix, opt);
  return detail::make_gloo_comm(rank, size, "world", store, prefix, opt);
}

std::vector<double> all_gather_doubles(Communicator& c, const std::vector<double>& mine) {
  const int64_t n = int64_t(mine.size());
  Tensor v = Tensor::empty({2 * n});
  for (int64_t i = 0; i < n; ++i) {
    v.data<float>()[2 * i] = float(mine[size_t(i)]);
    v.data<float>()[2 * i + 1] = float(mine[size_t(i)] - double(float(mine[size_t(i)])));
  }
  Tensor d = v.to(c.device()), all = Tensor::empty({2 * n * c.size()}, DType::F32, c.device());
  c.all_gather(d, all)->wait();
  device_mem::synchronize(c.device());
  Tensor h = all.to(Device::CPU);
  std::vector<double> out(size_t(n * c.size()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = double(h.data<float>()[2 * i]) + double(h.data<float>()[2 * i + 1]);
  return out;
}

}  // namespace mt::comm
