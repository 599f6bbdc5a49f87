// Element types and their conversions. bf16 and f16 are stored as raw 16-bit patterns; conversions
// round to nearest even, as PyTorch and CUDA do.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

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

// Storage types of the 16-bit floats, so that code can be written once over every dtype.
struct Bf16 {
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};

// Value conversions through float/double for any storage type.
inline double to_double(float v) { return v; }
inline double to_double(Bf16 v) { return bf16_to_f32(v.bits); }
inline double to_double(Half v) { return f16_to_f32(v.bits); }
inline double to_double(int32_t v) { return v; }
inline double to_double(int64_t v) { return double(v); }
template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, Bf16>) return Bf16{f32_to_bf16(float(v))};
  else if constexpr (std::is_same_v<T, Half>) return Half{f32_to_f16(float(v))};
  else return T(v);
}

template <class T>
struct TypeTag {
  using type = T;
};

// dtype dispatch: calls f(TypeTag<T>{}) with T the storage type of t.
template <class F>
decltype(auto) dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32: return f(TypeTag<float>{});
    case DType::BF16: return f(TypeTag<Bf16>{});
    case DType::F16: return f(TypeTag<Half>{});
    case DType::I32: return f(TypeTag<int32_t>{});
    case DType::I64: return f(TypeTag<int64_t>{});
  }
  return f(TypeTag<float>{});
}

}  // namespace mt
