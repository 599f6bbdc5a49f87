// The TCP rendezvous store. A TcpStoreServer (one thread, poll() over its client sockets) holds the
// key-value map; TcpStore is the client every rank uses (rank 0 also owns the server). The wire
// protocol is length-prefixed binary frames, one request and one reply at a time per connection.
// Blocking GET/WAIT never block the server: it parks the request and answers when the keys appear.
// The timeout lives on the client: when it expires the client drops that connection (the server
// forgets the parked request), finds out which keys are still missing and throws StoreTimeout naming
// them. A client is thread-safe: concurrent callers each take a connection of their own from a pool,
// so a thread blocked in get() never delays another thread's set().
#pragma once
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/store.h"

namespace mt::comm {

// The server. Listens on all interfaces (IPv6 dual-stack when available, else IPv4) on `port`
// (0 = a free port chosen by the kernel; port() says which). Stops and closes every socket on
// destruction; clients then see "connection closed".
class TcpStoreServer {
 public:
  explicit TcpStoreServer(int port);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  int port() const { return port_; }

 private:
  void run();
  int listen_fd_ = -1;
  int wake_fds_[2] = {-1, -1};  // a pipe: writing to [1] wakes the poll loop to shut down
  int port_ = 0;
  std::thread thread_;
};

class TcpStore : public Store {
 public:
  // is_server: start a TcpStoreServer on `port` first (then connect to it on `host`). Connecting
  // retries until `timeout`; the same timeout bounds every non-blocking request.
  TcpStore(const std::string& host, int port, bool is_server, Millis timeout);
  ~TcpStore() override;

  int port() const { return port_; }
  const std::string& host() const { return host_; }

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  void erase(const std::string& key) override;

 private:
  // One request/reply on a pooled connection. On timeout or I/O error the connection is closed
  // instead of being returned to the pool (its reply, if any ever comes, must not reach the next
  // request).
  Bytes request(const Bytes& frame, Millis timeout, const char* what, const std::vector<std::string>& keys);
  int connect_once(std::string* why);
  int take_conn();
  void give_back(int fd);
  std::string where() const;

  std::string host_;
  int port_ = 0;
  Millis timeout_;
  std::unique_ptr<TcpStoreServer> server_;
  std::mutex mu_;
  std::vector<int> idle_;  // connected sockets not in use
};

// Shared by the stores (store.cpp, tcp_store.cpp): ADD counters are decimal text.
namespace store_detail {
bool parse_counter(const Bytes& v, int64_t* out);
Bytes format_counter(int64_t v);
std::string keys_text(const std::vector<std::string>& keys);  // "'a', 'b'"
}  // namespace store_detail

}  // namespace mt::comm
