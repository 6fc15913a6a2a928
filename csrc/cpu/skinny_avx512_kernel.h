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
    for (int r = 0; r < NR; ++r) w[r] = Step::load_w(W + r * ldw + k);
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

// What the one-row stream (WeightStream) asks for ahead of the W row it reads.
constexpr int64_t kOneRowPrefetchBytes = 4096;

// How a product reads W, per CPU (measured on the default model's weights, whole forwards).
struct WeightStream {
  // Up to this many X rows read W a row after the other instead of in NR-row tiles, every X row
  // in one pass: one sequential stream, which the hardware prefetcher follows. On an AMD EPYC,
  // Zen 4: one row (a decoding step) 13% faster in bf16 and 7-9% in float32 than with the 4-row
  // tiles, whose interleaved streams it follows less well; 2 KB ahead neither helped nor hurt,
  // 8 KB hurt. Zen 5: the products of a forward's weights at 2-4 rows 1.30x the one-row time in
  // 2 x 8 tiles against 0.99-1.09x so; a forward of 2 / 3 / 4 / 5 tokens 0.80 / 0.87 / 0.85 /
  // 0.96x the time in float32, 0.81 / 0.85 / 0.98 / 0.93x in bf16; 6 rows 1.05-1.10x (slower:
  // the arithmetic no longer hides under the reading); 4 KB ahead: 1-5 tokens 0.95-0.97x the time
  // of 2 KB ahead, fp32 and bf16 (8 and 16 KB no better, 1 KB worse). 0: never (an Intel Xeon:
  // one row 6% slower).
  int64_t one_stream_rows;
  // Where the X rows take more than one pass over a tile's W rows, every pass asks for a share of
  // the next tile's rows (spread over its k steps, in proportion to its X rows) instead of each
  // pass asking for the same bytes 8 KB ahead: memory is then read during the later passes,
  // which otherwise only compute on W in L1 (an Intel Xeon, float32: a forward of 8, 12 and 16
  // tokens 0.92-0.95x, 0.88-0.89x and 0.86-0.90x the time, bf16 0.95-0.97x; one pass (up to 6
  // rows) is faster with the 8 KB, spread there 1.04-1.07x. An AMD EPYC measured a spread slower).
  bool next_tile_over_passes;
};

// The stream measured best on this CPU (on AMD's, the one-row stream up to kAmdOneStreamRows
// rows; elsewhere the spread).
inline WeightStream this_cpu_stream() {
  const bool amd = amd_cpu();
  return {amd ? kAmdOneStreamRows : 0, !amd};
}

// Y[:M, j0:j1) in tiles of NR W rows x up to MR X rows, the X rows innermost so that the NR W
// rows are read from memory once (see WeightStream). The path of each Y[m, j] is the tile's
// whatever the stream, so the result is the same.
template <typename Step, int NR, int MR>
void skinny(const typename Step::TX* X, int64_t M, int64_t ldx, const typename Step::TW* W, int64_t ldw, int64_t K,
            int64_t j0, int64_t j1, float* Y, int64_t ldy, WeightStream stream) {
  if (M <= stream.one_stream_rows) {
    with_static<kAmdOneStreamRows>(M, [&](auto mr) {
      for (int64_t j = j0; j < j1; ++j)
        tile<Step, 1, decltype(mr)::value, kOneRowPrefetchBytes>(X, ldx, W + j * ldw, ldw, K, Y + (j - j0), ldy);
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
