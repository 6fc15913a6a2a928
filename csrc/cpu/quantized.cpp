// Products with quantized weights (cpu/quantized.h): the activations' quantization and the
// per-block integer dot products, on 512-bit VNNI vectors (one output row per 32-bit lane: 16
// rows of a packed chunk at once, the weight codes decoded once for up to kRowTile activation
// rows) or in portable C++ with the same arithmetic. (AMX tiles for the integer products were
// measured on the 2-core Xeon and dropped: with the weight prefetched, 16 and 32 rows of the
// default model's forward took 1.1-1.3x the VNNI kernel's time; the float sums of the per-block
// scales, not the integer products, bound both.)
#include "cpu/quantized.h"

#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/skinny_avx512.h"
#include "cpu/skinny_gemm.h"

#ifdef JAKIRO_HAVE_AVX512_KERNELS
#include <immintrin.h>
#endif

namespace jakiro::cpu {
namespace {

// Activation rows whose products share one decoding of a chunk's weight codes (8 accumulators
// of the 32 vector registers beside the 8 code vectors).
constexpr int kRowTile = 8;

// One block of 32 activations quantized as GGML's quantize_row_q8_0: d = max |x| / 127, the
// codes x / d rounded to nearest (ties to even, as its vector code rounds), d kept as float16.
// False (nothing written) if a value is not finite. Both forms give the same bits.
bool quantize_block(const float* v, int8_t* q, float* scale, int32_t* sum) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < kQuantBlock; ++i) {
    finite &= std::isfinite(v[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  if (!finite) return false;
  const float d = amax / 127.f, inverse = d != 0.f ? 1.f / d : 0.f;
  int32_t s = 0;
  for (int64_t i = 0; i < kQuantBlock; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inverse));
    s += q[i];
  }
  *scale = static_cast<float>(c10::Half(d));
  *sum = s;
  return true;
}

#ifdef JAKIRO_HAVE_AVX512_KERNELS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
bool quantize_block_avx512(const float* v, int8_t* q, float* scale, int32_t* sum) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16), zero = _mm512_setzero_ps();
  // x - x is 0 for a finite x, NaN for an infinite or NaN one
  if ((_mm512_cmp_ps_mask(_mm512_sub_ps(a, a), zero, _CMP_EQ_OQ) &
       _mm512_cmp_ps_mask(_mm512_sub_ps(b, b), zero, _CMP_EQ_OQ)) != 0xFFFF)
    return false;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127.f, inverse = d != 0.f ? 1.f / d : 0.f;
  const __m512 scaled = _mm512_set1_ps(inverse);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, scaled)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, scaled));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  *scale = static_cast<float>(c10::Half(d));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  return true;
}
#pragma GCC pop_options
#endif

// The portable kernel: rows [m0, m1) of the 16 outputs of one group.
template <QuantFormat F>
void group_rows_portable(const QuantizedRows& xq, int64_t m0, int64_t m1, const uint8_t* group, float* y,
                         int64_t ldy) {
  constexpr int64_t chunk = kQuantLanes * quant_block_bytes(F), scales = quant_scale_bytes(F);
  constexpr int32_t offset = quant_code_offset(F);
  const int64_t K = xq.K, nb = K / kQuantBlock;
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t lane = 0; lane < kQuantLanes; ++lane) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* c = group + b * chunk;
        const int8_t* a = xq.codes.data() + m * K + b * kQuantBlock;
        int32_t dot = 0;
        for (int64_t e = 0; e < kQuantBlock; ++e) dot += quant_code<F>(c + scales, lane, e) * a[e];
        dot -= offset * xq.sum[m * nb + b];
        const float t = static_cast<float>(dot) * quant_half(c + 2 * lane);
        acc = std::fma(t, xq.scale[m * nb + b], acc);
        if constexpr (F == QuantFormat::kQ4_1) acc = std::fma(quant_half(c + 32 + 2 * lane), xq.scaled_sum[m * nb + b], acc);
      }
      y[(m - m0) * ldy + lane] = acc;
    }
  }
}

#ifdef JAKIRO_HAVE_AVX512_KERNELS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

// An int32 read from int8 codes (any alignment, any type's bytes).
typedef int32_t Int32Unaligned __attribute__((may_alias, aligned(1)));

