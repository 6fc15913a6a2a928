// The CPU tree attention's two products for few query rows (cpu/tree_attention.cpp: a decoding
// step's or a small tree's G x T rows over a block of keys) on 512-bit vectors, for float32 or
// bf16 keys, float32 values and a head dimension that is a multiple of 16. At these shapes the 256-bit skinny
// product spent most of its time reducing: a score is 64 products (4 vectors) and one horizontal
// sum. Here sixteen sums share their shuffles (reduce16) and P @ V keeps 4 rows x 64 columns in
// registers, reading each V row once for them.
#include "cpu/skinny_avx512.h"
#include "cpu/skinny_gemm.h"
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#ifdef JAKIRO_HAVE_AVX512_KERNELS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
#include "cpu/skinny_avx512_kernel.h"
namespace jakiro::cpu {
namespace {

// 16 keys' elements as float32: float32 loaded, bf16 widened in registers (exact: a bf16 is the top
// half of a float32; the zero-masked forms as in skinny_avx512_fp32.cpp): keys and values alike.
inline __m512 load_key(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_key(const c10::BFloat16* p) {
  constexpr __mmask16 all = 0xFFFF;
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all, _mm512_maskz_cvtepu16_epi32(all, half), 16));
}

// Scores of `Rows` query rows against 16 / Rows keys (3 rows x 5 keys, 2 x 8 or 1 x 16): an
// accumulator per (row, key) (16 at most), each over d in order, then reduce16. keys[i] points at
// key i of the block (a row of zeros past the block's last key: computed, not stored).
template <int Rows, typename key_t>
inline void scores_block(const float* q, int64_t D, const key_t* const* keys, int64_t count, float* s, int64_t lds) {
  constexpr int kKeys = 16 / Rows;
  __m512 acc[16];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 qr[Rows];
    for (int r = 0; r < Rows; ++r) qr[r] = _mm512_loadu_ps(q + r * D + d);
    for (int i = 0; i < kKeys; ++i) {
      const __m512 k = load_key(keys[i] + d);
      for (int r = 0; r < Rows; ++r) acc[r * kKeys + i] = _mm512_fmadd_ps(qr[r], k, acc[r * kKeys + i]);
    }
  }
  const __m512 sums = avx512::reduce16(acc);
  for (int r = 0; r < Rows; ++r) {  // row r's scores: lanes [r * kKeys, r * kKeys + count), stored from s[r, 0]
    const __mmask16 lanes = static_cast<__mmask16>(((1u << count) - 1) << (r * kKeys));
    _mm512_mask_storeu_ps(s + r * (lds - kKeys), lanes, sums);  // (masked-off lanes touch no memory)
  }
}

// Asks for the keys or values 8 KB past `rows` rows of a head's cache, into L2: the hardware
// prefetchers alone fell behind these short streams, a head's keys, then its values (the
// default model's Q4_1 forward of one token behind 1,000 on the 2-core Xeon: 4.75 -> 3.91 ms,
// 2 / 4 / 16 KB ahead 4.02 / 3.99 / 3.74 against 4.55 / 4.57 / 4.37 in their runs; behind 200:
// 0.97x).
template <typename key_t>
inline void prefetch_rows(const key_t* row, int64_t rows, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row) + skinny_detail::kPrefetchBytes;
  const int64_t bytes = rows * D * static_cast<int64_t>(sizeof(key_t));
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + line, 0, 2);
}

template <int Rows, typename key_t>
void scores_rows(const float* q, const key_t* k, int64_t n, int64_t D, float* s, int64_t lds, const key_t* zeros) {
  constexpr int kKeys = 16 / Rows;
  const key_t* keys[kKeys];
  for (int64_t j = 0; j < n; j += kKeys) {
    const int64_t count = std::min<int64_t>(kKeys, n - j);
    prefetch_rows(k + j * D, count, D);
    for (int i = 0; i < kKeys; ++i) keys[i] = i < count ? k + (j + i) * D : zeros;
    scores_block<Rows>(q, D, keys, count, s + j, lds);
  }
}

