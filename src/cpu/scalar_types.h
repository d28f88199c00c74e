// Storage types of the 16-bit formats and their scalar conversions.
//
// Deliberately in an unnamed namespace: this header is included by translation
// units compiled for different ISAs, and each must keep its own copy (a shared
// inline copy could be merged by the linker into code built for a lesser ISA).
#ifndef ATTNRES_SRC_CPU_SCALAR_TYPES_H_
#define ATTNRES_SRC_CPU_SCALAR_TYPES_H_

#include <cstdint>
#include <cstring>

namespace attnres::cpu {
namespace {  // NOLINT(build/namespaces): see above

struct Bf16 { uint16_t bits; };
struct F16 { uint16_t bits; };

inline float ToFloat(Bf16 x) {
  const uint32_t u = uint32_t{x.bits} << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even; NaN stays a quiet NaN with its sign.
inline Bf16 ToBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return Bf16{uint16_t((u >> 16) | 0x40u)};
  return Bf16{uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}

inline float ToFloat(F16 x) {
  _Float16 h;
  std::memcpy(&h, &x, sizeof(h));
  return static_cast<float>(h);
}

inline F16 ToF16(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  F16 r;
  std::memcpy(&r, &h, sizeof(r));
  return r;
}

}  // namespace
}  // namespace attnres::cpu

#endif  // ATTNRES_SRC_CPU_SCALAR_TYPES_H_
