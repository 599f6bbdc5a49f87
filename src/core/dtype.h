// Element types and their conversions. bf16 and f16 are stored as raw 16-bit patterns; conversions
// round to nearest even, as PyTorch and CUDA do.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

namespace mt {

enum class DType : uint8_t { F32, BF16, F16, I32, I64 };
enum class Device : uint8_t { CPU, CUDA };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "f32", "bf16", "f16", "i32", "i64"
const char* device_name(Device d);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace mt
