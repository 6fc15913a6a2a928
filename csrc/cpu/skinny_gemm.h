// Y[m, j] = sum_k X[m, k] * W[j, k] for a few rows of X (decoding, tree verification, draft
// steps: up to kLinearStreamRows) and a large weight W [N, K] in float32 or bf16: the
// projections, the LM head, the experts. Such products are bound by reading W, so W is read
// exactly once, with no packing and no dispatch per call (unlike a BLAS GEMM at these shapes).
// These are the 256-bit kernels (ATen's Vectorized<float>); where the CPU has AVX-512 the
// 512-bit ones of cpu/skinny_avx512.h run instead.
//
// How W is read matters more than the arithmetic. On a 2-core AMD EPYC (fp32, 1 row) one
// sequential stream, a W row after the other, read at the bandwidth of a plain sum and four
// rows side by side at half of it; on a 2-core Intel Xeon the hardware prefetchers fall behind
// as soon as the core also computes, and asking for the weight 8 KB ahead (prefetch_weight)
// made 2-8 rows 1.7-1.8x faster. So up to kOneStreamRows rows of X a W row is dotted with every
// X row (held in L1) before the next one; beyond that the product becomes compute-bound and
// register tiles of kTile W rows x kTile X rows reuse each load several times.
//
// Every Y[m, j] is computed in the same order whatever M and the tile: one vector accumulator
// over k, its fixed horizontal reduction, then the scalar tail with fused multiply-adds. So a
// row's result does not depend on how many rows share the call.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "cpu/vec_utils.h"

namespace jakiro::cpu {

namespace skinny_detail {

constexpr int64_t kOneStreamRows = 8;  // X rows up to which W is read as one stream
// W rows x X rows of a register tile beyond that: 5 x 5 accumulators fill the 32 vector registers
// of AVX-512 (measured 1.2-1.4x a 4 x 4 tile at 60 rows), 4 x 4 the 16 of AVX2.
#if defined(__AVX512VL__)
constexpr int kTile = 5;
#else
constexpr int kTile = 4;
#endif

// Asks for the weight kPrefetchBytes ahead of what a tile reads now, into L2. W is contiguous, so
// that is the same rows further on or the next tiles' rows. (Measured on the Intel Xeon, fp32,
// the default model's weights: 8 KB ahead into L2 beat 2, 4, 16 and 32 KB, and L1 or L3.)
constexpr int64_t kPrefetchBytes = 8192;
template <int64_t Ahead = kPrefetchBytes, typename T>
inline void prefetch_weight(const T* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + Ahead, 0, 2);
}

// Vec::size() consecutive weights as floats (bf16 widening is exact).
inline Vec load_widened(const float* p) { return Vec::loadu(p); }
inline Vec load_widened(const c10::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
#else
  float tmp[Vec::size()];
  for (int i = 0; i < Vec::size(); ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
#endif
}

// The tile: rows [0, NR) of W against rows [0, MR) of X.
template <int NR, int MR, typename scalar_t>
inline void tile(const float* X, int64_t ldx, const scalar_t* W, int64_t ldw, int64_t K, float* Y, int64_t ldy) {
  Vec acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = Vec(0.f);
  int64_t k = 0;
  for (; k + Vec::size() <= K; k += Vec::size()) {
    Vec w[NR];
    for (int r = 0; r < NR; ++r) w[r] = load_widened(W + r * ldw + k);
    for (int r = 0; r < NR; ++r) prefetch_weight(W + r * ldw + k);
    for (int m = 0; m < MR; ++m) {
      const Vec x = Vec::loadu(X + m * ldx + k);
      for (int r = 0; r < NR; ++r) acc[r][m] = at::vec::fmadd(x, w[r], acc[r][m]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int m = 0; m < MR; ++m) {
      float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[r][m]);
      for (int64_t kk = k; kk < K; ++kk) s = std::fma(X[m * ldx + kk], static_cast<float>(W[r * ldw + kk]), s);
      Y[m * ldy + r] = s;
    }
  }
}

// f(std::integral_constant<int, n>{}) for a run-time n in [1, Max]: a tile's shape as template
// arguments, so that its accumulators live in registers.
template <int Max, typename F>
inline void with_static(int64_t n, F&& f) {
  if constexpr (Max >= 1) {
    if (n == Max) return f(std::integral_constant<int, Max>{});
    with_static<Max - 1>(n, f);
  }
}

}  // namespace skinny_detail

// The 256-bit kernel's traversal over Y[:M, j0:j1) (the 512-bit one is in
// cpu/skinny_avx512_kernel.h): up to kOneStreamRows rows of X, a W row after the other against
// all of them (one stream through W); beyond, Tile x Tile register tiles.
// tile(j, m, NR, MR) computes W rows [j, j + NR) against X rows [m, m + MR), NR and MR as
// std::integral_constant.
template <int Tile, typename TileFn>
inline void skinny_traverse(int64_t M, int64_t j0, int64_t j1, TileFn&& tile) {
  using namespace skinny_detail;
  using One = std::integral_constant<int, 1>;
  if (M <= kOneStreamRows) {
    with_static<kOneStreamRows>(M, [&](auto mr) {
      for (int64_t j = j0; j < j1; ++j) tile(j, int64_t{0}, One{}, mr);
    });
    return;
  }
  for (int64_t j = j0; j < j1; j += Tile) {
    with_static<Tile>(std::min<int64_t>(Tile, j1 - j), [&](auto nr) {
      for (int64_t m = 0; m < M; m += Tile) {
        with_static<Tile>(std::min<int64_t>(Tile, M - m), [&](auto mr) { tile(j, m, nr, mr); });
      }
    });
  }
}


// Y[m, j - j0] = X[m, :] . W[j, :] for m < M, j in [j0, j1). X float32 [M, K] (row stride
// ldx), W [N, K] (row stride ldw), Y float32 (row stride ldy).
template <typename scalar_t>
void skinny_gemm_nt(const float* X, int64_t M, int64_t ldx, const scalar_t* W, int64_t ldw, int64_t K, int64_t j0,
                    int64_t j1, float* Y, int64_t ldy) {
  skinny_traverse<skinny_detail::kTile>(M, j0, j1, [&](int64_t j, int64_t m, auto nr, auto mr) {
    skinny_detail::tile<decltype(nr)::value, decltype(mr)::value>(X + m * ldx, ldx, W + j * ldw, ldw, K,
                                                                   Y + m * ldy + (j - j0), ldy);
  });
}

}  // namespace jakiro::cpu
