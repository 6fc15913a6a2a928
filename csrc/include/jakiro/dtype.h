// Element types of the kernels, framework-free and host/device: float32 and a bit-exact
// bfloat16 (the layout of torch's c10::BFloat16, round-to-nearest-even like it), so CUDA,
// HIP and the SIMT emulator read and write the same bits without any vendor bf16 header.
#pragma once

#include <cstdint>
#include <cstring>

#include "jakiro/common.h"

namespace jakiro {

struct bf16 {
  uint16_t bits;
};

JAKIRO_HOST_DEVICE float to_float(float x) { return x; }
JAKIRO_HOST_DEVICE float to_float(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
JAKIRO_HOST_DEVICE T from_float(float x);
template <>
JAKIRO_HOST_DEVICE float from_float<float>(float x) {
  return x;
}
template <>
JAKIRO_HOST_DEVICE bf16 from_float<bf16>(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{0x7fc0};  // NaN stays a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);                             // round to nearest, ties to even
  return bf16{static_cast<uint16_t>(u >> 16)};
}

}  // namespace jakiro
