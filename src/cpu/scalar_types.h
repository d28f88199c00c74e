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

// The compiler's IEEE binary16 type, for conversions only (arithmetic is in float):
// _Float16 on x86-64 (F16C vcvtph2ps/vcvtps2ph where the ISA has it, libgcc's
// conversions otherwise); __fp16 on aarch64, where g++ 12 has no _Float16 in C++
// and __fp16 converts with fcvt, from float and from double with one rounding.
#if defined(__aarch64__)
using Half = __fp16;
#else
using Half = _Float16;
#endif

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
  Half h;
  std::memcpy(&h, &x, sizeof(h));
  return static_cast<float>(h);
}

inline F16 ToF16(float x) {
  const Half h = static_cast<Half>(x);
  F16 r;
  std::memcpy(&r, &h, sizeof(r));
  return r;
}

}  // namespace
}  // namespace attnres::cpu

#endif  // ATTNRES_SRC_CPU_SCALAR_TYPES_H_
