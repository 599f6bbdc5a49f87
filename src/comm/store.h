// Rendezvous key-value store. Rank 0 serves a TCP store; every rank (rank 0 too) is a client. It
// carries what ranks must agree on before (or beside) the communicators: NCCL unique ids, Gloo's
// rendezvous, barriers, the collective-schedule records used to name diverging ranks, and the
// watchdog's "last collective" reports. Every blocking call has a timeout and, when it expires,
// throws an mt::Error that names the key and, for barriers, the ranks that never arrived.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"

namespace mt::comm {

using Bytes = std::vector<uint8_t>;
using Millis = std::chrono::milliseconds;

// What a blocking call throws when its timeout passes (other failures, such as a lost connection
// to the store's server, throw a plain mt::Error).
struct StoreTimeout : Error {
  using Error::Error;
};

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Blocks until the key exists (or the timeout passes: mt::Error naming the key and the wait).
  virtual Bytes get(const std::string& key, Millis timeout) = 0;
  // Atomic add to an integer counter (created at 0); returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Blocks until every key exists; on timeout the error lists the keys still missing.
  virtual void wait(const std::vector<std::string>& keys, Millis timeout) = 0;
  virtual bool check(const std::vector<std::string>& keys) = 0;  // all exist, without blocking
  virtual void erase(const std::string& key) = 0;

  // Convenience over the primitives above.
  void set_str(const std::string& key, const std::string& v) { set(key, Bytes(v.begin(), v.end())); }
  std::string get_str(const std::string& key, Millis timeout) {
    Bytes b = get(key, timeout);
    return std::string(b.begin(), b.end());
  }
  // Barrier of `world` ranks under a unique `name`: rank r sets `<name>/arrived/<r>` and waits for
  // all of them. On timeout it throws StoreTimeout naming the ranks that never arrived:
  //   barrier 'init' timed out after 5000 ms: ranks 2, 3 of 4 never arrived
  // The keys stay in the store, so a name must not be reused.
  void barrier(const std::string& name, int rank, int world, Millis timeout);
  // The keys of `keys` that do not exist now (one check per key; for error messages).
  std::vector<std::string> missing(const std::vector<std::string>& keys);
};

// rank 0 passes is_server = true: it starts the server on `port` (0 = any free port; port() says
// which) and connects to it like everyone else. Clients retry connecting until `timeout`.
// The concrete type is TcpStore (comm/tcp_store.h), whose port() says the port chosen for port 0.
std::unique_ptr<Store> make_tcp_store(const std::string& host, int port, bool is_server, Millis timeout);

// A store in one process (tests that run ranks as threads).
std::unique_ptr<Store> make_memory_store();

// A view of another store with every key prefixed (one namespace per communicator / group).
std::unique_ptr<Store> make_prefix_store(Store& base, const std::string& prefix);

}  // namespace mt::comm
