// The TCP store: server (one poll() thread) and client (a pool of blocking-with-deadline
// connections). Wire format, all integers little-endian:
//   frame   = u32 length, then `length` payload bytes
//   request = u8 op, then per op: HELLO u32 magic u32 version | SET str key, str value | GET str key
//             | ADD str key, i64 delta | CHECK u32 n, n x str | WAIT u32 n, n x str | ERASE str key
//   reply   = u8 status (0 ok, 1 error), then GET str value | ADD i64 | CHECK u8 | error str message
//   str     = u32 length, bytes
// A connection carries one request at a time. GET and WAIT are parked on the server until their
// keys exist; a client that gives up closes the connection, which drops the parked request.
#include "comm/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <map>

#include "core/error.h"

namespace mt::comm {

namespace {

enum Op : uint8_t { kHello = 0, kSet = 1, kGet = 2, kAdd = 3, kCheck = 4, kWait = 5, kErase = 6 };
enum Status : uint8_t { kOk = 0, kErr = 1 };
constexpr uint32_t kMagic = 0x3153544d;  // "MTS1"
constexpr uint32_t kVersion = 1;
// Values are small (ids, hashes, reports); a larger frame is a bug or a stranger on the port.
constexpr uint32_t kMaxFrame = 256u << 20;

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(Millis timeout) {
  // Millis::max() would overflow the clock; a week is "forever" for a rendezvous.
  Millis t = std::clamp(timeout, Millis(0), Millis(std::chrono::hours(24 * 7)));
  return Clock::now() + t;
}

int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, INT_MAX));
}

std::string errno_text(int e) {
  return std::strerror(e);
}

struct Writer {
  Bytes b;
  Writer() { b.resize(4); }  // room for the frame length
  void u8(uint8_t v) { b.push_back(v); }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  void i64(int64_t v) {
    for (int i = 0; i < 8; ++i) b.push_back(static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i)));
  }
  void bytes(const uint8_t* p, size_t n) {
    if (n > kMaxFrame) MT_THROW("store: a key or value of ", n, " bytes is over the limit of ", kMaxFrame, " bytes");
    u32(static_cast<uint32_t>(n));
    b.insert(b.end(), p, p + n);
  }
  void str(const std::string& s) { bytes(reinterpret_cast<const uint8_t*>(s.data()), s.size()); }
  void bytes(const Bytes& v) { bytes(v.data(), v.size()); }
  Bytes frame() {
    size_t n = b.size() - 4;
    if (n > kMaxFrame) MT_THROW("store: a request of ", n, " bytes is over the limit of ", kMaxFrame, " bytes");
    for (int i = 0; i < 4; ++i) b[i] = static_cast<uint8_t>(n >> (8 * i));
    return std::move(b);
  }
};

