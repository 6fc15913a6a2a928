// GPU kernel of jakiro::rope_kv_write: one block per (sequence, token) row of the fused qkv; its
// threads rotate the q and k heads (rounded as the eager code: each product, then the sum, with
// no fused multiply-add) and write q out, k and v into the cache slot lengths[b] + t.
#pragma once

#include "cuda/device.h"

namespace jakiro::gpu {

struct RopeKvParams {
  const void* qkv;          // [B, T, Hq + 2 Hkv, D], contiguous
  const void* cos;          // [B, T, D]
  const void* sin;          // [B, T, D]
  void* keys;               // kv_cache[0]: [B, Hkv, S, D] with the strides below
  void* values;             // kv_cache[1]
  const int64_t* lengths;   // [B]
  void* q;                  // [B, T, Hq, D]
  int64_t batch, tokens, q_heads, kv_heads, head_dim;
  int64_t batch_stride, head_stride;  // of the cache, in elements (a slot is D elements)
  int64_t capacity;                   // S
  int32_t* errors;                    // the device's error word
};

constexpr int kRopeKvThreads = 128;

template <typename scalar_t>
__global__ void rope_kv_write_kernel(RopeKvParams p) {
  const int64_t r = blockIdx.x, b = r / p.tokens, t = r % p.tokens, D = p.head_dim, half = D / 2;
  const int64_t heads = p.q_heads + 2 * p.kv_heads;
  const scalar_t* row = static_cast<const scalar_t*>(p.qkv) + r * heads * D;
  const scalar_t* cos = static_cast<const scalar_t*>(p.cos) + r * D;
  const scalar_t* sin = static_cast<const scalar_t*>(p.sin) + r * D;
  const int64_t length = p.lengths[b], slot = length + t;
  // A length that leaves no room for the T new tokens: q is still written, k and v are not.
  const bool in_cache = length >= 0 && length <= p.capacity - p.tokens;
  if (!in_cache && threadIdx.x == 0) report_error(p.errors, kBadLengths);
  for (int64_t e = threadIdx.x; e < heads * D; e += blockDim.x) {
    const int64_t h = e / D, i = e % D;
    scalar_t value = row[e];
    if (h < p.q_heads + p.kv_heads) {  // q or k: rotate
      const float partner = i < half ? -to_float(row[e + half]) : to_float(row[e - half]);
      const scalar_t a = from_float<scalar_t>(mul_rn(to_float(value), to_float(cos[i])));
      const scalar_t c = from_float<scalar_t>(mul_rn(partner, to_float(sin[i])));
      value = from_float<scalar_t>(add_rn(to_float(a), to_float(c)));
    }
    if (h < p.q_heads) {
      static_cast<scalar_t*>(p.q)[(r * p.q_heads + h) * D + i] = value;
    } else if (in_cache) {
      const bool is_key = h < p.q_heads + p.kv_heads;
      const int64_t kvh = is_key ? h - p.q_heads : h - p.q_heads - p.kv_heads;
      scalar_t* cache = static_cast<scalar_t*>(is_key ? p.keys : p.values);
      cache[b * p.batch_stride + kvh * p.head_stride + slot * D + i] = value;
    }
  }
}

template <typename scalar_t>
void launch_rope_kv_write(const RopeKvParams& p, cudaStream_t stream) {
  if (p.batch * p.tokens == 0) return;
  JAKIRO_LAUNCH(static_cast<unsigned>(p.batch * p.tokens), kRopeKvThreads, 0, stream,
                rope_kv_write_kernel<scalar_t>)(p);
}

}  // namespace jakiro::gpu
