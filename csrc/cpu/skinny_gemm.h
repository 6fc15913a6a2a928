// Y[m, j] = sum_k X[m, k] * W[j, k] for a few rows of X (draft-step sizes, up to 15 rows for
// float32 weights, any number for bf16; see rows_times_weight in cpu/gemm.h) and a
// large weight W [N, K] in float32 or bf16: the LM head, the experts. Such products are
// bound by reading W, so W is streamed exactly once, four rows at a time (a bf16 block is
// widened once into an L1 scratch), against every row of X, which stays in L1/L2; W is
// prefetched several blocks ahead so that reading it overlaps the arithmetic. No packing and
// no dispatch per call, unlike a BLAS GEMM at these shapes.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cstring>
#include <vector>

#include "cpu/vec_utils.h"

namespace jakiro::cpu {

namespace skinny_detail {

constexpr int64_t kRows = 4;              // rows of W per block
constexpr int64_t kPrefetchBlocks = 8;     // how far ahead W is prefetched, in blocks

// Rows [0, R) of float W (row stride ldw) against rows [0, MT) of X (MT <= 3).
template <int R, int MT>
inline void block(const float* X, int64_t ldx, const float* W, int64_t ldw, int64_t K, float* Y, int64_t ldy) {
  Vec acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) acc[r][t] = Vec(0.f);
  int64_t k = 0;
  for (; k + Vec::size() <= K; k += Vec::size()) {
    Vec w[R];
    for (int r = 0; r < R; ++r) w[r] = Vec::loadu(W + r * ldw + k);
    for (int t = 0; t < MT; ++t) {
      const Vec x = Vec::loadu(X + t * ldx + k);
      for (int r = 0; r < R; ++r) acc[r][t] = at::vec::fmadd(x, w[r], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < MT; ++t) {
      float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[r][t]);
      for (int64_t kk = k; kk < K; ++kk) s += X[t * ldx + kk] * W[r * ldw + kk];
      Y[t * ldy + r] = s;
    }
  }
}

template <int R>
inline void all_rows_of_x(const float* X, int64_t M, int64_t ldx, const float* W, int64_t ldw, int64_t K, float* Y,
                          int64_t ldy) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) block<R, 3>(X + m * ldx, ldx, W, ldw, K, Y + m * ldy, ldy);
  if (M - m == 2) block<R, 2>(X + m * ldx, ldx, W, ldw, K, Y + m * ldy, ldy);
  if (M - m == 1) block<R, 1>(X + m * ldx, ldx, W, ldw, K, Y + m * ldy, ldy);
}

template <typename scalar_t>
inline void prefetch_rows(const scalar_t* W, int64_t rows, int64_t ldw, int64_t K) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* p = reinterpret_cast<const char*>(W + r * ldw);
    for (int64_t off = 0; off < K * static_cast<int64_t>(sizeof(scalar_t)); off += 64) __builtin_prefetch(p + off);
  }
}

}  // namespace skinny_detail

// Y[m, j - j0] = X[m, :] . W[j, :] for m < M, j in [j0, j1). X float32 [M, K] (row stride
// ldx), W [N, K] (row stride ldw), Y float32 (row stride ldy).
template <typename scalar_t>
void skinny_gemm_nt(const float* X, int64_t M, int64_t ldx, const scalar_t* W, int64_t ldw, int64_t K, int64_t j0,
                    int64_t j1, float* Y, int64_t ldy) {
  using namespace skinny_detail;
  constexpr bool is_float = std::is_same_v<scalar_t, float>;
  std::vector<float> widened(is_float ? 0 : kRows * K);
  for (int64_t j = j0; j < j1; j += kRows) {
    const int64_t R = std::min(kRows, j1 - j);
    const int64_t ahead = j + kPrefetchBlocks * kRows;
    if (ahead < j1) prefetch_rows(W + ahead * ldw, std::min(kRows, j1 - ahead), ldw, K);
    const float* w;
    int64_t ld;
    if constexpr (is_float) {
      w = W + j * ldw;
      ld = ldw;
    } else {
      for (int64_t r = 0; r < R; ++r) to_float(W + (j + r) * ldw, widened.data() + r * K, K);
      w = widened.data();
      ld = K;
    }
    float* y = Y + (j - j0);
    switch (R) {
      case 4: all_rows_of_x<4>(X, M, ldx, w, ld, K, y, ldy); break;
      case 3: all_rows_of_x<3>(X, M, ldx, w, ld, K, y, ldy); break;
      case 2: all_rows_of_x<2>(X, M, ldx, w, ld, K, y, ldy); break;
      default: all_rows_of_x<1>(X, M, ldx, w, ld, K, y, ldy); break;
    }
  }
}

}  // namespace jakiro::cpu
