// NUMA binding from sysfs (see numa.h). The libnuma calls live in numa_libnuma.cpp / numa_stub.cpp.
#include "comm/numa.h"

#include <cctype>
#include <charconv>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/log.h"

namespace mt::comm {

namespace {

bool all_hex(const std::string& s) {
  for (char c : s)
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  return !s.empty();
}

}  // namespace

std::string normalize_pci_bus_id(const std::string& id) {
  auto bad = [&]() -> std::string {
    MT_THROW("PCI bus id '", id, "' is not of the form 0000:1b:00.0 (domain:bus:device.function, hex)");
  };
  std::string s;
  for (char c : id) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  size_t dot = s.rfind('.');
  if (dot == std::string::npos) return bad();
  std::string function = s.substr(dot + 1), rest = s.substr(0, dot);
  size_t c2 = rest.rfind(':');
  if (c2 == std::string::npos) return bad();
  std::string device = rest.substr(c2 + 1);
  rest = rest.substr(0, c2);
  size_t c1 = rest.rfind(':');
  std::string bus = c1 == std::string::npos ? rest : rest.substr(c1 + 1);
  std::string domain = c1 == std::string::npos ? "0000" : rest.substr(0, c1);
  // CUDA prints a 32-bit domain ("00000000"); sysfs names it with 4 digits unless it is wider.
  if (domain.size() == 8 && domain.compare(0, 4, "0000") == 0) domain = domain.substr(4);
  if ((domain.size() != 4 && domain.size() != 8) || !all_hex(domain) || bus.size() != 2 || !all_hex(bus) ||
      device.size() != 2 || !all_hex(device) || function.size() != 1 || function[0] < '0' || function[0] > '7')
    return bad();
  return domain + ":" + bus + ":" + device + "." + function;
}

NumaBinding bind_to_gpu_numa_node(int rank, const std::string& pci_bus_id, const std::string& sysfs_root,
                                  NumaOps* ops) {
  NumaOps& numa = ops ? *ops : system_numa_ops();
  NumaBinding b;
  auto done = [&](std::string line) {
    b.line = std::move(line);
    log_info(b.line);
    return b;
  };
  if (pci_bus_id.empty()) return done(str("numa: rank ", rank, ": no GPU PCI bus id (no GPU), not binding"));
  const std::string id = normalize_pci_bus_id(pci_bus_id);
  const std::string path = sysfs_root + "/bus/pci/devices/" + id + "/numa_node";
  std::ifstream f(path);
  std::string text;
  if (!f || !(f >> text))
    return done(str("numa: rank ", rank, ": no NUMA node for gpu ", id, " (no ", path, "), not binding"));
  int node = -1;
  auto r = std::from_chars(text.data(), text.data() + text.size(), node);
  if (r.ec != std::errc() || r.ptr != text.data() + text.size())
    return done(str("numa: rank ", rank, ": no NUMA node for gpu ", id, " (numa_node = '", text, "'), not binding"));
  if (node < 0)
    return done(str("numa: rank ", rank, ": no NUMA node for gpu ", id, " (numa_node = ", node, "), not binding"));
  b.node = node;
  if (!numa.have_library())
    return done(str("numa: rank ", rank, ": gpu ", id, " -> node ", node, ", but libnuma not found, not binding"));
  if (!numa.available())
    return done(str("numa: rank ", rank, ": gpu ", id, " -> node ", node, ", but NUMA is not available, not binding"));
  int max_node = numa.max_node();
  if (node > max_node)
    return done(str("numa: rank ", rank, ": gpu ", id, " -> node ", node, ", but the highest NUMA node is ", max_node,
                    ", not binding"));
  // A node without CPUs (GPU memory exposed as a NUMA node) refuses the CPU binding; memory can
  // still prefer it.
  b.cpus_bound = numa.run_on_node(node);
  numa.set_preferred(node);
  b.memory_preferred = true;
  return done(
      str("numa: rank ", rank, " gpu ", id, " -> node ", node,
          b.cpus_bound ? " (cpus bound, memory preferred)" : " (cpus NOT bound: the node refused, memory preferred)"));
}

}  // namespace mt::comm
