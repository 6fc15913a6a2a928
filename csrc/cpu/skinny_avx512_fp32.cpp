// The skinny products with float32 activations on 512-bit vectors (float32 and bf16 weights,
// cpu/skinny_avx512.h), and the run-time checks of all the 512-bit kernels.
#include "cpu/skinny_avx512.h"
#include "cpu/skinny_gemm.h"
#include "ops.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#ifdef JAKIRO_HAVE_AVX512_KERNELS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
#include "cpu/skinny_avx512_kernel.h"

namespace jakiro::cpu {
namespace avx512 {

// 16 float32 lanes, a fused multiply-add per step.
struct Fp32Step {
  using TX = float;
  using TW = float;
  using RegW = __m512;
  static constexpr int64_t kElems = 16;
  static inline __mmask32 mask(int64_t n) { return n >= kElems ? __mmask32(0xFFFF) : (__mmask32(1) << n) - 1; }
  static inline __m512 load_x(const float* p) { return _mm512_loadu_ps(p); }
  static inline __m512 load_x(const float* p, __mmask32 m) { return _mm512_maskz_loadu_ps(__mmask16(m), p); }
  static inline __m512 load_w(const float* p) { return load_x(p); }
  static inline __m512 load_w(const float* p, __mmask32 m) { return load_x(p, m); }
  static inline __m512 acc(__m512 a, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, a); }
};

// float32 X against bf16 W widened in registers (exact: a bf16 is the top half of a float32).
struct Bf16WidenStep : Fp32Step {
  using TW = c10::BFloat16;
  static inline __m512 widen(__m256i half) {  // (the zero-masked forms: see reduce_lanes)
    constexpr __mmask16 all = 0xFFFF;
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all, _mm512_maskz_cvtepu16_epi32(all, half), 16));
  }
  static inline __m512 load_w(const TW* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static inline __m512 load_w(const TW* p, __mmask32 m) { return widen(_mm256_maskz_loadu_epi16(__mmask16(m), p)); }
};

}  // namespace avx512

void skinny_gemm_nt_avx512(const float* X, int64_t M, int64_t ldx, const float* W, int64_t ldw, int64_t K,
                           int64_t j0, int64_t j1, float* Y, int64_t ldy) {
  const WeightStream stream = weight_stream();
  if (stream.amd_tiles)
    avx512::skinny<avx512::Fp32Step, kAmdFp32Rows, kAmdFp32Cols>(X, M, ldx, W, ldw, K, j0, j1, Y, ldy, stream);
  else
    avx512::skinny<avx512::Fp32Step, kAvx512Rows, kAvx512Cols>(X, M, ldx, W, ldw, K, j0, j1, Y, ldy, stream);
}

void skinny_gemm_nt_avx512(const float* X, int64_t M, int64_t ldx, const c10::BFloat16* W, int64_t ldw, int64_t K,
                           int64_t j0, int64_t j1, float* Y, int64_t ldy) {
  avx512::skinny<avx512::Bf16WidenStep, kAvx512Rows, kAvx512Cols>(X, M, ldx, W, ldw, K, j0, j1, Y, ldy,
                                                                  weight_stream());
}

}  // namespace jakiro::cpu
#pragma GCC pop_options
#endif

namespace jakiro::cpu {

bool env_disabled(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && std::strcmp(env, "0") == 0;
}

namespace {

bool cpu_supports_avx512() {
#ifdef JAKIRO_HAVE_AVX512_KERNELS
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

}  // namespace

bool amd_cpu() {
#ifdef JAKIRO_HAVE_AVX512_KERNELS
  static const bool amd = (__builtin_cpu_init(), __builtin_cpu_is("amd"));
  return amd;
#else
  return false;
#endif
}

int cpu_family() {
  static const int family = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
#ifdef JAKIRO_HAVE_AVX512_KERNELS
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
#endif
    const unsigned base = (eax >> 8) & 0xF, extended = (eax >> 20) & 0xFF;
    return static_cast<int>(base == 0xF ? base + extended : base);
  }();
  return family;
}

namespace {

struct NamedStream {
  const char* name;
  WeightStream stream;
};

const NamedStream& chosen_stream() {
  static const NamedStream chosen = [] {
    const NamedStream streams[] = {{"intel", {0, false, true, false}},
                                   {"zen4", {1, false, false, true}},
                                   {"zen5", {kZen5OneStreamRows, true, false, true}}};
    const char* env = std::getenv("JAKIRO_CPU_WEIGHT_STREAM");
    const std::string named = env == nullptr ? "" : env;
    for (const auto& s : streams)
      if (named == s.name) return s;
    TORCH_CHECK(named.empty(), "JAKIRO_CPU_WEIGHT_STREAM must be zen5, zen4 or intel (or unset), got '", named, "'");
    if (!amd_cpu()) return streams[0];
    return cpu_family() >= kZen5Family ? streams[2] : streams[1];
  }();
  return chosen;
}

}  // namespace

WeightStream weight_stream() { return chosen_stream().stream; }

const char* weight_stream_name() { return chosen_stream().name; }

bool avx512_enabled() {
  static const bool enabled = !env_disabled("JAKIRO_CPU_AVX512") && cpu_supports_avx512();
  return enabled;
}

bool bf16_dot_enabled() {
#ifdef JAKIRO_HAVE_AVX512_KERNELS
  static const bool enabled =
      avx512_enabled() && !env_disabled("JAKIRO_CPU_BF16_DOT") && __builtin_cpu_supports("avx512bf16");
  return enabled;
#else
  return false;
#endif
}

#ifndef JAKIRO_HAVE_AVX512_KERNELS
void skinny_gemm_nt_avx512(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, int64_t, float*,
                           int64_t) {
  std::abort();  // unreachable: callers check avx512_enabled()
}
void skinny_gemm_nt_avx512(const float*, int64_t, int64_t, const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t,
                           float*, int64_t) {
  std::abort();
}
#endif

}  // namespace jakiro::cpu
