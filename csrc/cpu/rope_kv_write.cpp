// CPU kernel of jakiro::rope_kv_write: the attention block's glue (RoPE of q and k, the KV cache
// write) in one pass over the fused qkv rows: fifteen eager ATen calls otherwise (slices, neg,
// cat, four products and sums, two index_puts), each a dispatch and an allocation. Rounded as
// the eager code: each product, then the sum, to the dtype (this file is built with the ISO C++
// default of no contraction into fused multiply-adds).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu/kernels.h"
#include "cpu/layer_rows.h"
#include "ops.h"

namespace jakiro::cpu {

at::Tensor rope_kv_write_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             const at::Tensor& kv_cache, const at::Tensor& lengths) {
  const auto s = check_rope_kv_write(qkv, cos, sin, kv_cache, lengths, /*bf16_cache=*/true);
  const int64_t B = s.batch, T = s.tokens, Hq = s.q_heads, Hkv = s.kv_heads, D = s.head_dim;
  auto x = qkv.contiguous(), c = cos.contiguous(), sn = sin.contiguous(), lens = lengths.contiguous();
  auto q = at::empty({B, T, Hq, D}, x.options());
  const int64_t* len = lens.data_ptr<int64_t>();
  auto run = [&](const auto* px, auto* keys, auto* values) {
    using scalar_t = std::remove_cv_t<std::remove_pointer_t<decltype(px)>>;
    using cache_t = std::remove_pointer_t<decltype(keys)>;
    const RopeKvWrite<scalar_t, cache_t> rope{px, c.data_ptr<scalar_t>(), sn.data_ptr<scalar_t>(), len,
                                              q.data_ptr<scalar_t>(), keys, values, T, Hq, Hkv, D,
                                              kv_cache.stride(1), kv_cache.stride(2)};
    at::parallel_for(0, B * T, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t h = 0; h < rope.units_per_row(); ++h) rope.unit(r, h);
      }
    });
  };
  with_cache_dtypes(x, kv_cache[0], kv_cache[1], run);
  return q;
}

TORCH_LIBRARY_IMPL(jakiro, CPU, m) { m.impl("rope_kv_write", &rope_kv_write_cpu); }

}  // namespace jakiro::cpu