// Asks for the weight skinny_detail::kPrefetchBytes (8 KB) past a chunk into L2, a line at a
// time: the hardware prefetchers alone fell behind the short streams of a layer's projections
// (the default model's Q4_1 forward of one token 4.0-4.5 -> 2.8-3.0 ms, of 4 tokens 7.0 -> 4.1-4.5
// ms, on the 2-core Xeon; 8, 16 and 32 KB ahead alike, 2 and 4 KB slower, into L1 slower).
template <QuantFormat F>
inline void prefetch_chunk(const uint8_t* c) {
  constexpr int64_t chunk = kQuantLanes * quant_block_bytes(F);
  for (int64_t line = 0; line < chunk; line += 64) skinny_detail::prefetch_weight(c + line);
}

// A chunk's 16 scales and (Q4_1) minimums, float32.
template <QuantFormat F>
inline void chunk_scales(const uint8_t* c, __m512& dw, __m512& mw) {
  dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
  mw = F == QuantFormat::kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32)))
                               : _mm512_setzero_ps();
}

// acc plus one block of a row (its integer dot products with the 16 lanes, the codes' offset not
// yet taken off; `at` its row and block in xq): every kernel adds a block so, in this order.
template <QuantFormat F>
inline __m512 add_block(__m512 acc, __m512i dot, __m512 dw, __m512 mw, const QuantizedRows& xq, int64_t at) {
  constexpr int32_t offset = quant_code_offset(F);
  if constexpr (offset != 0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offset * xq.sum[at]));
  const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), dw);
  acc = _mm512_fmadd_ps(t, _mm512_set1_ps(xq.scale[at]), acc);
  if constexpr (F == QuantFormat::kQ4_1) acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(xq.scaled_sum[at]), acc);
  return acc;
}

