// Element types. Compute happens in F32 and F64; BF16 and F16 are storage formats (safetensors,
// and the fast kernels' inputs); I32 and I64 carry integer valid_lens and token ids.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace attn {

enum class DType : uint8_t { F32, F64, BF16, F16, I32, I64 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
      return 4;
    case DType::F64:
      return 8;
    case DType::BF16:
      return 2;
    case DType::F16:
      return 2;
    case DType::I32:
      return 4;
    case DType::I64:
      return 8;
  }
  return 0;
}

// The safetensors spelling ("F32", "BF16", ...), also used in messages.
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "F32";
    case DType::F64:
      return "F64";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
  }
  return "?";
}

constexpr bool is_floating(DType t) {
  return t != DType::I32 && t != DType::I64;
}

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::F32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::F64;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::I32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::I64;
}

// bfloat16 <-> float: the top 16 bits of an IEEE float; rounding to nearest even, NaN kept NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The same for n contiguous values, vectorised (every element the bits of the scalar functions
// above). Tensor::copy_from converts with these; fused kernels that write or read a bf16 copy
// of their float data use them too, so that both give the same bits.
void floats_to_bf16(const float* x, uint16_t* y, int64_t n);
void bf16_to_floats(const uint16_t* x, float* y, int64_t n);

// IEEE binary16 <-> float, round to nearest even, with subnormals, infinities and NaN.
float f16_to_float(uint16_t h);
uint16_t float_to_f16(float f);

}  // namespace attn
