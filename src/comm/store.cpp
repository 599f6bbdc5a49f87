// Store helpers (barrier), the in-process memory store and the prefix store. The TCP store lives in
// tcp_store.cpp. Every store keeps the same contract: blocking calls throw StoreTimeout naming what
// is missing, ADD counters are stored as decimal text (so get_str() reads them), and a key's value is
// any bytes.
#include "comm/store.h"

#include <charconv>
#include <condition_variable>
#include <map>
#include <mutex>

#include "comm/tcp_store.h"

namespace mt::comm {

namespace {

std::string join_keys(const std::vector<std::string>& keys) {
  std::string s;
  for (size_t i = 0; i < keys.size(); ++i) s += (i ? ", '" : "'") + keys[i] + "'";
  return s;
}

}  // namespace

// Parses an ADD counter; shared with the TCP server through store_detail.
namespace store_detail {

bool parse_counter(const Bytes& v, int64_t* out) {
  const char* b = reinterpret_cast<const char*>(v.data());
  auto r = std::from_chars(b, b + v.size(), *out);
  return r.ec == std::errc() && r.ptr == b + v.size() && !v.empty();
}

Bytes format_counter(int64_t v) {
  std::string s = std::to_string(v);
  return Bytes(s.begin(), s.end());
}

std::string keys_text(const std::vector<std::string>& keys) {
  return join_keys(keys);
}

}  // namespace store_detail

std::vector<std::string> Store::missing(const std::vector<std::string>& keys) {
  std::vector<std::string> out;
  for (const std::string& k : keys)
    if (!check({k})) out.push_back(k);
  return out;
}

void Store::barrier(const std::string& name, int rank, int world, Millis timeout) {
  if (world < 1) MT_THROW("barrier '", name, "': world (", world, ") must be at least 1");
  if (rank < 0 || rank >= world) MT_THROW("barrier '", name, "': rank (", rank, ") must be in [0, ", world, ")");
  auto key_of = [&](int r) { return name + "/arrived/" + std::to_string(r); };
  set_str(key_of(rank), "1");
  std::vector<std::string> keys;
  keys.reserve(world);
  for (int r = 0; r < world; ++r) keys.push_back(key_of(r));
  try {
    wait(keys, timeout);
  } catch (const StoreTimeout&) {
    std::vector<int> absent;
    try {
      for (int r = 0; r < world; ++r)
        if (!check({keys[r]})) absent.push_back(r);
    } catch (const Error& e) {
      // Typically rank 0 timed out at the same moment and took the server down with it.
      throw StoreTimeout(str("barrier '", name, "' timed out after ", timeout.count(),
                             " ms (and asking which ranks arrived failed: ", e.what(), ")"));
    }
    std::string ranks;
    for (size_t i = 0; i < absent.size(); ++i) ranks += (i ? ", " : "") + std::to_string(absent[i]);
    throw StoreTimeout(str("barrier '", name, "' timed out after ", timeout.count(),
                           " ms: ", absent.size() == 1 ? "rank " : "ranks ", ranks, " of ", world, " never arrived"));
  }
}

namespace {

class MemoryStore : public Store {
 public:
  void set(const std::string& key, const Bytes& value) override {
    {
      std::lock_guard<std::mutex> g(mu_);
      map_[key] = value;
    }
    cv_.notify_all();
  }

  Bytes get(const std::string& key, Millis timeout) override {
    std::unique_lock<std::mutex> g(mu_);
    if (!cv_.wait_for(g, timeout, [&] { return map_.count(key) > 0; }))
      throw StoreTimeout(str("store get of key '", key, "' timed out after ", timeout.count(), " ms"));
    return map_.at(key);
  }

  int64_t add(const std::string& key, int64_t delta) override {
    int64_t v = 0;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = map_.find(key);
      if (it != map_.end() && !store_detail::parse_counter(it->second, &v))
        MT_THROW("store add to key '", key, "': its value (", it->second.size(),
                 " bytes) is not a decimal integer counter");
      v += delta;
      map_[key] = store_detail::format_counter(v);
    }
    cv_.notify_all();
    return v;
  }

  void wait(const std::vector<std::string>& keys, Millis timeout) override {
    std::unique_lock<std::mutex> g(mu_);
    auto all = [&] {
      for (const std::string& k : keys)
        if (!map_.count(k)) return false;
      return true;
    };
    if (!cv_.wait_for(g, timeout, all)) {
      std::vector<std::string> absent;
      for (const std::string& k : keys)
        if (!map_.count(k)) absent.push_back(k);
      throw StoreTimeout(
          str("store wait timed out after ", timeout.count(), " ms; still missing: ", store_detail::keys_text(absent)));
    }
  }

  bool check(const std::vector<std::string>& keys) override {
    std::lock_guard<std::mutex> g(mu_);
    for (const std::string& k : keys)
      if (!map_.count(k)) return false;
    return true;
  }

  void erase(const std::string& key) override {
    std::lock_guard<std::mutex> g(mu_);
    map_.erase(key);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Bytes> map_;
};

// Keys become `<prefix>/<key>`. Error messages from the base store name the full keys, which is what
// a user needs to find them.
class PrefixStore : public Store {
 public:
  PrefixStore(Store& base, std::string prefix) : base_(base), prefix_(std::move(prefix) + "/") {}
  void set(const std::string& key, const Bytes& value) override { base_.set(k(key), value); }
  Bytes get(const std::string& key, Millis timeout) override { return base_.get(k(key), timeout); }
  int64_t add(const std::string& key, int64_t delta) override { return base_.add(k(key), delta); }
  void wait(const std::vector<std::string>& keys, Millis timeout) override { base_.wait(ks(keys), timeout); }
  bool check(const std::vector<std::string>& keys) override { return base_.check(ks(keys)); }
  void erase(const std::string& key) override { base_.erase(k(key)); }

 private:
  std::string k(const std::string& key) const { return prefix_ + key; }
  std::vector<std::string> ks(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const std::string& key : keys) out.push_back(k(key));
    return out;
  }
  Store& base_;
  std::string prefix_;
};

}  // namespace

std::unique_ptr<Store> make_memory_store() {
  return std::make_unique<MemoryStore>();
}

std::unique_ptr<Store> make_prefix_store(Store& base, const std::string& prefix) {
  if (prefix.empty()) MT_THROW("make_prefix_store: the prefix must not be empty");
  return std::make_unique<PrefixStore>(base, prefix);
}

std::unique_ptr<Store> make_tcp_store(const std::string& host, int port, bool is_server, Millis timeout) {
  return std::make_unique<TcpStore>(host, port, is_server, timeout);
}

}  // namespace mt::comm
