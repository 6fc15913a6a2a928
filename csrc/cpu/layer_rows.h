// The per-row kernels of a decoder layer's small stages, shared by their ops (jakiro::rms_norm,
// rope_kv_write, silu_mul) and by the CPU decoder layer, which runs them inside its own parallel
// region: a row is computed by the same code whichever calls it, so the fused layer's results
// are the composed ops' bit for bit. Rounded where the checkpoints' eager code rounds; this
// code is built without contraction into fused multiply-adds (-ffp-contract=off) but where it
// calls fma itself.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/vec_utils.h"

namespace jakiro::cpu {

// out = RMSNorm(x + residual) * weight and sum = x + residual (x alone without a residual), one
// row of H: the sum rounded to scalar_t, the sum of squares in float32 (one fixed order), the
// normalised value rounded before the weight. s: H floats of scratch.
template <typename scalar_t>
void rms_norm_row(const scalar_t* x, const scalar_t* residual, const scalar_t* weight, int64_t H, float eps,
                  scalar_t* out, scalar_t* sum, float* s) {
  for (int64_t i = 0; i < H; ++i) {
    const scalar_t v = residual == nullptr ? x[i] : static_cast<scalar_t>(static_cast<float>(x[i]) + static_cast<float>(residual[i]));
    sum[i] = v;
    s[i] = static_cast<float>(v);
  }
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= H; i += Vec::size()) {
    const Vec v = Vec::loadu(s + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float squares = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < H; ++i) squares = std::fma(s[i], s[i], squares);
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(H) + eps);
  for (int64_t j = 0; j < H; ++j) {
    const scalar_t normed = static_cast<scalar_t>(s[j] * inv);
    out[j] = static_cast<scalar_t>(static_cast<float>(normed) * static_cast<float>(weight[j]));
  }
}

// RoPE of one head: dst[i] = src[i] * cos[i] + rotate_half(src)[i] * sin[i], with rotate_half(x) =
// (-x[half:], x[:half]); each product, then the sum, rounded to scalar_t (as the eager code), then
// to out_t (a bf16 cache's key beside float32 rows: rounded once more as it is stored).
template <typename scalar_t, typename out_t = scalar_t>
void rotate(const scalar_t* src, const scalar_t* cos, const scalar_t* sin, int64_t D, out_t* dst) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float partner = i < half ? -static_cast<float>(src[i + half]) : static_cast<float>(src[i - half]);
    const scalar_t a = static_cast<scalar_t>(static_cast<float>(src[i]) * static_cast<float>(cos[i]));
    const scalar_t b = static_cast<scalar_t>(partner * static_cast<float>(sin[i]));
    dst[i] = static_cast<out_t>(static_cast<scalar_t>(static_cast<float>(a) + static_cast<float>(b)));
  }
}

// out[i] = SiLU(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i], float32, the accurate
// (1 ulp) exp, vectors from i = 0 and a scalar tail: a slice of a row that starts at a multiple
// of Vec::size() gives each element what the whole row gives it.
inline void silu_mul_row(const float* gate, const float* up, int64_t n, float* out) {
  const Vec one(1.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec g = Vec::loadu(gate + i);
    (g / (one + g.neg().exp()) * Vec::loadu(up + i)).store(out + i);
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// The same from gate and up in scalar_t: float32 in place, bf16 widened into scratch (3 n floats)
// and rounded once.
inline void silu_mul_row(const float* gate, const float* up, int64_t n, float* out, std::vector<float>&) {
  silu_mul_row(gate, up, n, out);
}
inline void silu_mul_row(const c10::BFloat16* gate, const c10::BFloat16* up, int64_t n, c10::BFloat16* out,
                         std::vector<float>& scratch) {
  scratch.resize(3 * n);
  float *g = scratch.data(), *u = g + n, *result = u + n;
  to_float(gate, g, n);
  to_float(up, u, n);
  silu_mul_row(g, u, n, result);
  from_float(result, out, n);
}

}  // namespace jakiro::cpu

namespace jakiro::cpu {

// One rope_kv_write call's pointers, and its unit of work: head h of token row r = b * T + t of
// the fused qkv rows [B * T, (Hq + 2 Hkv) D]: h < Hq rotates that query head into q [B * T, Hq,
// D]; Hq <= h < Hq + Hkv rotates key head h - Hq into the cache slot lengths[b] + t and copies
// its value there (cache_t: the cache's dtype, scalar_t's or bf16 beside float32 rows, into which
// the key and value are rounded).
template <typename scalar_t, typename cache_t = scalar_t>
struct RopeKvWrite {
  const scalar_t *qkv, *cos, *sin;
  const int64_t* lengths;
  scalar_t* q;
  cache_t *keys, *values;
  int64_t tokens, q_heads, kv_heads, head_dim, batch_stride, head_stride;

  int64_t units_per_row() const { return q_heads + kv_heads; }
  void unit(int64_t r, int64_t h) const {
    const int64_t D = head_dim, b = r / tokens, t = r % tokens;
    const scalar_t* row = qkv + r * (q_heads + 2 * kv_heads) * D;
    const scalar_t *c = cos + r * D, *s = sin + r * D;
    if (h < q_heads) return rotate(row + h * D, c, s, D, q + (r * q_heads + h) * D);
    const int64_t kvh = h - q_heads, at_slot = b * batch_stride + kvh * head_stride + (lengths[b] + t) * D;
    rotate(row + h * D, c, s, D, keys + at_slot);
    const scalar_t* value = row + (q_heads + kv_heads + kvh) * D;
    if constexpr (std::is_same_v<scalar_t, cache_t>) {
      std::memcpy(values + at_slot, value, D * sizeof(scalar_t));
    } else {
      for (int64_t i = 0; i < D; ++i) values[at_slot + i] = static_cast<cache_t>(value[i]);
    }
  }
};

}  // namespace jakiro::cpu
