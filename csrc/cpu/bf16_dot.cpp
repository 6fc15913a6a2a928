// Native bf16 dot products (cpu/bf16_dot.h). Compiled for AVX512-BF16 through target
// attributes, whatever the build's -march; bf16_dot_enabled() gates every call at run time.
#include "cpu/bf16_dot.h"

#include "cpu/skinny_gemm.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define JAKIRO_HAVE_BF16_DOT 1
#include <immintrin.h>
#endif

namespace jakiro::cpu {

#ifdef JAKIRO_HAVE_BF16_DOT
namespace {

#define JAKIRO_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int64_t kLanes = 32;  // bf16 elements per 512-bit register
constexpr int kTile = 4;         // 16 zmm accumulators

JAKIRO_BF16_TARGET inline __m512bh load_bf16(const c10::BFloat16* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}

// The sum of the 16 lanes, in a fixed order (a pairwise tree). Through memory: GCC 12's
// extract intrinsics warn of an uninitialised operand inside its own headers.
JAKIRO_BF16_TARGET inline float reduce_lanes(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  for (int width = 8; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return lanes[0];
}

// Rows [0, NR) of W against rows [0, MR) of X. The k tail is a masked load (zeros beyond K), so
// every Y[m, j] takes one path: the lane accumulators over k, then their fixed reduction.
template <int NR, int MR>
JAKIRO_BF16_TARGET void tile(const c10::BFloat16* X, int64_t ldx, const c10::BFloat16* W, int64_t ldw, int64_t K,
                             float* Y, int64_t ldy) {
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kLanes) {
    const __mmask32 mask = K - k >= kLanes ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    __m512bh w[NR];
    for (int r = 0; r < NR; ++r) w[r] = load_bf16(W + r * ldw + k, mask);
    for (int m = 0; m < MR; ++m) {
      const __m512bh x = load_bf16(X + m * ldx + k, mask);
      for (int r = 0; r < NR; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], x, w[r]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) Y[m * ldy + r] = reduce_lanes(acc[r][m]);
}

bool detect() {
  const char* env = std::getenv("JAKIRO_CPU_BF16_DOT");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

}  // namespace

bool bf16_dot_enabled() {
  static const bool enabled = detect();
  return enabled;
}

void skinny_gemm_nt_bf16_dot(const c10::BFloat16* X, int64_t M, int64_t ldx, const c10::BFloat16* W, int64_t ldw,
                             int64_t K, int64_t j0, int64_t j1, float* Y, int64_t ldy) {
  skinny_traverse<kTile>(M, j0, j1, [&](int64_t j, int64_t m, auto nr, auto mr) {
    tile<decltype(nr)::value, decltype(mr)::value>(X + m * ldx, ldx, W + j * ldw, ldw, K, Y + m * ldy + (j - j0), ldy);
  });
}

#else  // no compiler support: the widening path everywhere

bool bf16_dot_enabled() { return false; }

void skinny_gemm_nt_bf16_dot(const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, int64_t, int64_t, int64_t,
                             int64_t, float*, int64_t) {
  std::abort();  // unreachable: callers check bf16_dot_enabled()
}

#endif

}  // namespace jakiro::cpu
