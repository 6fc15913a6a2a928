// CPU kernel of jakiro::rope_kv_write: the attention block's glue (RoPE of q and k, the KV cache
// write) in one pass over the fused qkv rows: fifteen eager ATen calls otherwise (slices, neg,
// cat, four products and sums, two index_puts), each a dispatch and an allocation. Rounded as
// the eager code: each product, then the sum, to the dtype (this file is built with the ISO C++
// default of no contraction into fused multiply-adds).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "cpu/kernels.h"
#include "ops.h"

namespace jakiro::cpu {
namespace {

// dst[i] = src[i] * cos[i] + rotate_half(src)[i] * sin[i], rotate_half(x) = (-x[half:], x[:half]).
template <typename scalar_t>
void rotate(const scalar_t* src, const scalar_t* cos, const scalar_t* sin, int64_t D, scalar_t* dst) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float partner = i < half ? -static_cast<float>(src[i + half]) : static_cast<float>(src[i - half]);
    const scalar_t a = static_cast<scalar_t>(static_cast<float>(src[i]) * static_cast<float>(cos[i]));
    const scalar_t b = static_cast<scalar_t>(partner * static_cast<float>(sin[i]));
    dst[i] = static_cast<scalar_t>(static_cast<float>(a) + static_cast<float>(b));
  }
}

}  // namespace

at::Tensor rope_kv_write_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             const at::Tensor& kv_cache, const at::Tensor& lengths) {
  const auto s = check_rope_kv_write(qkv, cos, sin, kv_cache, lengths);
  const int64_t B = s.batch, T = s.tokens, Hq = s.q_heads, Hkv = s.kv_heads, D = s.head_dim;
  auto x = qkv.contiguous(), c = cos.contiguous(), sn = sin.contiguous(), lens = lengths.contiguous();
  auto q = at::empty({B, T, Hq, D}, x.options());
  const int64_t* len = lens.data_ptr<int64_t>();
  JAKIRO_DISPATCH_FLOAT_BF16(qkv.scalar_type(), "rope_kv_write_cpu", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    scalar_t* pq = q.data_ptr<scalar_t>();
    scalar_t* keys = kv_cache[0].data_ptr<scalar_t>();
    scalar_t* values = kv_cache[1].data_ptr<scalar_t>();
    const int64_t batch_stride = kv_cache.stride(1), head_stride = kv_cache.stride(2);
    at::parallel_for(0, B * T, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / T, t = r % T, slot = len[b] + t;
        const scalar_t* row = px + r * (Hq + 2 * Hkv) * D;
        const scalar_t* cr = c.data_ptr<scalar_t>() + r * D;
        const scalar_t* sr = sn.data_ptr<scalar_t>() + r * D;
        for (int64_t h = 0; h < Hq; ++h) rotate(row + h * D, cr, sr, D, pq + (r * Hq + h) * D);
        for (int64_t h = 0; h < Hkv; ++h) {
          const int64_t at_slot = b * batch_stride + h * head_stride + slot * D;
          rotate(row + (Hq + h) * D, cr, sr, D, keys + at_slot);
          std::memcpy(values + at_slot, row + (Hq + Hkv + h) * D, D * sizeof(scalar_t));
        }
      }
    });
  });
  return q;
}

TORCH_LIBRARY_IMPL(jakiro, CPU, m) { m.impl("rope_kv_write", &rope_kv_write_cpu); }

}  // namespace jakiro::cpu
