// The bf16 skinny product with native bf16 dot products (vdpbf16ps: pairs of bf16 products
// accumulated into float32 lanes), cpu/skinny_avx512.h.
#include "cpu/skinny_avx512.h"
#include "cpu/skinny_gemm.h"

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#ifdef JAKIRO_HAVE_AVX512_KERNELS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#include "cpu/skinny_avx512_kernel.h"

namespace jakiro::cpu {
namespace avx512 {

// 32 bf16 elements into 16 float32 lanes (pairs of products), a bf16 dot product per step.
struct Bf16DotStep {
  using TX = c10::BFloat16;
  using TW = c10::BFloat16;
  using RegW = __m512bh;
  static constexpr int64_t kElems = 32;
  static inline __mmask32 mask(int64_t n) { return n >= kElems ? ~__mmask32(0) : (__mmask32(1) << n) - 1; }
  static inline __m512bh load_x(const TX* p) {
    return reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(p)));
  }
  static inline __m512bh load_x(const TX* p, __mmask32 m) {
    return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, p));
  }
  static inline __m512bh load_w(const TW* p) { return load_x(p); }
  static inline __m512bh load_w(const TW* p, __mmask32 m) { return load_x(p, m); }
  static inline __m512 acc(__m512 a, __m512bh x, __m512bh w) { return _mm512_dpbf16_ps(a, x, w); }
};

}  // namespace avx512

void skinny_gemm_nt_bf16_dot(const c10::BFloat16* X, int64_t M, int64_t ldx, const c10::BFloat16* W, int64_t ldw,
                             int64_t K, int64_t j0, int64_t j1, float* Y, int64_t ldy) {
  avx512::skinny<avx512::Bf16DotStep, kAvx512Rows, kAvx512Cols>(X, M, ldx, W, ldw, K, j0, j1, Y, ldy,
                                                                weight_stream());
}

}  // namespace jakiro::cpu
#pragma GCC pop_options
#else
namespace jakiro::cpu {
void skinny_gemm_nt_bf16_dot(const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, int64_t, int64_t, int64_t,
                             int64_t, float*, int64_t) {
  std::abort();  // unreachable: callers check bf16_dot_enabled()
}
}  // namespace jakiro::cpu
#endif