// acc[r, d0 + :16W] += sum_j p[r, j] v[j, d0 + :16W] for Rows rows: each element one chain of
// fused multiply-adds over j in order (as the 256-bit accumulate_pv_columns: the same bits).
template <int Rows, int W, typename value_t>
inline void pv_block(const float* p, int64_t ldp, int64_t n, const value_t* v, int64_t D, float* acc, int64_t d0) {
  __m512 a[Rows][W];
  for (int r = 0; r < Rows; ++r)
    for (int i = 0; i < W; ++i) a[r][i] = _mm512_loadu_ps(acc + r * D + d0 + 16 * i);
  for (int64_t j = 0; j < n; ++j) {
    if (d0 == 0) prefetch_rows(v + j * D, 1, D);  // (the row's first columns: its first call)
    __m512 vj[W];
    for (int i = 0; i < W; ++i) vj[i] = load_key(v + j * D + d0 + 16 * i);
    for (int r = 0; r < Rows; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * ldp + j]);
      for (int i = 0; i < W; ++i) a[r][i] = _mm512_fmadd_ps(pj, vj[i], a[r][i]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int i = 0; i < W; ++i) _mm512_storeu_ps(acc + r * D + d0 + 16 * i, a[r][i]);
}

template <typename key_t>
void scores(const float* q, int64_t rows, const key_t* k, int64_t n, int64_t D, float* s, int64_t lds) {
  alignas(64) key_t zeros[kMaxAttentionDim] = {};
  int64_t r = 0;  // (3 rows: a decoding step's query heads of a KV head, each key widened once for them)
  for (; r + 3 <= rows; r += 3) scores_rows<3>(q + r * D, k, n, D, s + r * lds, lds, zeros);
  for (; r + 2 <= rows; r += 2) scores_rows<2>(q + r * D, k, n, D, s + r * lds, lds, zeros);
  if (r < rows) scores_rows<1>(q + r * D, k, n, D, s + r * lds, lds, zeros);
}

template <typename value_t>
void pv(const float* p, int64_t ldp, int64_t rows, int64_t n, const value_t* v, int64_t D, float* acc) {
  for (int64_t d = 0; d < D; d += 64) {
    const int64_t width = std::min<int64_t>(64, D - d) / 16;
    for (int64_t r = 0; r < rows; r += 4) {
      skinny_detail::with_static<4>(std::min<int64_t>(4, rows - r), [&](auto rs) {
        skinny_detail::with_static<4>(width, [&](auto w) {
          pv_block<decltype(rs)::value, decltype(w)::value>(p + r * ldp, ldp, n, v, D, acc + r * D, d);
        });
      });
    }
  }
}

}  // namespace

void attention_scores_avx512(const float* q, int64_t rows, const float* k, int64_t n, int64_t D, float* s,
                             int64_t lds) {
  scores(q, rows, k, n, D, s, lds);
}
void attention_scores_avx512(const float* q, int64_t rows, const c10::BFloat16* k, int64_t n, int64_t D, float* s,
                             int64_t lds) {
  scores(q, rows, k, n, D, s, lds);
}
void attention_pv_avx512(const float* p, int64_t ldp, int64_t rows, int64_t n, const float* v, int64_t D,
                         float* acc) {
  pv(p, ldp, rows, n, v, D, acc);
}
void attention_pv_avx512(const float* p, int64_t ldp, int64_t rows, int64_t n, const c10::BFloat16* v, int64_t D,
                         float* acc) {
  pv(p, ldp, rows, n, v, D, acc);
}

}  // namespace jakiro::cpu
#pragma GCC pop_options
#else
namespace jakiro::cpu {
void attention_scores_avx512(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t) {
  std::abort();  // unreachable: callers check avx512_enabled()
}
void attention_scores_avx512(const float*, int64_t, const c10::BFloat16*, int64_t, int64_t, float*, int64_t) {
  std::abort();
}
void attention_pv_avx512(const float*, int64_t, int64_t, int64_t, const float*, int64_t, float*) { std::abort(); }
void attention_pv_avx512(const float*, int64_t, int64_t, int64_t, const c10::BFloat16*, int64_t, float*) {
  std::abort();
}
}  // namespace jakiro::cpu
#endif