// Reads a payload; any overrun throws (the server drops such a client, the client reports it).
struct Reader {
  const uint8_t* p;
  size_t n;
  size_t at = 0;
  void need(size_t k) const {
    if (n - at < k) MT_THROW("malformed store message: needs ", k, " more bytes at offset ", at, " of ", n);
  }
  uint8_t u8() {
    need(1);
    return p[at++];
  }
  uint32_t u32() {
    need(4);
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t(p[at + i]) << (8 * i);
    at += 4;
    return v;
  }
  int64_t i64() {
    need(8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t(p[at + i]) << (8 * i);
    at += 8;
    return static_cast<int64_t>(v);
  }
  Bytes bytes() {
    uint32_t k = u32();
    need(k);
    Bytes v(p + at, p + at + k);
    at += k;
    return v;
  }
  std::string str() {
    Bytes v = bytes();
    return std::string(v.begin(), v.end());
  }
  std::vector<std::string> strs() {
    uint32_t k = u32();
    if (k > n) MT_THROW("malformed store message: ", k, " keys in ", n, " bytes");
    std::vector<std::string> out;
    out.reserve(k);
    for (uint32_t i = 0; i < k; ++i) out.push_back(str());
    return out;
  }
};

uint32_t frame_length(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

void set_nonblocking(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// ---------------------------------------------------------------------------------------------
// Server state, touched only by the server thread.

struct ServerConn {
  int fd = -1;
  Bytes in;   // received bytes not yet parsed
  Bytes out;  // reply bytes not yet sent
  size_t out_at = 0;
  uint8_t parked = 0;  // kGet or kWait while waiting for keys, else 0
  std::vector<std::string> parked_keys;
  bool dead = false;
};

class ServerState {
 public:
  std::map<std::string, Bytes> kv;
  bool changed = false;  // a key was created or updated: parked requests may be ready

  bool has_all(const std::vector<std::string>& keys) const {
    for (const std::string& k : keys)
      if (!kv.count(k)) return false;
    return true;
  }

  static void reply_ok(ServerConn& c, Writer& w) {
    Bytes f = w.frame();
    c.out.insert(c.out.end(), f.begin(), f.end());
  }
  static void reply_error(ServerConn& c, const std::string& msg) {
    Writer w;
    w.u8(kErr);
    w.str(msg);
    reply_ok(c, w);
  }

  // Answers a parked request if its keys now exist.
  void try_unpark(ServerConn& c) {
    if (!c.parked || !has_all(c.parked_keys)) return;
    Writer w;
    w.u8(kOk);
    if (c.parked == kGet) w.bytes(kv.at(c.parked_keys[0]));
    reply_ok(c, w);
    c.parked = 0;
    c.parked_keys.clear();
  }

  void handle(ServerConn& c, Reader& r) {
    uint8_t op = r.u8();
    Writer w;
    w.u8(kOk);
    switch (op) {
      case kHello: {
        uint32_t magic = r.u32(), version = r.u32();
        if (magic != kMagic || version != kVersion) {
          reply_error(c, str("store protocol mismatch: client magic ", magic, " version ", version, ", server magic ",
                             kMagic, " version ", kVersion));
          return;
        }
        break;
      }
      case kSet: {
        std::string k = r.str();
        kv[k] = r.bytes();
        changed = true;
        break;
      }
      case kGet:
      case kWait: {
        c.parked_keys = op == kGet ? std::vector<std::string>{r.str()} : r.strs();
        c.parked = op;
        try_unpark(c);
        return;
      }
      case kAdd: {
        std::string k = r.str();
        int64_t delta = r.i64(), v = 0;
        auto it = kv.find(k);
        if (it != kv.end() && !store_detail::parse_counter(it->second, &v)) {
          reply_error(c, str("store add to key '", k, "': its value (", it->second.size(),
                             " bytes) is not a decimal integer counter"));
          return;
        }
        v += delta;
        kv[k] = store_detail::format_counter(v);
        changed = true;
        w.i64(v);
        break;
      }
      case kCheck:
        w.u8(has_all(r.strs()) ? 1 : 0);
        break;
      case kErase:
        kv.erase(r.str());
        break;
      default:
        MT_THROW("unknown store op ", int(op));
    }
    reply_ok(c, w);
  }

  // Handles every complete frame in c.in, stopping at a parked request (one request at a time).
  void process(ServerConn& c) {
    size_t at = 0;
    while (!c.parked && !c.dead && c.in.size() - at >= 4) {
      uint32_t len = frame_length(c.in.data() + at);
      if (len > kMaxFrame || len == 0) {
        c.dead = true;  // not our protocol: drop the connection
        break;
      }
      if (c.in.size() - at - 4 < len) break;
      Reader r{c.in.data() + at + 4, len};
      try {
        handle(c, r);
      } catch (const std::exception&) {
        c.dead = true;
      }
      at += 4 + len;
    }
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(at));
  }
};

void flush(ServerConn& c) {
  while (c.out_at < c.out.size()) {
    ssize_t k = ::send(c.fd, c.out.data() + c.out_at, c.out.size() - c.out_at, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      c.out_at += static_cast<size_t>(k);
    } else if (k < 0 && errno == EINTR) {
      continue;
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      c.dead = true;
      return;
    }
  }
  c.out.clear();
  c.out_at = 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

TcpStoreServer::TcpStoreServer(int port) {
  if (port < 0 || port > 65535) MT_THROW("store server port (", port, ") must be in [0, 65535] (0 = any free port)");
  // IPv6 dual-stack accepts IPv4 clients too; fall back to IPv4 where IPv6 is off.
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  bool v6 = fd >= 0;
  if (!v6) fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) MT_THROW("store server: socket() failed: ", errno_text(errno));
  int one = 1, zero = 0;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc;
  if (v6) {
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  }
  if (rc != 0 || ::listen(fd, SOMAXCONN) != 0) {
    int e = errno;
    ::close(fd);
    MT_THROW("store server: cannot listen on port ", port, ": ", errno_text(e),
             e == EADDRINUSE ? " (another job uses it? choose another MASTER_PORT / --master-port)" : "");
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  port_ = v6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
             : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  set_nonblocking(fd);
  listen_fd_ = fd;
  if (::pipe2(wake_fds_, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(fd);
    MT_THROW("store server: pipe() failed: ", errno_text(errno));
  }
  thread_ = std::thread([this] { run(); });
}

TcpStoreServer::~TcpStoreServer() {
  char x = 1;
  while (::write(wake_fds_[1], &x, 1) < 0 && errno == EINTR) {
  }
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_fds_[0]);
  ::close(wake_fds_[1]);
}

void TcpStoreServer::run() {
  ServerState state;
  std::vector<std::unique_ptr<ServerConn>> conns;
  std::vector<pollfd> pfds;
  for (;;) {
    pfds.clear();
    pfds.push_back({wake_fds_[0], POLLIN, 0});
    pfds.push_back({listen_fd_, POLLIN, 0});
    for (auto& c : conns) pfds.push_back({c->fd, static_cast<short>(POLLIN | (c->out.empty() ? 0 : POLLOUT)), 0});
    int n = ::poll(pfds.data(), pfds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;  // cannot happen with valid fds; stopping beats spinning
    }
    if (pfds[0].revents) break;
    if (pfds[1].revents & POLLIN) {
      for (;;) {
        int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;  // EAGAIN (all accepted) or a transient error; poll again
        set_nodelay(fd);
        auto c = std::make_unique<ServerConn>();
        c->fd = fd;
        conns.push_back(std::move(c));
      }
    }
    // Connections accepted just now have no pollfd yet (index past the end): they are polled next time.
    for (size_t i = 0; i + 2 < pfds.size(); ++i) {
      ServerConn& c = *conns[i];
      short ev = pfds[i + 2].revents;
      if (ev & (POLLIN | POLLHUP | POLLERR)) {
        uint8_t buf[65536];
        for (;;) {
          ssize_t k = ::recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
          if (k > 0) {
            c.in.insert(c.in.end(), buf, buf + k);
            if (c.in.size() > kMaxFrame + 8u) {
              c.dead = true;
              break;
            }
          } else if (k < 0 && errno == EINTR) {
            continue;
          } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            break;
          } else {
            c.dead = true;  // closed by the client (or reset): its parked request goes with it
            break;
          }
        }
        state.process(c);
      }
      if (ev & POLLOUT) flush(c);
    }
    // New keys may complete parked requests, whose connections may hold further requests.
    while (state.changed) {
      state.changed = false;
      for (auto& c : conns) {
        if (c->dead || !c->parked) continue;
        state.try_unpark(*c);
        if (!c->parked) state.process(*c);
      }
    }
    for (auto& c : conns)
      if (!c->dead && !c->out.empty()) flush(*c);
    std::erase_if(conns, [](const std::unique_ptr<ServerConn>& c) {
      if (c->dead) ::close(c->fd);
      return c->dead;
    });
  }
  for (auto& c : conns) ::close(c->fd);
}

// ---------------------------------------------------------------------------------------------
// Client.

namespace {

// Sends all of `b` before the deadline; false on timeout, throws on a broken connection.
bool send_all(int fd, const Bytes& b, Clock::time_point deadline) {
  size_t at = 0;
  while (at < b.size()) {
    ssize_t k = ::send(fd, b.data() + at, b.size() - at, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      at += static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      int left = ms_left(deadline);
      if (left == 0 || ::poll(&p, 1, left) == 0) return false;
      continue;
    }
    MT_THROW("send failed: ", errno_text(errno));
  }
  return true;
}

// Receives exactly n bytes; false on timeout, throws when the peer closed or the socket failed.
bool recv_all(int fd, uint8_t* out, size_t n, Clock::time_point deadline) {
  size_t at = 0;
  while (at < n) {
    ssize_t k = ::recv(fd, out + at, n - at, MSG_DONTWAIT);
    if (k > 0) {
      at += static_cast<size_t>(k);
      continue;
    }
    if (k == 0) MT_THROW("the server closed the connection");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd p{fd, POLLIN, 0};
      int left = ms_left(deadline);
      if (left == 0) return false;
      int r = ::poll(&p, 1, left);
      if (r == 0) return false;
      continue;
    }
    MT_THROW("recv failed: ", errno_text(errno));
  }
  return true;
}

}  // namespace

TcpStore::TcpStore(const std::string& host, int port, bool is_server, Millis timeout)
    : host_(host), port_(port), timeout_(timeout) {
  if (host.empty()) MT_THROW("store host must not be empty (set MASTER_ADDR or --master-addr)");
  if (timeout.count() <= 0) MT_THROW("store timeout (", timeout.count(), " ms) must be positive");
  if (is_server) {
    server_ = std::make_unique<TcpStoreServer>(port);
    port_ = server_->port();
  } else if (port < 1 || port > 65535) {
    MT_THROW("store port (", port, ") must be in [1, 65535]");
  }
  give_back(take_conn());  // fail here, with host:port named, if the server cannot be reached
}

TcpStore::~TcpStore() {
  std::lock_guard<std::mutex> g(mu_);
  for (int fd : idle_) ::close(fd);
  idle_.clear();
}

std::string TcpStore::where() const {
  return str(host_, ":", port_);
}

int TcpStore::connect_once(std::string* why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string port = std::to_string(port_);
  int rc = ::getaddrinfo(host_.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    *why = str("cannot resolve host '", host_, "': ", ::gai_strerror(rc));
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      *why = errno_text(errno);
      continue;
    }
    int err = 0;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        // A SYN to a host that is down can take minutes to fail; a second is enough to retry.
        pollfd p{fd, POLLOUT, 0};
        if (::poll(&p, 1, 1000) == 1) {
          socklen_t len = sizeof(err);
          ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        } else {
          err = ETIMEDOUT;
        }
      }
    }
    if (err != 0) {
      *why = errno_text(err);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  if (fd >= 0) set_nodelay(fd);
  return fd;
}

