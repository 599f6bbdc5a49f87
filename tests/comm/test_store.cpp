// Tests of the rendezvous stores: the same contract on the memory, prefix and TCP stores (ranks as
// threads), then what only the TCP store has (ports, parked requests, lost servers, strangers).
// Cross-process behaviour (the launcher and a store served by another process) is in test_launch.cpp.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "comm/store.h"
#include "comm/tcp_store.h"
#include "test_util.h"

namespace mt::comm {
namespace {

using namespace std::chrono_literals;
using testutil::error_of;

// One store per "rank"; all ranks see the same keys.
struct Ranks {
  std::vector<std::unique_ptr<Store>> stores;
  std::unique_ptr<Store> base;  // the memory store under the prefix stores
  Store& operator[](size_t i) { return *stores[i]; }
};

Ranks make_ranks(const std::string& kind, int n) {
  Ranks r;
  if (kind == "memory") {
    r.base = make_memory_store();
    for (int i = 0; i < n; ++i) r.stores.push_back(make_prefix_store(*r.base, "job"));
  } else {
    auto server = std::make_unique<TcpStore>("127.0.0.1", 0, true, 10s);
    int port = server->port();
    r.stores.push_back(std::move(server));
    for (int i = 1; i < n; ++i) r.stores.push_back(make_tcp_store("127.0.0.1", port, false, 10s));
  }
  return r;
}

class StoreContract : public ::testing::TestWithParam<std::string> {};

TEST_P(StoreContract, SetGetAcrossRanks) {
  Ranks r = make_ranks(GetParam(), 2);
  r[0].set_str("a", "hello");
  EXPECT_EQ(r[1].get_str("a", 1s), "hello");
  r[1].set("a", Bytes{0, 1, 255});  // overwrite, binary bytes
  EXPECT_EQ(r[0].get("a", 1s), (Bytes{0, 1, 255}));
  r[0].set("empty", Bytes{});
  EXPECT_TRUE(r[1].get("empty", 1s).empty());
}

TEST_P(StoreContract, GetBlocksUntilTheKeyIsSet) {
  Ranks r = make_ranks(GetParam(), 2);
  auto got = std::async(std::launch::async, [&] { return r[1].get_str("late", 10s); });
  std::this_thread::sleep_for(50ms);
  r[0].set_str("late", "here");
  EXPECT_EQ(got.get(), "here");
}

TEST_P(StoreContract, GetTimeoutNamesTheKeyAndTheWait) {
  Ranks r = make_ranks(GetParam(), 1);
  std::string e = error_of([&] { r[0].get("never/set", 100ms); });
  EXPECT_NE(e.find("never/set'"), std::string::npos) << e;
  EXPECT_NE(e.find("100 ms"), std::string::npos) << e;
  EXPECT_THROW(r[0].get("never/set", 10ms), StoreTimeout);
}

TEST_P(StoreContract, WaitTimeoutListsOnlyTheMissingKeys) {
  Ranks r = make_ranks(GetParam(), 1);
  r[0].set_str("k1", "x");
  std::string e = error_of([&] { r[0].wait({"k1", "k2", "k3"}, 100ms); });
  EXPECT_NE(e.find("k2'"), std::string::npos) << e;
  EXPECT_NE(e.find("k3'"), std::string::npos) << e;
  EXPECT_EQ(e.find("k1'"), std::string::npos) << e;
  EXPECT_NE(e.find("100 ms"), std::string::npos) << e;
}

TEST_P(StoreContract, WaitReturnsWhenAllKeysAppear) {
  Ranks r = make_ranks(GetParam(), 3);
  auto done = std::async(std::launch::async, [&] { r[0].wait({"x", "y"}, 10s); });
  r[1].set_str("x", "1");
  EXPECT_EQ(done.wait_for(50ms), std::future_status::timeout);  // y still missing
  r[2].set_str("y", "1");
  done.get();
  r[0].wait({}, 0ms);  // nothing to wait for
}

TEST_P(StoreContract, AddIsAtomicAcrossRanks) {
  constexpr int kRanks = 4, kAdds = 200;
  Ranks r = make_ranks(GetParam(), kRanks);
  std::vector<std::thread> ts;
  for (int i = 0; i < kRanks; ++i)
    ts.emplace_back([&, i] {
      for (int j = 0; j < kAdds; ++j) r[i].add("counter", 1);
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(r[0].add("counter", 0), kRanks * kAdds);
  EXPECT_EQ(r[1].get_str("counter", 1s), std::to_string(kRanks * kAdds));
  EXPECT_EQ(r[1].add("fresh", -5), -5);
  r[0].set_str("text", "abc");
  std::string e = error_of([&] { r[0].add("text", 1); });
  EXPECT_NE(e.find("not a decimal integer counter"), std::string::npos) << e;
}

TEST_P(StoreContract, CheckAndErase) {
  Ranks r = make_ranks(GetParam(), 2);
  EXPECT_FALSE(r[0].check({"a"}));
  r[1].set_str("a", "1");
  EXPECT_TRUE(r[0].check({"a"}));
  EXPECT_FALSE(r[0].check({"a", "b"}));
  EXPECT_TRUE(r[0].check({}));
  EXPECT_EQ(r[0].missing({"a", "b", "c"}), (std::vector<std::string>{"b", "c"}));
  r[0].erase("a");
  EXPECT_FALSE(r[1].check({"a"}));
  r[0].erase("never-existed");  // not an error
}

TEST_P(StoreContract, BarrierReleasesEveryRank) {
  constexpr int kRanks = 4;
  Ranks r = make_ranks(GetParam(), kRanks);
  std::atomic<int> passed{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < kRanks; ++i)
    ts.emplace_back([&, i] {
      r[i].barrier("b1", i, kRanks, 10s);
      r[i].barrier("b2", i, kRanks, 10s);
      ++passed;
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(passed.load(), kRanks);
}

TEST_P(StoreContract, BarrierTimeoutNamesTheRanksThatNeverArrived) {
  Ranks r = make_ranks(GetParam(), 2);
  auto other = std::async(std::launch::async, [&] { return error_of([&] { r[1].barrier("init", 1, 4, 300ms); }); });
  std::string e = error_of([&] { r[0].barrier("init", 0, 4, 300ms); });
  EXPECT_EQ(e, "barrier 'init' timed out after 300 ms: ranks 2, 3 of 4 never arrived");
  EXPECT_EQ(other.get(), e);
  e = error_of([&] { r[0].barrier("solo", 0, 2, 50ms); });
  EXPECT_EQ(e, "barrier 'solo' timed out after 50 ms: rank 1 of 2 never arrived");
}

TEST_P(StoreContract, BarrierRejectsBadRanks) {
  Ranks r = make_ranks(GetParam(), 1);
  EXPECT_EQ(error_of([&] { r[0].barrier("x", 4, 4, 1s); }), "barrier 'x': rank (4) must be in [0, 4)");
  EXPECT_EQ(error_of([&] { r[0].barrier("x", 0, 0, 1s); }), "barrier 'x': world (0) must be at least 1");
}

INSTANTIATE_TEST_SUITE_P(Stores, StoreContract, ::testing::Values("memory", "tcp"));

TEST(PrefixStore, KeysLandUnderThePrefix) {
  auto base = make_memory_store();
  auto a = make_prefix_store(*base, "comm0");
  auto b = make_prefix_store(*base, "comm1");
  a->set_str("id", "A");
  b->set_str("id", "B");
  EXPECT_EQ(base->get_str("comm0/id", 1s), "A");
  EXPECT_EQ(base->get_str("comm1/id", 1s), "B");
  auto nested = make_prefix_store(*a, "sub");
  nested->set_str("k", "v");
  EXPECT_TRUE(base->check({"comm0/sub/k"}));
  EXPECT_EQ(error_of([&] { make_prefix_store(*base, ""); }), "make_prefix_store: the prefix must not be empty");
}

TEST(TcpStore, PortZeroPicksAFreePort) {
  TcpStore a("127.0.0.1", 0, true, 5s), b("127.0.0.1", 0, true, 5s);
  EXPECT_GT(a.port(), 0);
  EXPECT_GT(b.port(), 0);
  EXPECT_NE(a.port(), b.port());
  // localhost may resolve to ::1 first; the dual-stack server takes both.
  TcpStore c("localhost", a.port(), false, 5s);
  c.set_str("k", "v");
  EXPECT_EQ(a.get_str("k", 1s), "v");
}

TEST(TcpStore, AParkedGetDoesNotBlockOtherClientsOrThreads) {
  TcpStore server("127.0.0.1", 0, true, 5s);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  auto parked = std::async(std::launch::async, [&] { return client.get_str("gate", 10s); });
  std::this_thread::sleep_for(20ms);
  // Same client object, another thread: served on its own pooled connection meanwhile.
  for (int i = 0; i < 50; ++i) client.set_str("k" + std::to_string(i), "v");
  EXPECT_EQ(server.get_str("k49", 1s), "v");
  EXPECT_EQ(parked.wait_for(0ms), std::future_status::timeout);
  server.set_str("gate", "open");
  EXPECT_EQ(parked.get(), "open");
}

TEST(TcpStore, TimedOutGetLeavesTheStoreUsable) {
  TcpStore server("127.0.0.1", 0, true, 5s);
  EXPECT_THROW(server.get("x", 20ms), StoreTimeout);
  server.set_str("x", "late");  // the abandoned GET must not answer a later request
  server.set_str("y", "y-value");
  EXPECT_EQ(server.get_str("y", 1s), "y-value");
  EXPECT_EQ(server.get_str("x", 1s), "late");
}

TEST(TcpStore, LargeValuesRoundTrip) {
  TcpStore server("127.0.0.1", 0, true, 10s);
  TcpStore client("127.0.0.1", server.port(), false, 10s);
  Bytes big(8 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 7 + (i >> 13));
  client.set("big", big);
  EXPECT_EQ(server.get("big", 5s), big);
}

TEST(TcpStore, ClientRetriesUntilTheServerComesUp) {
  int port;
  { port = TcpStoreServer(0).port(); }  // a port that was free a moment ago
  auto late = std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(200ms);
    return std::make_unique<TcpStore>("127.0.0.1", port, true, 5s);
  });
  TcpStore client("127.0.0.1", port, false, 5s);
  auto server = late.get();
  client.set_str("k", "v");
  EXPECT_EQ(server->get_str("k", 1s), "v");
}

TEST(TcpStore, ConnectTimeoutNamesHostAndPort) {
  int port;
  { port = TcpStoreServer(0).port(); }
  std::string e = error_of([&] { TcpStore("127.0.0.1", port, false, 200ms); });
  EXPECT_NE(e.find("could not connect to the store at 127.0.0.1:" + std::to_string(port) + " within 200 ms"),
            std::string::npos)
      << e;
  e = error_of([&] { TcpStore("no-such-host.invalid", 1234, false, 100ms); });
  EXPECT_NE(e.find("no-such-host.invalid"), std::string::npos) << e;
  EXPECT_EQ(error_of([&] { TcpStore("127.0.0.1", 0, false, 1s); }), "store port (0) must be in [1, 65535]");
  EXPECT_EQ(error_of([&] { TcpStore("127.0.0.1", 70000, true, 1s); }),
            "store server port (70000) must be in [0, 65535] (0 = any free port)");
}

TEST(TcpStore, PortInUseIsNamed) {
  TcpStore a("127.0.0.1", 0, true, 1s);
  std::string e = error_of([&] { TcpStore("127.0.0.1", a.port(), true, 1s); });
  EXPECT_NE(e.find("cannot listen on port " + std::to_string(a.port())), std::string::npos) << e;
}

TEST(TcpStore, ServerShutdownWakesParkedClientsAndFailsLaterCalls) {
  auto server = std::make_unique<TcpStore>("127.0.0.1", 0, true, 2s);
  TcpStore client("127.0.0.1", server->port(), false, 2s);
  auto parked = std::async(std::launch::async, [&] { return error_of([&] { client.get("never", 60s); }); });
  std::this_thread::sleep_for(50ms);
  auto t0 = std::chrono::steady_clock::now();
  server.reset();  // must not hang, and must release the parked client at once
  std::string e = parked.get();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_NE(e.find("did rank 0 exit?"), std::string::npos) << e;
  e = error_of([&] { client.set_str("k", "v"); });
  EXPECT_NE(e.find("store set of 'k'"), std::string::npos) << e;
}

TEST(TcpStore, AStrangerOnThePortIsDroppedOthersAreServed) {
  TcpStore server("127.0.0.1", 0, true, 5s);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(server.port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  const char junk[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";  // length prefix "GET " = 0x20544547: too big
  ASSERT_GT(::send(fd, junk, sizeof(junk) - 1, MSG_NOSIGNAL), 0);
  char buf[16];
  EXPECT_EQ(::recv(fd, buf, sizeof(buf), 0), 0);  // the server closed it
  ::close(fd);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  client.set_str("still", "fine");
  EXPECT_EQ(server.get_str("still", 1s), "fine");
}

}  // namespace
}  // namespace mt::comm
