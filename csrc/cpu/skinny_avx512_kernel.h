// The skinny products' 512-bit kernel, generic over what one k step loads and accumulates (a
// Step: X and W element types TX, TW; kElems elements of k per step, loaded by load_x / load_w,
// masked to zeros past K by the mask(n) forms; acc(a, x, w) adds their products into 16 float
// lanes). Included only by cpu/skinny_avx512_fp32.cpp and cpu/skinny_avx512_bf16.cpp, after all
// other headers and inside a `#pragma GCC target` region, so that everything here is compiled for
// those instructions whatever the build's -march (and nothing from ATen's headers is).
#pragma once

namespace jakiro::cpu::avx512 {

// The sum of the 16 lanes as a fixed pairwise tree: lane i + lane i+8, then +4, +2, +1. (The
// masked forms with every lane set: GCC 12's unmasked ones warn of an undefined operand.)
inline float reduce_lanes(__m512 v) {
  constexpr __mmask16 all = 0xFFFF;
  v = _mm512_add_ps(v, _mm512_mask_shuffle_f32x4(v, all, v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_mask_shuffle_f32x4(v, all, v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  v = _mm512_add_ps(v, _mm512_mask_permute_ps(v, all, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_mask_permute_ps(v, all, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(v);
}

// Rows [0, NR) of W against rows [0, MR) of X: one accumulator per output over k, then its
// reduction, so every Y[m, j] takes the same path whatever the tile. The weight is asked for
// Ahead bytes ahead of what the tile reads (skinny_detail::prefetch_weight).
template <typename Step, int NR, int MR, int64_t Ahead = skinny_detail::kPrefetchBytes>
inline void tile(const typename Step::TX* X, int64_t ldx, const typename Step::TW* W, int64_t ldw, int64_t K, float* Y,
                 int64_t ldy) {
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + Step::kElems <= K; k += Step::kElems) {
    typename Step::RegW w[NR];
    for (int r = 0; r < NR; ++r) w[r] = Step::load_w(W + r * ldw + k);
    for (int r = 0; r < NR; ++r) skinny_detail::prefetch_weight<Ahead>(W + r * ldw + k);
    for (int m = 0; m < MR; ++m) {
      const auto x = Step::load_x(X + m * ldx + k);
      for (int r = 0; r < NR; ++r) acc[r][m] = Step::acc(acc[r][m], x, w[r]);
    }
  }
  if (k < K) {
    const __mmask32 mask = Step::mask(K - k);
    typename Step::RegW w[NR];
    for (int r = 0; r < NR; ++r) w[r] = Step::load_w(W + r * ldw + k, mask);
    for (int m = 0; m < MR; ++m) {
      const auto x = Step::load_x(X + m * ldx + k, mask);
      for (int r = 0; r < NR; ++r) acc[r][m] = Step::acc(acc[r][m], x, w[r]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) Y[m * ldy + r] = reduce_lanes(acc[r][m]);
}

// f(n) with n a compile-time int in [1, Max] equal to the run-time n: a tile's shape as
// template arguments, so that its accumulators live in registers. (cpu/skinny_gemm.h has its
// twin; this one is compiled inside the target region so that the tile inlines into it.)
template <int Max, typename F>
inline void with_static(int64_t n, F&& f) {
  if constexpr (Max >= 1) {
    if (n == Max) return f(std::integral_constant<int, Max>{});
    with_static<Max - 1>(n, f);
  }
}

// What one X row (a decoding step) asks for ahead of a W row it reads.
constexpr int64_t kOneRowPrefetchBytes = 2048;

// Y[:M, j0:j1) in tiles of NR W rows x up to MR X rows, the X rows innermost so that the NR W
// rows are read from memory once. With one_row_stream one X row reads W a row after the other
// instead: one sequential stream, which the hardware prefetcher follows (measured on an AMD
// EPYC, Zen 4: a decoding step of the default model 13% faster in bf16 and 7-9% in float32 than
// with the 4-row tiles, whose four interleaved streams it follows less well; a prefetch 2 KB
// ahead neither helped nor hurt there, 8 KB hurt). From two rows on the tiles are faster (a
// tree's verification, a batch). The path of each Y[m, j] is the tile's, so the result is the same.
template <typename Step, int NR, int MR>
void skinny(const typename Step::TX* X, int64_t M, int64_t ldx, const typename Step::TW* W, int64_t ldw, int64_t K,
            int64_t j0, int64_t j1, float* Y, int64_t ldy, bool one_row_stream) {
  if (M == 1 && one_row_stream) {
    for (int64_t j = j0; j < j1; ++j)
      tile<Step, 1, 1, kOneRowPrefetchBytes>(X, ldx, W + j * ldw, ldw, K, Y + (j - j0), ldy);
    return;
  }
  for (int64_t j = j0; j < j1; j += NR) {
    with_static<NR>(std::min<int64_t>(NR, j1 - j), [&](auto nr) {
      for (int64_t m = 0; m < M; m += MR) {
        with_static<MR>(std::min<int64_t>(MR, M - m), [&](auto mr) {
          tile<Step, decltype(nr)::value, decltype(mr)::value>(X + m * ldx, ldx, W + j * ldw, ldw, K,
                                                                Y + m * ldy + (j - j0), ldy);
        });
      }
    });
  }
}

}  // namespace jakiro::cpu::avx512