int TcpStore::take_conn() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!idle_.empty()) {
      int fd = idle_.back();
      idle_.pop_back();
      return fd;
    }
  }
  // The server may not be up yet (rank 0 starts later than the others): retry until the timeout.
  auto deadline = deadline_after(timeout_);
  std::string why;
  Millis backoff(10);
  for (;;) {
    int fd = connect_once(&why);
    if (fd >= 0) {
      Writer w;
      w.u8(kHello);
      w.u32(kMagic);
      w.u32(kVersion);
      Bytes f = w.frame();
      uint8_t head[5];
      bool ok = false;
      try {
        ok = send_all(fd, f, deadline) && recv_all(fd, head, 5, deadline);
      } catch (const std::exception& e) {
        why = str("handshake failed: ", e.what(), " (is something else listening on that port?)");
      }
      if (ok && frame_length(head) == 1 && head[4] == kOk) return fd;
      if (ok)
        why = "the server refused the handshake (a different store protocol version?)";
      else if (why.empty())
        why = "no handshake reply";
      ::close(fd);
      if (ok) break;  // a definite answer: retrying will not change it
    }
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::min<Millis>(backoff, Millis(ms_left(deadline))));
    backoff = std::min(backoff * 2, Millis(200));
  }
  MT_THROW("could not connect to the store at ", where(), " within ", timeout_.count(), " ms: ", why);
}

