#include "comm/gather_words.h"

#include <algorithm>

namespace mt::comm {

std::vector<std::vector<int32_t>> all_gather_words(Communicator& comm, const std::vector<int32_t>& words) {
  const Device dev = comm.device();
  auto on = [&](const Tensor& t) { return dev == Device::CPU ? t : t.to(dev); };
  Tensor len = Tensor::empty({1}, DType::I64);
  len.data<int64_t>()[0] = int64_t(words.size());
  Tensor lens = on(Tensor::empty({comm.size()}, DType::I64));
  comm.all_gather(on(len), lens)->wait();
  const Tensor lens_h = lens.to(Device::CPU);
  int64_t longest = 1;
  for (int r = 0; r < comm.size(); ++r) longest = std::max(longest, lens_h.data<int64_t>()[r]);
  Tensor buf = Tensor::zeros({longest}, DType::I32);
  std::copy(words.begin(), words.end(), buf.data<int32_t>());
  Tensor all = on(Tensor::empty({comm.size() * longest}, DType::I32));
  comm.all_gather(on(buf), all)->wait();
  const Tensor all_h = all.to(Device::CPU);
  std::vector<std::vector<int32_t>> out;
  for (int r = 0; r < comm.size(); ++r) {
    const int32_t* w = all_h.data<int32_t>() + int64_t(r) * longest;
    out.emplace_back(w, w + lens_h.data<int64_t>()[r]);
  }
  return out;
}

}  // namespace mt::comm
