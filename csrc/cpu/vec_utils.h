// Small vectorised helpers (ATen's Vectorized<float>) used by the CPU kernels.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace jakiro::cpu {

using Vec = at::vec::Vectorized<float>;

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  using VecB = at::vec::Vectorized<c10::BFloat16>;  // holds 2 * Vec::size() elements
  int64_t i = 0;
  for (; i + VecB::size() <= n; i += VecB::size()) {
    auto [lo, hi] = at::vec::convert_to_float<c10::BFloat16>(VecB::loadu(src + i));
    lo.store(dst + i);
    hi.store(dst + i + Vec::size());
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void from_float(const float* src, c10::BFloat16* dst, int64_t n) { at::vec::convert(src, dst, n); }

inline float max_of(const float* x, int64_t n) {
  Vec acc(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::maximum(acc, Vec::loadu(x + i));
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, acc);
  for (; i < n; ++i) m = (x[i] > m || x[i] != x[i]) ? x[i] : m;
  return m;  // NaN if any x[i] is NaN (at::vec::maximum propagates it too)
}

// Is every x[i] finite? (x * 0 is NaN exactly for infinities and NaNs.)
inline bool all_finite(const float* x, int64_t n) {
  Vec acc(0.f);
  const Vec zero(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(x + i), zero, acc);
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) sum += x[i] * 0.f;
  return sum == 0.f;
}

// The same of bf16 values: none has the all-ones exponent of an infinity or a NaN.
inline bool all_finite(const c10::BFloat16* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if ((x[i].x & 0x7F80) == 0x7F80) return false;
  }
  return true;
}

// x[i] = exp(x[i] - shift) in place; returns the sum. Fast exp (ATen's exp_u20): for
// attention probabilities, where a few ulp do not matter. Element i always adds into lane
// i % Vec::size() (the tail too, the lanes past n adding zeros), so trailing x[i] = -inf (keys a
// row does not see) leave the sum's bits as they are without them: a chain verified in one
// forward attends bit for bit as its tokens decoded one at a time.
inline float exp_shift_sum_fast(float* x, int64_t n, float shift) {
  Vec acc(0.f), s(shift);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    Vec e = (Vec::loadu(x + i) - s).exp_u20();
    e.store(x + i);
    acc = acc + e;
  }
  if (i < n) {
    const int64_t rest = n - i;
    const Vec e = Vec::set(Vec(0.f), (Vec::loadu(x + i, rest) - s).exp_u20(), rest);
    e.store(x + i, rest);
    acc = acc + e;
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
}

// sum of exp(x[i] - shift), x unchanged, with the accurate (1 ulp) exp: for log-probabilities.
inline float exp_shift_sum(const float* x, int64_t n, float shift) {
  Vec acc(0.f), s(shift);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = acc + (Vec::loadu(x + i) - s).exp();
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) sum += std::exp(x[i] - shift);
  return sum;
}

inline void scale_in_place(float* x, int64_t n, float factor) {
  Vec f(factor);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(x + i) * f).store(x + i);
  for (; i < n; ++i) x[i] *= factor;
}

// y[i] += a * x[i]
inline void axpy(float* y, const float* x, int64_t n, float a) {
  Vec va(a);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) at::vec::fmadd(Vec::loadu(x + i), va, Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += a * x[i];
}

}  // namespace jakiro::cpu