void TcpStore::give_back(int fd) {
  std::lock_guard<std::mutex> g(mu_);
  idle_.push_back(fd);
}

Bytes TcpStore::request(const Bytes& frame, Millis timeout, const char* what, const std::vector<std::string>& keys) {
  int fd;
  try {
    fd = take_conn();
  } catch (const Error& e) {
    MT_THROW("store ", what, (keys.empty() ? "" : " of " + store_detail::keys_text(keys)), ": ", e.what());
  }
  auto deadline = deadline_after(timeout);
  Bytes payload;
  try {
    uint8_t head[4];
    bool ok = send_all(fd, frame, deadline) && recv_all(fd, head, 4, deadline);
    if (ok) {
      uint32_t len = frame_length(head);
      if (len == 0 || len > kMaxFrame) MT_THROW("bad reply length ", len);
      payload.resize(len);
      ok = recv_all(fd, payload.data(), len, deadline);
    }
    if (!ok) {
      ::close(fd);  // the server forgets a parked request when its connection closes
      fd = -1;
      if (std::string(what) == "wait" || std::string(what) == "get") {
        std::vector<std::string> absent;
        try {
          absent = missing(keys);
        } catch (const std::exception&) {
          absent = keys;  // the server is gone too; all we know is what we asked for
        }
        if (absent.empty()) absent = keys;  // appeared just now: still report what timed out
        if (std::string(what) == "get")
          throw StoreTimeout(
              str("store get of key '", keys[0], "' timed out after ", timeout.count(), " ms (store ", where(), ")"));
        throw StoreTimeout(str("store wait timed out after ", timeout.count(), " ms (store ", where(),
                               "); still missing: ", store_detail::keys_text(absent)));
      }
      throw StoreTimeout(str("store ", what, (keys.empty() ? "" : " of " + store_detail::keys_text(keys)),
                             " got no reply from ", where(), " within ", timeout.count(), " ms"));
    }
  } catch (const StoreTimeout&) {
    throw;
  } catch (const std::exception& e) {
    if (fd >= 0) ::close(fd);
    MT_THROW("store ", what, (keys.empty() ? "" : " of " + store_detail::keys_text(keys)), " failed: ", e.what(),
             " (store ", where(), "; did rank 0 exit?)");
  }
  give_back(fd);
  if (payload[0] == kErr) {
    Reader r{payload.data(), payload.size(), 1};
    MT_THROW(r.str());
  }
  payload.erase(payload.begin());
  return payload;
}

