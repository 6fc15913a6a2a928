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

// Sixteen sums at once: lane i of the result is reduce_lanes(a[i]) bit for bit (the same pairwise
// tree, levels sharing their shuffles across the sixteen: halves, quarters, pairs, neighbours),
// about 3 instructions a sum instead of 8.
inline __m512 reduce16(const __m512 (&a)[16]) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int p = 0; p < 8; ++p)  // lanes 0-7: a[2p]'s lane l + lane l+8; lanes 8-15: a[2p+1]'s
    halves[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int p = 0; p < 4; ++p)  // 128-bit part c: a[4p + c]'s l + l+4
    quarters[p] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * p], halves[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(halves[2 * p], halves[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int p = 0; p < 2; ++p)  // part c: a[8p + c]'s l + l+2 (l < 2), then a[8p + 4 + c]'s
    pairs[p] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * p], quarters[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(quarters[2 * p], quarters[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Part c: the sums of a[c], a[4 + c], a[8 + c], a[12 + c]; lane 4c + i holds a[4i + c]'s.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), sums);
}

// Bytes of W a tile asks for while it runs, spread over its k steps: `bytes_per_step` from
// `begin` on at each step (whole cache lines, into L2).
struct SpreadPrefetch {
  const char* begin;
  int64_t bytes_per_step;
};

// Rows [0, NR) of W against rows [0, MR) of X: one accumulator per output over k, then its
// reduction, so every Y[m, j] takes the same path whatever the tile. The weight is asked for
// Ahead bytes ahead of what the tile reads (skinny_detail::prefetch_weight), or, given `spread`,
// what that names instead.
template <typename Step, int NR, int MR, int64_t Ahead = skinny_detail::kPrefetchBytes>
inline void tile(const typename Step::TX* X, int64_t ldx, const typename Step::TW* W, int64_t ldw, int64_t K, float* Y,
                 int64_t ldy, const SpreadPrefetch* spread = nullptr) {
  const char* ahead = spread != nullptr ? spread->begin : nullptr;
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + Step::kElems <= K; k += Step::kElems) {
    typename Step::RegW w[NR];
    for (int r = 0; r < NR; ++r) {
      w[r] = Step::load_w(W + r * ldw + k);
      // One W row: W in a register, loaded once. Left to itself GCC folds the load into each
      // row's multiply-add at some row counts (3 rows: three loads of every line that misses,
      // and the LM head at 3 rows 1.2x the time of 4 on Zen 5).
      if constexpr (NR == 1) asm("" : "+v"(w[r]));
    }
    if (ahead == nullptr) {
      for (int r = 0; r < NR; ++r) skinny_detail::prefetch_weight<Ahead>(W + r * ldw + k);
    } else {
      for (int64_t b = 0; b < spread->bytes_per_step; b += 64) __builtin_prefetch(ahead + b, 0, 2);
      ahead += spread->bytes_per_step;
    }
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

// What the one-row stream (WeightStream) asks for ahead of the W row it reads: near (Zen 4) or far (Zen 5).
constexpr int64_t kNearPrefetchBytes = 2048;
constexpr int64_t kFarPrefetchBytes = 4096;

// Y[:M, j0:j1) in tiles of NR W rows x up to MR X rows, the X rows innermost so that the NR W
// rows are read from memory once (see WeightStream). The path of each Y[m, j] is the tile's
// whatever the stream, so the result is the same.
template <typename Step, int NR, int MR>
void skinny(const typename Step::TX* X, int64_t M, int64_t ldx, const typename Step::TW* W, int64_t ldw, int64_t K,
            int64_t j0, int64_t j1, float* Y, int64_t ldy, WeightStream stream) {
  if (M <= stream.one_stream_rows) {
    auto one_stream = [&](auto rows, auto ahead) {
      for (int64_t j = j0; j < j1; ++j)
        tile<Step, 1, decltype(rows)::value, decltype(ahead)::value>(X, ldx, W + j * ldw, ldw, K, Y + (j - j0), ldy);
    };
    with_static<kZen5OneStreamRows>(M, [&](auto rows) {
      if (stream.far_ahead)
        one_stream(rows, std::integral_constant<int64_t, kFarPrefetchBytes>{});
      else
        one_stream(rows, std::integral_constant<int64_t, kNearPrefetchBytes>{});
    });
    return;
  }
  const int64_t steps = (K + Step::kElems - 1) / Step::kElems;
  const bool spread = stream.next_tile_over_passes && M > MR && steps > 0;
  for (int64_t j = j0; j < j1; j += NR) {
    with_static<NR>(std::min<int64_t>(NR, j1 - j), [&](auto nr) {
      // The next tile's rows within [j0, j1), contiguous but for the row gaps of ldw > K.
      const int64_t next_rows = std::clamp<int64_t>(j1 - (j + NR), 0, NR);
      const int64_t next_bytes = next_rows * ldw * int64_t(sizeof(typename Step::TW));
      const char* next = next_rows > 0 ? reinterpret_cast<const char*>(W + (j + NR) * ldw) : nullptr;
      for (int64_t m = 0; m < M; m += MR) {
        with_static<MR>(std::min<int64_t>(MR, M - m), [&](auto mr) {
          constexpr int64_t rows = decltype(mr)::value;
          SpreadPrefetch share{nullptr, 0};
          if (spread && next != nullptr)  // (steps > 0: K = 0 reads nothing)
            share = {next + next_bytes * m / M / 64 * 64, ((next_bytes * rows / M + steps - 1) / steps + 63) / 64 * 64};
          tile<Step, decltype(nr)::value, rows>(X + m * ldx, ldx, W + j * ldw, ldw, K, Y + m * ldy + (j - j0), ldy,
                                                share.begin != nullptr ? &share : nullptr);
        });
      }
    });
  }
}

}  // namespace jakiro::cpu::avx512