// The VNNI kernel: R rows from m0 of the 16 outputs of one group, a lane per output.
template <QuantFormat F, int R>
void group_rows_vnni(const QuantizedRows& xq, int64_t m0, const uint8_t* group, float* y, int64_t ldy) {
  constexpr int64_t chunk = kQuantLanes * quant_block_bytes(F), scales = quant_scale_bytes(F);
  const int64_t K = xq.K, nb = K / kQuantBlock;
  const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = group + b * chunk;
    prefetch_chunk<F>(c);
    __m512 dw, mw;
    chunk_scales<F>(c, dw, mw);
    __m512i w[8];  // w[q]: each lane's codes of weights 4q .. 4q + 3
    if constexpr (F == QuantFormat::kQ8_0) {
      for (int q = 0; q < 8; ++q) w[q] = _mm512_loadu_si512(c + scales + 64 * q);
    } else {
      for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_loadu_si512(c + scales + 64 * q);
        w[q] = _mm512_and_si512(v, low);
        w[q + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r, at = m * nb + b;
      // The row's activation codes, 4 to an int32, each broadcast from memory into the products.
      const Int32Unaligned* a = reinterpret_cast<const Int32Unaligned*>(xq.codes.data() + m * K + b * kQuantBlock);
      __m512i s0 = _mm512_dpbusd_epi32(zero, w[0], _mm512_set1_epi32(a[0]));
      __m512i s1 = _mm512_dpbusd_epi32(zero, w[1], _mm512_set1_epi32(a[1]));
      for (int q = 2; q < 8; q += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[q], _mm512_set1_epi32(a[q]));
        s1 = _mm512_dpbusd_epi32(s1, w[q + 1], _mm512_set1_epi32(a[q + 1]));
      }
      acc[r] = add_block<F>(acc[r], _mm512_add_epi32(s0, s1), dw, mw, xq, at);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

template <QuantFormat F>
void group_rows_vnni_any(const QuantizedRows& xq, int64_t m0, int64_t rows, const uint8_t* group, float* y,
                         int64_t ldy) {
  switch (rows) {
    case 1: return group_rows_vnni<F, 1>(xq, m0, group, y, ldy);
    case 2: return group_rows_vnni<F, 2>(xq, m0, group, y, ldy);
    case 3: return group_rows_vnni<F, 3>(xq, m0, group, y, ldy);
    case 4: return group_rows_vnni<F, 4>(xq, m0, group, y, ldy);
    case 5: return group_rows_vnni<F, 5>(xq, m0, group, y, ldy);
    case 6: return group_rows_vnni<F, 6>(xq, m0, group, y, ldy);
    case 7: return group_rows_vnni<F, 7>(xq, m0, group, y, ldy);
    default: return group_rows_vnni<F, kRowTile>(xq, m0, group, y, ldy);
  }
}

#pragma GCC pop_options
#endif

template <QuantFormat F>
void columns(const QuantizedRows& xq, const uint8_t* w, const float* bias, int64_t j0, int64_t j1, float* y,
             int64_t ldy) {
  constexpr int64_t chunk = kQuantLanes * quant_block_bytes(F);
  const int64_t nb = xq.K / kQuantBlock;
  const bool vnni = vnni_enabled();
  for (int64_t g = j0 / kQuantLanes; g < j1 / kQuantLanes; ++g) {
    const uint8_t* group = w + g * nb * chunk;
    float* out = y + g * kQuantLanes;
    for (int64_t m0 = 0; m0 < xq.rows; m0 += kRowTile) {
      const int64_t rows = std::min<int64_t>(kRowTile, xq.rows - m0);
#ifdef JAKIRO_HAVE_AVX512_KERNELS
      if (vnni) {
        group_rows_vnni_any<F>(xq, m0, rows, group, out + m0 * ldy, ldy);
        continue;
      }
#endif
      group_rows_portable<F>(xq, m0, m0 + rows, group, out + m0 * ldy, ldy);
    }
    if (bias != nullptr) {
      for (int64_t m = 0; m < xq.rows; ++m)
        for (int64_t lane = 0; lane < kQuantLanes; ++lane) out[m * ldy + lane] += bias[g * kQuantLanes + lane];
    }
  }
}

}  // namespace

void QuantizedRows::quantize(const float* x, int64_t rows_, int64_t K_) {
  rows = rows_, K = K_;
  const int64_t nb = K / kQuantBlock;
  codes.resize(rows * K);
  scale.resize(rows * nb), scaled_sum.resize(rows * nb), sum.resize(rows * nb);
  const bool wide = avx512_enabled();
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = m * nb + b;
      const float* v = x + m * K + b * kQuantBlock;
      int8_t* q = codes.data() + m * K + b * kQuantBlock;
#ifdef JAKIRO_HAVE_AVX512_KERNELS
      const bool finite = wide ? quantize_block_avx512(v, q, &scale[at], &sum[at]) : quantize_block(v, q, &scale[at], &sum[at]);
#else
      const bool finite = quantize_block(v, q, &scale[at], &sum[at]);
#endif
      if (!finite) {
        std::memset(q, 0, kQuantBlock);
        scale[at] = std::numeric_limits<float>::quiet_NaN();
        sum[at] = 0;
      }
      scaled_sum[at] = scale[at] * static_cast<float>(sum[at]);
    }
  }
}

void QuantizedRows::reserve(int64_t rows_, int64_t K_) {
  const int64_t nb = K_ / kQuantBlock;
  codes.reserve(rows_ * K_);
  scale.reserve(rows_ * nb), scaled_sum.reserve(rows_ * nb), sum.reserve(rows_ * nb);
}

void quantized_columns(const QuantizedRows& xq, const uint8_t* w, QuantFormat format, const float* bias, int64_t j0,
                       int64_t j1, float* y, int64_t ldy) {
  switch (format) {
    case QuantFormat::kQ4_0: return columns<QuantFormat::kQ4_0>(xq, w, bias, j0, j1, y, ldy);
    case QuantFormat::kQ4_1: return columns<QuantFormat::kQ4_1>(xq, w, bias, j0, j1, y, ldy);
    case QuantFormat::kQ8_0: return columns<QuantFormat::kQ8_0>(xq, w, bias, j0, j1, y, ldy);
    default: std::abort();  // unreachable: the checks name the format
  }
}

bool vnni_enabled() {
#ifdef JAKIRO_HAVE_AVX512_KERNELS
  static const bool enabled =
      avx512_enabled() && !env_disabled("JAKIRO_CPU_VNNI") && __builtin_cpu_supports("avx512vnni");
  return enabled;
#else
  return false;
#endif
}

}  // namespace jakiro::cpu