void TcpStore::set(const std::string& key, const Bytes& value) {
  Writer w;
  w.u8(kSet);
  w.str(key);
  w.bytes(value);
  request(w.frame(), timeout_, "set", {key});
}

Bytes TcpStore::get(const std::string& key, Millis timeout) {
  Writer w;
  w.u8(kGet);
  w.str(key);
  Bytes p = request(w.frame(), timeout, "get", {key});
  Reader r{p.data(), p.size()};
  return r.bytes();
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  Writer w;
  w.u8(kAdd);
  w.str(key);
  w.i64(delta);
  Bytes p = request(w.frame(), timeout_, "add", {key});
  Reader r{p.data(), p.size()};
  return r.i64();
}

void TcpStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  if (keys.empty()) return;
  Writer w;
  w.u8(kWait);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (const std::string& k : keys) w.str(k);
  request(w.frame(), timeout, "wait", keys);
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  Writer w;
  w.u8(kCheck);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (const std::string& k : keys) w.str(k);
  Bytes p = request(w.frame(), timeout_, "check", keys);
  Reader r{p.data(), p.size()};
  return r.u8() != 0;
}

void TcpStore::erase(const std::string& key) {
  Writer w;
  w.u8(kErase);
  w.str(key);
  request(w.frame(), timeout_, "erase", {key});
}

}  // namespace mt::comm
