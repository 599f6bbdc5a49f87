// Tests of the NUMA binding rules on a fake sysfs tree and a fake libnuma: which node is read, what
// is bound, the bounds checks, and that the absence of NUMA is logged, never thrown.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <thread>

#include "comm/numa.h"
#include "test_util.h"

namespace mt::comm {
namespace {

using testutil::error_of;

class FakeNuma : public NumaOps {
 public:
  bool library = true, avail = true, refuse_cpus = false;
  int max = 1;
  std::vector<std::string> calls;
  bool have_library() const override { return library; }
  bool available() override {
    calls.push_back("available");
    return avail;
  }
  int max_node() override {
    calls.push_back("max_node");
    return max;
  }
  bool run_on_node(int node) override {
    calls.push_back("run_on_node " + std::to_string(node));
    return !refuse_cpus;
  }
  void set_preferred(int node) override { calls.push_back("set_preferred " + std::to_string(node)); }
};

class NumaBind : public ::testing::Test {
 protected:
  std::string root;
  FakeNuma numa;
  void SetUp() override {
    char tmpl[] = "/tmp/mt_sysfs_XXXXXX";
    root = ::mkdtemp(tmpl);
  }
  void TearDown() override { std::system(("rm -rf " + root).c_str()); }
  void device(const std::string& id, const std::string& numa_node) {
    std::string dir = root + "/bus/pci/devices/" + id;
    std::system(("mkdir -p " + dir).c_str());
    if (!numa_node.empty()) std::ofstream(dir + "/numa_node") << numa_node << "\n";
  }
};

TEST_F(NumaBind, BindsToTheGpusNode) {
  device("0000:1b:00.0", "1");
  NumaBinding b = bind_to_gpu_numa_node(3, "00000000:1B:00.0", root, &numa);  // CUDA's spelling
  EXPECT_EQ(b.line, "numa: rank 3 gpu 0000:1b:00.0 -> node 1 (cpus bound, memory preferred)");
  EXPECT_EQ(b.node, 1);
  EXPECT_TRUE(b.cpus_bound);
  EXPECT_TRUE(b.memory_preferred);
  EXPECT_EQ(numa.calls, (std::vector<std::string>{"available", "max_node", "run_on_node 1", "set_preferred 1"}));
}

TEST_F(NumaBind, MinusOneMeansNoBinding) {
  device("0000:1b:00.0", "-1");
  NumaBinding b = bind_to_gpu_numa_node(0, "0000:1b:00.0", root, &numa);
  EXPECT_EQ(b.line, "numa: rank 0: no NUMA node for gpu 0000:1b:00.0 (numa_node = -1), not binding");
  EXPECT_EQ(b.node, -1);
  EXPECT_FALSE(b.cpus_bound);
  EXPECT_TRUE(numa.calls.empty());
}

TEST_F(NumaBind, OutOfRangeNodeIsNotBound) {
  device("0000:1b:00.0", "7");
  NumaBinding b = bind_to_gpu_numa_node(2, "0000:1b:00.0", root, &numa);
  EXPECT_EQ(b.line, "numa: rank 2: gpu 0000:1b:00.0 -> node 7, but the highest NUMA node is 1, not binding");
  EXPECT_FALSE(b.cpus_bound);
  EXPECT_FALSE(b.memory_preferred);
  EXPECT_EQ(numa.calls, (std::vector<std::string>{"available", "max_node"}));
}

TEST_F(NumaBind, MissingFileOrDeviceIsNotAnError) {
  device("0000:1b:00.0", "");  // the device directory without numa_node
  NumaBinding b = bind_to_gpu_numa_node(1, "0000:1b:00.0", root, &numa);
  EXPECT_EQ(b.line, "numa: rank 1: no NUMA node for gpu 0000:1b:00.0 (no " + root +
                        "/bus/pci/devices/0000:1b:00.0/numa_node), not binding");
  b = bind_to_gpu_numa_node(1, "0000:99:00.0", root, &numa);  // no such device at all
  EXPECT_EQ(b.node, -1);
  EXPECT_TRUE(numa.calls.empty());
  device("0000:2a:00.0", "garbage");
  b = bind_to_gpu_numa_node(1, "0000:2a:00.0", root, &numa);
  EXPECT_EQ(b.line, "numa: rank 1: no NUMA node for gpu 0000:2a:00.0 (numa_node = 'garbage'), not binding");
}

TEST_F(NumaBind, NoLibraryNoNumaNoGpu) {
  device("0000:1b:00.0", "0");
  numa.library = false;
  EXPECT_EQ(bind_to_gpu_numa_node(0, "0000:1b:00.0", root, &numa).line,
            "numa: rank 0: gpu 0000:1b:00.0 -> node 0, but libnuma not found, not binding");
  numa.library = true;
  numa.avail = false;
  EXPECT_EQ(bind_to_gpu_numa_node(0, "0000:1b:00.0", root, &numa).line,
            "numa: rank 0: gpu 0000:1b:00.0 -> node 0, but NUMA is not available, not binding");
  EXPECT_EQ(numa.calls, (std::vector<std::string>{"available"}));  // nothing after a failed numa_available
  EXPECT_EQ(bind_to_gpu_numa_node(4, "", root, &numa).line, "numa: rank 4: no GPU PCI bus id (no GPU), not binding");
}

TEST_F(NumaBind, ANodeThatRefusesCpusStillPrefersMemory) {
  device("0000:1b:00.0", "1");
  numa.refuse_cpus = true;
  NumaBinding b = bind_to_gpu_numa_node(0, "0000:1b:00.0", root, &numa);
  EXPECT_EQ(b.line, "numa: rank 0 gpu 0000:1b:00.0 -> node 1 (cpus NOT bound: the node refused, memory preferred)");
  EXPECT_FALSE(b.cpus_bound);
  EXPECT_TRUE(b.memory_preferred);
}

TEST(NumaPciBusId, NormalizesAndRejects) {
  EXPECT_EQ(normalize_pci_bus_id("0000:1B:00.0"), "0000:1b:00.0");
  EXPECT_EQ(normalize_pci_bus_id("00000000:C1:00.3"), "0000:c1:00.3");
  EXPECT_EQ(normalize_pci_bus_id("1b:00.0"), "0000:1b:00.0");
  EXPECT_EQ(normalize_pci_bus_id("10000001:1b:00.0"), "10000001:1b:00.0");  // wide domains stay wide
  for (const char* bad : {"../../../etc/passwd", "0000:1b:00", "0000:1g:00.0", "0000:1b:00.8", "0000:1b/00.0", ""})
    EXPECT_EQ(
        error_of([&] { normalize_pci_bus_id(bad); }),
        std::string("PCI bus id '") + bad + "' is not of the form 0000:1b:00.0 (domain:bus:device.function, hex)");
}

TEST_F(NumaBind, RealLibnumaOnNodeZero) {
  // The machine's own libnuma (or none, per the build) on a fake device of node 0, which every
  // machine has. It runs in a thread of its own: the CPU and memory policy it sets are per thread.
  device("0000:1b:00.0", "0");
  NumaBinding b;
  std::thread([&] { b = bind_to_gpu_numa_node(0, "0000:1b:00.0", root); }).join();
  if (!system_numa_ops().have_library()) {
    EXPECT_EQ(b.line, "numa: rank 0: gpu 0000:1b:00.0 -> node 0, but libnuma not found, not binding");
  } else if (!system_numa_ops().available()) {
    EXPECT_EQ(b.line, "numa: rank 0: gpu 0000:1b:00.0 -> node 0, but NUMA is not available, not binding");
  } else {
    EXPECT_EQ(b.line, "numa: rank 0 gpu 0000:1b:00.0 -> node 0 (cpus bound, memory preferred)");
    EXPECT_TRUE(b.cpus_bound);
  }
}

}  // namespace
}  // namespace mt::comm
