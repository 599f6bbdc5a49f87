// Choosing the device by name (device_select.h).
#include "core/device_select.h"

#include "core/error.h"
#include "core/tensor.h"

namespace mt {

Device resolve_device(const std::string& name) {
  if (name == "cpu") return Device::CPU;
  if (name == "cuda") {
    if (!device_mem::cuda_available())
      MT_THROW("device 'cuda': no GPU is visible or this moetrain was built without CUDA; use --device cpu");
    return Device::CUDA;
  }
  if (name == "auto") return device_mem::cuda_available() ? Device::CUDA : Device::CPU;
  MT_THROW("device '", name, "' is not supported; allowed: cpu, cuda, auto");
}

}  // namespace mt
